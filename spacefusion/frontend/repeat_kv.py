"""Grouped-query attention's ``repeat_kv``: K and V copied once per query head of their group before an
attention that wants as many K/V heads as query heads.  Every attention row reads the copies' source instead
(``patterns.attention(..., kv_heads=hk)``: K/V broadcast over the group), so each K/V head is read once per
group, not once per query head, and the [b, heads, s, d] copy (2.16e9 elements in LLaMA-3-8B's decode at
batch 64 x 8192, past the kernels' 32-bit indices) is never made.

The forms taken, each ``X [b, hk, s, d] -> [b, hk * r, s, d]`` with query head ``i`` reading kv head ``i // r``:

- HF's ``repeat_kv`` (every decoder in ``transformers`` 5.x, under ``torch.compile`` as in eager attention):
  ``X[:, :, None, :, :].expand(b, hk, r, s, d).reshape(b, hk * r, s, d)``; in ATen (``torch.export``,
  training graphs) ``unsqueeze(X, 2)``, ``expand``, optionally ``clone`` (the decomposed reshape's copy),
  then ``reshape`` / ``view`` / ``_unsafe_view``;
- ``X.repeat_interleave(r, dim=1)`` (what ``repeat_kv``'s docstring says it equals).

``X.repeat(1, r, 1, 1)`` and an expand over a new dim 1 also repeat the heads, tiled (query head ``i`` reads
kv head ``i % hk``), which the pattern's grouping is not: ``tiled_repeat`` names them so the attention can
refuse them (``attention.kv_repeat``) instead of reading the copies.

Contract: ``repeat_of(x)`` is a ``Repeat`` only where ShapeProp's shapes prove the head mapping above
(shapes are read from ``tensor_meta``, not from the ops' arguments, so every spelling of the sizes agrees);
``unrepeated`` decides for an attention's K and V together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from spacefusion.frontend.canon import is_op
from spacefusion.frontend.graph import shape


@dataclass(frozen=True)
class Repeat:
    """``x`` is ``source`` [b, kv_heads, s, d] repeated ``group`` times per head, by ``nodes`` (``x`` first,
    then toward ``source``, which is not among them)."""

    source: fx.Node
    kv_heads: int
    group: int
    nodes: tuple[fx.Node, ...]


def _unsqueezed_dim2(u: Any) -> fx.Node | None:
    """``X`` of ``X[:, :, None]`` (any trailing full slices) or ``X.unsqueeze(2)`` on a 4-d ``X``."""
    if not isinstance(u, fx.Node) or not u.args or not isinstance(u.args[0], fx.Node):
        return None
    src = u.args[0]
    s_src, s_u = shape(src), shape(u)
    if s_src is None or s_u is None or len(s_src) != 4 or s_u != (*s_src[:2], 1, *s_src[2:]):
        return None
    if is_op(u, "getitem") and isinstance(u.args[1], tuple):
        idx = u.args[1]
        full = slice(None)
        if len(idx) >= 3 and idx[:2] == (full, full) and idx[2] is None and all(i == full for i in idx[3:]):
            return src
        return None
    if is_op(u, "unsqueeze"):
        dim = u.args[1] if len(u.args) > 1 else u.kwargs.get("dim")
        return src if dim in (2, -3) else None
    return None


def _expanded(x: fx.Node) -> Repeat | None:
    """``repeat_kv``'s unsqueeze -> expand -> [clone] -> reshape chain ending at ``x``."""
    if not is_op(x, "reshape", "view", "_unsafe_view") or not isinstance(x.args[0], fx.Node):
        return None
    nodes = [x]
    e = x.args[0]
    if is_op(e, "clone", "contiguous") and isinstance(e.args[0], fx.Node):
        nodes.append(e)
        e = e.args[0]
    if not is_op(e, "expand") or not isinstance(e.args[0], fx.Node):
        return None
    src = _unsqueezed_dim2(e.args[0])
    s_e, s_x = shape(e), shape(x)
    if src is None or s_e is None or s_x is None:
        return None
    b, hk, s, d = shape(src)
    r = s_e[2] if len(s_e) == 5 else 0
    if r < 1 or s_e != (b, hk, r, s, d) or s_x != (b, hk * r, s, d):
        return None
    return Repeat(src, hk, r, (*nodes, e, e.args[0]))


def _interleaved(x: fx.Node) -> Repeat | None:
    """``X.repeat_interleave(r, dim=1)`` (or ``torch.repeat_interleave``) with an int ``r``."""
    if not is_op(x, "repeat_interleave") and not (x.op == "call_function" and x.target is torch.repeat_interleave):
        return None
    names = ("input", "repeats", "dim")
    a = dict(zip(names, x.args)) | dict(x.kwargs)
    src, r, dim = a.get("input"), a.get("repeats"), a.get("dim")
    if not isinstance(src, fx.Node) or not isinstance(r, int) or isinstance(r, bool) or r < 1:
        return None
    s_src, s_x = shape(src), shape(x)
    if s_src is None or s_x is None or len(s_src) != 4 or dim not in (1, -3):
        return None
    b, hk, s, d = s_src
    return Repeat(src, hk, r, (x,)) if s_x == (b, hk * r, s, d) else None


def repeat_of(x: Any) -> Repeat | None:
    """The ``Repeat`` that ``x`` is (module docstring's forms), else None."""
    if not isinstance(x, fx.Node) or x.op not in ("call_function", "call_method"):
        return None
    return _expanded(x) or _interleaved(x)


def tiled_repeat(x: Any) -> str | None:
    """A sentence naming the tiled head repeat ``x`` is (``X.repeat(1, r, 1, 1)``, or an expand over a new
    dim 1 reshaped to [b, r * hk, s, d]): query head ``i`` reads kv head ``i % hk``, which the GQA pattern's
    ``i // r`` is not.  None where ``x`` is no such repeat."""
    if not isinstance(x, fx.Node):
        return None
    if is_op(x, "repeat") and len(shape(x) or ()) == 4 and isinstance(x.args[0], fx.Node):
        reps = x.args[1] if len(x.args) == 2 and isinstance(x.args[1], list | tuple) else x.args[1:]
        if len(reps) == 4 and all(isinstance(r, int) for r in reps) and (reps[0], reps[2], reps[3]) == (1, 1, 1) \
                and reps[1] > 1:
            return f"{x.name} repeats the heads tiled (Tensor.repeat{tuple(reps)})"
    if is_op(x, "reshape", "view", "_unsafe_view") and isinstance(x.args[0], fx.Node):
        e = x.args[0].args[0] if is_op(x.args[0], "clone", "contiguous") else x.args[0]
        s_e, s_x = shape(e), shape(x)
        if is_op(e, "expand") and s_e is not None and s_x is not None and len(s_e) == 5 and len(s_x) == 4 \
                and s_e[1] > 1 and s_x == (s_e[0], s_e[1] * s_e[2], *s_e[3:]) and _unit_dim1(e.args[0]):
            return f"{x.name} repeats the heads tiled (an expand over a new dim 1)"
    return None


def _unit_dim1(u: Any) -> bool:
    s_u = shape(u)
    return s_u is not None and len(s_u) == 5 and s_u[1] == 1


@dataclass(frozen=True)
class Unrepeated:
    """An attention's K and V read per kv head: their sources, the kv heads, and the repeat nodes the
    attention takes in (those only it reads; a repeat value read elsewhere stays torch's, and the kernel
    still reads the source)."""

    k: fx.Node
    v: fx.Node
    kv_heads: int
    taken: tuple[fx.Node, ...]


def unrepeated(k: Any, v: Any, readers: dict[Any, fx.Node], free: Any) -> Unrepeated | str | None:
    """K and V of an attention as the GQA pattern reads them, where both are ``repeat_of`` one group:
    ``readers`` maps each of ``k`` and ``v`` to the node of the attention that reads it (SDPA itself, or the
    written-out form's transpose and matmul), ``free`` is ``Context.free``.  A sentence (str) where K or V
    repeats the heads in a way the pattern cannot read per kv head (a tiled repeat, K and V repeated
    differently, one repeated and not the other): the caller refuses it.  None where neither repeats."""
    rk, rv = repeat_of(k), repeat_of(v)
    if rk is None and rv is None:
        tiled = tiled_repeat(k) or tiled_repeat(v)
        return f"{tiled}: GQA's query head i reads kv head i // group" if tiled else None
    if rk is None or rv is None or rk.group != rv.group or rk.kv_heads != rv.kv_heads:
        what = {"K": rk, "V": rv}
        said = ", ".join(f"{n} {'not repeated' if r is None else f'{r.kv_heads} heads x {r.group}'}"
                         for n, r in what.items())
        return f"K and V repeated over the heads differently ({said}): the pattern reads both per kv head"
    taken: list[fx.Node] = []
    for rep, x in ((rk, k), (rv, v)):
        reader = readers[x]
        for n in rep.nodes:  # from the attention toward the source: each taken where only taken nodes read it
            if set(n.users) != {reader} or not free(n):
                break
            taken.append(n)
            reader = n
    return Unrepeated(rk.source, rv.source, rk.kv_heads, tuple(dict.fromkeys(taken)))
