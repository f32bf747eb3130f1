"""Indexed loads: an SMG input read at data-dependent positions along some of its dims (a gather).

A transformer's first op, ``F.embedding``, is ``X[b, s, n] = Table[Ids[b, s], n]``: the rows of a weight table
picked by token ids read at run time.  The SMG's ops stay what they were (they read ``X`` over their own
iteration space, sliced as any input); only where ``X``'s elements come from changes, so an ``IndexedLoad`` is not
an op but a property of one input, the mirror image of ``smg.stores.IndexedStore``: ``value`` is not a kernel
parameter, its element at index ``i`` is ``table[ids[i[dims]], i[rest]]`` (``rest``: the value's other dims, in
its order; ``table``'s shape ``[length, *rest]``; ``ids`` int64 of ``dims``' sizes).  The lowering rewrites the
value's global loads (``spacefusion.lower.loads``); the reference gathers and evaluates (``gather``,
``resolve``).  Carried in ``SMG.attrs`` under ``LOADS_ATTR`` (``smg.indexed``, as the stores), so that no other
graph's content key changes.

Contract: an id outside ``[0, length)`` reads a row of zeros (torch raises ``IndexError``; a kernel cannot raise,
and must not read past the table: the frontend checks the ids before a CPU launch, ``check_ids``).  Ids may
repeat (a gather has no conflict).  ``table`` is contiguous in ``[length, *rest]`` order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from smg.errors import ShapeError, UnknownAxisError
from smg.indexed import attach, attached, check_free, inside
from smg.ir import SMG

#: the ``SMG.attrs`` key holding a graph's indexed loads (canonical JSON of their fields)
LOADS_ATTR = "indexed_loads"


class IndexOutOfRange(IndexError):
    """An id outside its table (torch's ``F.embedding`` raises ``IndexError`` there too)."""


@dataclass(frozen=True)
class IndexedLoad:
    """Input ``value`` read as ``value[i] = table[ids[i[dims]], i[rest]]``.

    ``dims``: the value's dims the ids are indexed by (in the ids' order: ``ids`` has their sizes); ``length``:
    the table's rows; the table's other dims are the value's others (``rest``) in the value's order."""

    value: str
    table: str
    ids: str
    dims: tuple[str, ...]
    length: int

    def rest(self, smg: SMG) -> tuple[str, ...]:
        """The value's dims the table keeps (not picked through the ids), in the value's order."""
        return tuple(d for d in smg.space(self.value).dims if d not in self.dims)

    def table_shape(self, smg: SMG) -> tuple[int, ...]:
        return (self.length, *(smg.dim_sizes[d] for d in self.rest(smg)))

    def ids_shape(self, smg: SMG) -> tuple[int, ...]:
        return tuple(smg.dim_sizes[d] for d in self.dims)

    def check(self, smg: SMG) -> None:
        """Raise (naming the load) unless ``value`` is an input of ``smg``, ``dims`` are distinct dims of it, the
        table has rows and the parameter names are free."""
        where = f"indexed load of {self.value!r} from {self.table!r}"
        if self.value not in smg.inputs:
            raise UnknownAxisError(f"{where}: {self.value!r} must be an input of {smg.name!r}")
        dims = smg.space(self.value).dims
        if not self.dims or len(set(self.dims)) != len(self.dims) or not set(self.dims) <= set(dims):
            raise UnknownAxisError(f"{where}: dims {self.dims} must be distinct dims of the value's {dims}")
        if self.length < 1:
            raise ShapeError(f"{where}: a table of {self.length} rows")
        check_free(smg, where, (self.table, self.ids))


def with_loads(smg: SMG, loads: tuple[IndexedLoad, ...]) -> SMG:
    """``smg`` with ``loads`` (each checked; one per value): the same ops, a new content key; ``smg`` itself (its
    key unchanged) where there are none."""
    for ld in loads:
        ld.check(smg)
    values = [ld.value for ld in loads]
    if len(set(values)) != len(values):
        raise UnknownAxisError(f"{smg.name}: an input loaded twice in {values}")
    check_free(smg, smg.name, [n for ld in loads for n in (ld.table, ld.ids)])
    return attach(smg, LOADS_ATTR, loads)


def loads_of(smg: SMG) -> tuple[IndexedLoad, ...]:
    """The indexed loads ``smg`` carries (``with_loads``); () for a graph without."""
    return attached(smg, LOADS_ATTR, lambda d: IndexedLoad(**{**d, "dims": tuple(d["dims"])}))


def gather(load: IndexedLoad, smg: SMG, table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The reference of one load: the value (in its space's dim order) read from ``table`` at ``ids``; zeros
    where an id lies outside the table (the contract)."""
    ids = np.asarray(ids, dtype=np.int64).reshape(load.ids_shape(smg))
    table = np.asarray(table).reshape(load.table_shape(smg))
    ok = inside(ids, load.length)
    rows = table[np.where(ok, ids, 0)]  # [*dims, *rest]
    rows = np.where(ok.reshape(ok.shape + (1,) * (rows.ndim - ok.ndim)), rows, 0).astype(table.dtype)
    order = (*load.dims, *load.rest(smg))
    return np.transpose(rows, [order.index(d) for d in smg.space(load.value).dims])


def resolve(smg: SMG, inputs: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
    """``inputs`` as the graph's ops read them: each loaded value not given gathered from its table and ids
    (which are dropped), the other inputs as given (``inputs`` itself where the graph has no loads)."""
    loads = loads_of(smg)
    if not loads:
        return inputs
    params = {n for ld in loads for n in (ld.table, ld.ids)}
    out = {k: v for k, v in inputs.items() if k not in params}
    for ld in loads:
        if ld.value not in out:
            out[ld.value] = gather(ld, smg, inputs[ld.table], inputs[ld.ids])
    return out


def check_ids(smg: SMG, inputs: Mapping[str, np.ndarray]) -> None:
    """Raise ``IndexOutOfRange`` (as torch's ``F.embedding``) where an id of one of ``smg``'s loads lies outside
    its table: what a caller holding the ids on the host checks before a launch (a kernel reads zeros there)."""
    for ld in loads_of(smg):
        ids = np.asarray(inputs[ld.ids])
        bad = ~inside(ids, ld.length)
        if bad.any():
            raise IndexOutOfRange(f"{smg.name}: id {int(ids[bad].reshape(-1)[0])} of {ld.ids!r} is out of range "
                                  f"for a table of {ld.length} rows ({ld.table!r})")
