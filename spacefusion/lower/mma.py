"""Warp-tile program -> TensorIR on tensor cores (mma.sync, ldmatrix, cp.async; wgmma, TMA).

The kernel is FlashAttention-2's shape, read off the schedule: one thread block per
(batch coordinates, row tile), 16 rows per warp; per serial step the streamed input
tiles arrive by cp.async into a ``stages``-deep ring of padded shared buffers; the
score tile is an ``mma.sync.m16n8k16`` GEMM (or a staged input read by ``ldmatrix``)
held in the accumulator layout, where each thread owns rows ``g`` and ``g + 8`` of
its warp's 16 and two adjacent columns per 8-column tile.  Element-wise ops and the
derived update functions are evaluated on those registers; row statistics combine
over the 4 threads of a quad with shuffles; the second GEMM takes the factor tile as
fp16 A fragments straight from the accumulator layout (the two layouts agree) and
the other operand through ``ldmatrix.trans``.  Every value comes from the plan's
sympy expressions: nothing here names attention or softmax.

The generator is split by the kernel's phases, each a small object over one shared
:class:`~spacefusion.lower.mma_state.KernelState`: block set-up (:mod:`mma_block`), the ring
loader (:mod:`mma_ring`, :mod:`mma_tma`), the MMA (:mod:`mma_sync`, :mod:`mma_wgmma`), one
step (:mod:`mma_step`) and its state updates (:mod:`mma_rows`), the epilogue (:mod:`mma_out`),
and the warp-specialised producer (:mod:`mma_ws`, :mod:`mma_overlap`).  This module wires them
and emits the main loop of the kernels without a producer warpgroup.
"""

from __future__ import annotations

from contextlib import ExitStack

from tvm import tirx
from tvm.script import ir_builder as IB
from tvm.script.ir_builder import tirx as T

from schedulers.schedule import Schedule
from schedulers.warp_tile import WarpTileProgram, warp_tile_program
from spacefusion.lower.mma_block import TIR_OPS, Block, row_tile_order
from spacefusion.lower.mma_out import Epilogue
from spacefusion.lower.mma_overlap import Overlap
from spacefusion.lower.mma_ring import Ring
from spacefusion.lower.mma_rows import RowUpdate
from spacefusion.lower.mma_state import I32, KernelState
from spacefusion.lower.mma_step import Step, tile_kept
from spacefusion.lower.mma_sync import MmaSync
from spacefusion.lower.mma_tma import TmaRing
from spacefusion.lower.mma_values import Values
from spacefusion.lower.mma_wgmma import Wgmma
from spacefusion.lower.mma_ws import WarpSpecialized
from spacefusion.lower.symbolic import SymbolicDim
from spacefusion.lower.symbolic import check as check_symbolic
from spacefusion.lower.tir import signature


class Kernel:
    """One warp-tile kernel: the shared state and the phases that emit it."""

    def __init__(self, s: Schedule, p: WarpTileProgram, symbolic: SymbolicDim | None = None) -> None:
        st = self.st = KernelState(s, p, symbolic)
        self.values = Values(st)
        self.block = Block(st)
        self.tma = TmaRing(st)
        self.ring = Ring(st, self.tma)
        self.sync = MmaSync(st)
        self.wgmma = Wgmma(st)
        self.overlap = Overlap(st, self.tma, self.wgmma)
        self.rows = RowUpdate(st, self.values, self.sync, self.wgmma, self.overlap)
        self.step = Step(st, self.values, self.sync, self.wgmma, self.overlap, self.rows)
        self.epilogue = Epilogue(st, self.values)
        self.ws = WarpSpecialized(st, self.block, self.ring, self.sync, self.wgmma, self.overlap, self.rows,
                                  self.step, self.epilogue)

    def build(self) -> tirx.PrimFunc:
        """The PrimFunc: parameters, then a block per work tile, its threads bound."""
        st = self.st
        s, p = st.s, st.p
        with IB.IRBuilder() as ib:
            with T.prim_func():
                T.func_name("main")
                for name, shape, dtype, role in signature(s).params:
                    if st.symbolic is not None and role in ("input", "output"):  # the row dim's extent: its argument
                        shape = tuple(st.sizes[d] for d in s.smg.space(name).dims)
                    st.glob[name] = T.arg(name, T.buffer(shape, dtype))
                T.func_attr({"global_symbol": "main", "tirx.noalias": True})
                with T.thread_binding(0, st.num_blocks(), thread="blockIdx.x") as bid:
                    with T.thread_binding(0, p.threads, thread="threadIdx.x") as tid:
                        st.tid = tid
                        if p.hopper.producer:
                            self.ws.kernel(bid)
                        else:
                            self.block.threads(tid)
                            self.block.coords(bid)
                            self._body()
        return ib.get()

    def _body(self) -> None:
        """The kernel without a producer warpgroup: the ring run ahead by every thread, one barrier
        per step, then the warp groups' or slices' merge and the outputs."""
        st, ring = self.st, self.ring
        p = st.p
        # cp.async groups per step: with early_scores the score tile's operands and the second GEMM's,
        # waited for one after the other (FlashAttention-2's order)
        st.groups = 2 if p.warp.early_scores else 1
        self.block.alloc()
        if p.hopper.tma:
            self.tma.init()
        if p.gemm is not None and p.gemm.kp != p.gemm.kd:  # K run as a multiple of 16: zeros past its end
            for name in (p.gemm.a,) if p.hopper.tma else (p.gemm.a, p.gemm.b):
                ring.zero_columns(name, p.gemm.kd, p.gemm.kp)
        zero = tirx.const(0, I32)
        self.rows.init_states()
        qf = None
        held = p.gemm is not None and not p.warp.reload_a
        if p.gemm is not None:  # its load overlaps the ring's first tiles' (read into registers after
            g = p.gemm  # them or, with reload_a, every step)
            ring.copy_tile(g.a, zero, p.row, st.row0, g.k, zero, block=True)
            T.evaluate(T.ptx.cp.async_.commit_group())
        st.first, nsteps = self.block.step_range()
        if p.warp.slices > 1:  # this block's contiguous range of steps (empty outside a mask's bounds), which
            per = st.s.steps_per_block  # its warp groups (split) interleave
            nsteps = tirx.min(nsteps, st.slice * per + per)
            st.first = tirx.max(st.first, st.slice * per)
        iters = tirx.max(nsteps - st.first, 0)
        if p.warp.split > 1:  # every group runs the same iteration count (the block-wide barriers), idle past the end
            iters = tirx.floordiv(iters + (p.warp.split - 1), p.warp.split)
        # warpgroup MMA in a ring of 3+ leaves one step's wgmma group in flight while the next step
        # waits and loads: the load then reuses the slot of two steps back, one step less ahead
        st.lag = 1 if p.wgmma_ss and p.warp.stages >= 3 else 0
        dist = p.warp.stages - 1 - st.lag
        for pre in range(dist):
            ring.issue_step(tirx.const(pre, I32), ring.step_of(tirx.const(pre, I32)) < nsteps)
        if p.hopper.tma and p.gemm is not None and not held:  # the ring commits no cp.async group: wait for the A
            T.evaluate(T.ptx.cp.async_.wait_group(0))  # tile here, for the async proxy (wgmma) to read
            T.evaluate(T.ptx.fence.proxy.async_.shared__cta())
            T.evaluate(T.tvm_storage_sync("shared"))
        if held:  # the A operand stays in registers for the whole loop; its group is the oldest
            T.evaluate(T.ptx.cp.async_.wait_group(0 if p.hopper.tma else st.groups * (p.warp.stages - 1)))
            T.evaluate(T.tvm_storage_sync("shared"))
            qf = self.sync.a_fragments()
        with T.serial(0, iters) as j:
            ahead = j + dist
            pred = ring.step_of(ahead) < nsteps if p.warp.stages > 1 or p.warp.split > 1 else None
            if p.warp.stages == 1:  # no ring: load, wait, compute, and every warp done before the next load
                ring.issue_step(ahead, pred)
                ring.wait_tiles(j, 0)
                T.evaluate(T.tvm_storage_sync("shared"))
            else:  # one barrier per step: it publishes tile j to every warp and frees the slot of
                # tile j - 1 (all warps are past its compute), which the load of tile j + stages - 1 reuses
                ring.wait_tiles(j, st.groups * dist - 1)
                if st.lag:  # the wgmma of two steps back is done (its slot is reloaded below)
                    T.evaluate(T.ptx.wgmma.wait_group.sync.aligned(st.lag))
                T.evaluate(T.tvm_storage_sync("shared"))
                ring.issue_step(ahead, pred)
            st.t0 = ring.step_of(j) * p.step
            st.slot = ring.slot_for(j)
            with ExitStack() as busy:
                if p.warp.split > 1:
                    busy.enter_context(T.If(ring.step_of(j) < nsteps))
                    busy.enter_context(T.Then())
                self.step.masked(qf)
            if p.warp.stages == 1:
                T.evaluate(T.tvm_storage_sync("shared"))
        if st.lag:  # the last steps' accumulators
            T.evaluate(T.ptx.wgmma.wait_group.sync.aligned(0))
        T.evaluate(T.tvm_storage_sync("shared"))  # the merge's hand-over lies over the ring
        if p.warp.slices > 1:  # warp groups too (split) leave their parts in the workspace
            self.epilogue.merge_slices()
        elif p.warp.split > 1:
            self.epilogue.merge()
        else:
            self.epilogue.finalize()


def build_warp_tile(s: Schedule, symbolic: SymbolicDim | None = None) -> tirx.PrimFunc:
    """The PrimFunc of the warp-tile program of ``s`` (CUDA only); with ``symbolic`` (which
    ``symbolic.check`` accepts) the row dim's size is its int32 argument ``symbolic.var``."""
    if symbolic is not None:
        check_symbolic(s, symbolic)
    return Kernel(s, warp_tile_program(s), symbolic).build()


__all__ = ["TIR_OPS", "Kernel", "build_warp_tile", "row_tile_order", "tile_kept"]
