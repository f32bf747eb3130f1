"""Indexed stores: an SMG output written into a larger tensor at data-dependent positions along one dim.

A decoder's KV cache is ``Cache[b, h, Pos[s], d] = K[b, h, s, d]`` (``index_copy_`` along the sequence dim):
the cache is the caller's tensor, written in place, and ``Pos`` an int64 vector read at run time.  The SMG's
ops stay what they were (the kernel computes ``K`` over its own iteration space, sliced as before); only where
its elements land changes, so an ``IndexedStore`` is not an op but a property of one output: the output is
not returned, its elements go to ``into`` (a kernel parameter of ``length`` positions along ``dim``, its dims
in ``layout`` order) at ``positions[i]`` for element ``i`` of ``dim`` (or, ``offset``, at ``positions[0] + i``: HF's
``arange(s) + cumulative_length`` read as the counter alone).  The lowering rewrites the output's
stores (``spacefusion.lower.stores``); the reference evaluates the SMG and scatters (``scatter``).

Why an attribute and not a field of ``SMG``: the content key hashes every field of the graph, so a new
field would change every committed key; the stores are carried in ``SMG.attrs`` under ``STORES_ATTR``
(canonical JSON, ``smg.indexed``: shared with the indexed loads, ``smg.loads``), so only graphs that have stores
get new keys, and those keys do depend on them.

Contract: positions are distinct (duplicates leave one of the values, in no defined order) and ``into`` is
contiguous in ``layout`` order.  A position outside ``[0, length)`` is not written (``index_copy_`` raises
there; a kernel cannot raise, and must not write past the caller's tensor).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from smg.errors import ShapeError, UnknownAxisError
from smg.indexed import attach, attached, check_free, inside
from smg.ir import SMG

#: the ``SMG.attrs`` key holding a graph's stores (canonical JSON of their fields)
STORES_ATTR = "indexed_stores"


@dataclass(frozen=True)
class IndexedStore:
    """Output ``value`` stored as ``into[layout with dim -> positions[dim]] = value[its dims]``.

    ``layout``: ``into``'s dims in storage order (a permutation of the value's dims: a RoPE output lying as
    [b, s, h, d] goes to a [b, h, cache, d] cache); ``dim``: the value's dim whose index goes through
    ``positions`` (an int64 vector of that dim's size; with ``offset``, one int64 the positions start at);
    ``length``: ``into``'s extent along ``dim``."""

    value: str
    into: str
    positions: str
    dim: str
    layout: tuple[str, ...]
    length: int
    offset: bool = False

    def positions_shape(self, smg: SMG) -> tuple[int, ...]:
        """The positions parameter's shape: one per element of ``dim``, or the one start (``offset``)."""
        return (1,) if self.offset else (smg.dim_sizes[self.dim],)

    def at(self, positions: np.ndarray, n: int) -> np.ndarray:
        """The ``n`` positions (int64) the elements of ``dim`` go to, from the positions parameter's values."""
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        return pos[0] + np.arange(n, dtype=np.int64) if self.offset else pos

    def shape(self, smg: SMG) -> tuple[int, ...]:
        """``into``'s shape: the value's sizes in ``layout`` order, ``length`` along ``dim``."""
        return tuple(self.length if d == self.dim else smg.dim_sizes[d] for d in self.layout)

    def check(self, smg: SMG) -> None:
        """Raise (naming the store) unless ``value`` is an output of ``smg`` that no op reads, ``layout``
        permutes its dims, ``dim`` is one of them, ``length`` covers it and the parameter names are free."""
        where = f"indexed store of {self.value!r} into {self.into!r}"
        if self.value not in smg.outputs or smg.consumers(self.value):
            raise UnknownAxisError(f"{where}: {self.value!r} must be an output of {smg.name!r} no op reads")
        dims = smg.space(self.value).dims
        if sorted(self.layout) != sorted(dims) or self.dim not in dims:
            raise UnknownAxisError(f"{where}: layout {self.layout} and dim {self.dim!r} must be the value's dims "
                                   f"{dims}")
        if not smg.dim_sizes[self.dim] <= self.length:
            raise ShapeError(f"{where}: {smg.dim_sizes[self.dim]} positions along {self.dim!r} into {self.length}")
        check_free(smg, where, (self.into, self.positions))


def with_stores(smg: SMG, stores: tuple[IndexedStore, ...]) -> SMG:
    """``smg`` with ``stores`` (each checked): the same ops and outputs, a new content key; ``smg`` itself
    (its key unchanged) where there are none."""
    for st in stores:
        st.check(smg)
    return attach(smg, STORES_ATTR, stores)


def stores_of(smg: SMG) -> tuple[IndexedStore, ...]:
    """The indexed stores ``smg`` carries (``with_stores``); () for a graph without."""
    return attached(smg, STORES_ATTR, lambda d: IndexedStore(**{**d, "layout": tuple(d["layout"])}))


def scatter(store: IndexedStore, smg: SMG, value: np.ndarray, into: np.ndarray, positions: np.ndarray) -> None:
    """The reference of one store: ``value`` (the output, in its space's dim order) written into ``into`` in
    place at ``positions`` along ``dim`` (numpy's fancy-index assignment, as ``index_copy_``)."""
    dims = smg.space(store.value).dims
    moved = np.transpose(value, [dims.index(d) for d in store.layout])
    pos = store.at(positions, smg.dim_sizes[store.dim])
    keep = inside(pos, store.length)  # outside the tensor: not written (the contract)
    axis = store.layout.index(store.dim)
    index = tuple(pos[keep] if d == store.dim else slice(None) for d in store.layout)
    into[index] = np.compress(keep, moved, axis=axis).astype(into.dtype)
