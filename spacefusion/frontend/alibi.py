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
"""

from __future__ import annotations

from typing import Any

from torch import fx

from smg import patterns
from spacefusion.frontend.attention import attention_subgraph, mask_mods
from spacefusion.frontend.canon import Call, canonical
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

