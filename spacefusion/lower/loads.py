"""Lowering an SMG's indexed loads (``smg.loads``): an input read from a caller's table at rows picked by ids
read at run time, ``value[i] = Table[Ids[i[dims]], i[rest]]`` (a TIR BufferLoad whose index holds a BufferLoad).

The kernel reads the value exactly as without the load (same schedule, same loops, tiles and masks): every
read of ``k.glob[value]`` (a plain element, a vector run's copy, a shared-memory stage, a window's clamped
read) goes through ``Gathered.__getitem__``, which looks the row up in the ids.  So a block's tile of the value
is never staged as a contiguous tile of the table: a stage copies it element by element, each element from its
own gathered row (the rows a block holds are whatever the ids say).  The value is no parameter; the table (the
value's dtype) and the ids (int64) are inputs in its place.

An id outside ``[0, length)`` reads zero (``smg.loads``' contract): the row index is clamped into the table and
the value selected away, so no address past the table is ever formed.  A vector run along a gathered dim is
not a wide load (consecutive elements come from unrelated rows: ``vector_read``); along a kept dim it is (the
row is the same for the whole run).  Tensor-core (warp-tile) kernels stage their operand tiles with cp.async,
TMA or ``ldmatrix`` from contiguous global tiles: they raise ``LoweringError`` (``check``), as the stores do.
"""

from __future__ import annotations

from typing import Any

from tvm import tirx

from schedulers.schedule import Schedule
from smg.ir import SMG
from smg.loads import IndexedLoad, loads_of
from spacefusion.lower.stores import LoweringError


def loaded(smg: SMG) -> dict[str, IndexedLoad]:
    """The graph's indexed loads by the input they read."""
    return {ld.value: ld for ld in loads_of(smg)}


def params(smg: SMG, name: str) -> list[tuple[str, tuple[int, ...], str, str]]:
    """The kernel parameters input ``name`` is passed as, (name, shape, dtype, role): itself, or for a loaded
    value its table (the value's dtype) and its ids (int64), both ``input``."""
    ld = loaded(smg).get(name)
    dtype = smg.space(name).dtype
    if ld is None:
        return [(name, smg.shape(name), dtype, "input")]
    return [(ld.table, ld.table_shape(smg), dtype, "input"), (ld.ids, ld.ids_shape(smg), "int64", "input")]


def check(s: Schedule) -> None:
    """Raise ``LoweringError`` where ``s`` is a warp-tile (tensor-core) schedule of a graph with indexed loads:
    those kernels copy contiguous global tiles of their operands (cp.async, TMA, ldmatrix), never a row at a
    time through ids."""
    if loads_of(s.smg) and (s.warp_tile is not None or s.tensor_cores):
        raise LoweringError(f"{s.smg.name}: indexed loads are lowered for CUDA-core kernels only; it is a warp-tile "
                            f"(tensor-core) kernel, whose operand tiles are copied as contiguous global tiles")


def vector_read(smg: SMG, name: str, serial: str) -> bool:
    """Whether a run of ``name``'s elements along the serial dim can be one wide load: not where the serial
    dim is one the ids pick (consecutive elements come from unrelated rows)."""
    ld = loaded(smg).get(name)
    return ld is None or serial not in ld.dims


class Gathered:
    """What the lowering's ``glob[value]`` is for a loaded value: indexed like the value's buffer (an index per
    value dim, in its order), each element read from the table's row its id picks, zero where the id lies
    outside the table.  ``dtype`` is the value's (a caller casts as it would the buffer's)."""

    def __init__(self, smg: SMG, load: IndexedLoad, table: tirx.Buffer, ids: tirx.Buffer) -> None:
        self.load, self.table, self.ids = load, table, ids
        self.dims = smg.space(load.value).dims
        self.rest = load.rest(smg)
        self.dtype = table.dtype

    def __getitem__(self, index: Any) -> tirx.PrimExpr:
        at = dict(zip(self.dims, list(index)))
        i = self.ids[[at[d] for d in self.load.dims]]
        ok = tirx.all(i >= 0, i < self.load.length)
        row = tirx.Cast("int32", tirx.max(tirx.min(i, self.load.length - 1), 0))  # never past the table
        val = self.table[[row, *(at[d] for d in self.rest)]]
        return tirx.if_then_else(ok, val, tirx.const(0, self.dtype))
