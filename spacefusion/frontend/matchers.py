"""Matchers: each recognises one fusable pattern at an fx node and maps it to an SMG with its bindings.

A matcher returns a ``Subgraph``, or ``None`` when the node is not its pattern.  A node that is its
pattern but cannot be fused (an attention mask, an unsupported dtype) is recorded in
``Context.refused`` with the reason, which the partition report then gives for that node.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import sympy as sp
import torch
from torch import fx

from smg import patterns
from smg.errors import ShapeError, SpaceFusionError
from smg.ir import SMG
from smg.ops import Builder, upsample_taps
from spacefusion.frontend import builders
from spacefusion.frontend.activations import Activation, activation_after
from spacefusion.frontend.gated import gated_of
from spacefusion.frontend.graph import (
    ADD,
    DTYPES,
    SDPA,
    Linear,
    activation_of,
    batchnorm_of,
    contiguous,
    contiguous_nhwc,
    conv_of,
    dtype,
    groupnorm_of,
    heads_interleaved,
    is_function,
    is_max_pool,
    linear_of,
    max_pool_of,
    nearest_upsample_of,
    norm_of,
    param_ref,
    patch_conv_of,
    permutation,
    row_view,
    rows,
    shape,
    single_user,
    swapped_dims_1_2,
)
from spacefusion.frontend.guard import clamp_of, guard_of, guarded
from spacefusion.frontend.layouts import LayoutChoice, decide
from spacefusion.frontend.maskexpr import PADDING, SYMBOLS, mask_expr
from spacefusion.frontend.prologue import Prologue, prologues
from spacefusion.frontend.records import Operand, Result, Subgraph
from spacefusion.frontend.refusals import Refusal, refusal
from spacefusion.frontend.rope import rope_of

#: how a partition decides a convolution's image layout: the backend's ``layout_of``, which an export records
#: and the GPU machine reads back (``default_layout_of`` where no backend is given)
LayoutOf = Callable[[SMG, SMG], LayoutChoice]


def default_layout_of(nchw: SMG, nhwc: SMG) -> LayoutChoice:
    """``layouts.decide`` for the machine the CUDA path ranks for here (``machine.ranking_hardware``: the GPU in
    hand's preset, else the reported default), for a partition made without a backend."""
    from spacefusion.frontend.machine import ranking_hardware

    return decide(nchw, nhwc, ranking_hardware().model)


@dataclass
class Context:
    gm: fx.GraphModule
    claimed: set[str] = field(default_factory=set)
    refused: dict[str, Refusal] = field(default_factory=dict)
    layout_of: LayoutOf = default_layout_of
    layouts: dict[str, str] = field(default_factory=dict)  # chosen conv SMG key -> why that layout
    #: forms the backend leaves to torch's library kernels, with why (``CudaBackend.library_first``)
    library: Mapping[str, str] = field(default_factory=dict)

    def free(self, *nodes: fx.Node) -> bool:
        return all(n.name not in self.claimed for n in nodes)

    def refuse(self, node: fx.Node, code: str, sentence: str) -> None:
        """Record why ``node`` is left to torch (the first reason given stands): a code declared in
        ``refusals.CODES`` and the sentence the report gives."""
        self.refused.setdefault(node.name, refusal(code, sentence))

    @cached_property
    def norm_inputs(self) -> set[str]:
        """The values a LayerNorm/RMSNorm normalises: an add among them is ``match_norm``'s to fuse (not a
        prologue's: the linear before it takes that add)."""
        found = (norm_of(n, self.gm) for n in self.gm.graph.nodes
                 if n.op.startswith("call_") and n.name not in self.prologues)
        return {nm.x.name for nm in found if nm is not None and isinstance(nm.x, fx.Node)}

    @cached_property
    def prologues(self) -> dict[str, Prologue]:
        """The norms the linears reading them take as their GEMMs' prologue (``frontend.prologue``)."""
        return prologues(self.gm)

    def prologue(self, x: object) -> Prologue | None:
        """The prologue a linear of ``x`` takes: ``x`` is such a norm's output."""
        return self.prologues.get(x.name) if isinstance(x, fx.Node) else None


def _value(space: str, node: fx.Node, shp: tuple[int, ...], permute: tuple[int, ...] | None = None) -> Operand:
    return Operand(space, "value", node.name, tuple(shp), permute=permute)


def _param(space: str, ref: str, shp: tuple[int, ...], transpose: bool = False) -> Operand:
    return Operand(space, "param", ref, tuple(shp), transpose)


def _subgraph(kind: str, label: str, nodes: tuple[fx.Node, ...], smg: SMG, operands: list[Operand],
              outs: dict[str, fx.Node]) -> Subgraph:
    results = tuple(Result(sp, outs[sp].name, shape(outs[sp])) for sp in smg.outputs)
    return Subgraph(kind, label, tuple(n.name for n in nodes), smg, tuple(operands), results)


def _build(ctx: Context, node: fx.Node, make: Callable[[], SMG]) -> SMG | None:
    try:
        return make()
    except SpaceFusionError as exc:
        ctx.refuse(node, "build.smg", f"its SMG cannot be built: {exc}")
        return None


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
    a = dict(zip(names, node.args)) | dict(node.kwargs)
    q, k, v = a["query"], a["key"], a["value"]
    sq, sk, sv = shape(q), shape(k), shape(v)
    if a.get("dropout_p", 0.0):
        ctx.refuse(node, "attention.dropout", "attention with dropout: random, not an index expression")
        return None
    if not (sq and sk and sv) or not len(sq) == len(sk) == len(sv) == 4:
        ctx.refuse(node, "attention.rank", "attention on tensors that are not [batch, heads, seq, head_dim]")
        return None
    (b, h, m, d), (_, hk, l, dk), dv = sq, sk, sv[3]
    dt = dtype(q)
    if dk != d or dv != d or dt is None:
        ctx.refuse(node, "attention.head_dims",
                   f"attention with head dims q {d}, k {dk}, v {dv} and dtype {q.meta['tensor_meta'].dtype}: "
                   f"the pattern takes one head dim and float32/float16/bfloat16")
        return None
    causal, scale = bool(a.get("is_causal", False)), a.get("scale")
    mods, extra = (), []
    if a.get("attn_mask") is not None:
        got = mask_mods(ctx, node, a["attn_mask"], (b, h, m, l), hk, dt)
        if got is None:
            return None
        causal = causal or got[0]
        mods, extra, taken = got[1], got[2], got[3]
    else:
        taken = ()
    what = "" if not mods else " + bias" if "+ Mask" in mods[0].body else " + mask"
    what += " (index)" if mods and "Mask" not in mods[0].body else ""
    label = f"attention b{b} h{h}/{hk} {m}x{l} d{d}{' causal' if causal else ''}{what} {dt}"
    return attention_subgraph(ctx, node, (*taken, node), q, k, v, (b, h, hk, m, l, d), dt, causal, scale, mods,
                              extra, label)


def mask_mods(ctx: Context, node: fx.Node, mask: object, want: tuple[int, int, int, int], kv_heads: int, dt: str
              ) -> tuple[bool, tuple[patterns.ScoreMod, ...], list[Operand], tuple[fx.Node, ...]] | None:
    """(causal, score mods, their operands, the mask's nodes taken in) of an attention's mask: index
    arithmetic where it is (``_index_mask``), else the mask read as a tensor (``_mask_mod``), and a bias kept
    by such a mask (``_kept_bias``); None, with the reason recorded on ``node``, where it can be none."""
    taken: tuple[fx.Node, ...] = ()
    if isinstance(mask, fx.Node) and mask.op == "call_method" and mask.target == "contiguous" \
            and len(mask.users) == 1 and ctx.free(mask):  # a copy of what the kernel reads through strides
        taken, mask = (mask,), mask.args[0]
    kept = _kept_bias(ctx, mask, want, kv_heads, dt)
    if kept is not None:
        return (*kept, (*taken, mask))
    got = _index_mask(mask, want, kv_heads, dt) or _mask_mod(mask, want, kv_heads, dt)
    if isinstance(got, str):
        ctx.refuse(node, "attention.mask", got)
        return None
    return (*got, taken)


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


def _mask_mod(mask: object, want: tuple[int, int, int, int], kv_heads: int, dt: str
              ) -> tuple[bool, tuple[patterns.ScoreMod, ...], list[Operand]] | str:
    """SDPA's ``attn_mask`` as a score mod over an input ``Mask`` with the mask's own dims: those of
    [b, heads, m, l] it has (size > 1, not a stride-0 broadcast; the query heads as GQA's (h, r)).  A boolean
    mask keeps the scores where it is true (``MASKED`` elsewhere), bound as 0/1 in the scores' dtype; a float
    one is added.  A reason (str) where the mask cannot be an input of that kind."""
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


#: rows below one tensor-core tile (16): the GEMM is a GEMV (decoding), bound by reading W, whose kernel
#: reads W's rows as ``nn.Linear`` stores them ([n, k]) in 16-byte runs along k; from 16 rows on, B = W.T
#: [k, n], the layout the tensor-core (mma / wgmma) GEMMs stream
GEMV_ROWS = 16


def b_layout(m: int) -> str:
    """The B layout a linear of ``m`` rows is fused with (``GEMV_ROWS``)."""
    return "nk" if m < GEMV_ROWS else "kn"


def _weight(space: str, ref: str, m: int, k: int, n: int, stored_kn: bool = False) -> Operand:
    """B of a GEMM of ``m`` rows from a weight stored [n, k] (``nn.Linear``) or [k, n] (GPT-2's ``Conv1D``):
    transposed once at build time where the layout ``b_layout`` picks is not the stored one."""
    nk = b_layout(m) == "nk"
    return _param(space, ref, (n, k) if nk else (k, n), transpose=nk == stored_kn)


def match_gated_gemm(node: fx.Node, ctx: Context) -> Subgraph | None:
    """``act(linear_g(x)) * linear_u(x)`` (two linears sharing x, or one linear's two chunked halves: GEGLU)
    -> ``builders.gated_gemm``; the halves of a chunked projection are slices of its weight's rows."""
    gu = gated_of(node, ctx.gm)
    if gu is None or not ctx.free(*gu.nodes) or dtype(node) is None:
        return None
    m, n, k, dt = rows(shape(gu.x)), gu.n, gu.gate.k, dtype(node)
    pro = ctx.prologue(gu.x)
    nk = b_layout(m) == "nk" or pro is not None  # a prologue's weights are folded copies as stored
    smg = _build(ctx, node, lambda: builders.gated_gemm(m, n, k, gu.act, dt, "nk" if nk else "kn", bias=gu.bias,
                                                        norm=pro.kind if pro else "none",
                                                        eps=pro.eps if pro else None))
    if smg is None:
        return None
    w_shape = (n, k) if nk else (k, n)
    fold = _fold(pro)
    ops = [_value("X", pro.x if pro else gu.x, (m, k)),
           Operand("Wg", "param", gu.gate.weight, w_shape, transpose=not nk, rows=gu.gate_rows, fold_norm=fold),
           Operand("Wu", "param", gu.up.weight, w_shape, transpose=not nk, rows=gu.up_rows, fold_norm=fold)]
    if gu.bias:
        ops += [Operand("bg", "param", gu.gate.bias, (n,), rows=gu.gate_rows),
                Operand("bu", "param", gu.up.bias, (n,), rows=gu.up_rows)]
    form = f"{gu.act}(X@Wg + bg)*(X@Wu + bu)" if gu.bias else f"{gu.act}(X@Wg)*(X@Wu)"
    label = f"{pro.label if pro else ''}gated gemm {form}{' (one chunked linear)' if gu.gate_rows else ''} " \
            f"{m}x{n}x{k} {dt}"
    return _subgraph("norm_gated_gemm" if pro else "gated_gemm", label, gu.nodes, smg, ops, {"Y": node})


def _fold(pro: Prologue | None) -> tuple[str, float] | None:
    """How a linear weight takes its prologue norm's weight (``Operand.fold_norm``); None without one."""
    return (pro.weight, pro.offset) if pro is not None and pro.weight is not None else None


def match_linear(node: fx.Node, ctx: Context) -> Subgraph | None:
    """``nn.Linear`` (+ bias) and a following activation -> ``patterns.gemm_epilogue`` with B = W.T (below
    ``GEMV_ROWS`` rows B = W as stored: ``b_layout``)."""
    lin = linear_of(node, ctx.gm)
    if lin is None or not ctx.free(node):
        return None
    xs, dt = shape(lin.x), dtype(node)
    if xs is None or dt is None:
        ctx.refuse(node, "linear.input", f"linear on a non-float or unshaped input ({node.meta.get('tensor_meta')})")
        return None
    act = _activation_after(node, ctx)
    out, name = (act.out, act.name) if act else (node, None)
    res = None if act else _residual_after(node, ctx)
    back = None if act or res else _residual_through_permute(node, ctx)
    if back is not None:
        res = back[1], back[2]
    out = res[0] if res else out
    m = rows(xs)
    pro = ctx.prologue(lin.x)
    smg = _build(ctx, node, lambda: patterns.gemm_epilogue(
        m, lin.n, lin.k, name or "none", lin.bias is not None, dtype=dt, b_layout="nk" if pro else b_layout(m),
        residual=res is not None, norm=pro.kind if pro else "none", eps=pro.eps if pro else None))
    if smg is None:
        return None
    weight = (Operand("Bw", "param", lin.weight, (lin.n, lin.k), fold_norm=_fold(pro)) if pro
              else _weight("Bw", lin.weight, m, lin.k, lin.n, lin.stored_kn))
    ops = [_value("A", pro.x if pro else lin.x, (m, lin.k)), weight]
    if lin.bias:
        ops.append(_param("bias", lin.bias, (lin.n,)))
    if back is not None:  # the residual and the sum in NCHW, channels-last: both bind as [m, n] views
        ops.append(_value("R", res[1], (m, lin.n), permute=(0, 2, 3, 1)))
        label = f"gemm{' + bias' if lin.bias else ''} + permute + add {m}x{lin.n}x{lin.k} {dt}"
        b, h, w, n = shape(node)
        result = Result("Y", res[0].name, shape(res[0]), permute=(0, 3, 1, 2), split=(b, h, w, n))
        return Subgraph("gemm", label, (node.name, back[0].name, res[0].name), smg, tuple(ops), (result,))
    if res:
        ops.append(_value("R", res[1], (m, lin.n)))
    label = (f"{pro.label if pro else ''}gemm{' + bias' if lin.bias else ''}{f' + {name}' if act else ''}"
             f"{' + add' if res else ''} {m}x{lin.n}x{lin.k} {dt}")
    nodes = (node, *act.nodes) if act else (node, res[0]) if res else (node,)
    return _subgraph("norm_gemm" if pro else "gemm", label, nodes, smg, ops, {"Y": out})


def _residual_through_permute(node: fx.Node, ctx: Context) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """(the permute, the add, the other operand) of ``linear(x).permute(0, 3, 1, 2) + r`` over images stored
    channels-last (ConvNeXt's block: its MLP runs on [b, h, w, c], the block's input is NCHW): the sum's rows
    are the GEMM's rows, so the add is its epilogue, the residual and the sum bound as [m, n] views (never a
    copy: a residual not stored channels-last is left to torch's add)."""
    p = single_user(node)
    pv = permutation(p) if p is not None else None
    if pv is None or pv[1] != (0, 3, 1, 2) or len(shape(node) or ()) != 4 or not ctx.free(p):
        return None
    added = _add_after(p, ctx)
    if added is None or added[0].name in ctx.norm_inputs or not contiguous_nhwc(added[1]) \
            or not contiguous_nhwc(added[0]):
        return None
    return p, added[0], added[1]


def _add_after(y: fx.Node, ctx: Context) -> tuple[fx.Node, fx.Node] | None:
    """(the add, the other operand) of ``y + r``, the add ``y``'s only reader and ``r`` a value of ``y``'s
    shape and dtype: a residual an epilogue takes (torchvision's ``out += identity`` is ``operator.iadd``
    on the BatchNorm's output, read by nothing else)."""
    u = single_user(y)
    if u is None or not is_function(u, (*ADD, operator.iadd)) or len(u.args) != 2 or u.kwargs or not ctx.free(u):
        return None
    other = u.args[1] if u.args[0] is y else u.args[0]
    ok = isinstance(other, fx.Node) and other is not y and shape(other) == shape(y) and dtype(other) == dtype(y)
    return (u, other) if ok else None


def _residual_after(node: fx.Node, ctx: Context) -> tuple[fx.Node, fx.Node] | None:
    """``_add_after`` a linear where no norm reads the sum (BERT's and LLaMA's residual adds are their norms'
    to fuse: ``match_norm``) and the other operand binds as [m, n] without a copy."""
    added = _add_after(node, ctx)
    return added if added is not None and added[0].name not in ctx.norm_inputs and contiguous(added[1]) else None


def match_patch_conv(node: fx.Node, ctx: Context) -> Subgraph | None:
    """A ``nn.Conv2d`` with kernel = stride (ViT's patch embedding, ``graph.patch_conv_of``) -> the GEMM of its
    patches, ``patterns.gemm_epilogue``: A is the image split into patches (torch's copy, im2col without
    overlap), B the weight as a linear's, and Y[b * nh * nw, c_out] goes back as the conv's [b, c_out, nh, nw]
    with channels-last strides, which the usual ``flatten(2).transpose(1, 2)`` after it reads as a view."""
    pc = patch_conv_of(node, ctx.gm)
    if pc is None or not ctx.free(node):
        return None
    xs, dt = shape(pc.x), dtype(node)
    if xs is None or dt is None or len(xs) != 4:
        ctx.refuse(node, "patch_conv.input",
                   f"patch conv on a non-float or non-4D input ({node.meta.get('tensor_meta')})")
        return None
    b, c, h, w = xs
    if h % pc.kh or w % pc.kw:
        ctx.refuse(node, "patch_conv.remainder",
                   f"a {h}x{w} image is not a whole number of {pc.kh}x{pc.kw} patches (the conv drops the "
                   f"rest; the patch GEMM reads whole patches)")
        return None
    nh, nw = h // pc.kh, w // pc.kw
    m, k, n = b * nh * nw, c * pc.kh * pc.kw, pc.cout
    smg = _build(ctx, node, lambda: patterns.gemm_epilogue(m, n, k, "none", pc.bias is not None, dtype=dt,
                                                           b_layout=b_layout(m)))
    if smg is None:
        return None
    ops = [Operand("A", "value", pc.x.name, (m, k), permute=(0, 2, 4, 1, 3, 5), split=(b, c, nh, pc.kh, nw, pc.kw)),
           _weight("Bw", pc.weight, m, k, n)]
    if pc.bias:
        ops.append(_param("bias", pc.bias, (n,)))
    out = Result("Y", node.name, shape(node), permute=(0, 3, 1, 2), split=(b, nh, nw, n))
    label = f"patch conv {pc.kh}x{pc.kw} as gemm{' + bias' if pc.bias else ''} {m}x{n}x{k} {dt}"
    return Subgraph("gemm", label, (node.name,), smg, tuple(ops), (out,))


#: activations a convolution's epilogue takes (ResNet's ReLU, diffusion models' SiLU, GELU)
CONV_ACTIVATIONS = ("relu", "relu6", "silu", "gelu", "gelu_tanh", "sigmoid", "tanh")


def conv_refusal(cv, x_shape: tuple[int, ...] | None, dt: str | None) -> str | None:
    """Why the implicit-GEMM convolution cannot take ``cv`` (None: it can)."""
    from spacefusion.frontend.reasons import conv_reason

    if cv.groups != 1 or cv.dilation not in ((1, 1), (1,)):
        return conv_reason(cv.stride, cv.padding, cv.dilation, cv.groups) + (
            f" (padding mode {cv.padding_mode!r})" if cv.padding_mode != "zeros" else "")
    if cv.padding_mode != "zeros":
        return f"padding mode {cv.padding_mode!r}: the SMG window reads zeros outside the image"
    if cv.dims == 1:
        if not isinstance(cv.padding, tuple):
            return (f"a 1-D convolution with padding {cv.padding!r} (kernel {cv.kw}): the window pads both ends "
                    f"alike")
    elif cv.kh != cv.kw or cv.stride[0] != cv.stride[1] or not isinstance(cv.padding, tuple) \
            or cv.padding[0] != cv.padding[1]:
        return (f"a {cv.kh}x{cv.kw} kernel, stride {cv.stride}, padding {cv.padding}: the implicit GEMM takes square "
                f"kernels with one stride and one padding")
    if x_shape is None or len(x_shape) != cv.dims + 2 or dt not in ("float16", "bfloat16", "float32"):
        return f"a convolution of a non-float or non-image input (shape {x_shape}, dtype {dt})"
    if cv.c % 8:
        return (f"{cv.c} input channels: the implicit GEMM's gathered tile reads 16-byte runs of 8 channels (an "
                f"RGB stem{' or a raw waveform' if cv.dims == 1 else ''} stays with cuDNN)")
    if cv.cout % 8:
        return (f"{cv.cout} output channels: the tensor-core GEMM's columns come in 8s, so the search's kernels "
                f"for so narrow an output run on CUDA cores (SD 1.5 VAE's RGB head took 919 us on the H100); cuDNN "
                f"keeps it")
    return None


#: an ``Upsample -> Conv`` runs per output parity (``patterns.upsample_conv2d``: 4 merged taps of the small image
#: an output pixel, not 9) where its GEMMs' rows fill a warpgroup MMA's 64: they run along one small-image row
#: (w pixels) or one column of them (n * h).  On the H100 the VAE's three went 115 -> 60, 510 -> 190 and 514 ->
#: 198 us, the UNet's 2x32x32x640 132 -> 70; its 2x16x16x1280 (32 rows) lost 134 -> 253 and its 2x8x8x1280 54
#: -> 139 (``experiments/tuning/upsample_parity_h100.json``)
PARITY_MIN_ROWS = 64


def by_parity(rows: int, width: int, kernel: int, stride: int, pad: int, factor: int) -> bool:
    """Whether a conv after a nearest ``factor``x upsampling of ``rows`` (n * h) image rows ``width`` wide runs
    by output parity: a stride-1 'same' conv whose parity GEMMs' rows fill a 64-row MMA tile
    (``PARITY_MIN_ROWS``) and whose parities each read a window of one width (``upsample_taps``; a 3x3
    after a 3x upsampling does not, and keeps the upsampled read)."""
    if factor < 2 or stride != 1 or 2 * pad != kernel - 1 or max(rows, width) < PARITY_MIN_ROWS:
        return False
    try:
        upsample_taps(kernel, pad, factor)
    except ShapeError:
        return False
    return True


#: an upsampled image of at most this many pixels (n * H * W, after the upsampling) that the parity form refuses
#: is written apart (torch's nearest kernel) and convolved as a plain image, by TMA im2col.  SD 1.5's UNet's
#: 2x1280x8x8 -> 16x16 (512 pixels) took 106 us read through the window on the H100, its plain 16x16 1280-channel
#: convs 44-55 (``experiments/results/model_profile_unet_h100.json``; the analytical model agrees: 64 against 41
#: + the copy).  Its 2x1280x16x16 -> 32x32 (2048) keeps the window read: 129 us measured, the plain form not
#: measured (the model's 98 + 4 was not trusted).  A rule, not the model's estimate, because the partition is
#: derived again on the GPU machine, which has no cost model (islpy), and must come out the same there
APART_MAX_PIXELS = 512


def upsample_apart(small: tuple[int, ...], cv, factor: int) -> str | None:
    """Why a nearest ``factor``x upsampling of ``small`` (NCHW) before ``cv`` should run apart (torch writes the
    upsampled image, the conv reads it as a plain one), or None to read it through the conv's window or by
    parity: where the parity form is refused (``by_parity``), the window read gathers its tile by cp.async (no
    TMA im2col reads ``floor(y / 2)``), and on a small grid that lost to the plain conv by TMA
    (``APART_MAX_PIXELS``); the plain conv must itself take TMA im2col (whole 64-channel bands; it is stride 1 here)."""
    n, c, h, w = small
    pad, k, stride = cv.padding[0], cv.kh, cv.stride[0]
    pixels = n * h * w * factor * factor
    if factor < 2 or by_parity(n * h, w, k, stride, pad, factor) or stride != 1 or c % 64 \
            or pixels > APART_MAX_PIXELS:
        return None
    return (f"a {factor}x nearest upsampling of a {n}x{c}x{h}x{w} image runs apart (torch's kernel): too few rows "
            f"for the parity form, and {pixels} pixels (at most {APART_MAX_PIXELS}) read through the window by the "
            f"cp.async gather lost to the plain conv by TMA im2col")


def lies_nchw(x: fx.Node) -> bool:
    """Whether a conv's image ``x`` is known to lie NCHW: a graph input packed so.  Only graph inputs: the
    export's meta tensors give a channels-last conv's output NCHW strides, so another value's strides there
    are not what the GPU sees (its layout is decided as channels-last, where every conv kernel writes)."""
    return x.op == "placeholder" and contiguous(x) and not contiguous_nhwc(x)


def _conv_epilogue(node: fx.Node, ctx: Context) -> tuple[fx.Node, Any, Any, Any, list[fx.Node]]:
    """What a convolution's kernel takes after it: an inference BatchNorm (folded), then a residual add, then
    an activation of ``CONV_ACTIVATIONS``.  (the last node taken, the BatchNorm, the residual, the activation,
    the nodes taken with the conv's own first)."""
    y, bn, res, act = node, None, None, None
    taken = [node]
    if (u := single_user(y)) is not None and (b := batchnorm_of(u, ctx.gm)) is not None and b.x is y \
            and ctx.free(u):
        y, bn = u, b
        taken.append(u)
    if (added := _add_after(y, ctx)) is not None:
        y, res = added
        taken.append(y)
    got = _activation_after(y, ctx)
    if got is not None and got.name in CONV_ACTIVATIONS and len(got.nodes) == 1:
        act, y = got, got.out
        taken.extend(got.nodes)
    return y, bn, res, act, taken


def match_conv(node: fx.Node, ctx: Context) -> Subgraph | None:
    """``nn.Conv2d`` (any padding and stride, groups 1) -> ``patterns.conv2d``, an implicit GEMM over the
    image seen channels-last, with what follows it fused: an inference BatchNorm (folded into the weight and
    bias once), a residual add of a value of the output's shape, an activation; and a nearest upsampling
    before it read through the window.  The output goes back as the conv's NCHW shape with channels-last
    strides, so the next convolution reads it without a copy."""
    cv = conv_of(node, ctx.gm)
    if cv is None or not ctx.free(node):
        return None
    if patch_conv_of(node, ctx.gm) is not None and not _fused_after(node, ctx):
        return None  # a lone patch embedding (ViT's): match_patch_conv's GEMM of the patches
    x, dt = cv.x, dtype(node)
    if cv.dims == 1:
        return _conv1d(node, cv, ctx)
    if cv.groups > 1 and cv.groups == cv.c == cv.cout:
        return _depthwise(node, cv, ctx)
    why = conv_refusal(cv, shape(x), dt)
    if why is not None:
        ctx.refuse(node, "conv.form", why)
        return None
    taken: list[fx.Node] = []
    up, factor = nearest_upsample_of(x, ctx.gm) or (None, 1)
    if up is not None and single_user(x) is node and ctx.free(x) and shape(up) is not None:
        apart = upsample_apart(shape(up), cv, factor)
        if apart is None:
            taken, x = [x], up
        else:
            ctx.refuse(x, "conv.upsample_apart", apart)
            factor = 1
    else:
        factor = 1
    n, c, h, w = shape(x)
    y, bn, res, act, after = _conv_epilogue(node, ctx)
    taken += after
    pad = cv.padding[0]
    has_bias = cv.bias is not None or bn is not None  # a BatchNorm folds into a bias even where the conv has none
    kw = {"act": act.name if act else "none", "bias": has_bias, "residual": res is not None, "dtype": dt}
    parity = by_parity(n * h, w, cv.kh, cv.stride[0], pad, factor)

    def make(layout: str) -> Callable[[], SMG]:
        return lambda: (patterns.upsample_conv2d(n, h, w, c, cv.cout, cv.kh, pad, factor=factor, **kw) if parity
                        else patterns.conv2d(n, h, w, c, cv.cout, cv.kh, cv.stride[0], pad, upsample=factor,
                                             layout=layout, **kw))

    smg, layout = _build(ctx, node, make("nhwc")), "nhwc"
    if smg is None:
        return None
    if factor == 1 and lies_nchw(x) and (nchw := _build(ctx, node, make("nchw"))) is not None:
        choice = ctx.layout_of(nchw, smg)  # the search's decision: read where it lies, or copied first
        if choice.layout == "nchw":
            smg, layout = nchw, "nchw"
        ctx.layouts[smg.key] = choice.reason
    _, p, q, co = shape(node)[0], shape(node)[2], shape(node)[3], cv.cout
    m, k = n * p * q, cv.kh * cv.kw * c
    fold = (bn.mean, bn.var, bn.weight or "", bn.bias or "", repr(bn.eps)) if bn is not None else ()
    rows: tuple[int, ...] = (n * h, factor, w, factor, co) if parity else (m, co)
    wt = (Operand("Wt", "param", cv.weight, (factor, factor, smg.dim_sizes["k"], co), conv=True, fold_bn=fold,
                  fold_upsample=(cv.kh, pad, factor)) if parity
          else Operand("Wt", "param", cv.weight, (k, co), conv=True, fold_bn=fold))
    ops = [_value("X", x, (n, c, h, w)) if layout == "nchw" else _value("X", x, (n, h, w, c), (0, 2, 3, 1)), wt]
    if has_bias:
        ops.append(Operand("bias", "param", cv.bias or "", (co,), fold_bn=fold))
    if res is not None:
        ops.append(_value("R", res, rows, (0, 2, 3, 1)))
    out = Result("Y", y.name, shape(y), permute=(0, 3, 1, 2), split=(n, p, q, co))
    parts = ["conv"] + ["bn"] * (bn is not None) + ["add"] * (res is not None) + ([act.name] if act else [])
    label = (f"{' + '.join(parts)}{' (upsample x' + str(factor) + ')' if factor > 1 else ''} {cv.kh}x{cv.kw}/s"
             f"{cv.stride[0]} {n}x{c}x{h * factor}x{w * factor} -> {co} {dt}"
             f"{' (NCHW image)' if layout == 'nchw' else ''}")
    return Subgraph("conv", label, tuple(t.name for t in taken), smg, tuple(ops), (out,))


def _conv1d(node: fx.Node, cv, ctx: Context) -> Subgraph | None:
    """A 1-D ``nn.Conv1d`` / ``F.conv1d`` (groups 1) -> ``patterns.conv1d``: the implicit GEMM of ``match_conv``
    over an image one row high, with what follows it fused as there (an inference BatchNorm folded, a residual
    add, an activation: Whisper's GELUs).  The input [batch, channels, length] is bound channels-last
    ([n, L, c]: a copy of an NCL tensor, none of a fused conv's output), or read where it lies where it is a
    graph input lying NCL and the search decides so (``ctx.layout_of``, as for a 2-D image: Whisper's log-mel
    frames).  The output goes back as the conv's [n, c_out, L'] with channels-last strides ([n, L', c_out] in
    memory): the next conv reads it without a copy, and Whisper's ``permute(0, 2, 1)`` after its second conv
    is then a packed [n, L', d] view."""
    x, dt = cv.x, dtype(node)
    if cv.groups > 1 and cv.groups == cv.c == cv.cout:
        ctx.refuse(node, "conv1d.depthwise",
                   f"a depthwise 1-D convolution (groups {cv.groups}): the depthwise pattern's window is "
                   f"square (2-D); torch runs it")
        return None
    why = conv_refusal(cv, shape(x), dt)
    if why is not None:
        ctx.refuse(node, "conv.form", why)
        return None
    n, c, length = shape(x)
    y, bn, res, act, taken = _conv_epilogue(node, ctx)
    k, stride, pad, co = cv.kw, cv.stride[1], cv.padding[1], cv.cout
    has_bias = cv.bias is not None or bn is not None
    kw = {"act": act.name if act else "none", "bias": has_bias, "residual": res is not None, "dtype": dt}

    def make(layout: str) -> Callable[[], SMG]:
        return lambda: patterns.conv1d(n, length, c, co, k, stride, pad, layout=layout, **kw)

    smg, layout = _build(ctx, node, make("nhwc")), "nhwc"
    if smg is None:
        return None
    if lies_nchw(x) and (ncl := _build(ctx, node, make("nchw"))) is not None:
        choice = ctx.layout_of(ncl, smg)  # the search's decision: read where it lies, or copied first
        if choice.layout == "nchw":
            smg, layout = ncl, "nchw"
        ctx.layouts[smg.key] = choice.reason
    out_len = shape(node)[2]
    fold = (bn.mean, bn.var, bn.weight or "", bn.bias or "", repr(bn.eps)) if bn is not None else ()
    ops = [_value("X", x, (n, c, 1, length)) if layout == "nchw" else _value("X", x, (n, 1, length, c), NLC),
           Operand("Wt", "param", cv.weight, (k * c, co), conv=True, fold_bn=fold)]  # [co, c, k] -> [k, c, co]
    if has_bias:
        ops.append(Operand("bias", "param", cv.bias or "", (co,), fold_bn=fold))
    if res is not None:
        ops.append(_value("R", res, (n * out_len, co), NLC))
    out = Result("Y", y.name, shape(y), permute=NLC, split=(n, out_len, co))
    parts = ["conv1d"] + ["bn"] * (bn is not None) + ["add"] * (res is not None) + ([act.name] if act else [])
    label = (f"{' + '.join(parts)} k{k}/s{stride} {n}x{c}x{length} -> {co} {dt}"
             f"{' (NCL frames)' if layout == 'nchw' else ''}")
    return Subgraph("conv", label, tuple(t.name for t in taken), smg, tuple(ops), (out,))


#: a 1-D image [n, c, L] seen channels-last [n, L, c] (and a [n, L, c] kernel output seen back as [n, c, L])
NLC = (0, 2, 1)


def depthwise_refusal(cv, x_shape: tuple[int, ...] | None, dt: str | None) -> str | None:
    """Why ``patterns.depthwise_conv2d`` cannot take the depthwise convolution ``cv`` (None: it can)."""
    if cv.dilation != (1, 1) or cv.padding_mode != "zeros":
        return (f"a depthwise convolution with dilation {cv.dilation} and padding mode {cv.padding_mode!r}: the "
                f"window is s*y + ky over a zero-padded image")
    if cv.kh != cv.kw or cv.stride[0] != cv.stride[1] or not isinstance(cv.padding, tuple) \
            or cv.padding[0] != cv.padding[1] or 2 * cv.padding[0] > cv.kh:
        return (f"a depthwise {cv.kh}x{cv.kw} kernel, stride {cv.stride}, padding {cv.padding}: the window takes "
                f"square kernels with one stride and a padding of at most half the kernel")
    if x_shape is None or len(x_shape) != 4 or dt not in ("float16", "bfloat16", "float32"):
        return f"a depthwise convolution of a non-float or non-image input (shape {x_shape}, dtype {dt})"
    return None


def _depthwise(node: fx.Node, cv, ctx: Context) -> Subgraph | None:
    """A depthwise ``nn.Conv2d`` (groups = in = out channels) -> ``patterns.depthwise_conv2d``: the window read
    channels-last and a per-channel filter summed over the taps, on CUDA cores, with what follows it as in
    ``match_conv`` (an inference BatchNorm folded into the filter and bias, a residual add, an activation)."""
    x, dt = cv.x, dtype(node)
    if ctx.library.get("dwconv"):
        ctx.refuse(node, "library.first", ctx.library["dwconv"])
        return None
    why = depthwise_refusal(cv, shape(x), dt)
    if why is not None:
        ctx.refuse(node, "dwconv.form", why)
        return None
    n, c, h, w = shape(x)
    y, bn, res, act, taken = _conv_epilogue(node, ctx)
    k, stride, pad = cv.kh, cv.stride[0], cv.padding[0]
    has_bias = cv.bias is not None or bn is not None
    smg = _build(ctx, node, lambda: patterns.depthwise_conv2d(n, h, w, c, k, stride, pad, act.name if act else "none",
                                                              has_bias, res is not None, dt))
    if smg is None:
        return None
    p, q = smg.dim_sizes["p"], smg.dim_sizes["q"]
    fold = (bn.mean, bn.var, bn.weight or "", bn.bias or "", repr(bn.eps)) if bn is not None else ()
    ops = [_value("X", x, (n, h, w, c), (0, 2, 3, 1)),
           Operand("Wt", "param", cv.weight, (k, k, c), conv=True, fold_bn=fold)]  # [c, 1, k, k] -> [k, k, c]
    if has_bias:
        ops.append(Operand("bias", "param", cv.bias or "", (c,), fold_bn=fold))
    if res is not None:
        ops.append(_value("R", res, (n, p, q, c), (0, 2, 3, 1)))
    out = Result("Y", y.name, shape(y), permute=(0, 3, 1, 2), split=(n, p, q, c))
    parts = ["dwconv"] + ["bn"] * (bn is not None) + ["add"] * (res is not None) + ([act.name] if act else [])
    label = f"{' + '.join(parts)} {k}x{k}/s{stride} {n}x{c}x{h}x{w} {dt}"
    return Subgraph("conv", label, tuple(t.name for t in taken), smg, tuple(ops), (out,))


def match_max_pool(node: fx.Node, ctx: Context) -> Subgraph | None:
    """``nn.MaxPool2d`` / ``F.max_pool2d`` -> ``patterns.max_pool2d``: the window read through the SMG's pooling
    view (taps outside the image masked as torch pads them, with -inf), the max over its taps, per channel.  A
    free ReLU right before the pool, and a per-channel shift before that (a BatchNorm's, which ``bn_fold``
    leaves after a cuDNN conv), move after the max, where they give the same values (both are monotone), and
    join the kernel."""
    if not is_max_pool(node, ctx.gm) or not ctx.free(node):
        return None
    mp = max_pool_of(node, ctx.gm)
    if mp is None:
        ctx.refuse(node, "max_pool.form",
                   "a max pool with dilation, ceil mode, indices or a non-square window: the SMG's pooling "
                   "view takes a square window with one stride and one padding")
        return None
    xs, dt = shape(mp.x), dtype(node)
    if xs is None or len(xs) != 4 or dt not in ("float16", "bfloat16", "float32"):
        ctx.refuse(node, "max_pool.input", f"a max pool of a non-float or non-image input (shape {xs}, dtype {dt})")
        return None
    n, c, h, w = xs
    x, taken, act, bias = mp.x, [node], "none", None

    def movable(v: fx.Node, reader: fx.Node) -> fx.Node | None:
        """The input of ``v``, where ``v`` (read by ``reader`` alone) may leave the graph: an in-place op wrote
        its input too, so that input must have no other reader either."""
        src = v.args[0] if v.args else None
        ok = isinstance(src, fx.Node) and single_user(v) is reader and single_user(src) is v and ctx.free(v) \
            and shape(src) == xs
        return src if ok else None

    if activation_of(x, ctx.gm) == "relu" and (src := movable(x, node)) is not None:
        taken, act, reader, x = [x, node], "relu", x, src
        if is_function(x, ADD) and len(x.args) == 2 and not x.kwargs and single_user(x) is reader and ctx.free(x):
            img, b = x.args
            ref = param_ref(b)
            if isinstance(img, fx.Node) and ref is not None and shape(img) == xs and shape(b) in ((1, c, 1, 1),
                                                                                            (c, 1, 1)):
                taken, bias, x = [x, *taken], ref, img
    smg = _build(ctx, node, lambda: patterns.max_pool2d(n, h, w, c, mp.kernel, mp.stride, mp.pad, act,
                                                        bias is not None, dt))
    if smg is None:
        return None
    p, q = shape(node)[2], shape(node)[3]
    ops = [_value("X", x, (n, h, w, c), (0, 2, 3, 1))] + ([_param("bias", bias, (c,))] if bias else [])
    out = Result("Y", node.name, shape(node), permute=(0, 3, 1, 2), split=(n, p, q, c))
    label = (f"{'add + ' if bias else ''}{'relu + ' if act == 'relu' else ''}max_pool {mp.kernel}x{mp.kernel}/s"
             f"{mp.stride} {n}x{c}x{h}x{w} {dt}")
    return Subgraph("pool", label, tuple(t.name for t in taken), smg, tuple(ops), (out,))


def match_group_norm(node: fx.Node, ctx: Context) -> Subgraph | None:
    """``nn.GroupNorm`` / ``F.group_norm`` on an image (and the SiLU after it, the VAE's and UNet's pair) ->
    ``patterns.group_norm`` over the image seen channels-last [n, h * w, groups, channels / groups].  The
    output goes back as NCHW shapes with channels-last strides, as a conv's does; the backend splits the
    reduction when the groups alone leave the SMs idle (``schedulers.split``)."""
    gn = groupnorm_of(node, ctx.gm)
    if gn is None or not ctx.free(node):
        return None
    xs, dt = shape(gn.x), dtype(node)
    if xs is None or len(xs) not in (3, 4) or dt is None or (gn.weight is None) != (gn.bias is None):
        ctx.refuse(node, "group_norm.form",
                   f"GroupNorm of a {xs} input, weight {gn.weight}, bias {gn.bias}: the pattern takes a 3-d or "
                   "4-d image with both or neither of the affine parameters")
        return None
    n, c, h, w = xs if len(xs) == 4 else (*xs, 1)  # [n, c, L] (an attention block's flattened image) as L x 1
    nchw = (0, 3, 1, 2) if len(xs) == 4 else (0, 2, 1)
    taken, y, act = [node], node, None
    x, shift = gn.x, _per_channel_shift(gn.x, node, ctx)
    if shift is not None:
        taken, x = [gn.x, node], shift[0]
    got = _activation_after(node, ctx)
    if got is not None and got.name in CONV_ACTIVATIONS and len(got.nodes) == 1:
        act, y = got, got.out
        taken.extend(got.nodes)
    affine = gn.weight is not None
    smg = _build(ctx, node, lambda: patterns.group_norm(n, h * w, gn.groups, c, act.name if act else "none",
                                                        affine, dt, gn.eps, shift=shift is not None))
    if smg is None:
        return None
    g, cg = gn.groups, c // gn.groups
    ops = [_value("X", x, (n, h * w, g, cg), tuple(nchw.index(i) for i in range(len(xs))))]
    if shift is not None:
        ops.append(_value("E", shift[1], (n, g, cg)))
    if affine:
        ops += [_param("W", gn.weight, (g, cg)), _param("B", gn.bias, (g, cg))]
    out = Result("Y", y.name, shape(y), permute=nchw, split=(n, h, w, c) if len(xs) == 4 else (n, h, c))
    size = "x".join(map(str, xs))
    label = f"{'add + ' if shift else ''}group_norm{' + ' + act.name if act else ''} {size} /{g} {dt}"
    return Subgraph("group_norm", label, tuple(t.name for t in taken), smg, tuple(ops), (out,))


def _per_channel_shift(x: fx.Node, norm: fx.Node, ctx: Context) -> tuple[fx.Node, fx.Node] | None:
    """(image, shift) where the GroupNorm's input ``x`` is ``image + shift[:, :, None, None]`` read by the
    norm alone (diffusers' ResNet block: ``conv1(h) + time_emb_proj(temb)[:, :, None, None]``)."""
    if not is_function(x, ADD) or len(x.args) != 2 or x.kwargs or single_user(x) is not norm or not ctx.free(x):
        return None
    xs = shape(x)
    for img, e in (x.args, x.args[::-1]):
        if isinstance(img, fx.Node) and isinstance(e, fx.Node) and shape(img) == xs and dtype(img) == dtype(x) \
                and shape(e) == (xs[0], xs[1], 1, 1) and dtype(e) == dtype(x) and contiguous(e):
            return img, e
    return None


def _fused_after(node: fx.Node, ctx: Context) -> bool:
    """Whether a BatchNorm, an add or an activation reads ``node`` alone (what match_conv fuses after it)."""
    u = single_user(node)
    return u is not None and ctx.free(u) and (batchnorm_of(u, ctx.gm) is not None or is_function(u, ADD)
                                              or activation_of(u, ctx.gm) is not None)


def _activation_after(node: fx.Node, ctx: Context) -> Activation | None:
    """The activation applied to a linear's output (``activations.activation_after``), fused into its
    epilogue when none of its nodes is claimed; a view between them that keeps the rows (GPT-2's
    ``addmm(...).view(b, s, n)``) is taken in too."""
    via: tuple[fx.Node, ...] = ()
    user = single_user(node)
    if user is not None and row_view(user, node):
        via, y = (user,), user
    else:
        y = node
    act = activation_after(y, ctx.gm)
    if act is None:
        return None
    nodes = (*via, *act.nodes)
    return Activation(act.name, nodes, act.out) if ctx.free(*nodes) else None


def _stack_key(lin: Linear, node: fx.Node, ctx: Context) -> tuple | None:
    """What linears must share to be one stacked GEMM (None: this one cannot join): a written-out
    activation or a view before it would need per-slice results, so only a one-op activation joins."""
    act = _activation_after(node, ctx)
    if not ctx.free(node) or dtype(node) is None or shape(lin.x) is None or (act and len(act.nodes) > 1):
        return None
    return lin.k, lin.n, lin.bias is not None, lin.stored_kn, act.name if act else None, dtype(node)


def match_stacked_linears(node: fx.Node, ctx: Context) -> Subgraph | None:
    """``node`` and the other ``nn.Linear`` of its input with equal shapes, bias use and activation (Q/K/V
    projections; GQA's K/V) -> one stacked ``patterns.gemm_epilogue`` (``stack``): the weights stacked once,
    each linear's output a contiguous slice of Y[t, m, n], so the attention or RoPE reading it binds it
    without a copy.
    Horizontal fusion: one launch instead of ``t``, and ``t`` times the blocks of a small GEMM."""
    first = linear_of(node, ctx.gm)
    if first is None or not isinstance(first.x, fx.Node) or (key := _stack_key(first, node, ctx)) is None:
        return None
    group = [(u, lin) for u in first.x.users if (lin := linear_of(u, ctx.gm)) is not None and lin.x is first.x
             and _stack_key(lin, u, ctx) == key]
    if len(group) < 2:
        return None
    (k, n, bias, stored_kn, act, dt), t, m = key, len(group), rows(shape(first.x))
    pro = ctx.prologue(first.x)
    nk = b_layout(m) == "nk" or pro is not None  # a prologue's weights are folded copies as stored
    smg = _build(ctx, group[0][0],
                 lambda: patterns.gemm_epilogue(m, n, k, act or "none", bias, dt, "nk" if nk else "kn", stack=t,
                                                norm=pro.kind if pro else "none", eps=pro.eps if pro else None))
    if smg is None:
        return None
    lins = [lin for _, lin in group]
    ops = [_value("A", pro.x if pro else first.x, (m, k)),
           Operand("Bw", "param", lins[0].weight, (t, n, k) if nk else (t, k, n), nk == stored_kn,
                   stack=tuple(lin.weight for lin in lins), fold_norm=_fold(pro))]
    if bias:
        ops.append(Operand("bias", "param", lins[0].bias, (t, n), stack=tuple(lin.bias for lin in lins)))
    outs = [single_user(u) if act else u for u, _ in group]
    results = tuple(Result("Y", o.name, shape(o), index=i) for i, o in enumerate(outs))
    nodes = [u.name for u, _ in group] + ([o.name for o in outs] if act else [])
    label = (f"{pro.label if pro else ''}{t} stacked gemms{' + bias' if bias else ''}{f' + {act}' if act else ''} "
             f"{m}x{n}x{k} {dt}")
    return Subgraph("norm_stacked_gemm" if pro else "stacked_gemm", label, tuple(nodes), smg, tuple(ops), results)


def match_norm(node: fx.Node, ctx: Context) -> Subgraph | None:
    """LayerNorm / RMSNorm over the last dim -> ``norm``; when its input is ``a + b`` of one shape the add
    is fused too (``residual_norm``), and the sum is a second output where something else reads it."""
    nm = norm_of(node, ctx.gm)
    if nm is None or not ctx.free(node, *nm.inner):
        return None
    if node.name in ctx.prologues:  # each linear reading it recomputes it from its input
        ctx.refuse(node, "norm.prologue",
                   f"an {nm.kind} read only by linears: the prologue of their GEMMs, each normalising the "
                   f"rows it multiplies (gone once they are fused)")
        return None
    xs, dt = shape(nm.x), dtype(node)
    if nm.dims != 1 or nm.weight is None or (nm.kind == "layernorm" and nm.bias is None) or xs is None or dt is None:
        ctx.refuse(node, "norm.form",
                   f"{nm.kind} over {nm.dims} dims, weight {nm.weight}, bias {nm.bias}: the patterns "
                   f"normalise the last dim with an affine weight (and LayerNorm bias)")
        return None
    x = nm.x
    guard = guard_of(x) if isinstance(x, fx.Node) else None
    guard = guard if guard is not None and ctx.free(*guard.nodes) and shape(guard.x) == xs else None
    clip = _clamped_sum(x, ctx) if guard is None else None
    add = clip[0] if clip else x
    residual = (guard is None and is_function(add, ADD) and len(add.args) == 2 and not add.kwargs and ctx.free(add)
                and all(shape(a) == xs for a in add.args))
    clip = clip if residual else None
    keep_sum = (residual or guard is not None) and any(u is not node and u not in nm.inner for u in x.users)
    m, n = rows(xs), xs[-1]
    smg = _build(ctx, node, lambda: builders.norm(nm.kind, m, n, residual, keep_sum, dt, float(nm.eps), nm.offset,
                                                  guard, clip[1:] if clip else None))
    if smg is None:
        return None
    if residual:
        ops = [_value("X", add.args[0], (m, n)), _value("R", add.args[1], (m, n))]
    else:
        ops = [_value("X", guard.x if guard else x, (m, n))]
    ops.append(_param("W", nm.weight, (n,)))
    if nm.kind == "layernorm":
        ops.append(_param("B", nm.bias, (n,)))
    kind = "residual_norm" if residual else "norm"
    weight = f" ({nm.offset:g} + w)" if nm.offset else ""
    kept = " (clamped kept)" if (guard or clip) and keep_sum else " (sum kept)" if keep_sum else ""
    first = "add + clamp + " if clip else "add + " if residual else "inf guard + " if guard else ""
    label = f"{first}{nm.kind}{weight}{kept} {m}x{n} {dt}"
    nodes = (*((add, x) if clip else (x,) if residual else guard.nodes if guard else ()), *nm.inner, node)
    return _subgraph(kind, label, nodes, smg, ops, {"Y": node, "T": x})


def _clamped_sum(x: object, ctx: Context) -> tuple[fx.Node, float, float] | None:
    """(the add, lo, hi) where a norm's input ``x`` is ``clamp(a + b, lo, hi)`` with number bounds and the add read
    by the clamp alone (Whisper's fp16 guard after its residual add): the norm's kernel then takes the add and
    the clamp, and the clamped sum is its second output where something else reads it (the next residual)."""
    got = clamp_of(x) if isinstance(x, fx.Node) and ctx.free(x) else None
    if got is None or single_user(got[0]) is not x or not ctx.free(got[0]):
        return None
    return got


def match_guard(node: fx.Node, ctx: Context) -> Subgraph | None:
    """T5's fp16 clamp (``guard.guard_of``) that no norm took (one reads it after ``match_norm`` has run):
    the flag, then the clamp as an element-wise pass."""
    guard = guard_of(node)
    if guard is None or not ctx.free(*guard.nodes) or shape(node) is None:
        return None
    xs, dt = shape(node), dtype(node)
    dims = {f"d{i}": s for i, s in enumerate(xs)}

    def make() -> SMG:
        g = Builder("inf_guard", dt)
        return g.build(guarded(g, g.input("X", dims), guard, dt))

    smg = _build(ctx, node, make)
    if smg is None:
        return None
    label = f"inf guard {'x'.join(map(str, xs))} {dt}"
    return _subgraph("guard", label, guard.nodes, smg, [_value("X", guard.x, xs)], {"T": node})


def _rope_input(x: fx.Node, inside: tuple[fx.Node, ...], ctx: Context
                ) -> tuple[fx.Node, tuple[int, ...] | None, str, tuple[fx.Node, ...]] | None:
    """(the node X is bound to, the permutation it is read through, the layout, nodes taken with it) for
    RoPE's input ``x`` [b, h, s, d]: HF's split_heads view of a packed [b, s, h, d] projection (the
    transpose is taken in and X is the projection), a value lying as [b, s, h, d] (read through
    ``TO_BSHD``), or a packed [b, h, s, d] value (bhsd).  None: strided otherwise (a copy to bind)."""
    src = _heads_split(x, inside, ctx)
    if src is not None:
        return src, None, "bshd", (x,)
    if heads_interleaved(x):
        return x, TO_BSHD, "bshd", ()
    if contiguous(x):
        return x, None, "bhsd", ()
    return None


def match_rope(node: fx.Node, ctx: Context) -> Subgraph | None:
    """HF's rotate-half RoPE ``x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)`` (``frontend.rope``)
    -> ``patterns.rope``: element-wise, rotate-half as two shifts along the head dim.

    On split_heads' [b, h, s, d] views (LLaMA's Q and K) the SMG's X and Y are [b, s, h, d], the memory the
    projection wrote, and Y goes back to the graph as a [b, h, s, d] view of it (``Result.permute``): the
    strides torch gives RoPE's output, which the attention after it binds as bshd without a copy.  The
    cos/sin tables are graph values shared by every layer, broadcast over the heads (and the batch where
    they are one table)."""
    r = rope_of(node)
    if r is None:
        return None
    if isinstance(r, str):
        ctx.refuse(node, "rope.form", r)
        return None
    if not ctx.free(*r.nodes):
        return None
    (b, h, s, d), dt = shape(r.x), dtype(node)
    bound = _rope_input(r.x, r.nodes, ctx)
    # the output must lie as the kernel writes it: later matchers bound its readers by its recorded strides
    if bound is None or not (heads_interleaved(node) if bound[2] == "bshd" else contiguous(node)):
        ctx.refuse(node, "rope.strided", f"RoPE on a value strided {r.x.meta['tensor_meta'].stride} giving "
                         f"{node.meta['tensor_meta'].stride}: the pattern binds packed [b, h, s, d] or [b, s, h, d] "
                         f"memory without a copy")
        return None
    src, permute, layout, taken = bound
    tables = "shared" if shape(r.cos)[0] == 1 else "per_batch"
    smg = _build(ctx, node, lambda: patterns.rope(b, s, h, d, tables, dt, layout))
    if smg is None:
        return None
    ops = [_value("X", src, smg.shape("X"), permute), _value("Cos", r.cos, smg.shape("Cos")),
           _value("Sin", r.sin, smg.shape("Sin"))]
    inside = (*taken, *r.nodes)
    unsq = tuple(u for u in dict.fromkeys(r.unsqueezes) if ctx.free(u) and set(u.users) <= set(inside))
    nodes = (*unsq, *inside)
    out = Result("Y", node.name, shape(node), TO_BSHD if layout == "bshd" else None)
    label = f"rope b{b} h{h} s{s} d{d} {dt}{' bshd' if layout == 'bshd' else ''}"
    return Subgraph("rope", label, tuple(n.name for n in nodes), smg, tuple(ops), (out,))


def match_concat(node: fx.Node, ctx: Context) -> Subgraph | None:
    """``torch.cat`` of images along the channels (a diffusion UNet's skip connections) -> ``patterns.concat``:
    each part a One-to-One read at its channel offset, in 16-byte runs where the parts' channels are multiples
    of 8.  The parts are bound channels-last and the output goes back with channels-last strides, as a conv's
    and a GroupNorm's are: a part lying NCHW is copied by its binding (the layout is not checked here, because
    the export's meta tensors give a channels-last conv's output NCHW strides).  Other concatenations stay
    torch's (a KV-cache append, a CLS token, RoPE's rotate-half, which ``match_rope`` takes first)."""
    if node.op != "call_function" or node.target not in (torch.cat, torch.concat) or not ctx.free(node):
        return None
    parts = node.args[0] if node.args else node.kwargs.get("tensors")
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    out, dt = shape(node), dtype(node)
    if out is None or len(out) != 4 or dim not in (1, -3) or not isinstance(parts, list | tuple) or len(parts) < 2:
        return None
    n, _, h, w = out
    ok = all(isinstance(p, fx.Node) and shape(p) is not None and len(shape(p)) == 4 and shape(p)[0] == n
             and shape(p)[2:] == (h, w) and shape(p)[1] > 0 and dtype(p) == dt for p in parts)
    if not ok or dt is None:
        ctx.refuse(node, "concat.parts",
                   f"a concatenation of {[shape(p) if isinstance(p, fx.Node) else p for p in parts]} "
                   f"({dt}) along the channels: the pattern takes two or more non-empty images of one "
                   "dtype and size")
        return None
    chans = tuple(shape(p)[1] for p in parts)
    smg = _build(ctx, node, lambda: patterns.concat(n, h * w, chans, dt))
    if smg is None:
        return None
    ops = tuple(_value(f"X{i}", p, (n, h * w, c), (0, 2, 3, 1)) for i, (p, c) in enumerate(zip(parts, chans)))
    res = Result("Y", node.name, out, permute=(0, 3, 1, 2), split=(n, h, w, sum(chans)))
    label = f"concat {' + '.join(map(str, chans))} {n}x{h}x{w} {dt}"
    return Subgraph("concat", label, (node.name,), smg, ops, (res,))
