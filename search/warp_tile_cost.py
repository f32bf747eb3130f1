"""Analytical time of a tensor-core warp-tile program: a per-step throughput/latency model.

A block runs the same step ``steps_per_block`` times: load the next K/V (or A/B) tiles, multiply
on the tensor cores, do the element-wise work of the score tile on the SIMT cores and the
special-function unit (exp), update the running states.  The SM interleaves its resident blocks:

- *throughput*: each unit (tensor cores, SFU, FP32 pipes, shared-memory port, the SM's share of
  L2 bandwidth) serves every resident block's demand of a step; the busiest unit bounds a round
  of steps, and of the units the warps issue to (tensor, SFU, FP32) the busiest plus part of the
  others' (one warp's phases follow each other), while the copies run in the background;
- *latency*: one block's own chain of a step, its phases one after another plus the barrier and
  the load latency the ring does not cover (``stages - 1`` steps ahead; none with one stage),
  bounds it too when too few blocks share the SM to hide it.

Blocks run in waves of ``occupancy x SMs``; a partial last wave has fewer blocks per SM; under a
causal mask a block runs its row tile's average share of the steps.  Each
block also pays its prologue (the A tile) and its epilogue (the outputs, their element-wise ops).
The constants are per-SM rates of the hardware model, the SFU rate of the CUDA Programming
Guide's throughput table, and five fitted on the first 104 of the 128 H100 kernels (``experiments/tuning/
warp_tile_calibration.json``, a coarse grid, not a regression): the fractions of the tensor peak
that wgmma and mma.sync reach, the load latency, the barrier, and how much the non-bound units
add.  Each of them scaled by 0.6 or 1.5 alone keeps Spearman >= 0.47 per workload (>= 0.56
except wgmma at 0.36 of the peak); the rankings, not the constants, are the point.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import sympy as sp

from schedulers.hardware import HardwareModel
from schedulers.schedule import Schedule
from schedulers.warp_tile import (
    WarpTileProgram,
    _quotient,
    smem_layout,
    steps_per_row_tile,
    tile_columns,
    wgmma_swizzled,
)
from smg.expr import Role, body_expr, logistic_arg, parse

#: exp2 / rcp results per SM per clock (CUDA Programming Guide, arithmetic throughput, cc 5.x-9.0)
SFU_PER_CLK = 16
#: fractions of the dense tensor peak reached by warpgroup MMA and by mma.sync (fitted)
WGMMA_FRACTION = 0.6
MMA_SYNC_FRACTION = 0.35
#: the fraction for wgmma fed by a producer warpgroup: a group stays in flight and no block barrier
#: drains the tensor pipe each step (fitted to one kernel, the 8192^2 x 1024 GEMM on 128 x 256 tiles,
#: 4 stages, persistent; the cp.async and TMA kernels keep WGMMA_FRACTION; measured: docs/tuning.md,
#: 'What the cost models are fitted to')
WGMMA_PRODUCER_FRACTION = 0.8
#: a cp.async tile's latency from L2 before its first byte lands (fitted), and a step's barrier
LOAD_LATENCY_S = 0.5e-6
BARRIER_S = 0.05e-6
#: share of the other issuing units' demand (tensor, SFU, FP32) that adds to the busiest's (fitted)
OVERLAP_LOSS = 0.45
#: how much faster TMA's bulk tensor copies draw from L2 than cp.async's 16-byte ones: the H100's
#: pingpong GEMM drew its tiles from L2 above the hardware model's L2 bandwidth, the cp.async GEMM below
#: it (measured on GEMMs only: attention's K/V by TMA ran as fast as by cp.async; docs/tuning.md,
#: 'What the cost models are fitted to')
TMA_L2_FACTOR = 1.3
#: the latency of a gathered tile (an implicit GEMM's im2col view, ``gathers``): each thread computes its
#: chunks' addresses before it issues them, and the convolutions' A tiles are re-read from L2 by every tap,
#: so they wait longer than a GEMM's.  Fitted on SD 1.5's 16 measured conv rounds (8 candidates each,
#: experiments/tuning/conv_sd15_records_h100.json): at LOAD_LATENCY_S the model's pick among the measured was
#: 1.25x the best (geometric mean; Spearman 0.47), 2 us gives 1.07x (0.70), 3 us no better; the deeper rings
#: (4 stages at 128 x 256) that won by 15-25% on the VAE's shapes are what it then prefers
GATHER_LATENCY_S = 2.0e-6
#: the latency of a gathered tile loaded by TMA in im2col mode (the copy engine computes the addresses)
IM2COL_LATENCY_S = 0.5e-6
#: what each of a thread's chunks of a scalar gather (an NCHW image, ``GatherTile.scalar``) adds to a step: its 8
#: loads go to registers, not by cp.async, and its store waits for them, so the ring hides none of it.  Fitted
#: on the H200's 12 measured NCHW tensor-core candidates (``experiments/results/history/conv_chains_nchw_h200_
#: rule.json``): without it the model's estimates were 0.47x the measured (geometric mean; rms log error 0.91),
#: with 0.75 us 0.99x (0.44).  On the round it then picked (``results/conv_chains_nchw_h200.json``, partly new
#: candidates) 1.09x (0.31).  The 1x1's are overestimated (45-47 against 26-28 us): what it is for is the
#: decision between layouts (``spacefusion.frontend.layouts``), not a fine rank
SCALAR_GATHER_LATENCY_S = 0.75e-6
#: FP32 operations of CUDA's tanhf, a software routine (exp-based with a polynomial for small |x|)
TANHF_OPS = 20


def _ops(exprs: list[sp.Expr], fast_math: bool = False) -> tuple[int, int]:
    """(SIMT, SFU) operations of ``exprs`` with shared subexpressions counted once (the lowering
    computes attention's ``exp(Ss - m)`` once for the row sum and P @ V): exp and reciprocals go
    to the special-function unit; with ``fast_math`` a logistic ``1 / (1 + exp(z))`` and a tanh
    are one tanh.approx each (else tanhf's software routine: about 20 FP32 ops).  Once per set of
    expressions: a ranking asks at every candidate, and the walk was 0.6 of a causal attention's 5 s."""
    return _ops_of(tuple(exprs), fast_math)


@lru_cache(maxsize=4096)
def _ops_of(exprs: tuple[sp.Expr, ...], fast_math: bool) -> tuple[int, int]:
    nodes = {a for e in exprs for a in sp.preorder_traversal(e) if not a.is_Atom}
    if fast_math:  # the logistic's exp and sum are inside its one tanh.approx
        logistic = {a for a in nodes if isinstance(a, sp.Pow) and a.exp == -1 and logistic_arg(a.base) is not None}
        nodes -= {x for a in logistic for x in (a.base, *a.base.args)}
        sfu = len(logistic) + sum(1 for a in nodes if isinstance(a, sp.tanh) or (_sfu(a) and a not in logistic))
        return len(nodes) - sfu + 2 * len(logistic), sfu  # + the halving of z and the 1/2 - t/2 of each
    sfu = sum(1 for a in nodes if _sfu(a))
    simt = len(nodes) - sfu + TANHF_OPS * sum(1 for a in nodes if isinstance(a, sp.tanh))
    return simt, sfu


def _sfu(a: sp.Expr) -> bool:
    """Whether node ``a`` runs on the special-function unit: an exp or a reciprocal."""
    return isinstance(a, sp.exp) or (isinstance(a, sp.Pow) and a.exp.is_negative)


@dataclass(frozen=True)
class StepCost:
    """One block's demand per step (seconds on one SM's units) and its per-block fixed costs."""

    tensor_s: float
    sfu_s: float
    simt_s: float
    smem_s: float
    l2_s: float
    latency_s: float  # the chain beyond the units' work: barrier and uncovered load latency
    fixed_s: float  # prologue + epilogue of a block
    #: the step's GEMMs run beside its element-wise work (a producer-fed score GEMM: each step's row
    #: states overlap the previous step's P @ V, two warpgroups take turns), not after it
    overlapped: bool = False

    @property
    def units(self) -> tuple[float, ...]:
        return self.tensor_s, self.sfu_s, self.simt_s, self.smem_s, self.l2_s

    def round_s(self, blocks: float) -> float:
        """Time for each of ``blocks`` resident blocks to run one step."""
        per_unit = [blocks * u for u in self.units]
        issue = [blocks * u for u in (self.tensor_s, self.sfu_s, self.simt_s)]
        throughput = max(max(per_unit), max(issue) + OVERLAP_LOSS * (sum(issue) - max(issue)))
        if self.overlapped:
            chain = max(self.tensor_s, self.sfu_s + self.simt_s) + self.latency_s
        else:
            chain = self.tensor_s + self.sfu_s + self.simt_s + self.latency_s
        return max(throughput, chain)


def _elementwise(s: Schedule, p: WarpTileProgram) -> tuple[float, float, float, float]:
    """(SIMT, SFU) ops per score element per step -- the score ops, the running states' bodies,
    the GEMM states' factors (packed to 16 bits for the tensor cores) and one combine per state
    not summed on the tensor cores -- and per output element in the epilogue."""
    bodies = [body_expr(s.smg.producer(n)) for n in p.score_ops]
    bodies += [parse(u.body) for u in p.row_states]
    bodies += [_quotient(g.update.body, g.x) for g in p.gemm_states if p.gemm is not None or p.score_ops]
    simt, sfu = _ops(bodies)
    simt += len(p.row_states) - len(p.row_sums) + (len(p.gemm_states) if p.score_ops else 0)
    out_simt, out_sfu = _ops([parse(v) for _, v in p.outputs], p.warp.fast_math)
    return float(simt), float(sfu), float(out_simt + 1), float(out_sfu)


def _carries(s: Schedule, p: WarpTileProgram) -> tuple[float, float]:
    """(SIMT ops, SFU ops) per row per step of the derived update functions: each state's carry
    applied to every accumulator element of the row (O's rescale touches all of its columns), the
    distinct exps of the carries once per row."""
    cols = {g.update.state: g.n_tile for g in p.gemm_states}
    simt, exps = 0.0, set()
    for u in p.row_states + tuple(g.update for g in p.gemm_states):
        if not u.carry:
            continue
        ops, carry_exps = _carry_terms(u.carry)
        simt += ops * cols.get(u.state, 1)
        exps |= carry_exps
    return simt, float(len(exps))


@lru_cache(maxsize=4096)
def _carry_terms(carry: str) -> tuple[int, frozenset]:
    """(count_ops, the exps in it) of a carry's text, once per text (a ranking asks for every candidate)."""
    e = parse(carry)
    return int(sp.count_ops(e)), frozenset(a for a in sp.preorder_traversal(e) if isinstance(a, sp.exp))


def step_cost(s: Schedule, hw: HardwareModel) -> StepCost:
    """The per-step demand of one block of the warp-tile program of ``s`` on ``hw``."""
    p = s.warp_tile
    dtype = s.smg.space(s.smg.inputs[0]).dtype
    sms = hw.num_sms
    fraction = ((WGMMA_PRODUCER_FRACTION if p.hopper.producer else WGMMA_FRACTION) if p.hopper.wgmma
                else MMA_SYNC_FRACTION)
    tc_rate = hw.peak_flops(dtype, tensor_core=True) / 2 / sms * fraction
    fp32_rate = hw.peak_flops("float32", tensor_core=False) / sms
    sfu_rate = SFU_PER_CLK * hw.clock_hz
    smem_rate = hw.smem_bandwidth_bytes_per_s_per_sm
    l2_rate = hw.l2_bandwidth_bytes_per_s / sms * (TMA_L2_FACTOR if p.hopper.tma and p.wgmma_ss else 1.0)

    rows, step = p.rows, p.step
    kd = p.gemm.kp if p.gemm else 0  # K as the MMAs run it (padded to 16)
    n_total = sum(g.n_tile for g in p.gemm_states)
    elems = rows * step
    macs = elems * (kd + n_total + 8 * len(p.row_sums))
    step_simt, step_sfu, out_simt, out_sfu = _elementwise(s, p)

    # shared memory: the fill of this step's tiles, then the tensor cores' operand reads
    layout, cols, swizzled = smem_layout(s, p), tile_columns(s, p), set(wgmma_swizzled(p))
    # a swizzled tile's padded last band (padded_band) is neither loaded nor read by wgmma
    streamed = {n: (r, cols[n] if n in swizzled else w) for n, (c, r, w) in layout.items()
                if not (p.gemm and n == p.gemm.a)}
    fill = sum(r * w * 2 for r, w in streamed.values())
    halves = max(1, rows // 64)
    if p.wgmma_ss:  # the A tile once, the B tile by each 64-row half (and A again by ldmatrix for row states)
        a_fill = rows * step * 2
        reads = a_fill * (2 if p.row_states else 1) + halves * (fill - a_fill)
    elif p.hopper.wgmma:  # each 64-row half reads the whole K and V tiles; Q once with reload_a
        reads = halves * fill + (rows * kd * 2 if p.warp.reload_a else 0)
    else:  # ldmatrix: every warp reads the whole streamed tiles; A's fragments again with reload_a
        reads = p.warps * fill + (rows * kd * 2 if p.warp.reload_a else 0)
    smem_s = (fill + reads) / smem_rate
    l2_s = fill / l2_rate
    tensor_s = macs / tc_rate
    carry_simt, carry_sfu = _carries(s, p)
    sfu_s = (elems * step_sfu + rows * carry_sfu) / sfu_rate
    simt_s = (elems * step_simt + rows * carry_simt + gather_ops(s, p)) / fp32_rate
    load = ((IM2COL_LATENCY_S if p.hopper.tma else GATHER_LATENCY_S) if p.gathers else LOAD_LATENCY_S) + l2_s
    # steps loaded ahead: the ring less the slot being read and, a GEMM fed by a producer warpgroup,
    # the slot its wgmma group in flight still holds (attention's steps wait for their wgmma groups)
    ahead = p.warp.stages - 1 - (1 if p.wgmma_ss and (p.hopper.producer or p.warp.stages >= 3) else 0)
    if ahead <= 0:
        latency = load
    else:
        latency = max(0.0, load / ahead - (tensor_s + sfu_s + simt_s))
    latency += scalar_gather_chunks(p) * SCALAR_GATHER_LATENCY_S
    if not p.hopper.producer:  # a producer warpgroup's ring hands slots back by mbarriers: no block barrier
        latency += BARRIER_S

    # prologue (the A tile) and epilogue (outputs through the arena, their element-wise ops)
    a_bytes = rows * kd * 2 if p.gemm else 0
    out_elems = rows * max(_output_columns(s, p) or n_total, 1)
    fixed = (a_bytes / l2_rate + LOAD_LATENCY_S + out_elems * (out_simt / fp32_rate + out_sfu / sfu_rate)
             + out_elems * 2 * 2 / smem_rate + out_elems * 2 / l2_rate)
    # FlashAttention-3's overlap (lower/mma_overlap.py): lost to mma.sync row sums, which stall the async wgmma pipe
    overlapped = p.hopper.producer and p.gemm is not None and not p.row_sums
    overlapped = overlapped or (p.wgmma_ss and bool(p.row_states))  # a norm's statistics beside the async wgmmas
    return StepCost(tensor_s, sfu_s, simt_s, smem_s, l2_s, latency, fixed, overlapped)


#: integer ops of one floor division by a constant (a multiply-high, a shift, the correction)
FLOOR_DIV_OPS = 3


def scalar_gather_chunks(p: WarpTileProgram) -> int:
    """16-byte chunks each MMA thread gathers element by element per step (``lower/mma_ring._gather_scalar``)."""
    per_tile = -(-p.rows * p.step // 8 // (32 * p.warps))
    return sum(per_tile for g in p.gathers if g.scalar)


def gather_ops(s: Schedule, p: WarpTileProgram) -> float:
    """Integer ops per step of the gathered tiles' addresses (an implicit GEMM's im2col tile): each 16-byte chunk
    evaluates the view's index expressions (a floor division costs FLOOR_DIV_OPS), checks each component
    against its bounds and combines them into an offset, on the threads that also issue the MMAs (a scalar
    gather's every element does).  None by TMA: an im2col load's addresses are the copy engine's."""
    total = 0.0
    if p.hopper.tma:
        return total
    for g in p.gathers:
        exprs = [parse(e, Role.INDEX) for e in g.index]
        per_chunk = sum(int(sp.count_ops(e)) + (FLOOR_DIV_OPS - 1) * len(e.atoms(sp.floor)) for e in exprs)
        per_chunk += 3 * len(exprs) + 2  # two bounds compares and a multiply-add per component; rows, columns
        # a scalar gather (an NCHW image) evaluates them per element and issues 8 loads and selects a chunk
        total += p.rows * p.step / 8 * (8 * (per_chunk + 2) if g.scalar else per_chunk)
    return total


def _output_columns(s: Schedule, p: WarpTileProgram) -> int:
    """Columns per block of the outputs over a GEMM state's column dim: what the epilogue stores.  GEMM
    states that feed one output (a gated GEMM's G and U into ``silu(G) * U``) store one tile, not one
    per accumulator."""
    n_tile = {g.n: g.n_tile for g in p.gemm_states}
    return sum(next((n_tile[d] for d in s.smg.space(out).dims if d in n_tile), 0) for out, _ in p.outputs)


def warp_tile_time_s(s: Schedule, hw: HardwareModel, occupancy: int) -> tuple[float, float]:
    """(seconds, FLOPs) of the warp-tile program of ``s`` with ``occupancy`` blocks per SM."""
    p = s.warp_tile
    c = step_cost(s, hw)
    groups = s.num_tiles * p.warp.split  # warp groups of a block (split) run like blocks of their own
    per_tile = steps_per_row_tile(s, p)  # a killing mask (causal) skips whole steps
    steps = sum(per_tile) / len(per_tile) / s.slices / p.warp.split
    if p.hopper.persistent:  # every block runs its share of the tiles; after its first tile the producer has the
        per_sm = min(max(1, occupancy), -(-p.hopper.persistent // hw.num_sms))  # next one's loads under way
        tiles = -(-groups // p.hopper.persistent)
        main = steps * c.round_s(per_sm)
        if p.hopper.pingpong:  # one warpgroup's outputs go out while the other runs its main loop
            return tiles * max(main, c.fixed_s) + min(main, c.fixed_s), _flops(s, p, groups, steps)
        return tiles * (main + c.fixed_s) - (tiles - 1) * LOAD_LATENCY_S, _flops(s, p, groups, steps)
    slots = max(1, occupancy) * p.warp.split * hw.num_sms
    full, rest = divmod(groups, slots)
    fixed = c.fixed_s + merge_s(s, p, hw)
    total = full * (steps * c.round_s(max(1, occupancy) * p.warp.split) + fixed)
    if rest:
        per_sm = -(-rest // hw.num_sms)
        total += steps * c.round_s(per_sm) + fixed
    return total, _flops(s, p, groups, steps)


def merge_s(s: Schedule, p: WarpTileProgram, hw: HardwareModel) -> float:
    """The slices' merge on a row tile's critical path: every block stores its partial accumulators, and the
    last one to finish reads all ``slices`` of them back alone, at one SM's share of the L2 bandwidth (the
    device-wide bytes are in the memory term).  8 slices of a 128 x 128 tile read 512 KB through one SM:
    SD 1.5 UNet's convs in them measured 1.3-4.8x their estimate without this (unet_convs_h100.json).  Charged to
    the GEMM form (GEMMs, implicit-GEMM convs), where it was measured."""
    if s.slices == 1 or p.gemm is not None or p.row_states or p.score_ops:
        return 0.0  # attention's slices (flash-decoding) merge a few rows of states: the prior was fitted there
    part = p.merge_floats() * 32 * p.warps * p.warp.split * 4
    return (1 + s.slices) * part / (hw.l2_bandwidth_bytes_per_s / hw.num_sms)


def _flops(s: Schedule, p: WarpTileProgram, groups: int, steps: float) -> float:
    """FLOPs of ``groups`` warp groups of ``steps`` steps each (both GEMMs)."""
    kd = p.gemm.kp if p.gemm else 0  # K as the MMAs run it (padded to 16)
    return 2.0 * groups * steps * p.rows * p.step * (kd + sum(g.n_tile for g in p.gemm_states))
