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
(named barriers of 128 threads).  Attention's MMA warpgroups (each over its own 64-row halves) copy
Q themselves and run FlashAttention-3's order (:mod:`mma_overlap`): K and V come and go apart, each
step's row states overlap the previous step's P @ V, and two MMA warpgroups take turns issuing their
GEMMs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from tvm import tirx
from tvm.script.ir_builder import tirx as T

from schedulers.warp_tile import (
    CONSUMER_REGS,
    PRODUCER_REGS,
    PRODUCER_THREADS,
    moves_registers,
    split_ring,
    tma_streamed,
)
from spacefusion.lower.mma_block import Block
from spacefusion.lower.mma_out import Epilogue
from spacefusion.lower.mma_overlap import TURN_BARRIER, Overlap
from spacefusion.lower.mma_ring import Ring
from spacefusion.lower.mma_rows import RowUpdate
from spacefusion.lower.mma_state import I32, KernelState
from spacefusion.lower.mma_step import Step
from spacefusion.lower.mma_sync import MmaSync
from spacefusion.lower.mma_tma import TmaRing
from spacefusion.lower.mma_wgmma import Wgmma

#: the named barrier at which the MMA warpgroups meet once A (Q) has landed (0 is __syncthreads;
#: 1 and 2 are the warpgroups' output staging)
A_BARRIER = 3

if TYPE_CHECKING:
    #: the address of a ring slot's mbarrier
    Barrier = Callable[[tirx.PrimExpr | int], tirx.PrimExpr]


class WarpSpecialized:
    """The producer warpgroup and the MMA warpgroups of a TMA ring over :class:`KernelState` ``st``."""

    def __init__(self, st: KernelState, block: Block, ring: Ring, sync: MmaSync, wgmma: Wgmma, overlap: Overlap,
                 rows: RowUpdate, step: Step, epilogue: Epilogue) -> None:
        self.st = st
        self.block = block
        self.ring = ring
        self.tma: TmaRing = ring.tma
        self.sync = sync
        self.wgmma = wgmma
        self.overlap = overlap
        self.rows = rows
        self.step = step
        self.epilogue = epilogue

    def kernel(self, bid: tirx.PrimExpr) -> None:
        """The whole kernel: the arena and mbarriers, then the producer's and the MMA warpgroups'
        branches over this block's tiles ``bid, bid + blocks, ...``."""
        st, p = self.st, self.st.p
        mma_tid = st.tid - PRODUCER_THREADS
        group = 32 * p.warps  # the threads of one tile's MMA warpgroups
        self.block.threads(mma_tid % group if p.hopper.pingpong else mma_tid)
        st.mma_wg = mma_tid // group if p.hopper.pingpong else tirx.const(0, I32)  # whose tiles (pingpong)
        self.block.alloc()
        self.tma.init()
        st.lag = 1  # one wgmma group in flight: a slot goes back one step after its wgmma is issued
        two = moves_registers(p)
        with T.If(st.tid < PRODUCER_THREADS):
            with T.Then():
                if two:
                    T.evaluate(T.ptx.setmaxnreg.dec.sync.aligned.u32(PRODUCER_REGS))
                with T.If(st.tid == 0):
                    with T.Then():
                        self._over_tiles(bid, self._produce)
            with T.Else():
                if two:
                    T.evaluate(T.ptx.setmaxnreg.inc.sync.aligned.u32(CONSUMER_REGS))
                self._over_tiles(bid, self._consume, st.p.mma_groups)

    def _over_tiles(self, bid: tirx.PrimExpr, body: Callable[[tirx.PrimExpr, tirx.PrimExpr], None],
                    every: int = 1) -> None:
        """``body(kk, k)`` for this block's ``kk``-th tile, its coordinates set (persistent: every
        ``num_blocks``-th tile from ``bid``), ``k`` counting the calls: all of the block's tiles, or
        with ``every`` 2 (pingpong) those of this MMA warpgroup, every other one."""
        st, s = self.st, self.st.s
        if not st.p.hopper.persistent:
            self.block.coords(bid)
            body(tirx.const(0, I32), tirx.const(0, I32))
            return
        tiles, stride = st.num_tiles(), s.num_blocks  # the stride: the persistent grid's static block count
        if st.symbolic is None:
            per = -(-tiles // stride)
            count = -(-per // every)
        else:  # the tiles of a run-time row count: the loop's count from the argument too
            per = tirx.floordiv(tiles + (stride - 1), stride)
            count = tirx.floordiv(per + (every - 1), every)
        with T.serial(0, count) as k:
            kk = k * every + st.mma_wg if every > 1 else k
            t = bid + kk * stride
            with T.If(t < tiles):
                with T.Then():
                    self.block.coords(t)
                    body(kk, k)

    def _produce(self, k: tirx.PrimExpr, _: tirx.PrimExpr) -> None:
        """Thread 0 of the producer: load every step of tile ``k`` into the ring, each into a slot
        the MMA warpgroups have handed back (the first ``stages`` are free); under a killing mask
        (causal, a window) only the steps the row tile needs."""
        st, p = self.st, self.st.p
        lo, hi = (0, st.s.num_steps) if p.wgmma_ss else self.block.step_range(scan=False)
        n = hi - lo
        with T.serial(0, n) as j:
            it = k * n + j  # the block's running step count: slot and phase continue across tiles
            slot = it % p.warp.stages
            back = (tirx.floordiv(it, p.warp.stages) + 1) % 2  # the slot's previous use (step it - stages): that phase
            for names, empty, full in self._ring_parts():
                with T.If(it >= p.warp.stages):
                    with T.Then():
                        T.evaluate(T.cuda.mbarrier_wait(empty(slot), back))
                self.tma.step(slot, (lo + j) * p.step, None, names, full(slot))

    def _ring_parts(self) -> list[tuple[tuple[str, ...], Barrier, Barrier]]:
        """(tiles, empty barrier, full barrier) of each part of a ring slot the producer loads apart:
        all its tiles, or with a split ring the score GEMM's (K), then the GEMM states' (V)."""
        p = self.st.p
        names = tma_streamed(p)
        if not split_ring(p):
            return [(names, self.tma.empty, self.tma.full)]
        xs = {g.x for g in p.gemm_states}
        return [(tuple(n for n in names if n not in xs), self.tma.empty, self.tma.full),
                (tuple(n for n in names if n in xs), self.tma.empty_v, self.tma.full_v)]

    def _consume(self, k: tirx.PrimExpr, mine: tirx.PrimExpr) -> None:
        """The MMA warpgroups on the block's tile ``k`` (their ``mine``-th): per step wait for the
        slot, issue its wgmma, and hand the previous step's slot back once its wgmma is done; then
        store the outputs.  With ``pingpong`` a warpgroup's main loop waits until the other's on the
        tile before has ended: its ring slots are then this tile's, never still the other's (a slot's
        parity alone cannot tell uses two phases apart), and the two take turns at the tensor cores."""
        st = self.st
        if not st.p.wgmma_ss:
            self._consume_scores()
            return
        p, n = st.p, st.s.num_steps
        first = st.tid % 128 == 0  # one arrival per MMA warpgroup
        self.rows.init_states()  # accumulators at zero (and a norm's row statistics), per tile
        if p.hopper.pingpong:  # the other warpgroup's main loops so far complete this barrier's phases
            with T.If(k > 0):
                with T.Then():
                    T.evaluate(T.cuda.mbarrier_wait(self.tma.order(st.mma_wg), (mine + 1 + st.mma_wg) % 2))
        with T.serial(0, n) as j:
            it = k * n + j
            st.slot = it % p.warp.stages
            st.t0 = j * p.step
            T.evaluate(T.cuda.mbarrier_wait(self.tma.full(st.slot), tirx.floordiv(it, p.warp.stages) % 2))
            self.wgmma.step()
            if p.row_states:  # read from the slot beside its wgmmas, before the slot goes back (next step)
                self.step.row_statistics()
            T.evaluate(T.ptx.wgmma.wait_group.sync.aligned(1))
            with T.If(tirx.all(j > 0, first)):
                with T.Then():
                    prev = (it + p.warp.stages - 1) % p.warp.stages
                    T.evaluate(T.ptx.mbarrier.arrive.shared.b64(self.tma.empty(prev)))
        T.evaluate(T.ptx.wgmma.wait_group.sync.aligned(0))
        with T.If(first):
            with T.Then():
                T.evaluate(T.ptx.mbarrier.arrive.shared.b64(self.tma.empty((k * n + n - 1) % p.warp.stages)))
                if p.hopper.pingpong:  # the other warpgroup's next main loop may start
                    T.evaluate(T.ptx.mbarrier.arrive.shared.b64(self.tma.order(1 - st.mma_wg)))
        self.epilogue.finalize()

    def _consume_scores(self) -> None:
        """The MMA warpgroups of a program with a score GEMM (attention): their threads copy A (Q) by
        cp.async and meet at a named barrier of their own.  Then FlashAttention-3's intra-warpgroup
        overlap: step j issues its scores (K_j), then the previous step's ``P @ V`` (V_{j-1}, P kept in
        registers) behind them, waits for the scores alone (K_j's slot goes back), computes the row
        states and P_j while that ``P @ V`` runs, then waits for it (V_{j-1}'s slot goes back) before
        the accumulator's rescale.  Step 0 runs before the loop, so every step in it has a ``P @ V``
        before it (no branch between the wgmma groups for ptxas to serialise on); the last ``P @ V``
        runs after it."""
        st = self.st
        p, g = st.p, st.p.gemm
        (gs,) = p.gemm_states
        zero = tirx.const(0, I32)
        st.groups = 1  # one cp.async group: Q's
        self.rows.init_states()
        self.ring.copy_tile(g.a, zero, p.row, st.row0, g.k, zero)  # by the MMA warpgroups' threads
        if g.kp != g.kd:  # K run as a multiple of 16: zeros past its end (TMA zero-fills K's bands)
            self.ring.zero_columns(g.a, g.kd, g.kp, block=False)
        T.evaluate(T.ptx.cp.async_.commit_group())
        T.evaluate(T.ptx.cp.async_.wait_group(0))
        T.evaluate(T.ptx.fence.proxy.async_.shared__cta())  # wgmma reads Q through the async proxy
        T.evaluate(T.ptx.bar.sync(tirx.Cast("uint32", A_BARRIER), T.uint32(32 * p.warps)))
        qf = None if p.warp.reload_a else self.sync.a_fragments()
        st.pf_keep = T.alloc_buffer((st.ns,), st.half, scope="local")  # P, until the next step
        st.lo, hi = self.block.step_range(scan=False)
        n = hi - st.lo
        st.n = n
        if p.warps == 8:  # warpgroup 0 takes the first turn
            with T.If(st.warp // 4 == 1):
                with T.Then():
                    T.evaluate(T.ptx.bar.arrive(tirx.Cast("uint32", TURN_BARRIER), T.uint32(256)))
        self._consumer_step(0, qf)
        with T.serial(1, n) as j:
            self._consumer_step(j, qf)
        st.j = n
        self.overlap.issue_previous_pv(last=True)
        self.overlap.await_previous_pv()
        self.epilogue.finalize()

    def _consumer_step(self, j: tirx.PrimExpr | int, qf: tirx.Buffer | None) -> None:
        """Step ``j`` of the MMA warpgroups: wait for its K, run it."""
        st, p = self.st, self.st.p
        st.j, st.slot, st.t0 = j, j % p.warp.stages, (st.lo + j) * p.step
        T.evaluate(T.cuda.mbarrier_wait(self.tma.full(st.slot), self.overlap.phase(j)))
        self.step.masked(qf)
