"""Lowering an SMG's indexed stores (``smg.stores``): an output's elements stored into a caller's tensor at
positions read at run time, ``Into[.., Cast(Pos[i]), ..] = value`` (a TIR BufferStore whose index holds a
BufferLoad).

The kernel computes the output exactly as without the store (same schedule, same loops and masks); only its
global store changes: the element the kernel would write at ``value[idx]`` goes to ``into`` at ``idx``
permuted into ``layout`` order, its ``dim`` component replaced by ``positions[idx[dim]]``.  So ``into`` is a
parameter the kernel writes but never allocates (role ``inout``: the caller's tensor, passed by address, as
``index_copy_`` writes its ``self``) and ``positions`` an int64 input; the stored output is no parameter.

Taken only by element-wise kernels (no reduction, no warp tile): their outputs are written in exactly one
place per element (``_emit_store`` or a vector run's flush), each through ``store``; a kernel of any other
form raises ``LoweringError`` rather than leave one of its stores unredirected.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from tvm import tirx
from tvm.script.ir_builder import tirx as T

from schedulers.schedule import Schedule
from smg.errors import ShapeError, SpaceFusionError
from smg.ir import SMG
from smg.stores import IndexedStore, stores_of

#: the role of a parameter the kernel writes in place (the caller's tensor, never allocated by a launcher)
INOUT = "inout"
#: the data alignment (bytes) TVM's llvm kernels assume of a buffer parameter
ALIGNMENT = 64


class LoweringError(SpaceFusionError, ValueError):
    """An indexed store the lowering of this schedule cannot place."""


def stored(smg: SMG) -> dict[str, IndexedStore]:
    """The graph's indexed stores by the output they store."""
    return {st.value: st for st in stores_of(smg)}


def params(smg: SMG) -> list[tuple[str, tuple[int, ...], str, str]]:
    """The kernel parameters the stores add, (name, shape, dtype, role): each ``into`` (the stored output's
    dtype, ``inout``) and each distinct ``positions`` (int64 ``input``)."""
    out: dict[str, tuple[str, tuple[int, ...], str, str]] = {}
    for st in stores_of(smg):
        out.setdefault(st.into, (st.into, st.shape(smg), smg.space(st.value).dtype, INOUT))
        out.setdefault(st.positions, (st.positions, st.positions_shape(smg), "int64", "input"))
    return list(out.values())


def check(s: Schedule) -> None:
    """Raise ``LoweringError`` unless ``s`` is a schedule whose outputs the element-wise store paths write
    (none where the graph has no stores)."""
    if not stores_of(s.smg):
        return
    why = ("it reduces" if any(op.reduce for op in s.smg.ops) else
           "it is a warp-tile (tensor-core) kernel" if s.warp_tile is not None or s.tensor_cores else None)
    if why is not None:
        raise LoweringError(f"{s.smg.name}: indexed stores are lowered for element-wise kernels only; {why}")


def vector_run(k: Any, name: str) -> bool:
    """Whether a run of ``name``'s elements along the serial dim can be one vector store: not where the
    serial dim is the one its positions index (consecutive elements land at unrelated positions)."""
    st = k.stored.get(name)
    return st is None or st.dim != k.s.serial


def store(k: Any, name: str, value: tirx.PrimExpr, env: dict[str, tirx.PrimExpr]) -> None:
    """Store ``value`` as output ``name``'s element at ``env`` (``k``: the lowering's ``_Kernel``): at its
    own global index, or, for a stored output, into its store's tensor at the run-time position, skipped
    where that lies outside the tensor (``smg.stores``' contract: never a write past the caller's memory)."""
    st = k.stored.get(name)
    index = k.global_index(name, env)
    if st is None:
        T.buffer_store(k.glob[name], value, index)
        return
    at = dict(zip(k.smg.space(name).dims, index))
    i = at[st.dim]
    dtype = getattr(i, "dtype", "int32")
    pos = k.glob[st.positions][0] + i.astype("int64") if st.offset else k.glob[st.positions][i]
    at[st.dim] = tirx.Cast(dtype, pos)
    with T.If(tirx.all(pos >= 0, pos < st.length)), T.Then():
        T.buffer_store(k.glob[st.into], value, [at[d] for d in st.layout])


def in_place(tvm: Any, arr: np.ndarray, shape: tuple[int, ...], dtype: str) -> tuple[Any, Callable[[], None]]:
    """(the TVM tensor an ``inout`` parameter is passed as, what to call after the kernel ran) for the
    caller's array ``arr``: its own memory through DLPack where it is writable, packed, of ``dtype`` and
    64-byte aligned (TVM's llvm kernels assume buffer alignment), so the kernel writes the caller's tensor
    and nothing is copied; otherwise a copy that is written back into ``arr`` after the call (same result,
    two copies: a view at an odd offset, a bf16 array numpy cannot export)."""
    if tuple(arr.shape) != tuple(shape):
        raise ShapeError(f"in-place parameter has shape {tuple(arr.shape)}, the kernel expects {tuple(shape)}")
    if (arr.flags.c_contiguous and arr.flags.writeable and str(arr.dtype) == dtype
            and arr.ctypes.data % ALIGNMENT == 0):
        try:
            return tvm.runtime.from_dlpack(arr), lambda: None
        except (TypeError, ValueError, BufferError, RuntimeError):  # a dtype numpy's DLPack export lacks
            pass
    copy = tvm.runtime.tensor(np.ascontiguousarray(arr, dtype=dtype))
    return copy, lambda: np.copyto(arr, copy.numpy().astype(arr.dtype, copy=False))
