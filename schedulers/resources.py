"""Per-block resources of a Schedule as the lowering will emit it (no TVM needed).

The search prunes with these before building anything: static shared memory
(staged input tiles in their dtype, cooperatively computed tiles in fp32),
threads, and an estimate of registers per thread from the per-thread local
buffers (accumulators, streamed tiles, snapshots of running states).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from schedulers.halo import halo_elements, window_box
from schedulers.hardware import HardwareModel, ResourceError
from schedulers.memo import per_schedule
from schedulers.options import MAX_UNROLL
from schedulers.schedule import Schedule
from schedulers.temporal import TemporalPlan
from smg.expr import parse
from smg.ir import itemsize

#: registers a thread needs besides its local buffers (indices, pointers, temporaries)
BASE_REGISTERS = 32
MAX_REGISTERS = 255  # per thread on every NVIDIA GPU since Kepler; beyond it values spill
#: registers of one block on every NVIDIA GPU since Kepler: a kernel compiled with ``__launch_bounds__(threads)``
#: (TVM emits it) gets at most this share per thread, to the allocation unit of 8 (64 at 1024 threads)
REGS_PER_BLOCK = 65536
SPILL_SLACK = 40  # registers the estimate may exceed the limit by before the cost model charges spills
#: the same for a warp-tile (tensor-core) program, whose estimate is fitted to nvcc's counts
#: (``warp_tile_registers``, 90% within 23): on the corpus (experiments/tuning/register_corpus.json) this
#: charges 135 of the 143 kernels nvcc spilled (all but one of those spilling 256 B or more) and 3 of the
#: 610 it compiled without spills (no slack: 137 and 10; the CUDA-core 40: 123 and 0)
WARP_TILE_SPILL_SLACK = 16


def shared_bytes(s: Schedule, align: int = 1) -> int:
    """Shared memory of the generated kernel (each buffer rounded up to ``align`` bytes)."""
    total = 0
    sizes = s.smg.dim_sizes
    for name, lvl in s.memory:
        if lvl == "shared":
            if window_box(s.smg, name) is not None:  # a window's input: its halo box
                n = halo_elements(s.smg, name, s.tiles, s.serial, s.step)
            else:
                n = math.prod(s.tiles[d] if d in s.tiles else s.step if d == s.serial else sizes[d]
                              for d in s.smg.space(name).dims)
            nbytes = n * (itemsize(s.smg.space(name).dtype) if name in s.smg.inputs else 4)
            total += -(-nbytes // align) * align
    if s.lanes > 32 and s.warp_tile is None:  # the warps' partial results of a cross-warp reduction
        total += -(-(s.threads // 32 * 4) // align) * align
    if s.cluster > 1 and s.warp_tile is None:  # the block's result the cluster's blocks read, and their total
        total += -(-8 // align) * align
    return total


def launch_cap(threads: int) -> int:
    """Registers ptxas may give a thread of a ``threads``-thread block: ``__launch_bounds__`` caps it at the
    block's even share of the register file, so a 1024-thread CUDA-core kernel spills above 64."""
    return min(MAX_REGISTERS, REGS_PER_BLOCK // threads // 8 * 8)


def live_loads(s: Schedule) -> int:
    """Registers a thread holds for the step's unrolled reads of inputs that several ops read: ptxas loads
    such an element once and keeps it until its last reader (a gated GEMV's ``X`` read by the gate's and the
    up projection's reduction, a softmax's row read by its max, sum and output), so a step whose runs are
    unrolled (vector runs, or the ``unroll`` knob) holds every run's copy at once.  Why: LLaMA-2-7B's decode
    gate/up GEMV walking K in one unrolled step of 4096 (16 runs of 8 halves a lane, 1024 threads) spilled
    364 B a thread and ran 99 us against 62 for steps of 1024; the local-buffer count alone gave both 34
    registers.  On the CUDA-core corpus (``experiments/tuning/simt_register_corpus.json``, ``--simt``) this
    term flags 12 of the 13 kernels ptxas spilled 64 B or more; without it, none."""
    if s.warp_tile is not None or s.serial is None:
        return 0
    lane_step = -(-s.step // s.row_lanes)
    vec = s.vector
    if vec > 1:
        runs, unrolled = lane_step // vec, lane_step // vec <= MAX_UNROLL
    else:
        runs, unrolled = lane_step, bool(s.simt.unroll)
    if not unrolled or runs <= 1:
        return 0
    total = 0
    for name in s.smg.inputs:
        space = s.smg.space(name)
        readers = sum(1 for op in s.smg.ops for a in op.inputs if a.space == name)
        if readers > 1 and s.serial in space.dims:
            total += runs * max(1, vec * itemsize(space.dtype) // 4)
    return total


def local_floats(s: Schedule) -> int:
    """fp32 values each thread keeps in local buffers (registers, or spilled)."""
    sizes = s.smg.dim_sizes
    cut = set(s.tiles)

    lane_step = -(-s.step // s.row_lanes)  # a lane keeps only its own serial elements (of its cluster's row)

    def per_thread(space: str) -> int:
        dims = s.smg.space(space.split("__")[0]).dims
        return math.prod(lane_step if d == s.serial else sizes[d] for d in dims if d not in cut)

    names = [u.state for u in s.plan.states]
    names += [n for n in s.plan.streamed if s.level(n) != "shared"]
    names += _snapshots(s.plan)
    return sum(per_thread(n) for n in names)


@functools.lru_cache(maxsize=1024)
def _snapshots(plan: TemporalPlan) -> tuple[str, ...]:
    """The running states a plan's carries read as they were before the step (``x__old``): each a local
    buffer.  Cached per plan (a search's candidates share a few), since parsing the carries is sympy's."""
    return tuple(sorted({x.name for u in plan.states for x in parse(u.carry or "0").free_symbols
                         if x.name.endswith("__old")}))


@dataclass(frozen=True)
class BlockResources:
    threads: int
    shared_bytes: int
    local_floats: int
    #: registers a thread may hold before its values spill: 255, or what ``setmaxnreg`` gives the MMA
    #: warpgroups of a warp-specialised block
    register_cap: int = MAX_REGISTERS
    #: registers per thread the block launches with, when not the estimate (``setmaxnreg`` moves them later)
    launch_registers: int | None = None
    #: registers the estimate may pass ``register_cap`` by before ``likely_spilled_floats`` counts them
    spill_slack: int = SPILL_SLACK
    #: registers of loads kept live across the step's ops (``live_loads``): counted exactly, so no slack
    live_loads: int = 0

    @property
    def registers_per_thread(self) -> int:
        """What a thread launches with: the estimate (above the cap the buffers spill to local memory)."""
        if self.launch_registers is not None:
            return self.launch_registers
        return min(self.register_cap, self.registers_estimate)

    @property
    def registers_estimate(self) -> int:
        """The estimate before the cap."""
        return BASE_REGISTERS + self.local_floats + self.live_loads

    @property
    def spills(self) -> bool:
        return self.registers_estimate > self.register_cap

    @property
    def likely_spilled_floats(self) -> int:
        """Values per thread that surely go to local memory: the part of the estimate beyond the limit plus
        ``spill_slack``.  A CUDA-core kernel's estimate counts every local buffer (it runs up to ~55 above
        what nvcc allocates), so 40 of slack; a warp-tile program's is fitted to nvcc's counts, so 16.  The
        slack covers the local buffers' overcount only where no loads are held live: ``live_loads`` are counted
        as ptxas keeps them, and beside them it has no room to spare (on the CUDA-core corpus, counting the
        local buffers whole there flags 12 of the 13 kernels ptxas spilled 64 B or more, against 11, and no
        other kernel)."""
        local = self.local_floats if self.live_loads else max(0, self.local_floats - self.spill_slack)
        return max(0, BASE_REGISTERS + local + self.live_loads - self.register_cap)


@per_schedule  # derived once per candidate: the resource check and the estimate both read it
def block_resources(s: Schedule) -> BlockResources:
    p = s.warp_tile
    if p is not None:  # tensor-core warp-tile kernel: mma fragments, padded cp.async tiles
        from schedulers.warp_tile import CONSUMER_REGS, moves_registers, warp_tile_registers, warp_tile_smem_bytes

        local = warp_tile_registers(s, p) - BASE_REGISTERS
        if moves_registers(p):  # the launch's even share, rounded down to the allocation unit of 8
            return BlockResources(s.threads, warp_tile_smem_bytes(s, p), local, CONSUMER_REGS,
                                  65536 // s.threads // 8 * 8, WARP_TILE_SPILL_SLACK)
        return BlockResources(s.threads, warp_tile_smem_bytes(s, p), local, spill_slack=WARP_TILE_SPILL_SLACK)
    return BlockResources(s.threads, shared_bytes(s, align=128), local_floats(s), launch_cap(s.threads),
                          live_loads=live_loads(s))


def check_resources(s: Schedule, hw: HardwareModel) -> BlockResources:
    """Raise ResourceError (naming the resource) when one block of ``s`` cannot run on ``hw``."""
    r = block_resources(s)
    # above the static limit the lowering switches to dynamic shared memory
    hw.check_block(r.shared_bytes, r.threads, r.registers_per_thread,
                   dynamic=r.shared_bytes > hw.smem_static_per_block_bytes)
    if hw.occupancy_blocks_per_sm(r.shared_bytes, r.threads, r.registers_per_thread) == 0:
        raise ResourceError(f"{hw.name}: a block of {r.threads} threads with {r.shared_bytes} B shared memory and "
                            f"~{r.registers_per_thread} registers/thread does not fit on one SM", code="resource.sm")
    return r
