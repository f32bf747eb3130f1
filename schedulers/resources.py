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

import numpy as np

from schedulers.halo import halo_elements, window_box
from schedulers.hardware import HardwareModel, ResourceError
from schedulers.schedule import Schedule
from schedulers.temporal import TemporalPlan
from smg.expr import parse

#: registers a thread needs besides its local buffers (indices, pointers, temporaries)
BASE_REGISTERS = 32
MAX_REGISTERS = 255  # per thread on every NVIDIA GPU since Kepler; beyond it values spill
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
            nbytes = n * (np.dtype(s.smg.space(name).dtype).itemsize if name in s.smg.inputs else 4)
            total += -(-nbytes // align) * align
    if s.lanes > 32 and s.warp_tile is None:  # the warps' partial results of a cross-warp reduction
        total += -(-(s.threads // 32 * 4) // align) * align
    if s.cluster > 1 and s.warp_tile is None:  # the block's result the cluster's blocks read, and their total
        total += -(-8 // align) * align
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

    @property
    def registers_per_thread(self) -> int:
        """What a thread launches with: the estimate (above the cap the buffers spill to local memory)."""
        if self.launch_registers is not None:
            return self.launch_registers
        return min(self.register_cap, BASE_REGISTERS + self.local_floats)

    @property
    def registers_estimate(self) -> int:
        """The estimate before the 255-register cap."""
        return BASE_REGISTERS + self.local_floats

    @property
    def spills(self) -> bool:
        return self.registers_estimate > self.register_cap

    @property
    def likely_spilled_floats(self) -> int:
        """Values per thread that surely go to local memory: the part of the estimate beyond the limit plus
        ``spill_slack``.  A CUDA-core kernel's estimate counts every local buffer (it runs up to ~55 above
        what nvcc allocates), so 40 of slack; a warp-tile program's is fitted to nvcc's counts, so 16."""
        return max(0, BASE_REGISTERS + self.local_floats - self.register_cap - self.spill_slack)


def block_resources(s: Schedule) -> BlockResources:
    p = s.warp_tile
    if p is not None:  # tensor-core warp-tile kernel: mma fragments, padded cp.async tiles
        from schedulers.warp_tile import CONSUMER_REGS, moves_registers, warp_tile_registers, warp_tile_smem_bytes

        local = warp_tile_registers(s, p) - BASE_REGISTERS
        if moves_registers(p):  # the launch's even share, rounded down to the allocation unit of 8
            return BlockResources(s.threads, warp_tile_smem_bytes(s, p), local, CONSUMER_REGS,
                                  65536 // s.threads // 8 * 8, WARP_TILE_SPILL_SLACK)
        return BlockResources(s.threads, warp_tile_smem_bytes(s, p), local, spill_slack=WARP_TILE_SPILL_SLACK)
    return BlockResources(s.threads, shared_bytes(s, align=128), local_floats(s))


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
