"""Attention builders: SDPA (``match_attention``) and what every attention row shares: an attention's mask
as score mods (``mask_mods``) and its subgraph over [b, h, s, d] or HF's split_heads views (``attention_subgraph``)."""

from __future__ import annotations

import dataclasses
import math
import operator

import sympy as sp
import torch
from torch import fx

from smg import patterns
from smg.expr import MINUS_INF
from spacefusion.frontend.graph import (
    DTYPES,
    SDPA,
    contiguous,
    dtype,
    heads_interleaved,
    is_function,
    shape,
    single_user,
    swapped_dims_1_2,
)
from spacefusion.frontend.maskexpr import KEEP, PADDING, SYMBOLS, mask_expr
from spacefusion.frontend.matchers import Context, _build, _subgraph, _value
from spacefusion.frontend.records import Operand, Result, Subgraph
from spacefusion.frontend.repeat_kv import unrepeated


def _heads_split(x: fx.Node, readers: tuple[fx.Node, ...], ctx: Context) -> fx.Node | None:
    """The [b, s, h, d] node that ``x`` [b, h, s, d] is the ``transpose(1, 2)`` of (HF's split_heads), when
    that node is a packed tensor (the unflatten of a projection's output) and only ``readers`` read the
    transpose (the attention, or RoPE's ops): the pattern takes the transpose in and reads the packed
    tensor where it lies."""
    src = swapped_dims_1_2(x)
    if src is None or not ctx.free(x) or not contiguous(src) or not set(x.users) <= set(readers):
        return None
    b, h, s, d = shape(x)
    return src if shape(src) == (b, s, h, d) else None


#: how a [b, h, s, d] operand lying as [b, s, h, d] is viewed as the bshd space
TO_BSHD = (0, 2, 1, 3)


def _bshd(node: fx.Node, q: fx.Node, k: fx.Node, v: fx.Node, ctx: Context
          ) -> tuple[tuple[fx.Node, fx.Node, fx.Node], tuple[int, ...] | None, fx.Node] | None:
    """((Q, K, V) sources, the permutation they are read through, the output's transpose) where the
    attention's output is read only through merge_heads' ``transpose(1, 2)`` and its operands lie as
    [b, s, h, d]: HF's split_heads views of packed projections (the sources are then the packed nodes,
    their transposes taken into the subgraph), or values torch laid out that way (RoPE's outputs keep
    split_heads' strides: read through ``TO_BSHD``).  Else None: the bhsd pattern, on copies."""
    out = single_user(node)
    if out is None or swapped_dims_1_2(out) is not node or not ctx.free(out):
        return None
    srcs = tuple(_heads_split(x, (node,), ctx) for x in (q, k, v))
    if all(x is not None for x in srcs):
        return srcs, None, out  # type: ignore[return-value]
    if all(heads_interleaved(x) for x in (q, k, v)):
        return (q, k, v), TO_BSHD, out
    return None


def match_attention(node: fx.Node, ctx: Context) -> Subgraph | None:
    """``F.scaled_dot_product_attention`` on [b, h, s, d] -> ``patterns.attention``; GQA's Q is viewed as
    [b, kv_heads, heads / kv_heads, s, d], the layout the pattern broadcasts K/V over.

    Where the operands are HF's split_heads views ([b, s, h, d] projections, transposed) and the output is
    transposed back, the subgraph takes the transposes too and runs the bshd pattern on the projections'
    own memory (GQA's Q as [b, s, kv_heads, group, d]), its output already in the order merge_heads'
    ``flatten(2)`` views: no ``.contiguous()`` copy on either side."""
    if not is_function(node, SDPA):
        return None
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    form = _sdpa_form(node, ctx, dict(zip(names, node.args)) | dict(node.kwargs), empty_rows_zero=True)
    if form is None:
        return None
    (q, k, v), dims, dt, causal, scale, mods, extra, taken, label = form
    return attention_subgraph(ctx, node, (*taken, node), q, k, v, dims, dt, causal, scale, mods, extra, label)


def _sdpa_form(node: fx.Node, ctx: Context, a: dict[str, object], empty_rows_zero: bool = False) -> tuple | None:
    """What an SDPA call ``node`` with arguments ``a`` (SDPA's names: query, key, value, attn_mask,
    dropout_p, is_causal, scale) is as the attention pattern: ((q, k, v), (b, heads, kv heads, m, l, d),
    dtype, causal, scale, score mods, their operands, the nodes taken in (the mask's and K/V's repeats),
    label); None, with the reason recorded on ``node``, where the pattern cannot take it (dropout, not 4-d,
    head dims, mask, K/V repeated over the heads in a form it cannot read per kv head).

    K and V that are ``repeat_kv`` of tensors with fewer heads (HF's sdpa path with a mask: it passes
    ``enable_gqa`` only without one) are read un-repeated, the repeat's nodes taken in
    (``frontend.repeat_kv``): GQA with ``kv_heads`` the sources' heads.  ``empty_rows_zero``: the mask's
    query rows that keep no key are 0, as SDPA's (``mask_mods``); the training forward's CPU flash op, whose
    logsumexp a backward reads, keeps the forms its backward was checked with."""
    q, k, v = a["query"], a["key"], a["value"]
    if a.get("dropout_p", 0.0):
        ctx.refuse(node, "attention.dropout", "attention with dropout: random, not an index expression")
        return None
    unrep = unrepeated(k, v, {k: node, v: node}, ctx.free)
    if isinstance(unrep, str):
        ctx.refuse(node, "attention.kv_repeat", unrep)
        return None
    repeats: tuple[fx.Node, ...] = ()
    if unrep is not None:
        k, v, repeats = unrep.k, unrep.v, unrep.taken
    sq, sk, sv = shape(q), shape(k), shape(v)
    if not (sq and sk and sv) or not len(sq) == len(sk) == len(sv) == 4:
        ctx.refuse(node, "attention.rank", "attention on tensors that are not [batch, heads, seq, head_dim]")
        return None
    (b, h, m, d), (_, hk, l, dk), dv = sq, sk, sv[3]
    dt = dtype(q)
    if dk != d or dv != d or dt is None or h % hk or shape(v)[1] != hk:
        ctx.refuse(node, "attention.head_dims",
                   f"attention with head dims q {d}, k {dk}, v {dv}, heads q {h}, k {hk}, v {sv[1]} and dtype "
                   f"{q.meta['tensor_meta'].dtype}: the pattern takes one head dim, query heads a multiple of "
                   f"K's and V's, and float32/float16/bfloat16")
        return None
    causal, scale = bool(a.get("is_causal", False)), a.get("scale")
    mods, extra = (), []
    if a.get("attn_mask") is not None:
        got = mask_mods(ctx, node, a["attn_mask"], (b, h, m, l), hk, dt, empty_rows_zero=empty_rows_zero)
        if got is None:
            return None
        causal = causal or got[0]
        mods, extra, taken = got[1], got[2], (*got[3], *repeats)
    else:
        taken = repeats
    what = "" if not mods else " + bias" if "+ Mask" in mods[0].body else " + mask"
    what += " (index)" if mods and "Mask" not in mods[0].body else ""
    label = f"attention b{b} h{h}/{hk} {m}x{l} d{d}{' causal' if causal else ''}{what} {dt}"
    return (q, k, v), (b, h, hk, m, l, d), dt, causal, scale, mods, extra, taken, label


#: torch's CPU flash attention, as a training step's ATen graph holds it: (out, logsumexp)
CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def match_attention_lse(node: fx.Node, ctx: Context) -> Subgraph | None:
    """torch's CPU flash attention, ``_scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p,
    is_causal, *, attn_mask, scale) -> (out, logsumexp)``, as a training step's forward holds it where the
    backward reads the logsumexp -> ``patterns.attention(..., save_lse=True)``: the kernel's O is the op's
    element 0, its ``LSE`` element 1 (the rows' max plus the log of their sum of exp of the scaled, masked
    scores, float32 [b, heads, m]: exactly torch's logsumexp, which the derived backward, or torch's own,
    reads).  The same forms as ``match_attention`` (causal, GQA by K/V's head count, scale, masks as score
    mods); without a reader of the logsumexp, the plain pattern.

    Layout: torch's op returns ``out`` with q's layout and ``logsumexp`` lying as [b, m, heads] (strides
    (m * heads, 1, heads)); later views rely on it (``transpose(1, 2).view(b, m, -1)`` of ``out`` needs
    [b, m, h, d] memory).  Where ``out`` lies as [b, m, h, d] (HF's split_heads operands) the bshd pattern
    runs, whose O {b, m, h, n} and LSE {b, m, h} are torch's memory exactly, viewed back by a permute;
    otherwise the bhsd pattern, and each result whose view's strides differ from the node's (``tensor_meta``)
    is copied into them (``Result.strides``: the LSE, b * heads * m floats)."""
    if not is_function(node, (CPU_FLASH,)):
        return None
    got = {u.args[1]: u for u in node.users if is_function(u, (operator.getitem,)) and u.args[0] is node}
    if set(got) - {0, 1} or len(got) != len(node.users) or 0 not in got or not ctx.free(*got.values()):
        return None  # read other than through its two elements: not this op as autograd writes it
    names = ("query", "key", "value", "dropout_p", "is_causal")
    form = _sdpa_form(node, ctx, dict(zip(names, node.args)) | dict(node.kwargs))
    if form is None:
        return None
    (q, k, v), dims, dt, causal, scale, mods, extra, taken, label = form
    b, h, hk, m, l, d = dims
    out, lse = got[0], got.get(1)
    save = lse is not None and bool(lse.users)
    bshd = heads_interleaved(out)
    layout = "bshd" if bshd else "bhsd"
    smg = _build(ctx, node, lambda: patterns.attention(b, h, m, l, d, kv_heads=hk, causal=causal, dtype=dt,
                                                       scale=scale, layout=layout, mods=mods, save_lse=save))
    if smg is None:
        return None
    ops = [_value(sp, x, smg.shape(sp), TO_BSHD if bshd else None) for sp, x in (("Q", q), ("K", k), ("V", v))]
    results = [_result("O", out, (b, m, h, d) if bshd else None)]
    if save:
        results.append(_result("LSE", lse, (b, m, h) if bshd else None))
    nodes = (*taken, node, *got.values())
    what = f"{label}{' bshd' if bshd else ''}{' + LSE saved' if save else ''}"
    return Subgraph("attention", what, tuple(n.name for n in nodes), smg, (*ops, *extra), tuple(results))


def _result(space: str, node: fx.Node, seq_first: tuple[int, ...] | None) -> Result:
    """``space`` standing for ``node`` with the node's strides (``tensor_meta``): where ``seq_first`` is given
    the output lies in that shape (bshd: [b, m, heads(, d)]) and is viewed back through the swap of dims 1 and
    2; a view whose strides still differ is copied into the node's (``Result.strides``)."""
    meta = node.meta["tensor_meta"]
    swap = (0, 2, 1, 3)[:len(seq_first)] if seq_first is not None else None
    return Result(space, node.name, tuple(meta.shape), permute=swap, split=seq_first,
                  strides=tuple(meta.stride))


def mask_mods(ctx: Context, node: fx.Node, mask: object, want: tuple[int, int, int, int], kv_heads: int, dt: str,
              empty_rows_zero: bool = False
              ) -> tuple[bool, tuple[patterns.ScoreMod, ...], list[Operand], tuple[fx.Node, ...]] | None:
    """(causal, score mods, their operands, the mask's nodes taken in) of an attention's mask: index
    arithmetic where it is (``_index_mask``), else the mask read as a tensor (``_mask_mod``), and a bias kept
    by such a mask (``_kept_bias``); None, with the reason recorded on ``node``, where it can be none.
    ``empty_rows_zero``: ``mask`` is SDPA's boolean ``attn_mask``, whose query rows that keep no key are 0, so
    a padding row with structure (a decoder's causal mask and left padding) is taken too
    (``_padded_index_mask``)."""
    taken: tuple[fx.Node, ...] = ()
    if isinstance(mask, fx.Node) and mask.op == "call_method" and mask.target == "contiguous" \
            and len(mask.users) == 1 and ctx.free(mask):  # a copy of what the kernel reads through strides
        taken, mask = (mask,), mask.args[0]
    kept = _kept_bias(ctx, mask, want, kv_heads, dt)
    if kept is not None:
        return (*kept, (*taken, mask))
    got = _index_mask(mask, want, kv_heads, dt) or (_padded_index_mask(mask, want, kv_heads, dt)
                                                    if empty_rows_zero else None) or _mask_mod(mask, want, kv_heads, dt)
    if isinstance(got, str):
        ctx.refuse(node, "attention.mask", got)
        return None
    # an added float mask is added as it is: a query row it masks everywhere (HF's finfo.min under left
    # padding) is the mean of V, as eager's, and a row of -inf 0, as SDPA's, in every kernel (issue 59:
    # ``spacefusion.lower.exprs.MAX_IDENTITY``), so no finite stand-in is needed here
    return (got[0], got[1], got[2], taken)


def _kept_bias(ctx: Context, mask: object, want: tuple[int, int, int, int], kv_heads: int, dt: str
               ) -> tuple[bool, tuple[patterns.ScoreMod, ...], list[Operand]] | None:
    """HF's ``create_position_bias_mask`` (T5): ``where(keep, bias, finfo.min)``, a float bias where an index
    mask keeps the scores: the mask's mods, then the bias added as an input (its broadcast dims dropped), so
    the [b, h, m, l] sum is never written.  None where ``mask`` is not that.

    A query row whose every key is masked gets the mean of V, as in eager T5: there the scores are all
    ``finfo.min`` (the bias vanishes in its rounding) and the softmax is uniform.  So the padding mod keeps
    no ``zero_v`` here (that rule, 0 for such a row, is SDPA's for boolean masks): its finite fill
    (``MASKED``) gives the online softmax the same uniform row."""
    if not is_function(mask, (torch.where,)) or len(mask.args) != 3 or mask.kwargs or len(mask.users) != 1 \
            or not ctx.free(mask):
        return None
    keep, bias, fill = mask.args
    if not isinstance(fill, int | float) or fill > -6e4 or not isinstance(bias, fx.Node):
        return None
    if not isinstance(keep, fx.Node) or keep.meta.get("tensor_meta") is None \
            or keep.meta["tensor_meta"].dtype != torch.bool:
        return None
    masked = _index_mask(keep, want, kv_heads, dt)
    added = _mask_mod(bias, want, kv_heads, dt)
    if masked is None or isinstance(added, str) or added[1][0].body != "{s} + Mask":
        return None
    uniform = tuple(dataclasses.replace(mod, zero_v=None) for mod in masked[1])
    return masked[0], (*added[1], *uniform), [*added[2], *masked[2]]


def attention_subgraph(ctx: Context, node: fx.Node, nodes: tuple[fx.Node, ...], q: fx.Node, k: fx.Node,
                       v: fx.Node, dims: tuple[int, int, int, int, int, int], dt: str, causal: bool,
                       scale: float | None, mods: tuple[patterns.ScoreMod, ...], extra: list[Operand],
                       label: str) -> Subgraph | None:
    """The attention subgraph whose output is ``node`` and which takes in ``nodes``, Q/K/V read from ``q``,
    ``k`` and ``v``; ``dims`` (b, heads, kv heads, m, l, d).  Where HF's split_heads / merge_heads surround it
    (``_bshd``), the bshd pattern on the projections' own memory, the transposes taken in."""
    b, h, hk, m, l, d = dims
    bshd = _bshd(node, q, k, v, ctx)
    layout = "bhsd" if bshd is None else "bshd"
    smg = _build(ctx, node, lambda: patterns.attention(b, h, m, l, d, kv_heads=hk, causal=causal, dtype=dt,
                                                       scale=scale, layout=layout, mods=mods))
    if smg is None:
        return None
    if bshd is None:
        q_shape = shape(q) if hk == h else (b, hk, h // hk, m, d)
        return _subgraph("attention", label, nodes, smg, [_value("Q", q, q_shape), _value("K", k, shape(k)),
                                                          _value("V", v, shape(v)), *extra], {"O": node})
    (qs, ks, vs), permute, out = bshd
    ops = [_value(sp, x, smg.shape(sp), permute) for sp, x in (("Q", qs), ("K", ks), ("V", vs))]
    taken = (*(dict.fromkeys((q, k, v)) if permute is None else ()), *nodes, out)
    return _subgraph("attention", f"{label} bshd", taken, smg, [*ops, *extra], {"O": out})


#: the masked-out score of a boolean mask: large and finite, so a fully masked tile of the online softmax
#: gives no inf - inf (``smg.ops.Builder.mask``'s fill)
MASKED = -1e30


def _index_mask(mask: object, want: tuple[int, int, int, int], kv_heads: int, dt: str
                ) -> tuple[bool, tuple[patterns.ScoreMod, ...], list[Operand]] | None:
    """(causal, score mods, their operands) of a mask whose construction is index arithmetic
    (``maskexpr``): all true is no mod, exactly ``l <= m`` the attention's causal mask, the rest a predicate
    over the grid and the padding row ``Keep[b, l]``.  None: read the mask as a tensor (``_mask_mod``)."""
    me = mask_expr(mask) if isinstance(mask, fx.Node) else None
    if me is None:
        return None
    keep, causal = me.keep, False
    if keep == sp.true:
        return False, (), []
    rule = sp.Le(SYMBOLS["l"], SYMBOLS["m"])
    parts = sp.And.make_args(keep)
    if rule in parts:
        causal, keep = True, sp.And(*(p for p in parts if p != rule))
        if keep == sp.true:
            return True, (), []
    if SYMBOLS["h"] in keep.free_symbols and kv_heads != want[1]:
        return None  # a query head's predicate under GQA: the grid's h is the kv head there
    body = f"Piecewise(({{s}}, {keep}), ({MASKED!r}, True))"
    if me.padding is None:  # index arithmetic alone: fused where no query row loses every key
        l, m = SYMBOLS["l"], SYMBOLS["m"]
        diagonal = keep.subs(l, m) == sp.true and want[2] <= want[3]
        return (causal, (patterns.ScoreMod(body),), []) if diagonal else None
    if causal or keep != PADDING:
        return None  # a padding row with structure (left padding + causal) can mask whole query rows: see below
    if shape(me.padding) != (want[0], want[3]):
        return None
    mod = patterns.ScoreMod(body, (("Keep", ("b", "l")),), zero_v="Keep")
    return False, (mod,), [Operand("Keep", "value", me.padding.name, (want[0], want[3]), cast=dt)]


def _padded_index_mask(mask: object, want: tuple[int, int, int, int], kv_heads: int, dt: str
                       ) -> tuple[bool, tuple[patterns.ScoreMod, ...], list[Operand]] | None:
    """SDPA's boolean mask built from index arithmetic and the padding row ``Keep[b, l]`` together (HF's
    decoder prefill with an ``attention_mask``: ``l <= m`` and ``Keep[b, l]``), which ``_index_mask`` leaves:
    under left padding it keeps no key of a padded query row, where SDPA gives 0.  Its keys are filled with
    -inf (``MINUS_INF``), so such a row is -inf throughout, which every kernel gives 0 for (issue 59's
    contract, ``tests/test_masked_rows.py``), whichever steps run; not with ``MASKED`` plus the padding row's
    ``zero_v``: the causal mask's finite fill would leave the row the mean of the V after it.  The causal part
    is a mod of its own, an affine -inf mask whose steps the tensor-core kernels skip (``killing_masks``),
    not the pattern's ``causal`` (filled with ``MASKED``, above the -inf).  None where the mask is not that."""
    me = mask_expr(mask) if isinstance(mask, fx.Node) else None
    if me is None or me.padding is None or shape(me.padding) != (want[0], want[3]):
        return None
    keep = me.keep
    if keep in (sp.true, sp.false) or (SYMBOLS["h"] in keep.free_symbols and kv_heads != want[1]):
        return None
    rule = sp.Le(SYMBOLS["l"], SYMBOLS["m"])
    parts = sp.And.make_args(keep)
    rest = sp.And(*(p for p in parts if p != rule))
    if KEEP not in rest.free_symbols:
        return None
    mods = (patterns.ScoreMod(f"Piecewise(({{s}}, {rest}), ({MINUS_INF}, True))", (("Keep", ("b", "l")),)),)
    if rule in parts:
        mods += (patterns.ScoreMod(f"Piecewise(({{s}}, {rule}), ({MINUS_INF}, True))"),)
    return False, mods, [Operand("Keep", "value", me.padding.name, (want[0], want[3]), cast=dt)]


def _mask_dims(mask: object, want: tuple[int, int, int, int], kv_heads: int
               ) -> tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...], object] | str:
    """(dims, shape, the broadcast dims a binding selects away, tensor_meta) of a mask read as an input with
    its own dims: those of [b, heads, m, l] it has (size > 1, not a stride-0 broadcast; the query heads as
    GQA's (h, r)); a reason (str) where it cannot be read so."""
    ms = shape(mask)
    meta = mask.meta.get("tensor_meta") if isinstance(mask, fx.Node) else None
    if ms is None or meta is None or len(ms) > 4:
        return f"attention with an attn_mask that is not a tensor of at most 4 dims ({ms})"
    pad = 4 - len(ms)
    full, strides = (1,) * pad + tuple(ms), (0,) * pad + tuple(meta.stride)
    if any(g not in (1, w) for g, w in zip(full, want)):
        return f"attention with an attn_mask of shape {tuple(ms)}, which does not broadcast to {want}"
    b, heads, m, l = want
    names = {0: ("b",), 1: ("h", "r") if kv_heads != heads else ("h",), 2: ("m",), 3: ("l",)}
    sizes = {0: (b,), 1: (kv_heads, heads // kv_heads) if kv_heads != heads else (heads,), 2: (m,), 3: (l,)}
    kept = [i for i in range(4) if full[i] > 1 and strides[i] != 0]
    if not kept:
        return "attention with an attn_mask that is one value broadcast everywhere"
    select = tuple(i - pad for i in range(pad, 4) if full[i] > 1 and strides[i] == 0)
    dims = tuple(n for i in kept for n in names[i])
    shp = tuple(n for i in kept for n in sizes[i])
    return dims, shp, select, meta


def _mask_mod(mask: object, want: tuple[int, int, int, int], kv_heads: int, dt: str
              ) -> tuple[bool, tuple[patterns.ScoreMod, ...], list[Operand]] | str:
    """SDPA's ``attn_mask`` as a score mod over an input ``Mask`` with the mask's own dims (``_mask_dims``).
    A boolean mask keeps the scores where it is true (``MASKED`` elsewhere), bound as 0/1 in the scores'
    dtype; a float one is added.  A reason (str) where the mask cannot be an input of that kind."""
    got = _mask_dims(mask, want, kv_heads)
    if isinstance(got, str):
        return got
    dims, shp, select, meta = got
    zero_v = None
    if meta.dtype == torch.bool:
        if set(dims) - {"b", "l"}:
            return (f"attention with a boolean attn_mask over {dims}: it may mask every key of a query row, where "
                    f"torch's SDPA gives 0 and the online softmax's finite fill the mean of V; fused are padding "
                    f"rows [b, l] and masks built from index arithmetic that keep the diagonal")
        body, cast, zero_v = f"Piecewise(({{s}}, Mask > 0.5), ({MASKED!r}, True))", dt, "Mask"
    elif meta.dtype in (torch.float16, torch.bfloat16, torch.float32):
        body, cast = "{s} + Mask", None if DTYPES[meta.dtype] == dt else dt
    else:
        return f"attention with an attn_mask of dtype {meta.dtype}: the score mods take bool or float masks"
    return False, (patterns.ScoreMod(body, (("Mask", dims),), zero_v=zero_v),), [
        Operand("Mask", "value", mask.name, shp, select=select, cast=cast)]


def fill_mod(mask: object, fill: object, want: tuple[int, int, int, int], kv_heads: int, dt: str
             ) -> tuple[patterns.ScoreMod, Operand] | str:
    """torch's ``scores.masked_fill(mask, fill)`` (MPT's mask) as a score mod: ``fill`` where the boolean
    ``mask`` is true, the score elsewhere, over an input ``Fill`` with the mask's own dims (``_mask_dims``),
    bound as 0/1 in the scores' dtype.  Exact, a query row filled everywhere included: its scores all equal
    ``fill`` (HF's ``finfo.min``), the mean of V as in eager; a -inf ``fill`` gives such a row 0, SDPA's
    value (eager's is NaN).  A reason (str) where the fill is not a number below +inf or the mask not a
    boolean tensor that broadcasts to the scores."""
    if not isinstance(fill, int | float) or isinstance(fill, bool) or math.isnan(fill) or fill == math.inf:
        return f"masked_fill of the scores with {fill!r}: the pattern fills with a number below +inf"
    got = _mask_dims(mask, want, kv_heads)
    if isinstance(got, str):
        return got.replace("an attn_mask", "a masked_fill mask")
    dims, shp, select, meta = got
    if meta.dtype != torch.bool:
        return f"masked_fill of the scores with a mask of dtype {meta.dtype}: the pattern takes boolean masks"
    value = MINUS_INF if fill == -math.inf else repr(float(fill))
    mod = patterns.ScoreMod(f"Piecewise(({value}, Fill > 0.5), ({{s}}, True))", (("Fill", dims),))
    return mod, Operand("Fill", "value", mask.name, shp, select=select, cast=dt)
