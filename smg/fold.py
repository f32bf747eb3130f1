"""Folding two dimensions of an SMG into one: a view of the same memory, found from the mappings.

Grouped-query attention has query heads (kv head ``h``, member ``r``) and K/V lack ``r``: along
``r`` (and along the query rows ``m``) K/V reach the score space One-to-All.  Where two dims
``outer``, ``inner``

- sit in exactly the same spaces, ``outer`` right before ``inner`` in each (so element
  ``(o, i)`` is at the same address as element ``o * |inner| + i`` of one merged dim),
- are read through plain indices only (no window, no ``floor``), in that order, and
- are neither reduced nor named by an index-dependent body (a mask ``l <= m``),

every edge carries the same dependency kind along both of them, and the graph with one dim of
``|outer| * |inner|`` in their place computes the same thing over the same memory.  The slicers
then see a GQA decoder's query group as rows of one tile: K/V are read once per kv head instead
of once per query head, and the group (4-8 rows at one query) fills tensor-core rows that a single
query leaves empty.
"""

from __future__ import annotations

import dataclasses
import re

from smg.errors import ShapeError
from smg.ir import SMG, Access, DataSpace, Dim

#: the SMG attribute that records the folds applied, as ``outer*inner`` pairs
FOLD_ATTR = "fold"


class FoldError(ShapeError):
    """Two dims cannot be folded into one; the message says which rule they break."""


def _idents(text: str) -> set[str]:
    return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))


def _adjacent(index: tuple[str, ...], outer: str, inner: str) -> bool | None:
    """True if ``outer`` is immediately followed by ``inner`` in ``index``; None if neither is there;
    False otherwise (one alone, apart, swapped, or inside a compound component)."""
    has = [c for c in index if _idents(c) & {outer, inner}]
    if not has:
        return None
    if len(has) != 2 or outer not in index or inner not in index:
        return False
    i = index.index(outer)
    return i + 1 < len(index) and index[i + 1] == inner


def fold_reason(g: SMG, outer: str, inner: str) -> str | None:
    """Why ``outer`` and ``inner`` cannot be folded (None: they can)."""
    sizes = g.dim_sizes
    for d in (outer, inner):
        if d not in sizes:
            return f"{d!r} is not a dim of {g.name!r} (dims: {list(sizes)})"
    if outer == inner:
        return f"a dim cannot be folded with itself ({outer!r})"
    for s in g.spaces:
        if _adjacent(s.dims, outer, inner) is False:
            return f"space {s.name!r} has dims {s.dims}: {outer!r} is not right before {inner!r} there"
    for op in g.ops:
        if len({outer, inner} & set(op.reduce)) == 1:  # over both: the folded dim is reduced whole
            return f"op {op.out!r} reduces over one of {outer!r} and {inner!r}, not both"
        if {outer, inner} <= set(op.reduce) and not _adjacent(op.reduce, outer, inner):
            return f"op {op.out!r} reduces over {op.reduce}: {outer!r} is not right before {inner!r}"
        if _adjacent(op.out_index, outer, inner) is False:
            return f"op {op.out!r} writes {op.out_index}: {outer!r} is not right before {inner!r}"
        for a in op.inputs:
            if _adjacent(a.index, outer, inner) is False:
                return f"op {op.out!r} reads {a.space}{list(a.index)}: not plainly {outer!r} then {inner!r}"
            dims = g.space(a.space).dims  # a space read through expressions of other dims (a convolution's
            for d in {outer, inner} & set(dims):  # input at an implicit GEMM's rows and columns)
                if a.index[dims.index(d)] != d:
                    return f"op {op.out!r} reads {a.space}{list(a.index)}: its dim {d!r} at an index expression"
        named = _idents(op.body) & {outer, inner}
        if named:
            return f"op {op.out!r} names {sorted(named)} in its body {op.body!r} (an index-dependent value)"
    return None


def _merge(index: tuple[str, ...], outer: str) -> tuple[str, ...]:
    return tuple(c for c in index if c != outer)


def fold_dims(g: SMG, outer: str, inner: str) -> SMG:
    """The SMG with ``outer`` folded into ``inner`` (which keeps its name, ``|outer| * |inner|`` long);
    FoldError naming the rule broken where they cannot be folded."""
    why = fold_reason(g, outer, inner)
    if why is not None:
        raise FoldError(f"cannot fold {outer!r} into {inner!r}: {why}")
    size = g.dim_sizes[outer] * g.dim_sizes[inner]
    dims = tuple(Dim(d.name, size) if d.name == inner else d for d in g.dims if d.name != outer)
    spaces = tuple(DataSpace(s.name, _merge(s.dims, outer), s.dtype) for s in g.spaces)
    ops = tuple(dataclasses.replace(op, out_index=_merge(op.out_index, outer), reduce=_merge(op.reduce, outer),
                                    inputs=tuple(Access(a.space, _merge(a.index, outer)) for a in op.inputs))
                for op in g.ops)
    attrs = dict(g.attrs)
    attrs[FOLD_ATTR] = ",".join(filter(None, (attrs.get(FOLD_ATTR, ""), f"{outer}*{inner}")))
    return SMG(g.name, dims, spaces, ops, g.outputs, tuple(attrs.items()))


def foldable(g: SMG) -> tuple[tuple[str, str], ...]:
    """Every (outer, inner) pair of ``g`` that :func:`fold_dims` accepts, in dim order."""
    names = [d.name for d in g.dims]
    return tuple((o, i) for o in names for i in names if o != i and fold_reason(g, o, i) is None)


def fold_all(g: SMG) -> SMG:
    """``g`` with every foldable pair of dims folded, one pair at a time until none is left."""
    while (pairs := foldable(g)):
        g = fold_dims(g, *pairs[0])
    return g


__all__ = ["FOLD_ATTR", "FoldError", "fold_all", "fold_dims", "fold_reason", "foldable"]

