"""Attention written out in ops, as HF's ``eager_attention_forward`` writes it (Gemma-2's, whose logit
soft-cap SDPA cannot take, and every model run with ``attn_implementation="eager"``)::

    s = torch.matmul(q, repeat_kv(k).transpose(2, 3)) * scaling
    s = torch.tanh(s / cap) * cap                      # optional: Gemma-2's soft-cap
    s = s + mask                                       # optional: an additive mask
    p = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    p = F.dropout(p, p=0.0, training=False)            # optional, a no-op in eval
    o = torch.matmul(p, repeat_kv(v))

becomes ``patterns.attention`` with the soft-cap and the mask as score mods, K and V read per kv head
where ``repeat_kv`` (expand + reshape) only repeated them.  Anything else in the chain leaves it to torch.

MPT writes its ALiBi the same way and masks with ``masked_fill`` (``match_masked_fill_attention``, a row of
its own)::

    s = torch.matmul(q, k.transpose(-1, -2)) * softmax_scale
    s = s + position_bias                              # ALiBi: [heads, 1, l], a constant buffer
    s = s.masked_fill(mask, torch.finfo(q.dtype).min)  # mask: bool [b, 1, m, l], causal and padding
    p = F.softmax(s.float(), dim=-1).to(v.dtype)       # the casts where the model is 16-bit
    o = torch.matmul(p, v)

the scale folded into the pattern's, the bias an added score mod and the fill one more (``fill_mod``).
"""

from __future__ import annotations

from typing import Any

from torch import fx

from smg import patterns
from spacefusion.frontend.attention import attention_subgraph, fill_mod, mask_mods
from spacefusion.frontend.canon import canonical, is_op
from spacefusion.frontend.graph import dtype, shape, single_user
from spacefusion.frontend.matchers import Context
from spacefusion.frontend.records import Subgraph
from spacefusion.frontend.repeat_kv import unrepeated


def _arg(node: fx.Node, i: int, name: str, default: Any = None) -> Any:
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def _number(x: Any) -> float | None:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) else None


def _scores(s: fx.Node) -> tuple[list[fx.Node], fx.Node, fx.Node, float | None, float | None, fx.Node | None] | None:
    """(chain nodes, Q, K^T node, scale, soft-cap, additive mask) of the scores ``s`` as written above."""
    chain: list[fx.Node] = []
    mask = cap = scale = None
    if is_op(s, "add") and len(s.args) == 2:
        a, b = s.args
        for x, m in ((a, b), (b, a)):
            if isinstance(x, fx.Node) and isinstance(m, fx.Node) and is_op(x, "mul", "matmul"):
                chain.append(s)
                s, mask = x, m
                break
        else:
            return None
    if is_op(s, "mul") and len(s.args) == 2:  # tanh(s / cap) * cap
        t, c = s.args
        if isinstance(c, fx.Node):
            t, c = c, t
        if _number(c) is not None and isinstance(t, fx.Node) and is_op(t, "tanh"):
            d = t.args[0]
            if is_op(d, "div") and _number(d.args[1]) == _number(c):
                chain += [s, t, d]
                s, cap = d.args[0], _number(c)
    if is_op(s, "mul") and len(s.args) == 2:  # matmul * scaling
        mm, k = s.args if isinstance(s.args[0], fx.Node) else s.args[::-1]
        if _number(k) is None:
            return None
        chain.append(s)
        s, scale = mm, _number(k)
    if not is_op(s, "matmul"):
        return None
    chain.append(s)
    q, kt = s.args
    return chain, q, kt, scale, cap, mask


def _key(kt: Any) -> fx.Node | None:
    """K of ``K.transpose(2, 3)`` (or ``(-2, -1)``) on a 4-d K."""
    if not is_op(kt, "transpose") or len(kt.args) != 3 or shape(kt.args[0]) is None:
        return None
    dims = {d % 4 for d in kt.args[1:]}
    return kt.args[0] if dims == {2, 3} and len(shape(kt.args[0])) == 4 else None


#: casts of the scores before the softmax (MPT's ``.float()``): the kernels compute the scores in fp32
SCORE_CASTS = ("float", "to")


def match_eager_attention(node: fx.Node, ctx: Context) -> Subgraph | None:
    """``torch.matmul(softmax(scores), V)`` as written above -> ``patterns.attention``."""
    return _written(node, ctx, filled=False)


def match_masked_fill_attention(node: fx.Node, ctx: Context) -> Subgraph | None:
    """MPT's form: ``torch.matmul(softmax(scores.masked_fill(mask, fill)[.float()]), V)``, the scores
    ``matmul * scale [+ bias]`` -> ``patterns.attention`` with the bias and the fill as score mods (in that
    order, as torch applies them); ``masked_fill.form`` where the fill or its mask is not one the mod takes."""
    return _written(node, ctx, filled=True)


def _filled(s: Any) -> tuple[list[fx.Node], Any, Any, Any] | None:
    """(nodes taken, the scores filled, the mask, the fill) of ``scores.masked_fill(mask, fill)`` behind an
    optional cast to fp32; None where ``s`` is not that."""
    chain: list[fx.Node] = []
    if is_op(s, *SCORE_CASTS) and dtype(s) == "float32" and isinstance(s.args[0], fx.Node):
        chain.append(s)
        s = s.args[0]
    c = canonical(s) if is_op(s, "masked_fill") else None
    if c is None:
        return None
    a = c.bind(("input", "mask", "value"))
    if set(a) != {"input", "mask", "value"}:
        return None
    return [*chain, s], a["input"], a["mask"], a["value"]


def _written(node: fx.Node, ctx: Context, filled: bool) -> Subgraph | None:
    """The written-out attention read back from its last ``matmul``; with ``filled``, only MPT's form (a
    ``masked_fill`` between the scores and the softmax), without, only the form without one."""
    if not is_op(node, "matmul") or len(node.args) != 2:
        return None
    p, v = node.args
    chain: list[fx.Node] = [node]
    if is_op(p, "dropout"):
        if _arg(p, 1, "p", 0.5) and _arg(p, 2, "training", True):
            return None
        chain.append(p)
        p = p.args[0]
    if is_op(p, "to", "type_as") and isinstance(p.args[0], fx.Node):
        chain.append(p)
        p = p.args[0]
    if not is_op(p, "softmax") or _arg(p, 1, "dim") not in (-1, 3):
        return None
    chain.append(p)
    scores = p.args[0]
    fill = _filled(scores) if filled else None
    if filled and fill is None:
        return None
    if fill is not None:
        chain += fill[0]
        scores = fill[1]
    got = _scores(scores)
    if got is None or not isinstance(v, fx.Node):
        return None
    links, q, kt, scale, cap, mask = got
    chain += links
    k = _key(kt)
    if k is None or not isinstance(q, fx.Node):
        return None
    chain.append(kt)
    if any(single_user(n) is None for n in chain[1:]) or not ctx.free(*chain):
        return None  # the probabilities or the scores are read elsewhere (returned as attention weights)
    unrep = unrepeated(k, v, {k: kt, v: node}, ctx.free)
    if isinstance(unrep, str):
        ctx.refuse(node, "attention.kv_repeat", unrep)
        return None
    hk = shape(k)[1]
    if unrep is not None:  # the copies repeat_kv made are not needed: K and V are read per kv head
        k, v, hk = unrep.k, unrep.v, unrep.kv_heads
        chain += unrep.taken
    sq, sk, sv = shape(q), shape(k), shape(v)
    dt = dtype(q)
    if not (sq and sk and sv and len(sq) == len(sk) == len(sv) == 4) or dt is None:
        return None
    (b, h, m, d), (_, _, l, dk) = sq, sk
    if dk != d or sv[3] != d or h % hk:
        ctx.refuse(node, "attention.head_dims",
                   f"attention written in ops with head dims q {d}, k {dk}, v {sv[3]}: the pattern takes one")
        return None
    mods: tuple[patterns.ScoreMod, ...] = ()
    extra = []
    if cap is not None:
        mods += (patterns.ScoreMod(f"{cap!r}*tanh({{s}}/{cap!r})"),)
    causal = False
    if mask is not None:
        got_mask = mask_mods(ctx, node, mask, (b, h, m, l), hk, dt)
        if got_mask is None:
            return None
        causal, mods, extra = got_mask[0], mods + got_mask[1], got_mask[2]
        chain = [*got_mask[3], *chain]
    if fill is not None:  # after the bias (torch fills the biased scores); the causal mask, if any, after both
        got_fill = fill_mod(fill[2], fill[3], (b, h, m, l), hk, dt)
        if isinstance(got_fill, str):
            ctx.refuse(node, "masked_fill.form", got_fill)
            return None
        mods, extra = (*mods, got_fill[0]), [*extra, got_fill[1]]
    label = (f"attention (eager) b{b} h{h}/{hk} {m}x{l} d{d}{' causal' if causal else ''}"
             f"{f' softcap {cap:g}' if cap is not None else ''}{' + mask' if mask is not None else ''}"
             f"{' + masked_fill' if fill is not None else ''} {dt}")
    return attention_subgraph(ctx, node, tuple(chain), q, k, v, (b, h, hk, m, l, d), dt, causal,
                              1.0 if scale is None else scale, mods, extra, label)
