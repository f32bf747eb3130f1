"""Warp-level MMA of a warp-tile kernel: ``ldmatrix`` fragments and ``mma.sync.m16n8k16``.

Fragment loops are unrolled in Python, so every register index is a constant.  Shared tiles are
addressed from the arena base of the tile (``sbase``) plus an element offset.
"""

from __future__ import annotations

from collections.abc import Callable

from tvm import tirx
from tvm.script.ir_builder import tirx as T

from spacefusion.lower.exprs import F32
from spacefusion.lower.mma_state import KernelState


class MmaSync:
    """ldmatrix and mma.sync over the fragments and shared tiles of :class:`KernelState` ``st``."""

    def __init__(self, st: KernelState) -> None:
        self.st = st

    def ldsm(self, frag: tirx.Buffer, off: int, name: str, soff: tirx.PrimExpr, trans: bool) -> None:
        """``ldmatrix.x4`` (``.trans`` with ``trans``) from shared tile ``name`` at element ``soff``
        into ``frag[off:off + 8]``."""
        st = self.st
        T.evaluate(T.ptx_legacy.ldmatrix(trans, 4, ".b16", frag.data, off, st.smem[name].access_ptr("r"),
                                         st.sbase[name] + soff, dtype=st.half))

    def mma(self, c: tirx.Buffer, coff: int, a: tirx.Buffer, aoff: int, b: tirx.Buffer, boff: int) -> None:
        """``c[coff:coff + 4] += a[aoff:aoff + 8] @ b[boff:boff + 4]`` (one m16n8k16)."""
        T.evaluate(T.ptx_legacy.mma("m16n8k16", "row", "col", self.st.ab, self.st.ab, "fp32", a.data, aoff, b.data,
                                    boff, c.data, coff, False, dtype=F32))

    def a_offset(self, stride: int, r0: tirx.PrimExpr, c0: int) -> tirx.PrimExpr:
        """ldmatrix.x4 row address of a 16x16 A-layout block at (r0, c0)."""
        lane = self.st.lane
        return (r0 + lane % 16) * stride + c0 + (lane // 16) * 8

    def b_offset(self, stride: int, nrow0: int, kcol0: int, trans: bool) -> tirx.PrimExpr:
        """ldmatrix.x4 row address for two 8-column B tiles (k 16) from [n, k] (or [k, n] with trans)."""
        j, r = self.st.lane // 8, self.st.lane % 8
        if trans:
            return (kcol0 + (j % 2) * 8 + r) * stride + nrow0 + (j // 2) * 8
        return (nrow0 + (j // 2) * 8 + r) * stride + kcol0 + (j % 2) * 8

    def pipelined(self, kts: int, size: int, load: Callable[[int, tirx.Buffer], None],
                  mma: Callable[[int, tirx.Buffer], None]) -> None:
        """Register double buffering over the k slices of a GEMM: the B fragments of slice kt+1
        are requested (ldmatrix) before the mma.sync of slice kt, so shared-memory latency overlaps
        the tensor cores instead of stalling each mma on its operands."""
        bufs = [T.alloc_buffer((size,), self.st.half, scope="local") for _ in range(min(2, kts))]
        load(0, bufs[0])
        for kt in range(kts):
            if kt + 1 < kts:
                load(kt + 1, bufs[(kt + 1) % 2])
            mma(kt, bufs[kt % 2])

    def a_fragments(self) -> tirx.Buffer:
        """The score GEMM's A (Q) read from its landed tile into registers, held for the whole loop."""
        st = self.st
        g = st.p.gemm
        kd = g.kp  # the MMAs run K padded to 16 (zero columns in shared memory)
        qf = T.alloc_buffer((st.mt * kd // 2,), st.half, scope="local")
        stride = st.layout[g.a][2]
        for mi in range(st.mt):
            for kt in range(kd // 16):
                self.ldsm(qf, mi * kd // 2 + kt * 8, g.a, self.a_offset(stride, st.mtile_row(mi), kt * 16), False)
        return qf
