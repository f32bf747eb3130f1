"""TMA tensor maps (``CUtensorMap``) for a kernel's ``tensormap`` params, through the CUDA driver.

A TMA load names its global tensor by a 128-byte descriptor that only the host can encode
(``cuTensorMapEncodeTiled``).  The launcher builds one per mapped tensor and launch address, copies
it to device memory, and passes its pointer; the kernel hands that generic address to
``cp.async.bulk.tensor``.  libcuda is reached through ctypes: neither torch nor cupy wraps the call.
The checks here run before the driver sees anything, so a bad tensor gets a message naming it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from .artefact import MAX_TRAVERSAL_STRIDE

if TYPE_CHECKING:
    import torch

#: CUtensorMapDataType for the dtypes the lowering maps
DATA_TYPES = {"float16": 6, "bfloat16": 9, "float32": 7}
#: CUtensorMapSwizzle by swizzle width in bytes
SWIZZLES = {0: 0, 32: 1, 64: 2, 128: 3}
_L2_PROMOTION_128B = 2
TENSOR_MAP_BYTES = 128


class TensorMapError(ValueError):
    """A tensor cannot be described by the tensor map a kernel asks for; the message says why."""


def tiled_args(shape: Sequence[int], strides: Sequence[int], itemsize: int, box: Sequence[int],
               swizzle: int, order: Sequence[int] | None = None) -> tuple[list[int], list[int], list[int]]:
    """(dims, byte strides of dims 1.., box) in the map's order for a tensor view, after the
    driver's rules: a contiguous first dim, 16-byte strides, boxes of 1..256 elements, and a first
    box of at most ``swizzle`` bytes when swizzled.

    ``order`` lists the tensor's dims in the map's order (None: innermost first, a row-major
    view's).  Each map dim keeps its own stride, so a kernel may map a [b, s, h, d] tensor as
    (d, s, h, b): its tile rows then run along s, h * d elements apart (no copy to [b, h, s, d])."""
    rank = len(shape)
    if not 1 <= rank <= 5 or len(box) != rank:
        raise TensorMapError(f"a {rank}-d tensor with a {len(box)}-d box: need 1-5 dims and one box size per dim")
    order = list(range(rank))[::-1] if order is None else [int(i) for i in order]
    if sorted(order) != list(range(rank)):
        raise TensorMapError(f"dim order {order} is not a permutation of the tensor's {rank} dims")
    if strides[order[0]] != 1:
        raise TensorMapError(f"the innermost dim has stride {strides[order[0]]} (tensor dim {order[0]}, the map's "
                             f"first); a tensor map needs it contiguous")
    dims = [int(shape[i]) for i in order]
    byte_strides = [int(strides[i]) * itemsize for i in order[1:]]
    if any(b % 16 for b in byte_strides):
        raise TensorMapError(f"row strides {byte_strides} B must be multiples of 16 for a tensor map")
    box = [int(b) for b in box]
    if any(not 1 <= b <= 256 for b in box):
        raise TensorMapError(f"box {box} must be 1..256 elements per dim")
    if swizzle not in SWIZZLES:
        raise TensorMapError(f"swizzle {swizzle} must be one of {sorted(SWIZZLES)} bytes")
    if swizzle and box[0] * itemsize > swizzle:
        raise TensorMapError(f"an innermost box of {box[0] * itemsize} B is wider than the {swizzle} B swizzle")
    return dims, byte_strides, box


@lru_cache(maxsize=1)
def _libcuda() -> Any:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise TensorMapError(f"the CUDA driver (libcuda.so.1) is not loadable: {e}") from None


#: pinned host copies of tensor maps encoded during a CUDA graph capture (their replays read them)
_CAPTURED: list[torch.Tensor] = []
#: maps one ``deferred_copies`` block can place (128 B each: a 512 KB slab allocated before its capture)
DEFERRED_SLOTS = 4096


class _Deferred:
    """A capture's slab of map slots, taken in order, and the (slot, pinned host map) copies still to do."""

    def __init__(self, slab: torch.Tensor) -> None:
        self.slab, self.used = slab, 0
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    def take(self, host: torch.Tensor, device: torch.device) -> torch.Tensor | None:
        if self.used >= DEFERRED_SLOTS or self.slab.device != device:
            return None
        dev = self.slab[self.used * TENSOR_MAP_BYTES:(self.used + 1) * TENSOR_MAP_BYTES]
        self.used += 1
        self.pending.append((dev, host))
        return dev


_DEFERRED: list[_Deferred] = []


@contextmanager
def deferred_copies() -> Iterator[None]:
    """Around a CUDA graph capture (on the current device) whose graph is not replayed before the block
    ends: a map encoded while capturing gets a slot of a slab allocated before the capture, filled once when
    the block ends, instead of a copy node in the graph.  Each such node ran again at every replay and cut
    the programmatic dependent launch of the kernel after it: the SD 1.5 UNet's graph idled 798 us between
    its 489 kernels, with 94 gaps of 5-20 us, most before a TMA kernel whose activation maps the capture had
    encoded anew (its memory pool moves every activation).  The slab is not the capture's pool on purpose:
    memory allocated while capturing may be a block an earlier kernel of the graph writes at every replay.
    Past ``DEFERRED_SLOTS`` maps, and outside the block (a capture of the caller's own), maps keep the copy
    node, as they do with ``SPACEFUSION_DEFER_MAPS=0`` (an A/B of this)."""
    import os

    import torch

    if os.environ.get("SPACEFUSION_DEFER_MAPS", "1") == "0" or not torch.cuda.is_available():
        yield
        return
    state = _Deferred(torch.empty(DEFERRED_SLOTS * TENSOR_MAP_BYTES, dtype=torch.uint8, device="cuda"))
    _DEFERRED.append(state)
    try:
        yield
    finally:
        _DEFERRED.pop()
        for dev, host in state.pending:
            dev.copy_(host, non_blocking=True)
        if state.pending:
            torch.cuda.synchronize()


def _dtype_name(t: torch.Tensor) -> str:
    name = str(t.dtype).removeprefix("torch.")
    if name not in DATA_TYPES:
        raise TensorMapError(f"dtype {name} has no tensor-map type here; known: {sorted(DATA_TYPES)}")
    if t.data_ptr() % 16:
        raise TensorMapError(f"the tensor's address {t.data_ptr():#x} is not 16-byte aligned")
    return name


def encode_tiled(t: torch.Tensor, box: Sequence[int], swizzle: int,
                 order: Sequence[int] | None = None) -> torch.Tensor:
    """The tensor map of ``t`` (a CUDA tensor) with ``box`` and ``swizzle``, its dims in ``order``
    (None: innermost first; see ``tiled_args``), as a uint8[128] tensor on ``t``'s device."""
    name = _dtype_name(t)
    dims, strides, box = tiled_args(t.shape, t.stride(), t.element_size(), box, swizzle, order)
    rank = len(dims)
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    raw = (ctypes.c_ubyte * (TENSOR_MAP_BYTES + 64))()
    addr = -(-ctypes.addressof(raw) // 64) * 64  # CUtensorMap is 64-byte aligned
    rc = _libcuda().cuTensorMapEncodeTiled(
        ctypes.c_void_p(addr), DATA_TYPES[name], rank, ctypes.c_void_p(t.data_ptr()), (u64 * rank)(*dims),
        (u64 * max(1, rank - 1))(*strides), (u32 * rank)(*box), (u32 * rank)(*([1] * rank)),
        0, SWIZZLES[swizzle], _L2_PROMOTION_128B, 0)
    if rc != 0:
        raise TensorMapError(f"cuTensorMapEncodeTiled refused dims {dims}, strides {strides} B, box {box}, "
                             f"swizzle {swizzle}: CUresult {rc}")
    return _on_device(t, addr)


def im2col_args(shape: Sequence[int], strides: Sequence[int], itemsize: int, channels: int, pixels: int,
                lower: Sequence[int], upper: Sequence[int], swizzle: int,
                traversal: Sequence[int] | None = None) -> tuple[list[int], list[int], list[int]]:
    """(dims, byte strides of dims 1..., element strides) of a channels-last image [n, (d,) h, w, c] for an
    im2col map, after the driver's rules: contiguous channels, 16-byte strides, 1..256 channels and pixels a
    load, one corner and one traversal stride (1..``MAX_TRAVERSAL_STRIDE``, innermost spatial dim first;
    None: 1 each) per spatial dim, and a channel run of at most ``swizzle`` bytes when swizzled."""
    rank = len(shape)
    traversal = [1] * (rank - 2) if traversal is None else [int(v) for v in traversal]
    if not 3 <= rank <= 5 or len(lower) != rank - 2 or len(upper) != rank - 2 or len(traversal) != rank - 2:
        raise TensorMapError(f"an im2col map takes a 3-5-d channels-last image and one corner and one traversal "
                             f"stride per spatial dim; got shape {list(shape)}, corners {list(lower)} / "
                             f"{list(upper)}, stride {traversal}")
    if not all(1 <= v <= MAX_TRAVERSAL_STRIDE for v in traversal):
        raise TensorMapError(f"traversal strides {traversal} must each be 1..{MAX_TRAVERSAL_STRIDE}")
    if strides[-1] != 1:
        raise TensorMapError(f"the channels have stride {strides[-1]}; an im2col map needs them contiguous")
    dims = [int(v) for v in reversed(shape)]
    byte_strides = [int(v) * itemsize for v in reversed(strides[:-1])]
    if any(b % 16 for b in byte_strides):
        raise TensorMapError(f"row strides {byte_strides} B must be multiples of 16 for a tensor map")
    if not (1 <= channels <= 256 and 1 <= pixels <= 256):
        raise TensorMapError(f"{channels} channels and {pixels} pixels a load must each be 1..256")
    if swizzle not in SWIZZLES or (swizzle and channels * itemsize > swizzle):
        raise TensorMapError(f"swizzle {swizzle} must be one of {sorted(SWIZZLES)} bytes and hold a pixel's "
                             f"{channels * itemsize} B")
    return dims, byte_strides, [1, *traversal, 1]


def encode_im2col(t: torch.Tensor, channels: int, pixels: int, lower: Sequence[int], upper: Sequence[int],
                  swizzle: int, traversal: Sequence[int] | None = None) -> torch.Tensor:
    """The im2col tensor map of channels-last image ``t`` (a CUDA tensor): each load fetches ``channels``
    channels of ``pixels`` consecutive pixels of the box whose first-tap corners are ``lower`` / ``upper``
    (innermost spatial dim first), stepping ``traversal`` pixels along each spatial dim (a strided conv's
    output pixels; None: 1), as a uint8[128] tensor on ``t``'s device."""
    name = _dtype_name(t)
    dims, strides, element_strides = im2col_args(t.shape, t.stride(), t.element_size(), channels, pixels, lower,
                                                 upper, swizzle, traversal)
    rank = len(dims)
    u64, u32, i32 = ctypes.c_uint64, ctypes.c_uint32, ctypes.c_int
    raw = (ctypes.c_ubyte * (TENSOR_MAP_BYTES + 64))()
    addr = -(-ctypes.addressof(raw) // 64) * 64
    rc = _libcuda().cuTensorMapEncodeIm2col(
        ctypes.c_void_p(addr), DATA_TYPES[name], rank, ctypes.c_void_p(t.data_ptr()), (u64 * rank)(*dims),
        (u64 * (rank - 1))(*strides), (i32 * (rank - 2))(*lower), (i32 * (rank - 2))(*upper), u32(channels),
        u32(pixels), (u32 * rank)(*element_strides), 0, SWIZZLES[swizzle], _L2_PROMOTION_128B, 0)
    if rc != 0:
        raise TensorMapError(f"cuTensorMapEncodeIm2col refused dims {dims}, strides {strides} B, corners "
                             f"{list(lower)} / {list(upper)}, element strides {element_strides}, "
                             f"{channels} channels x {pixels} pixels, "
                             f"swizzle {swizzle}: CUresult {rc}")
    return _on_device(t, addr)


def _on_device(t: torch.Tensor, addr: int) -> torch.Tensor:
    """The 128-byte map at host address ``addr`` copied to ``t``'s device from pinned memory, without the host
    waiting: a copy from pageable memory first waits for the stream to drain, which stalled every launch
    queued behind a newly encoded map (a model run kernel by kernel, whose activations' addresses move)."""
    import torch

    blob = bytes((ctypes.c_ubyte * TENSOR_MAP_BYTES).from_address(addr))
    host = torch.frombuffer(bytearray(blob), dtype=torch.uint8).pin_memory()
    capturing = torch.cuda.is_current_stream_capturing()
    dev = _DEFERRED[-1].take(host, t.device) if capturing and _DEFERRED else None
    if dev is not None:  # filled when the capture's block ends (the caller keeps ``dev`` alive)
        return dev
    if capturing:
        # a replay copies it again: kept alive with the process (128 bytes per tensor address a captured
        # launch saw); otherwise torch's pinned allocator keeps the block until the copy has run
        _CAPTURED.append(host)
    return host.to(t.device, non_blocking=True)
