"""The TMA ring of a warp-tile kernel (``tma``): tensor-map loads into the ring slots, an mbarrier
per slot counting their bytes in (and, with a producer warpgroup, one per slot handing it back,
and with ``pingpong`` one per MMA warpgroup ordering their main loops).

The mbarriers sit in the arena past everything else, 8 bytes each: the slots' full barriers, then
their empty barriers, then (split ring) the V parts' full and empty barriers, or (pingpong) the two
order barriers.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import tirx as T

from schedulers.gather_tile import Im2col
from schedulers.warp_tile import split_ring, tma_dims, tma_streamed
from smg.ops import UPSAMPLE_VIEW
from spacefusion.lower.mma_state import I32, KernelState


class TmaRing:
    """Mbarrier addresses and TMA loads over :class:`KernelState` ``st`` (its arena, layout, coordinates)."""

    def __init__(self, st: KernelState) -> None:
        self.st = st

    # -- mbarriers -------------------------------------------------------------------------------
    def full(self, slot: tirx.PrimExpr | int) -> tirx.PrimExpr:
        """Address of ring slot ``slot``'s mbarrier (8 bytes, after the arena's tiles)."""
        return self.st.arena.ptr_to([self.st.mbar_base + slot * 4])

    def empty(self, slot: tirx.PrimExpr | int) -> tirx.PrimExpr:
        """Address of the mbarrier by which the MMA warpgroups hand ring slot ``slot`` back to a
        producer warpgroup (after the slots' full barriers)."""
        return self.full(self.st.p.warp.stages + slot)

    def full_v(self, slot: tirx.PrimExpr | int) -> tirx.PrimExpr:
        """With a split ring: the mbarrier counting slot ``slot``'s GEMM-state tiles (V) in."""
        return self.full(2 * self.st.p.warp.stages + slot)

    def empty_v(self, slot: tirx.PrimExpr | int) -> tirx.PrimExpr:
        """With a split ring: the mbarrier by which the MMA warpgroups hand slot ``slot``'s V back."""
        return self.full(3 * self.st.p.warp.stages + slot)

    def order(self, wg: tirx.PrimExpr | int) -> tirx.PrimExpr:
        """Address of the mbarrier that lets MMA warpgroup ``wg`` start its next main loop (pingpong)."""
        return self.full(2 * self.st.p.warp.stages + wg)

    def init(self) -> None:
        """One arrival (thread 0's expect_tx) per phase of every slot's mbarrier, and with a producer
        warpgroup one per MMA warpgroup per phase of every slot's empty barrier, visible to all."""
        st, p = self.st, self.st.p
        with T.If(st.tid == 0):
            with T.Then():
                for i in range(p.warp.stages):
                    T.evaluate(T.ptx.mbarrier.init.shared.b64(self.full(i), T.uint32(1)))
                    if p.hopper.producer:
                        T.evaluate(T.ptx.mbarrier.init.shared.b64(self.empty(i), T.uint32(p.warps // 4)))
                    if split_ring(p):
                        T.evaluate(T.ptx.mbarrier.init.shared.b64(self.full_v(i), T.uint32(1)))
                        T.evaluate(T.ptx.mbarrier.init.shared.b64(self.empty_v(i), T.uint32(p.warps // 4)))
                for i in range(2 if p.hopper.pingpong else 0):
                    T.evaluate(T.ptx.mbarrier.init.shared.b64(self.order(i), T.uint32(1)))
                T.evaluate(T.ptx.fence.mbarrier_init.release.cluster())
        T.evaluate(T.tvm_storage_sync("shared"))

    # -- loads -----------------------------------------------------------------------------------
    def step(self, slot: tirx.PrimExpr, t0: tirx.PrimExpr, pred: tirx.PrimExpr | None,
             names: tuple[str, ...] | None = None, bar: tirx.PrimExpr | None = None) -> None:
        """Thread 0 loads the ring's tiles of the step at ``t0`` by TMA into ``slot``, in 64-column
        swizzled bands, their bytes counted by the slot's mbarrier: inputs on the score plane (a plain
        GEMM's A, Softmax-GEMM's S) as [rows, 64] bands along L, the score GEMM's B (K) and the GEMM
        states' ``x`` (V, a plain GEMM's B) as [step, 64] bands along their columns (a K-major ``x``,
        ``nn.Linear``'s weight [n, k], as [n_tile, 64] bands along L), at this block's (batch, head)
        coordinates; rows and columns past the ends arrive as zeros and count too."""
        st, p = self.st, self.st.p
        cond = st.tid == 0 if pred is None else tirx.all(st.tid == 0, pred)
        names = tma_streamed(p) if names is None else names  # (a split ring loads K and V apart)
        nbytes = sum(st.layout[n][1] * st.layout[n][2] * 2 for n in names)
        cols0 = {g.x: st.col0(g.n) for g in p.gemm_states}
        kmajor = {g.x for g in p.gemm_states if g.k_major}
        with T.If(cond):
            with T.Then():
                bar = self.full(slot) if bar is None else bar
                T.evaluate(T.ptx.mbarrier.arrive.expect_tx.shared.b64(bar, T.uint32(nbytes)))
                for n in names:
                    if p.im2col(n) is not None:
                        self._im2col(n, slot, t0, bar)
                        continue
                    dims = st.smg.space(n).dims
                    op = T.ptx[f"cp.async.bulk.tensor.{len(dims)}d.shared::cluster.global.mbarrier::complete_tx::bytes"]
                    outer = [st.coord[d] for d in tma_dims(st.smg, p, n)[2:]]  # the map's order
                    _, rows, cols = st.layout[n]
                    for band in range(cols // 64):
                        dst = st.arena.ptr_to([st.slot_tile(n, slot) + band * rows * 64])
                        if n in p.tiles_in:  # [rows, step] of the score plane: the band runs along L
                            c0, c1 = t0 + band * 64, st.row0
                        elif n in kmajor:  # a K-major x [n_tile, step]: the band runs along L too
                            c0, c1 = t0 + band * 64, cols0[n]
                        else:  # [step, cols]: the band runs along the tile's columns
                            c0, c1 = cols0.get(n, tirx.const(0, I32)) + band * 64, t0
                        T.evaluate(op(dst, st.glob[f"{n}__tmap"].data, c0, c1, *outer, bar))

    def _im2col(self, n: str, slot: tirx.PrimExpr, t0: tirx.PrimExpr, bar: tirx.PrimExpr) -> None:
        """Gathered tile ``n``'s step at column ``t0`` by TMA im2col loads, one per 64-column band (one tap's
        64 channels): the box's first pixel is the row tile's first output pixel (n, y, x) at (s x - pad,
        s y - pad) for stride s (by parity: the small-image pixel its parity reads first), the tap (kx, ky) its im2col
        offsets; pixels past the image's edge arrive as zeros."""
        st = self.st
        im = st.p.im2col(n)
        (p_out, q_out), (pad_y, pad_x) = im.out, im.pads
        m0 = st.row0
        if im.shift:  # by output parity (a, b): row nh's pixels from j0, shifted by the parity's first small row
            nh, a, b = (st.coord[d] for d in UPSAMPLE_VIEW[:3])
            img, y0, x0 = nh // p_out, nh % p_out + self._shift(im, a), m0 + self._shift(im, b)
            pad_y = pad_x = 0
        else:
            img, y0, x0 = m0 // (p_out * q_out), (m0 // q_out) % p_out, m0 % q_out
            if im.stride > 1:  # the output pixel's first tap: ``stride`` input pixels an output pixel
                y0, x0 = y0 * im.stride, x0 * im.stride
        _, rows, cols = st.layout[n]
        for band in range(cols // 64):
            col = t0 + band * 64
            tap, ch = col // im.channels, col % im.channels
            ky, kx = tap // im.kernel[1], tap % im.kernel[1]
            dst = st.arena.ptr_to([st.slot_tile(n, slot) + band * rows * 64])
            T.evaluate(tirx.call_extern("void", IM2COL_LOAD, dst, st.glob[f"{n}__tmap"].data, ch, x0 - pad_x,
                                        y0 - pad_y, img, kx, ky, bar))


    @staticmethod
    def _shift(im: Im2col, parity: tirx.PrimExpr) -> tirx.PrimExpr:
        """``im.shift[parity]`` for a block coordinate ``parity``."""
        out = tirx.const(im.shift[-1], I32)
        for i in range(len(im.shift) - 2, -1, -1):
            out = tirx.Select(parity == i, tirx.const(im.shift[i], I32), out)
        return out


#: the device function (``IM2COL_SOURCE``) a kernel with im2col loads calls: TVM's PTX builtins have no im2col form
IM2COL_LOAD = "sf_tma_load_im2col_4d"
IM2COL_SOURCE = f"""
__forceinline__ __device__ void {IM2COL_LOAD}(void* dst, const void* tmap, int c, int w, int h, int n, int kx, int ky,
                                                void* mbar) {{
  unsigned int d = (unsigned int)__cvta_generic_to_shared(dst), b = (unsigned int)__cvta_generic_to_shared(mbar);
  unsigned short ow = (unsigned short)kx, oh = (unsigned short)ky;
  asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.im2col.mbarrier::complete_tx::bytes"
               " [%0], [%1, {{%2, %3, %4, %5}}], [%6], {{%7, %8}};"
               :: "r"(d), "l"(tmap), "r"(c), "r"(w), "r"(h), "r"(n), "r"(b), "h"(ow), "h"(oh) : "memory");
}}
"""
