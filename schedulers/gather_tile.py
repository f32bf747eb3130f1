"""Gathered tiles: a streamed view of an input on the (rows, serial) plane, loaded through its index expressions.

An implicit-GEMM convolution streams ``A[m, k] = X[n(m), y(m, k), x(m, k), c(k)]`` (``Builder.window2d``): the
temporal slicer materialises A per step, and the warp-tile kernel stages A's [rows, step] tile in shared
memory as it stages any input on that plane, except that each 16-byte chunk's address comes from the
view's index expressions instead of A's own row-major layout.  That works when a chunk of 8 consecutive
columns is 8 consecutive elements of X: the last index component is ``k``'s own (``c(k)``, contiguous and
8-aligned on 8-aligned columns) and every other component changes only between chunks (it reads the
column dim through ``floor(k / c)`` with ``c`` a multiple of 8).  A chunk then lies wholly inside X or
wholly in the zero padding, so it is one cp.async or one zero store.

Where it does not (an NCHW image: 8 columns are 8 channels H * W apart), the tile is ``scalar``: each thread
loads a chunk's 8 elements one by one (each its own bounds check) and stores them as one 16-byte chunk, the
block's threads walking the rows first, so a warp's load reads 32 neighbouring pixels of one channel (what
is contiguous in NCHW).  Analysis only (no TVM).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import sympy as sp

from schedulers.errors import ScheduleError
from smg.expr import index_symbol
from smg.ops import UPSAMPLE_VIEW, pads2d, upsample_taps, upsample_window2d_index, window2d_index

#: elements of a 16-byte chunk (fp16 / bf16)
CHUNK = 8


@dataclass(frozen=True)
class GatherTile:
    """The streamed view ``tile`` = ``src[index]`` (index: one expression of the view's dims per dim of ``src``)."""

    tile: str
    src: str
    index: tuple[str, ...]
    #: loaded element by element (a chunk of 8 columns is not 8 consecutive elements of ``src``)
    scalar: bool = False


#: gather_tile's answers by (SMG content key, view, row dim, serial dim): the search asks for every schedule
#: of one SMG (44k times while ranking a ResNet conv, 356 of its 380 s before this)
_MEMO: dict[tuple[str, str, str, str], GatherTile | tuple[str, str]] = {}


def gather_tile(smg, op, row: str, L: str) -> GatherTile:
    """The gathered-tile reading of streamed op ``op`` (a view of one input on the ({row}, {L}) plane);
    ScheduleError says why it cannot be loaded in 16-byte chunks."""
    key = (smg.key, op.out, row, L)
    if key not in _MEMO:
        if len(_MEMO) > 4096:
            _MEMO.clear()
        try:
            _MEMO[key] = _gather_tile(smg, op, row, L)
        except ScheduleError as exc:  # its code and sentence, not the exception (nor its traceback)
            _MEMO[key] = (exc.code, str(exc))
    got = _MEMO[key]
    if isinstance(got, tuple):
        raise ScheduleError(got[1], code=got[0])
    return got


def _gather_tile(smg, op, row: str, L: str) -> GatherTile:
    if op.reduce or len(op.inputs) != 1 or op.body != op.inputs[0].space or op.inputs[0].space not in smg.inputs:
        raise ScheduleError(f"streamed op {op.out!r} gathers through an index expression but is not a view of one "
                            f"input (its body {op.body!r})", code="gather.not_view")
    acc = op.inputs[0]
    if op.out_index[-1] != L or row not in op.out_index:
        raise ScheduleError(f"view {op.out!r} {op.out_index} must be on ({row}, {L}) with {L} last",
                            code="gather.off_plane")
    try:
        return _chunked(smg, op, L)
    except ScheduleError:
        return GatherTile(op.out, acc.space, acc.index, scalar=True)


def _chunked(smg, op, L: str) -> GatherTile:
    """The view read in 16-byte chunks, or ScheduleError saying why a chunk is not 8 consecutive elements."""
    acc = op.inputs[0]
    src = smg.space(acc.space)
    sizes = smg.dim_sizes
    if sizes[src.dims[-1]] % CHUNK:
        raise ScheduleError(f"view {op.out!r} reads {acc.space!r} whose last dim {src.dims[-1]!r} = "
                            f"{sizes[src.dims[-1]]} is not a multiple of {CHUNK} (16-byte chunks)",
                            code="gather.chunk_width")
    *outer, last = acc.index
    lsym = index_symbol(L)
    for text, e in zip(outer, acc.exprs):
        hidden = e.replace(lambda f: isinstance(f, sp.floor) and f.args[0].free_symbols == {lsym}
                           and _chunk_constant(f.args[0], lsym), lambda f: index_symbol("chunk__const"))
        if lsym in hidden.free_symbols:
            raise ScheduleError(f"view {op.out!r} reads {acc.space!r} at {text!r}, which changes within a chunk of "
                                f"{CHUNK} columns of {L!r} (only floor({L}/c) with c a multiple of {CHUNK} may)",
                                code="gather.chunk_outer")
    e = acc.exprs[-1]
    if e.free_symbols != {lsym}:
        raise ScheduleError(f"view {op.out!r}: the last index {last!r} of {acc.space!r} must depend on {L!r} alone",
                            code="gather.chunk_last")
    ks = np.arange(sizes[L])
    v = np.asarray(sp.lambdify(lsym, e, "numpy")(ks), dtype=np.int64).reshape(-1)
    v = np.broadcast_to(v, ks.shape)
    first = v[(ks // CHUNK) * CHUNK]
    if np.any(v != first + ks % CHUNK) or np.any(first % CHUNK):
        raise ScheduleError(f"view {op.out!r}: {last!r} does not run over 8-aligned runs of 8 consecutive "
                            f"elements of {acc.space!r} on 8-aligned columns of {L!r}", code="gather.chunk_runs")
    return GatherTile(op.out, acc.space, acc.index)


#: the largest kernel and padding an im2col tensor map describes here (4-d maps: corners in [-128, 127])
IM2COL_MAX_KERNEL = 7
IM2COL_MAX_PAD = 3
#: the largest stride matched: the driver's ``elementStrides`` limit (``runtime.artefact.MAX_TRAVERSAL_STRIDE``,
#: which this layer does not import; ``tests/test_conv_im2col.py`` checks the two agree)
IM2COL_MAX_STRIDE = 8
#: channels of one im2col box: a 128-byte swizzle band of fp16 / bf16
IM2COL_BAND = 64


@dataclass(frozen=True)
class Im2col:
    """A gathered tile that a TMA im2col tensor map loads: the view is a ``kernel`` window of the channels-last
    image ``src`` [n, h, w, c] with ``pad`` zeros around it, moved ``stride`` pixels an output pixel
    (``Builder.window2d`` without upsampling), its output ``out`` = (p, q) pixels per image.  A 64-column band
    of the tile is one tap's 64 channels, so one TMA load fetches [rows, 64] with the tap as the load's im2col
    offsets; a stride is the map's traversal stride (``elementStrides``) along w and h.

    ``shift`` non-empty: the view is ``Builder.upsample_window2d``'s (a conv after an upsampling, by output
    parity): ``kernel`` is the merged window, rows are the pixels ``j`` of one small-image row ``nh``, and
    parity ``a`` reads from small row (column) ``i + shift[a]`` on (a row tile never wraps to the next row)."""

    src: str
    kernel: tuple[int, int]
    pad: int | tuple[int, int]  # one for both dims, or (rows, columns): a 1-D conv's (0, p)
    channels: int
    out: tuple[int, int]
    shift: tuple[int, ...] = ()
    stride: int = 1

    def tap(self, col: int) -> tuple[int, int, int]:
        """(ky, kx, channel) of tile column ``col`` (the view's column order: taps, then channels)."""
        tap, ch = divmod(col, self.channels)
        return tap // self.kernel[1], tap % self.kernel[1], ch

    @property
    def corners(self) -> tuple[list[int], list[int]]:
        """The tensor map's pixel-box corners, (w, h) as the map orders them: a filter's first tap ranges
        over [-pad, size - 1 + pad - (kernel - 1)] along each.  Stride 1: the output pixels.  Stride s: the
        map steps s pixels through the same box, ceil((size + 2 pad - kernel + 1) / s) of them, which is
        floor((size + 2 pad - kernel) / s) + 1, the output pixels again."""
        if self.shift:  # by parity: the box's first pixel ranges over [min shift, size - 1 + max shift]
            lo, hi = min(self.shift), max(self.shift)
            return [lo, lo], [hi, hi]
        (r, s), (pad_y, pad_x) = self.kernel, self.pads
        return [-pad_x, -pad_y], [pad_x - (s - 1), pad_y - (r - 1)]

    @property
    def pads(self) -> tuple[int, int]:
        """The padding as (rows, columns)."""
        return pads2d(self.pad)


#: im2col_of's answers by (SMG content key, gathered tile): asked for every schedule of a conv the search ranks
_IM2COL_MEMO: dict[tuple[str, GatherTile], Im2col | str] = {}


def im2col_of(smg, g: GatherTile) -> Im2col | str:
    """``g`` as a TMA im2col load, or why it is not one: the view must be exactly ``window2d``'s
    non-upsampled form (any stride up to ``IM2COL_MAX_STRIDE``) or ``upsample_window2d``'s (matched by
    rebuilding its index expressions), its image
    16-bit and its channels whole 64-wide bands (a band then never straddles two taps)."""
    key = (smg.key, g)
    if key not in _IM2COL_MEMO:
        if len(_IM2COL_MEMO) > 4096:
            _IM2COL_MEMO.clear()
        _IM2COL_MEMO[key] = _im2col_of(smg, g)
    return _IM2COL_MEMO[key]


def _im2col_of(smg, g: GatherTile) -> Im2col | str:
    op = smg.producer(g.tile)
    src = smg.space(g.src)
    sizes = smg.dim_sizes
    if g.scalar:
        return f"{g.tile!r} is gathered element by element (its image is not channels-last: NCHW)"
    if len(src.dims) != 4:
        return f"{g.src!r} is not a 4-d channels-last image"
    if src.dtype not in ("float16", "bfloat16"):
        return f"{g.src!r} is {src.dtype}; im2col boxes here are 16-bit"
    n, h, w, c = (sizes[d] for d in src.dims)
    if c % IM2COL_BAND:
        return f"{g.src!r} has {c} channels, not whole {IM2COL_BAND}-channel bands (a band would straddle two taps)"
    norm = tuple(re.sub(r"\s+", "", t) for t in g.index)
    if op.out_index == UPSAMPLE_VIEW:
        return _parity_im2col(g, norm, (h, w), c, sizes["a"])
    if len(op.out_index) != 2:
        return f"{g.tile!r} {op.out_index} is not a window2d view [pixels, taps]"
    m, k = op.out_index
    taps = sizes[k] // c
    pads = range(IM2COL_MAX_PAD + 1)
    for r in range(1, IM2COL_MAX_KERNEL + 1):
        if taps % r or taps // r > IM2COL_MAX_KERNEL:
            continue
        s = taps // r
        for pad_y, pad_x in ((a, b) for a in pads for b in pads):
            if h + 2 * pad_y < r or w + 2 * pad_x < s:
                continue
            for stride in range(1, IM2COL_MAX_STRIDE + 1):
                p, q = (h + 2 * pad_y - r) // stride + 1, (w + 2 * pad_x - s) // stride + 1
                if n * p * q != sizes[m]:
                    continue
                want = window2d_index(m, k, c, (p, q), s, stride, (pad_y, pad_x))
                if tuple(re.sub(r"\s+", "", t) for t in want) == norm:
                    pad = pad_y if pad_y == pad_x else (pad_y, pad_x)
                    return Im2col(g.src, (r, s), pad, c, (p, q), stride=stride)
    return (f"{g.tile!r} is not a non-upsampled window of {g.src!r} that a tensor map steps through "
            f"(its index {g.index})")


def _parity_im2col(g: GatherTile, norm: tuple[str, ...], size: tuple[int, int], c: int, factor: int) -> Im2col | str:
    """``upsample_window2d``'s view as an im2col load (matched by rebuilding its index expressions)."""
    for kernel in range(1, IM2COL_MAX_KERNEL + 1, 2):
        pad = (kernel - 1) // 2
        want = upsample_window2d_index(c, size[0], kernel, pad, factor)
        if tuple(re.sub(r"\s+", "", t) for t in want) == norm:
            taps = upsample_taps(kernel, pad, factor)
            t = taps[0][1][-1] + 1
            return Im2col(g.src, (t, t), pad, c, size, tuple(d for d, _ in taps))
    return f"{g.tile!r} is not an upsample_window2d view of {g.src!r} (its index {g.index})"


def _chunk_constant(arg: sp.Expr, lsym: sp.Symbol) -> bool:
    """``arg`` is ``L / c`` (+ a constant multiple of ``1/c``... only the plain form) with c a multiple of 8."""
    coeff = sp.Poly(arg, lsym).all_coeffs() if arg.is_polynomial(lsym) else None
    if coeff is None or len(coeff) != 2 or coeff[1] != 0:
        return False
    c = 1 / coeff[0]
    return c.is_Integer and int(c) % CHUNK == 0


__all__ = ["CHUNK", "GatherTile", "Im2col", "gather_tile", "im2col_of"]
