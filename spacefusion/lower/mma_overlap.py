"""FlashAttention-3's overlap inside the MMA warpgroups of a producer-fed attention kernel (a split
ring: K and V loaded and handed back apart).

Step ``j`` issues its score wgmma (K_j), then the previous step's ``P @ V`` (V_{j-1}, P kept in
registers) behind it, waits for the scores alone and hands K_j's slot back; the row states and P_j
run while that ``P @ V`` does, which is waited for (and V_{j-1}'s slot handed back) before the
accumulator's rescale.  With two MMA warpgroups they take turns issuing their GEMMs at a pair of
named barriers.  Step 0 is peeled before the loop (``st.j`` an int): no ``P @ V`` precedes it.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import tirx as T

from spacefusion.lower.mma_state import I32, KernelState
from spacefusion.lower.mma_tma import TmaRing
from spacefusion.lower.mma_wgmma import Wgmma

#: the named barriers (this and the next) at which two MMA warpgroups take turns issuing their GEMMs
TURN_BARRIER = 4


class Overlap:
    """The hand-overs between one step's GEMMs and the previous step's, over :class:`KernelState` ``st``."""

    def __init__(self, st: KernelState, tma: TmaRing, wgmma: Wgmma) -> None:
        self.st = st
        self.tma = tma
        self.wgmma = wgmma

    def peeled(self) -> bool:
        """Whether this is step 0, run before the loop: no ``P @ V`` comes before it."""
        return isinstance(self.st.j, int) and self.st.j == 0

    def phase(self, j: tirx.PrimExpr | int) -> tirx.PrimExpr | int:
        """The parity of the ring slot's barrier phase that step ``j`` completes."""
        stages = self.st.p.warp.stages
        return (j // stages) % 2 if isinstance(j, int) else tirx.floordiv(j, stages) % 2

    def issue_previous_pv(self, last: bool = False) -> None:
        """Behind this step's score wgmma (its group committed), the previous step's ``P @ V`` from the
        kept P once V_{j-1} has landed; then wait until the scores alone are done and hand K_j's slot
        back (``last``: only the ``P @ V``, after the loop)."""
        st, p = self.st, self.st.p
        (gs,) = p.gemm_states
        first = st.tid % 128 == 0
        if not self.peeled():
            slot, prev = st.slot, (st.j + p.warp.stages - 1) % p.warp.stages
            T.evaluate(T.cuda.mbarrier_wait(self.tma.full_v(prev), self.phase(st.j - 1)))
            st.slot = prev
            self.wgmma.rs(st.acc[gs.update.state], st.pf_keep, gs, wait=False)
            st.slot = slot
            if last:
                return
            self.pass_turn()
            T.evaluate(T.ptx.wgmma.wait_group.sync.aligned(1))
        else:
            self.pass_turn()
            T.evaluate(T.ptx.wgmma.wait_group.sync.aligned(0))
        with T.If(first):
            with T.Then():
                T.evaluate(T.ptx.mbarrier.arrive.shared.b64(self.tma.empty(st.slot)))

    def await_turn(self) -> None:
        """Two MMA warpgroups: wait until the other has issued its step's GEMMs (its named barrier of
        the pair's 256 threads), so that one's row states run while the other's GEMMs do
        (FlashAttention-3's ping-pong)."""
        if self.st.p.warps == 8:
            T.evaluate(T.ptx.bar.sync(tirx.Cast("uint32", TURN_BARRIER + self.st.warp // 4), T.uint32(256)))

    def pass_turn(self) -> None:
        """This warpgroup's GEMMs are issued: the other's turn (warpgroup 1's last step passes none,
        so every barrier's arrivals match its waits)."""
        st = self.st
        if st.p.warps != 8:
            return
        wg = st.warp // 4
        j = tirx.const(st.j, I32) if isinstance(st.j, int) else st.j
        with T.If(tirx.any(wg == 0, j < st.n - 1)):
            with T.Then():
                T.evaluate(T.ptx.bar.arrive(tirx.Cast("uint32", TURN_BARRIER + 1 - wg), T.uint32(256)))

    def await_previous_pv(self) -> None:
        """The previous step's ``P @ V`` done: V_{j-1}'s slot goes back to the producer (one arrival
        per warpgroup), and the accumulator may be rescaled and P overwritten."""
        st, p = self.st, self.st.p
        if self.peeled():
            return
        T.evaluate(T.ptx.wgmma.wait_group.sync.aligned(0))
        with T.If(st.tid % 128 == 0):
            with T.Then():
                prev = (st.j + p.warp.stages - 1) % p.warp.stages
                T.evaluate(T.ptx.mbarrier.arrive.shared.b64(self.tma.empty_v(prev)))
