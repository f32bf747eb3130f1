"""Warpgroup MMA of a warp-tile kernel: ``wgmma.mma_async.m64nNk16`` on 128-byte-swizzled shared
tiles read through matrix descriptors, A from shared memory (ss) or from registers (rs).

A warpgroup's 64-row halves are the units: accumulators hold ``N / 2`` floats per half and thread.
The rs form's A operand is the 4 registers of a 16x16 block that mma.sync would take (the layouts
agree), packed into 32-bit pairs.
"""

from __future__ import annotations

from collections.abc import Callable

from tvm import tirx
from tvm.script.ir_builder import tirx as T

from schedulers.warp_tile import SWIZZLE_ATOM, GemmState
from spacefusion.lower.mma_state import KernelState


class Wgmma:
    """Warpgroup MMA over the arena and accumulators of :class:`KernelState` ``st``."""

    def __init__(self, st: KernelState) -> None:
        self.st = st

    def step(self, wait: bool | None = None) -> None:
        """``acc += A @ B`` of every GEMM state for this step on warpgroup MMA: per k16 slice, GEMM
        state and 64-row half one ``wgmma.mma_async.m64nNk16`` reading both tiles from their 128 B-swizzled
        layouts in shared memory (A K-major, B N-contiguous and transposed by the instruction), then one
        commit and a wait, so the ring slot is free when the next step's barrier lets its copy in.  GEMM
        states sharing A (a gated GEMM's G and U) read the same A slice, each its own B into its own
        accumulator: the slice's wgmmas of both are in flight together."""
        st, p = self.st, self.st.p
        a = p.tiles_in[0]
        a_tile = st.slot_tile(a, st.slot)
        T.evaluate(T.ptx.wgmma.fence.sync.aligned())
        for kt in range(p.step // 16):
            for gs in p.gemm_states:
                per = (gs.n_tile // 8) * 4  # accumulator floats per 64-row half: N / 2
                acc = st.acc[gs.update.state]
                op = self.op(gs.n_tile)
                bdesc = self.mn_desc(gs, kt)
                for h in range(st.mt):  # this warpgroup's 64-row halves
                    # A [r, 64 k] K-major: a 64-row half is 8 atoms on; the k16 slice 32 B into the rows
                    adesc = self.k_desc(a_tile + st.half_of(h) * 8 * SWIZZLE_ATOM + kt * 16)
                    T.evaluate(op(*[acc[h * per + i] for i in range(per)], adesc, bdesc, T.ptx.pred(1), 1, 1, 0,
                                  0 if gs.k_major else 1))
        # with a lag, waited for at the top of the step after next, before its slot is reloaded (``wait``
        # False: by the caller, after the row states that read A's tile beside the wgmmas)
        self.commit(wait=not st.lag if wait is None else wait)

    def rs(self, acc: tirx.Buffer, pf: tirx.Buffer, gs: GemmState, wait: bool = True) -> None:
        """``acc += P @ x`` on warpgroup MMA with P in registers: per k16 slice and 64-row half of
        this warpgroup one ``wgmma.mma_async.m64nNk16`` whose A operand is the 4 registers of P that
        mma.sync would take (the layouts agree) and whose B is the swizzled ``x`` tile (N-contiguous,
        transposed by the instruction); then a wait, before P's registers change."""
        st = self.st
        per = (gs.n_tile // 8) * 4
        n4 = st.nt * 4
        words = self.words(pf, st.ns)  # P as packed pairs
        op = self.op(gs.n_tile)
        T.evaluate(T.ptx.wgmma.fence.sync.aligned())
        for kt in range(st.p.step // 16):
            bdesc = self.mn_desc(gs, kt)
            for mi in range(st.mt):
                a = (mi * n4 + kt * 8) // 2
                T.evaluate(op(*[acc[mi * per + i] for i in range(per)], *[words[a + w] for w in range(4)], bdesc,
                              T.ptx.pred(1), 1, 1, 0 if gs.k_major else 1))
        self.commit(wait=wait)

    def scores(self, sacc: tirx.Buffer, qf: tirx.Buffer | None, base: tirx.PrimExpr, wait: bool = True) -> None:
        """The score tile ``A @ B^T`` on warpgroup MMA: B (K, [L, d] with d contiguous) from its
        swizzled ring slot, K-major, d in 64-wide bands of atoms; A (Q) from its swizzled tile
        (``reload_a``) or from the fragments held in registers (the rs form)."""
        st = self.st
        p, g = st.p, st.p.gemm
        kd, n4 = g.kp, st.nt * 4  # K padded to 16 (zero columns in shared memory)
        op = self.op(p.step)
        words = None if p.warp.reload_a else self.words(qf, st.mt * kd // 2)
        T.evaluate(T.ptx.wgmma.fence.sync.aligned())
        for kt in range(kd // 16):
            band, within = kt // 4, (kt % 4) * 16  # a 64-wide band of d, then 16 elements (32 B) into it
            bdesc = self.k_desc(st.sbase[g.b] + base + band * (p.step // 8) * SWIZZLE_ATOM + within)
            for mi in range(st.mt):
                acc = [sacc[mi * n4 + i] for i in range(n4)]
                if words is None:
                    atom = band * (p.rows // 8) + st.half_of(mi) * 8
                    adesc = self.k_desc(st.sbase[g.a] + atom * SWIZZLE_ATOM + within)
                    T.evaluate(op(*acc, adesc, bdesc, T.ptx.pred(1), 1, 1, 0, 0))
                else:
                    a = (mi * kd // 2 + kt * 8) // 2
                    T.evaluate(op(*acc, *[words[a + w] for w in range(4)], bdesc, T.ptx.pred(1), 1, 1, 0))
        self.commit(wait=wait)

    def op(self, n: int) -> Callable[..., tirx.PrimExpr]:
        """``wgmma.mma_async.sync.aligned.m64n{n}k16.f32`` with this kernel's input type (ss or rs
        form by the operands given)."""
        ab = "f16" if self.st.ab == "fp16" else "bf16"
        return getattr(getattr(getattr(T.ptx.wgmma.mma_async.sync.aligned, f"m64n{n}k16").f32, ab), ab)

    @staticmethod
    def commit(wait: bool) -> None:
        """Commit the issued wgmmas as a group; with ``wait`` wait for every group."""
        T.evaluate(T.ptx.wgmma.commit_group.sync.aligned())
        if wait:
            T.evaluate(T.ptx.wgmma.wait_group.sync.aligned(0))

    def words(self, frag: tirx.Buffer, halves: int) -> tirx.Buffer:
        """An fp16/bf16 fragment as packed 32-bit pairs: the registers of a wgmma rs-form A operand."""
        words = T.alloc_buffer((halves // 2,), "uint32", scope="local")
        pack = "__pack_half2" if self.st.ab == "fp16" else "__pack_nv_bfloat162"  # TVM's CUDA header defines both
        for i in range(halves // 2):
            T.buffer_store(words, tirx.call_extern("uint32", pack, frag[2 * i], frag[2 * i + 1]), [i])
        return words

    def mn_desc(self, gs: GemmState, kt: int) -> tirx.PrimExpr:
        """Descriptor of k16 slice ``kt`` of a GEMM state's swizzled ``x`` tile [k, n], N-contiguous
        (transposed by the instruction): 2 atoms down per slice, 64-column bands step * 128 B apart
        (LBO), 8-row atoms 1 KB apart (SBO).  A K-major tile [n, k] (``nn.Linear``'s weight) is read as
        the score GEMM's K is: 64-wide bands of k, each ``n_tile / 8`` atoms, the slice 32 B into its band."""
        tile = self.st.slot_tile(gs.x, self.st.slot)
        if gs.k_major:
            band, within = kt // 4, (kt % 4) * 16
            return self.k_desc(tile + band * (gs.n_tile // 8) * SWIZZLE_ATOM + within)
        return self.desc(tile + kt * 2 * SWIZZLE_ATOM, lbo=self.st.p.step * 128, sbo=2 * SWIZZLE_ATOM)

    def k_desc(self, elem: tirx.PrimExpr) -> tirx.PrimExpr:
        """Descriptor of a K-major swizzled operand (K within one 128 B atom row: LBO unused)."""
        return self.desc(elem, lbo=16, sbo=2 * SWIZZLE_ATOM)

    def desc(self, elem: tirx.PrimExpr, lbo: int, sbo: int) -> tirx.PrimExpr:
        """The 64-bit wgmma matrix descriptor of a 128-byte-swizzled tile at arena element ``elem``:
        start address, leading and stride byte offsets (16 B units), layout type 1 (128 B swizzle)."""
        addr = tirx.Cast("uint64", ((self.st.arena_addr[0] + elem * 2) >> 4) & 0x3FFF)
        return addr | tirx.const(((lbo >> 4) << 16) | ((sbo >> 4) << 32) | (1 << 62), "uint64")
