"""Warp specialisation of a TMA ring (``producer``): a GEMM's, optionally persistent (``persistent``),
or attention's K/V.

Warpgroup 0 is the producer: its thread 0 walks the block's tiles and their steps, waits until the
MMA warpgroups have handed a ring slot back (the slot's *empty* mbarrier, one arrival per MMA
warpgroup) and loads the step's A tile and B bands into it by TMA (the slot's *full* mbarrier
counts the bytes).  The other warpgroups run the wgmma of each step as soon as its slot is full,
keep one wgmma group in flight and hand the slot of the step before back.  No block-wide barrier
sits in the loop, so the loads run ``stages - 1`` steps ahead of the tensor cores by themselves, and
in a persistent block on into the next tile while the MMA warpgroups store this one's outputs.
Each MMA warpgroup stores its own rows, one 64-column band at a time through its own staging area
(named barriers of 128 threads).  Hand-written probe of the same structure: H100, 8192^2 x 1024
fp16 GEMM, 128 x 256 tiles, 4 stages, 132 persistent blocks: 204 us against cuBLAS's 194-203.
Attention's MMA warpgroups (each over its own 64-row halves) copy Q themselves and run
FlashAttention-3's order: K and V come and go apart, each step's row states overlap the previous
step's P @ V, and two MMA warpgroups take turns issuing their GEMMs (``_consume_scores``).

A mixin of ``mma._Gen``: it reads the generator's arena, mbarriers, coordinates and wgmma step.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import tirx as T

from schedulers.warp_tile import (
    BAND,
    CHUNK,
    CONSUMER_REGS,
    PAD,
    PRODUCER_REGS,
    PRODUCER_THREADS,
    GemmState,
    moves_registers,
    split_ring,
    tma_streamed,
)
from spacefusion.lower.mma_out import I32, _f

#: the named barrier at which the MMA warpgroups meet once A (Q) has landed (0 is __syncthreads;
#: 1 and 2 are the warpgroups' output staging)
A_BARRIER = 3
#: the named barriers (this and the next) at which two MMA warpgroups take turns issuing their GEMMs
TURN_BARRIER = 4


class _WarpSpecialized:
    def _ws_kernel(self, bid: tirx.PrimExpr) -> None:
        """The whole kernel: the arena and mbarriers, then the producer's and the MMA warpgroups'
        branches over this block's tiles ``bid, bid + blocks, ...``."""
        p = self.p
        mma_tid = self.tid - PRODUCER_THREADS
        group = 32 * p.warps  # the threads of one tile's MMA warpgroups
        self._threads(mma_tid % group if p.pingpong else mma_tid)
        self.mma_wg = mma_tid // group if p.pingpong else tirx.const(0, I32)  # whose tiles (pingpong)
        self._alloc()
        self._tma_init()
        self.lag = 1  # one wgmma group in flight: a slot goes back one step after its wgmma is issued
        two = moves_registers(p)
        with T.If(self.tid < PRODUCER_THREADS):
            with T.Then():
                if two:
                    T.evaluate(T.ptx.setmaxnreg.dec.sync.aligned.u32(PRODUCER_REGS))
                with T.If(self.tid == 0):
                    with T.Then():
                        self._over_tiles(bid, self._produce)
            with T.Else():
                if two:
                    T.evaluate(T.ptx.setmaxnreg.inc.sync.aligned.u32(CONSUMER_REGS))
                self._over_tiles(bid, self._consume, self.p.mma_groups)

    def _over_tiles(self, bid: tirx.PrimExpr, body, every: int = 1) -> None:
        """``body(kk, k)`` for this block's ``kk``-th tile, its coordinates set (persistent: every
        ``num_blocks``-th tile from ``bid``), ``k`` counting the calls: all of the block's tiles, or
        with ``every`` 2 (pingpong) those of this MMA warpgroup, every other one."""
        s = self.s
        if not self.p.persistent:
            self._coords(bid)
            body(tirx.const(0, I32), tirx.const(0, I32))
            return
        per = -(-s.num_tiles // s.num_blocks)
        with T.serial(0, -(-per // every)) as k:
            kk = k * every + self.mma_wg if every > 1 else k
            t = bid + kk * s.num_blocks
            with T.If(t < s.num_tiles):
                with T.Then():
                    self._coords(t)
                    body(kk, k)

    def _produce(self, k: tirx.PrimExpr, _: tirx.PrimExpr) -> None:
        """Thread 0 of the producer: load every step of tile ``k`` into the ring, each into a slot
        the MMA warpgroups have handed back (the first ``stages`` are free); under a killing mask
        (causal, a window) only the steps the row tile needs."""
        p = self.p
        lo, hi = (0, self.s.num_steps) if p.wgmma_ss else self._step_range()
        n = hi - lo
        with T.serial(0, n) as j:
            it = k * n + j  # the block's running step count: slot and phase continue across tiles
            slot = it % p.stages
            back = (tirx.floordiv(it, p.stages) + 1) % 2  # the slot's previous use (step it - stages): that phase
            for names, empty, full in self._ring_parts():
                with T.If(it >= p.stages):
                    with T.Then():
                        T.evaluate(T.cuda.mbarrier_wait(empty(slot), back))
                self._tma_step(slot, (lo + j) * p.step, None, names, full(slot))

    def _ring_parts(self) -> list[tuple[tuple[str, ...], object, object]]:
        """(tiles, empty barrier, full barrier) of each part of a ring slot the producer loads apart:
        all its tiles, or with a split ring the score GEMM's (K), then the GEMM states' (V)."""
        p = self.p
        names = tma_streamed(p)
        if not split_ring(p):
            return [(names, self._empty, self._mbar)]
        xs = {g.x for g in p.gemm_states}
        return [(tuple(n for n in names if n not in xs), self._empty, self._mbar),
                (tuple(n for n in names if n in xs), self._empty_v, self._full_v)]

    def _consume(self, k: tirx.PrimExpr, mine: tirx.PrimExpr) -> None:
        """The MMA warpgroups on the block's tile ``k`` (their ``mine``-th): per step wait for the
        slot, issue its wgmma, and hand the previous step's slot back once its wgmma is done; then
        store the outputs.  With ``pingpong`` a warpgroup's main loop waits until the other's on the
        tile before has ended: its ring slots are then this tile's, never still the other's (a slot's
        parity alone cannot tell uses two phases apart), and the two take turns at the tensor cores."""
        if not self.p.wgmma_ss:
            self._consume_scores()
            return
        p, n = self.p, self.s.num_steps
        first = self.tid % 128 == 0  # one arrival per MMA warpgroup
        for buf in self.acc.values():
            for i in range(int(buf.shape[0])):
                T.buffer_store(buf, _f(0.0), [i])
        if p.pingpong:  # the other warpgroup's main loops so far complete this barrier's phases
            with T.If(k > 0):
                with T.Then():
                    T.evaluate(T.cuda.mbarrier_wait(self._order(self.mma_wg), (mine + 1 + self.mma_wg) % 2))
        with T.serial(0, n) as j:
            it = k * n + j
            self.slot = it % p.stages
            self.t0 = j * p.step
            T.evaluate(T.cuda.mbarrier_wait(self._mbar(self.slot), tirx.floordiv(it, p.stages) % 2))
            self._wgmma_step()
            T.evaluate(T.ptx.wgmma.wait_group.sync.aligned(1))
            with T.If(tirx.all(j > 0, first)):
                with T.Then():
                    T.evaluate(T.ptx.mbarrier.arrive.shared.b64(self._empty((it + p.stages - 1) % p.stages)))
        T.evaluate(T.ptx.wgmma.wait_group.sync.aligned(0))
        with T.If(first):
            with T.Then():
                T.evaluate(T.ptx.mbarrier.arrive.shared.b64(self._empty((k * n + n - 1) % p.stages)))
                if p.pingpong:  # the other warpgroup's next main loop may start
                    T.evaluate(T.ptx.mbarrier.arrive.shared.b64(self._order(1 - self.mma_wg)))
        self._finalize()

    def _consume_scores(self) -> None:
        """The MMA warpgroups of a program with a score GEMM (attention): their threads copy A (Q) by
        cp.async and meet at a named barrier of their own.  Then FlashAttention-3's intra-warpgroup
        overlap: step j issues its scores (K_j), then the previous step's ``P @ V`` (V_{j-1}, P kept in
        registers) behind them, waits for the scores alone (K_j's slot goes back), computes the row
        states and P_j while that ``P @ V`` runs, then waits for it (V_{j-1}'s slot goes back) before
        the accumulator's rescale.  Step 0 runs before the loop, so every step in it has a ``P @ V``
        before it (no branch between the wgmma groups for ptxas to serialise on); the last ``P @ V``
        runs after it."""
        p, g = self.p, self.p.gemm
        (gs,) = p.gemm_states
        zero = tirx.const(0, I32)
        self.groups = 1  # one cp.async group: Q's
        self._init_states()
        self.copy_tile(g.a, zero, p.row, self.row0, g.k, zero)  # by the MMA warpgroups' threads
        T.evaluate(T.ptx.cp.async_.commit_group())
        T.evaluate(T.ptx.cp.async_.wait_group(0))
        T.evaluate(T.ptx.fence.proxy.async_.shared__cta())  # wgmma reads Q through the async proxy
        T.evaluate(T.ptx.bar.sync(tirx.Cast("uint32", A_BARRIER), T.uint32(32 * p.warps)))
        qf = None if p.reload_a else self._a_fragments()
        self.pf_keep = T.alloc_buffer((self.ns,), self.half, scope="local")  # P, until the next step
        self.lo, hi = self._step_range()
        n = hi - self.lo
        self.n = n
        if p.warps == 8:  # warpgroup 0 takes the first turn
            with T.If(self.warp // 4 == 1):
                with T.Then():
                    T.evaluate(T.ptx.bar.arrive(tirx.Cast("uint32", TURN_BARRIER), T.uint32(256)))
        self._consumer_step(0, qf)
        with T.serial(1, n) as j:
            self._consumer_step(j, qf)
        self.j = n
        self._issue_previous_pv(last=True)
        self._await_previous_pv()
        self._finalize()

    def _consumer_step(self, j: tirx.PrimExpr | int, qf: tirx.Buffer | None) -> None:
        """Step ``j`` of the MMA warpgroups: wait for its K, run it."""
        p = self.p
        self.j, self.slot, self.t0 = j, j % p.stages, (self.lo + j) * p.step
        T.evaluate(T.cuda.mbarrier_wait(self._mbar(self.slot), self._phase(j)))
        self._step_masked(qf)

    def _peeled(self) -> bool:
        """Whether this is step 0, run before the loop: no ``P @ V`` comes before it."""
        return isinstance(self.j, int) and self.j == 0

    def _phase(self, j: tirx.PrimExpr | int) -> tirx.PrimExpr | int:
        """The parity of the ring slot's barrier phase that step ``j`` completes."""
        return (j // self.p.stages) % 2 if isinstance(j, int) else tirx.floordiv(j, self.p.stages) % 2

    def _issue_previous_pv(self, last: bool = False) -> None:
        """Behind this step's score wgmma (its group committed), the previous step's ``P @ V`` from the
        kept P once V_{j-1} has landed; then wait until the scores alone are done and hand K_j's slot
        back (``last``: only the ``P @ V``, after the loop)."""
        p = self.p
        (gs,) = p.gemm_states
        first = self.tid % 128 == 0
        if not self._peeled():
            slot, prev = self.slot, (self.j + p.stages - 1) % p.stages
            T.evaluate(T.cuda.mbarrier_wait(self._full_v(prev), self._phase(self.j - 1)))
            self.slot = prev
            self._wgmma_rs(self.acc[gs.update.state], self.pf_keep, gs, wait=False)
            self.slot = slot
            if last:
                return
            self._pass_turn()
            T.evaluate(T.ptx.wgmma.wait_group.sync.aligned(1))
        else:
            self._pass_turn()
            T.evaluate(T.ptx.wgmma.wait_group.sync.aligned(0))
        with T.If(first):
            with T.Then():
                T.evaluate(T.ptx.mbarrier.arrive.shared.b64(self._empty(self.slot)))

    def _await_turn(self) -> None:
        """Two MMA warpgroups: wait until the other has issued its step's GEMMs (its named barrier of
        the pair's 256 threads), so that one's row states run while the other's GEMMs do
        (FlashAttention-3's ping-pong)."""
        if self.p.warps == 8:
            T.evaluate(T.ptx.bar.sync(tirx.Cast("uint32", TURN_BARRIER + self.warp // 4), T.uint32(256)))

    def _pass_turn(self) -> None:
        """This warpgroup's GEMMs are issued: the other's turn (warpgroup 1's last step passes none,
        so every barrier's arrivals match its waits)."""
        if self.p.warps != 8:
            return
        wg = self.warp // 4
        j = tirx.const(self.j, I32) if isinstance(self.j, int) else self.j
        with T.If(tirx.any(wg == 0, j < self.n - 1)):
            with T.Then():
                T.evaluate(T.ptx.bar.arrive(tirx.Cast("uint32", TURN_BARRIER + 1 - wg), T.uint32(256)))

    def _await_previous_pv(self) -> None:
        """The previous step's ``P @ V`` done: V_{j-1}'s slot goes back to the producer (one arrival
        per warpgroup), and the accumulator may be rescaled and P overwritten."""
        p = self.p
        if self._peeled():
            return
        T.evaluate(T.ptx.wgmma.wait_group.sync.aligned(0))
        with T.If(self.tid % 128 == 0):
            with T.Then():
                prev = (self.j + p.stages - 1) % p.stages
                T.evaluate(T.ptx.mbarrier.arrive.shared.b64(self._empty_v(prev)))

    def _order(self, wg: tirx.PrimExpr) -> tirx.PrimExpr:
        """Address of the mbarrier that lets MMA warpgroup ``wg`` start its next main loop (pingpong)."""
        return self._mbar(2 * self.p.stages + wg)

    def _store_bands(self, out: str, text: str, gs: GemmState) -> None:
        """Store output ``out`` of this MMA warpgroup's rows one ``BAND``-column band at a time: its
        threads write their column pairs of the band into the warpgroup's staging area, then copy
        whole 16-byte chunks of its rows out; a named barrier of the warpgroup's 128 threads
        between (the producer warpgroup runs on meanwhile)."""
        p = self.p
        per = (gs.n_tile // 8) * 4
        acc = self.acc[gs.update.state]
        wg = self.warp // 4  # which rows of the tile
        wrows = 64 * p.warp_mtiles  # this warpgroup's rows: its 64-row halves
        stride = BAND + PAD
        mine = wg + self.mma_wg  # its staging area and named barrier (one of the two is 0)
        base = self.stage_base + mine * wrows * stride
        bar = tirx.Cast("uint32", 1 + mine)  # named barrier 0 is __syncthreads
        for band in range(-(-gs.n_tile // BAND)):  # the last band partial where N is not whole bands (d = 96)
            per_row = min(BAND, gs.n_tile - band * BAND) // CHUNK
            for i in range(0, int(acc.shape[0]), 2):  # elements i, i + 1: columns 2t, 2t + 1 of one row
                if ((i % per) // 4) * 8 // BAND != band:
                    continue
                h = self.slot_of(i, per)
                r = self.row_of(h) - self.row0 - wg * wrows
                off = base + r * stride + self.col_of(i, per) - band * BAND
                self._stage_pair(gs, text, i, off)
            T.evaluate(T.ptx.bar.sync(bar, T.uint32(128)))
            with T.serial(0, wrows * per_row // 128) as it:
                c = it * 128 + self.tid % 128
                r, cc = c // per_row, (c % per_row) * CHUNK
                self._store_chunk(out, gs, self.row0 + wg * wrows + r, self.col0(gs.n) + band * BAND + cc,
                                  base + r * stride + cc, [])
            T.evaluate(T.ptx.bar.sync(bar, T.uint32(128)))
