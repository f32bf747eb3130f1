"""The TMA ring of a warp-tile kernel (``tma``): tensor-map loads into the ring slots, an mbarrier
per slot counting their bytes in (and, with a producer warpgroup, one per slot handing it back,
and with ``pingpong`` one per MMA warpgroup ordering their main loops).

A mixin of ``mma._Gen``: it reads the generator's arena, layout, coordinates and parameters.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import tirx as T

from schedulers.warp_tile import split_ring, tma_dims, tma_streamed
from spacefusion.lower.mma_out import I32


class _TmaRing:
    def _mbar(self, slot: tirx.PrimExpr | int) -> tirx.PrimExpr:
        """Address of ring slot ``slot``'s mbarrier (8 bytes, after the arena's tiles)."""
        return self.arena.ptr_to([self.mbar_base + slot * 4])

    def _empty(self, slot: tirx.PrimExpr | int) -> tirx.PrimExpr:
        """Address of the mbarrier by which the MMA warpgroups hand ring slot ``slot`` back to a
        producer warpgroup (after the slots' full barriers)."""
        return self._mbar(self.p.stages + slot)

    def _full_v(self, slot: tirx.PrimExpr | int) -> tirx.PrimExpr:
        """With a split ring: the mbarrier counting slot ``slot``'s GEMM-state tiles (V) in."""
        return self._mbar(2 * self.p.stages + slot)

    def _empty_v(self, slot: tirx.PrimExpr | int) -> tirx.PrimExpr:
        """With a split ring: the mbarrier by which the MMA warpgroups hand slot ``slot``'s V back."""
        return self._mbar(3 * self.p.stages + slot)

    def _tma_init(self) -> None:
        """One arrival (thread 0's expect_tx) per phase of every slot's mbarrier, and with a producer
        warpgroup one per MMA warpgroup per phase of every slot's empty barrier, visible to all."""
        with T.If(self.tid == 0):
            with T.Then():
                for i in range(self.p.stages):
                    T.evaluate(T.ptx.mbarrier.init.shared.b64(self._mbar(i), T.uint32(1)))
                    if self.p.producer:
                        T.evaluate(T.ptx.mbarrier.init.shared.b64(self._empty(i), T.uint32(self.p.warps // 4)))
                    if split_ring(self.p):
                        T.evaluate(T.ptx.mbarrier.init.shared.b64(self._full_v(i), T.uint32(1)))
                        T.evaluate(T.ptx.mbarrier.init.shared.b64(self._empty_v(i), T.uint32(self.p.warps // 4)))
                for i in range(2 if self.p.pingpong else 0):
                    T.evaluate(T.ptx.mbarrier.init.shared.b64(self._order(i), T.uint32(1)))
                T.evaluate(T.ptx.fence.mbarrier_init.release.cluster())
        T.evaluate(T.tvm_storage_sync("shared"))

    def _tma_step(self, slot: tirx.PrimExpr, t0: tirx.PrimExpr, pred: tirx.PrimExpr | None,
                  names: tuple[str, ...] | None = None, bar: tirx.PrimExpr | None = None) -> None:
        """Thread 0 loads the ring's tiles of the step at ``t0`` by TMA into ``slot``, in 64-column
        swizzled bands, their bytes counted by the slot's mbarrier: inputs on the score plane (a plain
        GEMM's A, Softmax-GEMM's S) as [rows, 64] bands along L, the score GEMM's B (K) and the GEMM
        states' ``x`` (V, a plain GEMM's B) as [step, 64] bands along their columns, at this block's
        (batch, head) coordinates; rows and columns past the ends arrive as zeros and count too."""
        cond = self.tid == 0 if pred is None else tirx.all(self.tid == 0, pred)
        p = self.p
        names = tma_streamed(p) if names is None else names  # (a split ring loads K and V apart)
        nbytes = sum(self.layout[n][1] * self.layout[n][2] * 2 for n in names)
        cols0 = {g.x: self.col0(g.n) for g in p.gemm_states}
        with T.If(cond):
            with T.Then():
                bar = self._mbar(slot) if bar is None else bar
                T.evaluate(T.ptx.mbarrier.arrive.expect_tx.shared.b64(bar, T.uint32(nbytes)))
                for n in names:
                    dims = self.smg.space(n).dims
                    op = T.ptx[f"cp.async.bulk.tensor.{len(dims)}d.shared::cluster.global.mbarrier::complete_tx::bytes"]
                    outer = [self.coord[d] for d in tma_dims(self.smg, p, n)[2:]]  # the map's order
                    _, rows, cols = self.layout[n]
                    for band in range(cols // 64):
                        dst = self.arena.ptr_to([self._slot_tile(n, slot) + band * rows * 64])
                        if n in p.tiles_in:  # [rows, step] of the score plane: the band runs along L
                            c0, c1 = t0 + band * 64, self.row0
                        else:  # [step, cols]: the band runs along the tile's columns
                            c0, c1 = cols0.get(n, tirx.const(0, I32)) + band * 64, t0
                        T.evaluate(op(dst, self.glob[f"{n}__tmap"].data, c0, c1, *outer, bar))
