"""Analytical cost model: a time estimate for a Schedule on a HardwareModel, no GPU.

The kernel the lowering emits runs one thread per element of a block tile on
CUDA cores, so the estimate is a roofline with the corrections that decide
which schedule wins among those:

- device-memory bytes are the exact islpy footprints (``schedulers.traffic``),
  with per-thread reads of an input whose fastest-varying index is not the
  thread dim charged a whole 32-byte sector per element (uncoalesced), and
  spilled local buffers charged as extra traffic every step; inputs every
  block re-reads whole (a norm's weight and bias) cost device memory once and
  L2 after that;
- the device-memory bandwidth a CUDA-core kernel reaches is what its resident
  threads keep in flight over the DRAM latency (``search.simt_memory``): a
  16-byte vector load keeps 8x the bytes of a scalar fp16 load in flight, and a
  grid of a few blocks leaves most SMs without loads to issue;
- FLOPs count every op once per element of its iteration domain, times the
  recomputation the schedule implies: streamed tiles computed per thread are
  recomputed by every thread along the cut dims they lack, and the second pass
  recomputes the streamed tiles when the row was sliced;
- the machine is only busy if there are enough threads: occupancy from the
  hardware model, waves of blocks, partial last waves;
- each serial step costs the block-wide barriers the lowering emits in it
  (staged tiles, lane groups wider than a warp); a row per warp has none;
- a running reduction's step waits for its own loads before the next step's are issued (the steps are
  a loop carried by the states): each step after the first adds a memory latency (``STEP_LATENCY_S``).

Tensor-core warp-tile programs have their own per-step model (``search.warp_tile_cost``).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from functools import lru_cache

import sympy as sp

from schedulers.hardware import HardwareModel
from schedulers.resources import BlockResources, block_resources
from schedulers.schedule import Schedule, input_lane_spread
from schedulers.traffic import fused_kernel
from smg.expr import body_expr, parse
from smg.ir import SMG, Op, itemsize

from .simt_memory import dram_bandwidth, l1_sector_seconds, l2_reread_bytes, view_run_bytes
from .warp_tile_cost import warp_tile_time_s

SECTOR_BYTES = 32
#: device memory serves a view's reads in 64-byte pairs of sectors: a run of neighbours shorter than this
#: wastes the rest (ResNet-50's stem pool on the H100: 16-channel fp16 runs 51.6 us, 32- and 64-channel 37)
DRAM_RUN_BYTES = 64
BARRIER_CYCLES = 200
LAUNCH_US = 2.0
#: the time an SM takes to retire and start a block, whatever the block does: a CUDA-core grid of many tiny
#: blocks is bound by it.  ResNet-50's stem pool on the H100 (``experiments/tuning/raw/pool_round_view3_h100.json``):
#: 802816 blocks of 8 outputs took 485 us (6082 an SM: 80 ns each), 100352 blocks of 64 took 65 us, 50176 of
#: 128 took 36 (then the memory binds)
BLOCK_ISSUE_S = 75e-9
#: the latency each serial step of a CUDA-core reduction exposes: its loads are issued together, then waited
#: for before the states' updates and carries, which the next step's loads follow.  Fitted on the H200 rounds
#: of SD 1.5's ``X + E`` GroupNorm partials (``experiments/tuning/unet_groupnorm_partial_steps_h200.json.xz``,
#: L2 flushed): 2x320x64x64 at 16, 8, 4, 2 and 1 steps a chunk 13.7, 10.5, 8.3, 8.3, 7.2 us; 2x640x32x32 at
#: 8, 4, 2, 1 steps 9.0, 7.6, 6.8, 5.9 -- about 0.45 us a step over each shape's one-step time (bandwidth),
#: where the in-flight model alone tied them all
STEP_LATENCY_S = 450e-9


@lru_cache(maxsize=4096)
def _ops_per_point(op: Op) -> int:
    return max(1, int(sp.count_ops(body_expr(op))) + (1 if op.reduce else 0))


@lru_cache(maxsize=4096)
def _carry_ops(carry: str) -> int:
    """count_ops of a derived update function's carry (its one parse, ``smg.expr.parse``), once per text: a
    search estimates thousands of schedules with the same few carries, and sympy's count_ops walks the tree."""
    return int(sp.count_ops(parse(carry)))


@dataclass(frozen=True)
class Estimate:
    """The estimate and its parts (seconds), so a user can see what dominates."""

    memory_s: float
    compute_s: float
    sync_s: float
    bytes: float
    flops: float
    occupancy: int

    @property
    def us(self) -> float:
        return (max(self.memory_s, self.compute_s) + self.sync_s) * 1e6 + LAUNCH_US


def _work(s: Schedule) -> tuple[float, float, float]:
    """FLOPs, and operand bytes loaded from shared memory and from the L1/L2 path."""
    smg, sizes = s.smg, s.smg.dim_sizes
    grid = s.grid()
    total = shared_b = cached_b = 0.0
    states = {u.base for u in s.plan.states}
    for op in smg.ops:
        if op.out not in s.plan.streamed and op.out not in states:
            continue  # inlined: counted in the bodies that use it (its share is small)
        points = float(math.prod(sizes[d] for d in op.iter_dims))
        if op.out in s.plan.streamed:
            per_thread = s.level(op.out) != "shared"
            for d, t in s.block:
                if d not in op.iter_dims:  # every block (and, per thread, every thread) along d recomputes it
                    points *= grid[d] * (t if per_thread else 1)
            if s.plan.second_pass and s.num_steps > 1 and s.serial in op.iter_dims:
                points *= 2
        total += points * _ops_per_point(op)
        for a in op.inputs:
            lvl = s.level(a.space)
            item = itemsize(smg.space(a.space).dtype) if a.space in smg.inputs else 4
            if lvl == "shared":
                shared_b += points * item
            elif lvl == "global" or a.space in smg.inputs:
                cached_b += points * item
    if s.lanes > 1:  # the butterfly of shuffles per state element per step
        total += sum(math.prod(sizes[d] for d in smg.space(u.base).dims) for u in s.plan.states) \
            * s.num_steps * 2 * math.log2(s.lanes) * s.lanes
    for u in s.plan.states:  # the derived update functions, applied per element per step
        if u.carry:
            total += _carry_ops(u.carry) * math.prod(
                sizes[d] for d in smg.space(u.base).dims) * s.num_steps
    return total, shared_b, cached_b


def _uncoalesced_reads(s: Schedule) -> dict[str, float]:
    """Per-thread global reads that consecutive threads make far apart, and their extra bytes (a whole
    sector per element).  An input read through a view is coalesced where the index consecutive threads
    step (the lanes' serial dim, else the thread dim) is in the expression of its innermost dim: a pool's
    threads over the channels read 64 neighbours, over the output pixels or the taps a channel row apart
    (ResNet-50's stem pool took 485 us on the H100 with 8 lanes over its 9 taps)."""
    smg = s.smg
    extra: dict[str, float] = {}
    k = fused_kernel(s)
    for name, nbytes in k.reads:
        if s.level(name) != "global" or (s.tiles.get(s.thread_dim, 1) == 1 and s.lanes == 1):
            continue
        dims = smg.space(name).dims
        run = view_run_bytes(s, name)
        if run is not None:
            if run < DRAM_RUN_BYTES:
                extra[name] = nbytes * (DRAM_RUN_BYTES / run - 1)
            continue
        if s.lanes > 1 and smg.inner_read(name)[0] == s.serial:
            continue  # consecutive lanes read consecutive serial elements: coalesced
        spread = input_lane_spread(s, name)
        if spread and spread[-1] == dims[-1]:
            continue  # lanes spread over the reduced dims, consecutive ones on the innermost: coalesced
        if s.thread_dim in dims and dims[-1] != s.thread_dim:
            item = itemsize(smg.space(name).dtype)
            extra[name] = nbytes * (SECTOR_BYTES / item - 1)
    return extra


def _uncoalesced_bytes(s: Schedule) -> float:
    """Extra bytes of per-thread global reads that consecutive threads make far apart."""
    return sum(_uncoalesced_reads(s).values())


def _wgmma_spill_bytes(s: Schedule, res) -> float:
    """Accumulators beyond the register file in wgmma's ss form, stored and reloaded around every
    wgmma (each k16 slice of each 64-row half).  Its register estimate is exact there (168 against
    nvcc's 166), so no slack: the 128 x 256 and 256 x 128 tiles on one warpgroup (296) ran 8-16x
    slower on the H100 (experiments/tuning/raw/gemm_sigmoid_round_wt1.json).  The limit is the register
    cap, which ``setmaxnreg`` lowers to ``CONSUMER_REGS`` (232) beside a producer warpgroup: SD 1.5's GEGLU
    (512 x 5120 x 1280) on 192 x 64 tiles of two GEMM states (estimated 240) spilled 2.2 KB a thread and
    took 423 us a call on the H100, 14x its 128-row neighbours' throughput."""
    p = s.warp_tile
    over = max(0, res.registers_estimate - res.register_cap)
    per_step = (p.step // 16) * max(1, p.rows // 64 // max(1, p.warps // 4))
    return over * 4 * 2 * res.threads * s.num_tiles * s.steps_per_block * per_step


def _barriers_per_step(s: Schedule) -> int:
    """Block-wide barriers a CUDA-core step waits at, both passes, as the lowering emits them: around
    the tiles staged or computed in shared memory (the second pass again where it runs more than one
    step), and two per running state where a lane group spans warps (its warps' partial results meet
    in shared memory; the second pass reduces nothing), two more (cluster barriers) where it spans a
    cluster's blocks.  Lane groups within a warp reduce by shuffles alone, so a row per warp with nothing
    staged has none."""
    shared = 2 if any(lvl == "shared" for _, lvl in s.memory) else 0
    first = shared + 2 * len(s.plan.states) * ((s.lanes > 32) + (s.cluster > 1))
    second = shared if s.plan.second_pass and s.num_steps > 1 else 0
    return first + second


@dataclass(frozen=True)
class _Occupancy:
    """What ``estimate`` derives from a block's resources and the grid before its compute and memory terms."""

    res: BlockResources
    occ: int
    blocks: int
    waves: int
    busy_sms: int
    thread_util: float
    wave_util: float


def _occupancy(s: Schedule, hw: HardwareModel) -> _Occupancy:
    res = block_resources(s)
    occ = hw.occupancy_blocks_per_sm(res.shared_bytes, res.threads, res.registers_per_thread)
    slots = max(1, occ) * hw.num_sms
    blocks = s.num_blocks
    waves = math.ceil(blocks / slots)
    busy_sms = min(hw.num_sms, blocks)
    resident = min(blocks, slots) * res.threads
    # latency hiding: CUDA cores reach their peak with about half the maximum resident threads
    thread_util = min(1.0, resident / (0.5 * hw.num_sms * hw.max_threads_per_sm))
    wave_util = blocks / (waves * slots) if waves > 1 else 1.0
    return _Occupancy(res, occ, blocks, waves, busy_sms, thread_util, wave_util)


def _simt_compute(s: Schedule, hw: HardwareModel, o: _Occupancy) -> tuple[float, float]:
    """A CUDA-core schedule's compute seconds and FLOPs."""
    peak = hw.peak_flops("float32", tensor_core=False)
    flops, shared_b, cached_b = _work(s)
    util = max(o.thread_util * o.wave_util, 1e-6)
    # every operand comes from shared memory or the L1/L2 path, not registers: those limit first
    return max(flops / peak, shared_b / (hw.smem_bandwidth_bytes_per_s_per_sm * hw.num_sms),
               cached_b / hw.l2_bandwidth_bytes_per_s) / util, flops


def _issue_s(hw: HardwareModel, blocks: int) -> float:
    """The least memory seconds of a CUDA-core grid of ``blocks``: each SM retires and starts its blocks."""
    return math.ceil(blocks / hw.num_sms) * BLOCK_ISSUE_S


def _barrier_s(s: Schedule, hw: HardwareModel, waves: int) -> float:
    """A CUDA-core schedule's barrier seconds (the first of its sync terms)."""
    return waves * s.steps_per_block * _barriers_per_step(s) * BARRIER_CYCLES / hw.clock_hz


def _step_latency_s(s: Schedule, waves: int) -> float:
    """A CUDA-core reduction's exposed step latencies (the last of its sync terms)."""
    return waves * (s.steps_per_block - 1) * STEP_LATENCY_S if s.plan.states else 0.0


def estimate_floor_us(s: Schedule, hw: HardwareModel) -> float:
    """A lower bound of ``estimate_us(s, hw)`` at a fraction of its cost: for a CUDA-core schedule its compute
    term, the block-issue floor of its memory term and its sync terms but the L1 sectors' (which is never
    negative), computed by the same expressions as ``estimate`` (IEEE rounding is monotone, so the bound holds
    exactly, not only up to rounding); the device-memory footprints (``schedulers.traffic``) and the warp
    sectors, most of a CUDA-core estimate, are left out.  A warp-tile schedule's floor is the launch alone.
    ``frontend.schedules.ranked`` estimates a first pick's candidates in the order of this floor and stops where
    it is above what can reach the head of the order."""
    if s.warp_tile is not None:
        return LAUNCH_US
    o = _occupancy(s, hw)
    compute_s, _ = _simt_compute(s, hw, o)
    sync_s = _barrier_s(s, hw, o.waves) + _step_latency_s(s, o.waves)
    return (max(_issue_s(hw, o.blocks), compute_s) + sync_s) * 1e6 + LAUNCH_US


def estimate(s: Schedule, hw: HardwareModel) -> Estimate:
    """The analytical time estimate of ``s`` on ``hw``."""
    o = _occupancy(s, hw)
    res, occ, blocks, waves, busy_sms = o.res, o.occ, o.blocks, o.waves, o.busy_sms
    if s.warp_tile is not None:
        compute_s, flops = warp_tile_time_s(s, hw, occ)
    else:
        compute_s, flops = _simt_compute(s, hw, o)
    if s.warp_tile is not None:
        # cp.async reads 16-byte chunks (coalesced), and the row tiles of one batch coordinate run
        # side by side, so the tiles they all stream (K, V) come from L2 after the first: the device
        # memory sees each tensor once (the L2 re-reads are in the compute term)
        smg = s.smg
        nbytes = float(sum(math.prod(smg.shape(n)) * itemsize(smg.space(n).dtype)
                           for n in (*smg.inputs, *smg.outputs)))
    else:
        k = fused_kernel(s)
        unco = _uncoalesced_reads(s)
        # broadcast inputs (a norm's W, B) re-read by every block come from L2 after the first block
        nbytes = float(k.read_bytes + k.write_bytes) + sum(unco.values()) - l2_reread_bytes(s, k, hw)
    if s.slices > 1:  # every block writes its partial states, the merging blocks read them all back
        nbytes += 2.0 * s.num_blocks * s.warp_tile.merge_floats() * res.threads * 4
    # values beyond the register file are stored and reloaded (local memory) every step
    nbytes += res.likely_spilled_floats * 4 * 2 * res.threads * blocks * s.steps_per_block
    if s.warp_tile is not None and s.warp_tile.wgmma_ss:
        nbytes += _wgmma_spill_bytes(s, res)
    if s.warp_tile is not None:
        mem_util = min(1.0, busy_sms / hw.num_sms * max(1.0, occ / 2))
        memory_s = nbytes / (hw.dram_bandwidth_bytes_per_s * max(mem_util, 1e-3))
    else:  # the bytes its resident threads keep in flight bound a CUDA-core kernel (search.simt_memory)
        memory_s = nbytes / dram_bandwidth(s, hw, occ, res.threads, frozenset(unco))
        memory_s = max(memory_s, _issue_s(hw, blocks))
    # the warp-tile model has each step's barrier in its chain
    sync_s = 0.0 if s.warp_tile is not None else \
        _barrier_s(s, hw, waves) + l1_sector_seconds(s, k, hw, frozenset(unco)) + _step_latency_s(s, waves)
    return Estimate(memory_s, compute_s, sync_s, nbytes, flops, occ)


def estimate_us(s: Schedule, hw: HardwareModel) -> float:
    return estimate(s, hw).us


#: the CUDA-core candidates are skipped when even their floor is this many times the best tensor-core estimate
SIMT_SKIP_FACTOR = 2.0


def simt_floor_us(smg: SMG, hw: HardwareModel) -> float:
    """What ``estimate`` gives any CUDA-core schedule of ``smg`` at least: its reductions' FLOPs (each
    computed once, no recomputation) at the SIMT fp32 peak, plus the launch."""
    flops = sum(math.prod(smg.dim_sizes[d] for d in op.iter_dims) * _ops_per_point(op) for op in smg.ops if op.reduce)
    return flops / hw.peak_flops("float32", tensor_core=False) * 1e6 + LAUNCH_US


def simt_veto(hw: HardwareModel, estimate_of: Callable[[Schedule], float] | None = None
              ) -> Callable[[list[Schedule]], str | None]:
    """A ``SearchSpace.candidates`` veto: skip the CUDA-core candidates where their floor is above
    ``SIMT_SKIP_FACTOR`` times the best tensor-core estimate (a deep GEMM's 29k CUDA-core tilings took
    13 s to enumerate and 8 s to estimate, against its 1.2k tensor-core ones; a GEMV's are kept)."""
    est = estimate_of or (lambda s: estimate_us(s, hw))

    def veto(tc: list[Schedule]) -> str | None:
        best = min(est(s) for s in tc)
        floor = simt_floor_us(tc[0].smg, hw)
        if floor <= SIMT_SKIP_FACTOR * best:
            return None
        return f"their compute floor {floor:.1f} us is over {SIMT_SKIP_FACTOR:g}x the best tensor-core estimate " \
               f"{best:.1f} us"

    return veto


def either(*vetoes: Callable[[list[Schedule]], str | None]) -> Callable[[list[Schedule]], str | None]:
    """A veto that refuses where any of ``vetoes`` does (the first reason)."""
    def veto(tc: list[Schedule]) -> str | None:
        return next((why for v in vetoes if (why := v(tc)) is not None), None)

    return veto


def head_veto(hw: HardwareModel, head: int, estimate_of: Callable[[Schedule], float] | None = None
              ) -> Callable[[list[Schedule]], str | None]:
    """Skip the CUDA-core candidates where none can be among the first ``head`` of the first round's order
    (``frontend.schedules.ranked``); ``estimate_of`` shares the caller's estimates (each candidate estimated once).

    Why that is exact: the order sorts by tie group (``search.prior.tie_groups``: estimates within ``1 + TIE``
    of a group's first), then by the prior's score within a group.  The first ``head`` lie in the groups up to
    that of the ``head``-th smallest estimate, e5, and those groups end at most at e5 * (1 + TIE).  Given only
    some candidates (the tensor-core ones of one graph of the space), their ``head``-th smallest estimate is at
    least the whole space's e5.  A CUDA-core schedule's estimate is at least ``simt_floor_us``; above
    e5 * (1 + TIE), each would sort after every member of those groups, and removing candidates from after
    them changes neither the groups before nor the prior's per-candidate scores."""
    from search.prior import TIE

    est = estimate_of or (lambda s: estimate_us(s, hw))

    def veto(tc: list[Schedule]) -> str | None:
        if len(tc) < head:
            return None
        bound = sorted(est(s) for s in tc)[head - 1] * (1 + TIE)
        floor = simt_floor_us(tc[0].smg, hw)
        if floor <= bound:
            return None
        return f"their compute floor {floor:.1f} us is above {bound:.1f} us, beyond the first {head} candidates"

    return veto


def within_reach(cands: dict[str, Schedule], hw: HardwareModel, head: int,
                 estimate_of: Callable[[Schedule], float] | None = None, prefix: int = 0,
                 shape_of: Callable[[Schedule], Hashable] | None = None, shapes: int = 0) -> dict[str, Schedule]:
    """The candidates of ``cands`` (by key) that can be: among the first ``head`` of the first round's order
    (``search.prior.first_round_order``), among its ``prefix`` smallest estimates (by estimate, then key), or
    the best of its shape (``shape_of``) for one of the ``shapes`` shapes whose best estimates are smallest.
    The rest are left out without their estimate; each kept one is estimated (``estimate_of``: the caller's
    memo).  Removing the rest leaves ``first_round_order``'s first ``head``, its ``prefix`` first estimates and
    the first of each of those shapes in the order where the whole of ``cands`` has them.

    How: candidates are estimated in the order of ``estimate_floor_us``, a lower bound of their estimate; the
    bound is the largest of (a) the ``head``-th smallest estimate so far times ``1 + TIE`` (why nothing above it
    reaches the head: ``head_veto``), (b) the ``prefix``-th smallest estimate so far, (c) the ``shapes``-th
    smallest best-of-a-shape estimate so far.  Each can only fall as more are estimated, so the first candidate
    whose floor is above it, and every one after, has an estimate above what the whole space's would be: it is
    none of those.  Why (b) and (c): the prior reorders the ``PRIOR_CANDIDATES`` best estimates as a set, and a
    family (``frontend.families.kept``) keeps the first schedule of each further grid shape of the order, up to
    ``shapes`` schedules; past the prior's prefix the order is by estimate, so a shape first met there is met at
    its best, and every shape with a smaller best is met before it: it is kept only if at most ``shapes - 1``
    shapes have a smaller best.  A dwconv 7x7 of ConvNeXt-T's first stage
    has 27,640 candidates of which 4,338 are estimated (H100)."""
    from search.prior import TIE

    est = estimate_of or (lambda s: estimate_us(s, hw))
    floors = {k: estimate_floor_us(s, hw) for k, s in cands.items()}
    best: list[float] = []  # the max(head, prefix) smallest estimates so far, ascending
    mins: dict[Hashable, float] = {}  # each shape's best estimate so far
    ranked_mins: list[float] = []  # their values, ascending
    keep = max(head, prefix)
    out: dict[str, Schedule] = {}
    for k in sorted(cands, key=lambda k: (floors[k], k)):
        bound = math.inf
        if len(best) >= head and (len(best) >= prefix or not prefix):
            bound = best[head - 1] * (1 + TIE)
            if prefix:
                bound = max(bound, best[prefix - 1])
            if shape_of is not None and shapes:
                bound = max(bound, ranked_mins[shapes - 1] if len(ranked_mins) >= shapes else math.inf)
        if floors[k] > bound:
            break
        s = cands[k]
        e = est(s)
        out[k] = s
        bisect.insort(best, e)
        del best[keep:]
        if shape_of is not None:
            shape = shape_of(s)
            old = mins.get(shape)
            if old is None or e < old:
                if old is not None:
                    del ranked_mins[bisect.bisect_left(ranked_mins, old)]
                mins[shape] = e
                bisect.insort(ranked_mins, e)
    return out
