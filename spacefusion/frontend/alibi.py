"""ALiBi attention through ``baddbmm``, as BLOOM writes it (heads folded into the batch)::

    q3, k3, v3 = (x.reshape(b * h, s, d) for x in (q, k, v))        # q, k, v: [b, h, s, d]
    s3 = alibi.baddbmm(q3, k3.transpose(-1, -2), beta=beta, alpha=scale)   # alibi: [b * h, 1 or m, l]
    s4 = s3.view(b, h, m, l) [+ mask]                                 # optional: an additive mask
    p = F.softmax(s4, dim=-1, dtype=torch.float32).to(q.dtype)        # the cast optional
    o = torch.bmm(p.view(b * h, m, l), v3)

becomes ``patterns.attention`` on Q, K, V [b, h, s, d] with scale ``alpha`` and the bias as a score mod
``{s} + beta * Alibi`` over Alibi[b, h, l] (or [b, h, m, l]); the mask's mods follow it (``mask_mods``, as for
SDPA's ``attn_mask``).  The row anchors on the ``bmm`` (the subgraph's output) and reads back to the
``baddbmm``; the [b * h, ...] reshapes, the transpose, the views and the softmax are taken in.

DeBERTa-v2's disentangled attention folds the heads the same way with ``bmm`` and no ``baddbmm``
(``match_bmm_attention``, a row of its own)::

    s3 = torch.bmm(q3, k3.transpose(-1, -2) / scale)                  # scale: sqrt(d * factor), a constant
    s3 = s3 + rel_att                                                 # optional: [b * h, 1 or m, l]
    s4 = s3.view(b, h, m, l).masked_fill(~mask, finfo.min)            # optional: a boolean mask
    o = torch.bmm(F.softmax(s4, dim=-1).view(b * h, m, l), v3)

the same ``patterns.attention`` with scale ``1 / scale``, the bias an added score mod and the fill one more
(``attention.fill_mod``).  Its relative-position bias ``rel_att`` (two ``bmm``s of Q and K against the
projected position embeddings, each gathered by the bucketed relative positions) stays with torch: the
gather reads its column from a tensor of indices, which no index expression of the SMG states.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from smg import patterns
from spacefusion.frontend.attention import attention_subgraph, fill_mod, mask_mods
from spacefusion.frontend.canon import Call, canonical, is_op
from spacefusion.frontend.graph import DTYPES, dtype, permutation, shape, single_user
from spacefusion.frontend.matchers import Context
from spacefusion.frontend.records import Operand, Subgraph

RESHAPES = ("view", "reshape")
CASTS = ("to", "type_as")


def _folded(x: Any, bh: int) -> fx.Node | None:
    """The [b, h, s, d] node that ``x`` [b * h, s, d] reshapes (None: ``x`` is not such a reshape)."""
    c = canonical(x)
    if c is None or c.op not in RESHAPES or not isinstance(c.args[0], fx.Node):
        return None
    src, xs = c.args[0], shape(x)
    ss = shape(src)
    ok = ss is not None and xs is not None and len(ss) == 4 and len(xs) == 3 and ss[0] * ss[1] == bh == xs[0] \
        and ss[2:] == xs[1:]
    return src if ok else None


def _number(v: Any, default: float) -> float | None:
    v = default if v is None else v
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _probabilities(node: fx.Node) -> tuple[list[fx.Node], fx.Node, fx.Node] | None:
    """(nodes taken, the softmax's input [b, h, m, l], V3) of ``bmm(p.view(b * h, m, l), V3)``."""
    p3, v3 = node.args if len(node.args) == 2 and not node.kwargs else (None, None)
    c = canonical(p3)
    if c is None or c.op not in RESHAPES or not isinstance(v3, fx.Node):
        return None
    chain, p = [p3], c.args[0]
    cast = canonical(p)
    if cast is not None and cast.op in CASTS and isinstance(p.args[0], fx.Node):
        chain.append(p)
        p = p.args[0]
    sm = canonical(p)
    if sm is None or sm.op != "softmax" or sm.arg(1, "dim") not in (-1, 3) or len(shape(p) or ()) != 4:
        return None
    return [*chain, p], sm.args[0], v3


def _scores(s4: Any) -> tuple[list[fx.Node], Call, fx.Node, fx.Node | None] | None:
    """(nodes taken, the baddbmm's call, its node, the additive mask) of ``baddbmm(...).view(b, h, m, l) [+ mask]``."""
    mask, chain = None, []
    c = canonical(s4)
    if c is not None and c.op == "add" and len(c.args) == 2 and not c.kwargs:
        for x, m in (c.args, c.args[::-1]):
            xc = canonical(x)
            if isinstance(m, fx.Node) and xc is not None and xc.op in RESHAPES:
                chain, mask, s4 = [s4], m, x
                break
        else:
            return None
    c = canonical(s4)
    if c is None or c.op not in RESHAPES:
        return None
    bad = c.args[0]
    bc = canonical(bad)
    if bc is None or bc.op != "baddbmm":
        return None
    return [*chain, s4, bad], bc, bad, mask


def _bias(alibi: Any, b: int, h: int, m: int, l: int, beta: float, dt: str
          ) -> tuple[patterns.ScoreMod, Operand] | str:
    """The score mod adding ``beta * alibi`` and its operand, or why it cannot be one."""
    a = shape(alibi)
    meta = alibi.meta.get("tensor_meta") if isinstance(alibi, fx.Node) else None
    if a == (b * h, 1, l):
        dims, shp = ("b", "h", "l"), (b, h, l)
    elif a == (b * h, m, l):
        dims, shp = ("b", "h", "m", "l"), (b, h, m, l)
    else:
        return f"ALiBi baddbmm with a bias of shape {a}: the pattern adds a [b * heads, 1 or m, l] bias"
    if meta is None or meta.dtype not in DTYPES:
        return f"ALiBi baddbmm with a bias of dtype {getattr(meta, 'dtype', None)}: the score mods add float biases"
    body = "{s} + Alibi" if beta == 1.0 else f"{{s}} + {beta!r}*Alibi"
    cast = None if DTYPES[meta.dtype] == dt else dt
    return patterns.ScoreMod(body, (("Alibi", dims),)), Operand("Alibi", "value", alibi.name, shp, cast=cast)


def match_alibi_attention(node: fx.Node, ctx: Context) -> Subgraph | None:
    """``bmm(softmax(baddbmm(alibi, Q3, K3^T, beta, alpha).view(b, h, m, l) [+ mask]).view(...), V3)`` ->
    ``patterns.attention`` with the ALiBi bias (and the mask) as score mods; None where ``node`` is not that."""
    got = _probabilities(node)
    scores = _scores(got[1]) if got is not None else None
    if scores is None:
        return None
    chain, _, v3 = got
    links, bc, bad, mask = scores
    a = bc.bind(("input", "batch1", "batch2"))
    alibi, q3, kt3 = a.get("input"), a.get("batch1"), a.get("batch2")
    sq = shape(q3)
    if sq is None or len(sq) != 3:
        return None
    bh = sq[0]
    perm = permutation(kt3)
    k3 = perm[0] if perm is not None and perm[1] == (0, 2, 1) else None
    q, k, v = _folded(q3, bh), _folded(k3, bh), _folded(v3, bh)
    if q is None or k is None or v is None:
        return None  # heads not folded from [b, h, s, d] values: not this pattern
    (b, h, m, d), (_, hk, l, dk), dt = shape(q), shape(k), dtype(q)
    alpha, beta = _number(bc.kwargs.get("alpha"), 1.0), _number(bc.kwargs.get("beta"), 1.0)
    if hk != h or dk != d or shape(v) != (b, h, l, d) or dt is None or alpha is None or beta is None \
            or len(bc.args) + len(bc.kwargs) > 5:
        ctx.refuse(node, "alibi.form",
                   f"ALiBi baddbmm attention with q {shape(q)}, k {shape(k)}, v {shape(v)}, dtype {dt}, alpha "
                   f"{bc.kwargs.get('alpha')}, beta {bc.kwargs.get('beta')}: the pattern takes one head dim, equal "
                   f"heads, a float dtype and number coefficients")
        return None
    bias = _bias(alibi, b, h, m, l, beta, dt)
    if isinstance(bias, str):
        ctx.refuse(node, "alibi.form", bias)
        return None
    mods, extra, causal, taken = (bias[0],), [bias[1]], False, ()
    if mask is not None:
        got_mask = mask_mods(ctx, node, mask, (b, h, m, l), hk, dt)
        if got_mask is None:
            return None
        causal, extra, taken = got_mask[0], [*extra, *got_mask[2]], got_mask[3]
        mods = (*mods, *got_mask[1])  # a masked row is right in every kernel (lower.exprs.MAX_IDENTITY)
    inner = [*chain, *links]
    # the [b * h, ...] copies are not needed where only this attention reads them (K's only through its transpose)
    folds = [x for x in (q3, v3, kt3) if single_user(x) is not None]
    folds += [k3] if kt3 in folds and single_user(k3) is kt3 else []
    if any(single_user(n) is None for n in inner) or not ctx.free(node, *inner, *folds, *taken):
        return None  # the probabilities or the scores are read elsewhere (returned as attention weights)
    label = (f"attention (alibi baddbmm) b{b} h{h} {m}x{l} d{d}{' causal' if causal else ''}"
             f"{' + mask' if mask is not None else ''} {dt}")
    return attention_subgraph(ctx, node, (*taken, *folds, *inner, node), q, k, v, (b, h, h, m, l, d), dt, causal,
                              alpha, mods, extra, label)



def _constant_value(x: Any, depth: int) -> Any:
    """The value of ``x``: itself where it is no fx node, else its op evaluated on its inputs' values where
    every node under it is an op of constants (no input, no weight) at most ``depth`` deep; None otherwise."""
    if not isinstance(x, fx.Node):
        return x
    if depth <= 0 or x.op not in ("call_function", "call_method"):
        return None
    values: dict[fx.Node, Any] = {}
    for n in x.all_input_nodes:
        values[n] = _constant_value(n, depth - 1)
        if values[n] is None:
            return None
    args = fx.node.map_arg(x.args, lambda n: values[n])
    kwargs = fx.node.map_arg(x.kwargs, lambda n: values[n])
    try:
        return x.target(*args, **kwargs) if x.op == "call_function" else getattr(args[0], x.target)(*args[1:], **kwargs)
    except Exception:  # not an op of numbers: no constant
        return None


def _constant_number(x: Any, depth: int = 8) -> float | None:
    """The number ``x`` is: a Python number, or a one-element tensor computed from constants alone
    (``torch.sqrt(torch.tensor(d) * f).to(dtype)``, DeBERTa's scale) evaluated here; None otherwise (a value
    that reads an input or a weight, or is more than ``depth`` ops deep)."""
    if isinstance(x, fx.Node) and len(shape(x) or ()) != 0:
        return None
    out = _constant_value(x, depth)
    if isinstance(out, torch.Tensor) and out.numel() == 1:
        return float(out)
    return float(out) if isinstance(out, int | float) and not isinstance(out, bool) else None


def _scaled_key(kt: Any) -> tuple[list[fx.Node], fx.Node, float] | None:
    """(nodes taken, K3, the factor on the scores) of ``K3.transpose(-1, -2)`` divided or multiplied by a
    constant number, or not scaled at all."""
    taken: list[fx.Node] = []
    factor = 1.0
    c = canonical(kt)
    if c is not None and c.op in ("div", "mul") and len(c.args) == 2 and not c.kwargs:
        num = _constant_number(c.args[1])
        if num is None or num == 0.0 or not isinstance(c.args[0], fx.Node):
            return None
        taken.append(kt)
        factor = 1.0 / num if c.op == "div" else num
        kt = c.args[0]
    perm = permutation(kt)
    if perm is None or perm[1] != (0, 2, 1):
        return None
    return [*taken, kt], perm[0], factor


def match_bmm_attention(node: fx.Node, ctx: Context) -> Subgraph | None:
    """DeBERTa-v2's ``bmm(softmax(bmm(Q3, K3^T / scale) [+ bias]).view(b, h, m, l).masked_fill(mask, fill)).view(...),
    V3)`` -> ``patterns.attention`` with the bias and the fill as score mods (in torch's order); None where
    ``node`` is not that (BLOOM's ``baddbmm`` is ``match_alibi_attention``'s)."""
    got = _probabilities(node)
    if got is None:
        return None
    chain, s4, v3 = got
    links: list[fx.Node] = []
    fill = None
    if is_op(s4, "masked_fill"):
        a = canonical(s4).bind(("input", "mask", "value"))
        if set(a) != {"input", "mask", "value"}:
            return None
        links.append(s4)
        fill, s4 = (a["mask"], a["value"]), a["input"]
    c = canonical(s4)
    if c is None or c.op not in RESHAPES or not isinstance(c.args[0], fx.Node) or len(shape(s4) or ()) != 4:
        return None
    links.append(s4)
    s3, bias = c.args[0], None
    c = canonical(s3)
    if c is not None and c.op == "add" and len(c.args) == 2 and not c.kwargs:
        scores = [x for x in c.args if is_op(x, "bmm")]
        if len(scores) != 1 or not all(isinstance(x, fx.Node) for x in c.args):
            return None
        links.append(s3)
        bias = c.args[1] if c.args[0] is scores[0] else c.args[0]
        s3 = scores[0]
    if not is_op(s3, "bmm") or len(s3.args) != 2 or s3.kwargs:
        return None
    links.append(s3)
    q3, kt = s3.args
    key = _scaled_key(kt)
    sq = shape(q3)
    if key is None or sq is None or len(sq) != 3:
        return None
    k_taken, k3, scale = key
    bh = sq[0]
    q, k, v = _folded(q3, bh), _folded(k3, bh), _folded(v3, bh)
    if q is None or k is None or v is None:
        return None  # heads not folded from [b, h, s, d] values: not this pattern
    (b, h, m, d), (_, hk, l, dk), dt = shape(q), shape(k), dtype(q)
    if hk != h or dk != d or shape(v) != (b, h, l, d) or dt is None or shape(s4) != (b, h, m, l):
        ctx.refuse(node, "attention.head_dims",
                   f"bmm attention with q {shape(q)}, k {shape(k)}, v {shape(v)}, scores {shape(s4)}, dtype {dt}: "
                   f"the pattern takes one head dim, equal heads and a float dtype")
        return None
    mods: tuple[patterns.ScoreMod, ...] = ()
    extra: list[Operand] = []
    if bias is not None:
        got_bias = _bias(bias, b, h, m, l, 1.0, dt)
        if isinstance(got_bias, str):
            ctx.refuse(node, "alibi.form", got_bias.replace("ALiBi baddbmm", "bmm attention"))
            return None
        mods, extra = (got_bias[0],), [got_bias[1]]
    if fill is not None:  # after the bias: torch fills the biased scores
        got_fill = fill_mod(fill[0], fill[1], (b, h, m, l), hk, dt)
        if isinstance(got_fill, str):
            ctx.refuse(node, "masked_fill.form", got_fill)
            return None
        mods, extra = (*mods, got_fill[0]), [*extra, got_fill[1]]
    inner = [*chain, *links, *k_taken]
    folds = [x for x in (q3, v3, k3) if all(u in inner or u is node for u in x.users)]
    if any(single_user(n) is None for n in inner) or not ctx.free(node, *inner, *folds):
        return None  # the probabilities or the scores are read elsewhere (returned as attention weights)
    label = (f"attention (bmm) b{b} h{h} {m}x{l} d{d}{' + bias' if bias is not None else ''}"
             f"{' + masked_fill' if fill is not None else ''} {dt}")
    return attention_subgraph(ctx, node, (*folds, *inner, node), q, k, v, (b, h, h, m, l, d), dt, False, scale,
                              mods, extra, label)
