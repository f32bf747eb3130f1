"""Fixed-length numeric features of a Schedule for the learned cost model.

The vector mixes what the workload is (sizes, FLOPs, bytes) with what the
schedule decides (tiles, step, memory levels) and with analytical estimates
the model can correct rather than rediscover (exact device traffic from
``schedulers.traffic``, occupancy and waves from the hardware model, a
roofline time).  Tiles are summarised order-independently (product, max, min,
the thread dim's tile) so that one model serves workloads with different dim
names.  ``log2_*`` features are ``log2(1 + x)`` (finite at 0).  Everything
is a pure function of (schedule, hardware): equal inputs give bit-identical
vectors.  ``traffic`` (islpy footprints) dominates the cost, ~2-10 ms each.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import lru_cache

import numpy as np
import sympy as sp

from schedulers.hardware import HardwareError, HardwareModel
from schedulers.options import KNOB_FIELDS, KNOB_GROUP
from schedulers.schedule import LEVELS, Schedule
from schedulers.traffic import traffic
from smg.expr import body_expr, parse
from smg.ir import SMG, Op, itemsize

from .cost import estimate_us
from .warp_tile_cost import step_cost

#: the per-step units of the warp-tile cost model whose shares of the slowest are features
STEP_UNITS = ("tensor", "sfu", "simt", "smem", "l2", "latency")

#: (column, knob, encoding) of every knob that declares its own feature column, in group order
KNOB_COLUMNS: tuple[tuple[str, str, str], ...] = tuple(
    (f.metadata["feature"], f.name, f.metadata["encode"]) for f in KNOB_FIELDS if f.metadata["encode"])
_ENCODE = {"value": float, "flag": lambda v: float(bool(v)), "log2": lambda v: math.log2(1 + v)}

FEATURE_NAMES: tuple[str, ...] = (
    # -- workload
    "log2_iter_points",  # sum over ops of the iteration-domain size
    "log2_flops",  # sum over ops of domain size x body op count (+1 per point for a reduction)
    "log2_input_bytes",
    "log2_output_bytes",
    "num_ops",
    "num_states",  # update functions, auxiliary accumulators included
    "dtype_itemsize",  # widest input element
    # -- schedule
    "log2_num_blocks",
    "threads",
    "log2_threads",
    "warp_efficiency",  # threads / (warps x warp size): idle lanes of the last warp
    "log2_step",
    "num_steps",
    "log2_num_steps",
    "serial_tail",  # 1 when the step does not divide the serial dim (a partial last step)
    "num_cut_dims",
    "num_tiled_dims",  # cut dims whose tile is > 1
    "log2_tile_product",
    "log2_tile_max",
    "log2_tile_min",
    "log2_thread_dim_tile",
    "thread_dim_innermost",  # the thread dim is the innermost dim of the first output (coalesced writes)
    "second_pass",
    "log2_carry_flops",  # per-step rescaling of the accumulators (online-softmax style carries)
    "tensor_cores",  # 1 for a tensor-core kernel (warp-tile mma.sync or WMMA)
    "warp_mtiles",  # 16-row mma tiles per warp of a warp-tile program (0 otherwise)
    *(name for name, _, _ in KNOB_COLUMNS),  # the knobs' own columns, declared with each knob (options.knob)
    *(f"num_{level}_spaces" for level in LEVELS),
    # -- analytical estimates
    "shared_bytes_per_block",
    "log2_shared_bytes_per_block",
    "log2_register_bytes_per_block",
    "on_chip_bytes_per_block",
    "log2_on_chip_bytes_per_block",
    "regs_per_thread_est",
    "fused_bytes",
    "log2_fused_bytes",
    "log2_reread_factor",  # plain log2 of fused bytes / (inputs + outputs once): re-reads across blocks, passes
    "log2_bytes_per_block",
    "log2_flops_per_block",
    "fits",  # 1 when the hardware model admits at least one block per SM
    "occupancy_blocks_per_sm",
    "waves",
    "ceil_waves",
    "wave_efficiency",  # waves / ceil(waves): the tail wave's idle share
    "sm_utilization",  # busy SMs at one block per SM, averaged over rounds
    "log2_arith_intensity",
    "log2_roofline_us",
    # -- the analytical cost model's estimate, and for tensor-core kernels what bounds a step
    "log2_analytical_us",
    *(f"step_{u}_share" for u in STEP_UNITS),
)

_REG_BASE = 32  # registers per thread before any accumulator (indices, pointers, loop state)
_REGS_PER_FLOAT = 4  # a generous multiplier: each local fp32 value costs spills / temporaries too
_FALLBACK_PEAK = 1e12  # FLOP/s when the hardware model knows no peak at all for any dtype


def _log2(x: float) -> float:
    """log2(1 + x): finite for 0 and monotone, so zero bytes or FLOPs need no special case."""
    return math.log2(1.0 + max(0.0, float(x)))


@lru_cache(maxsize=4096)
def _op_flops_per_point(op: Op) -> int:
    """Body operations (sympy's ``count_ops``: a cheap, deterministic proxy), plus one for the
    combiner of a reduction, at least one."""
    return max(1, int(sp.count_ops(body_expr(op))) + (1 if op.reduce else 0))


def _domain(smg: SMG, dims: Iterable[str]) -> int:
    sizes = smg.dim_sizes
    return math.prod(sizes[d] for d in dims)


def _space_bytes(smg: SMG, name: str) -> int:
    return _domain(smg, smg.space(name).dims) * itemsize(smg.space(name).dtype)


def _simt_peak(hw: HardwareModel, dtype: str) -> float:
    """SIMT peak for ``dtype``; else fp32 SIMT, else the tensor peak, else the largest known one.

    The fallbacks keep the feature finite on models without a SIMT table (the NPU preset).
    """
    for key, tc in ((dtype, False), ("float32", False), (dtype, True)):
        try:
            return hw.peak_flops(key, tensor_core=tc)
        except HardwareError:
            continue
    known = [v for _, v in hw.peak_simt_flops_per_s + hw.peak_flops_per_s]
    return max(known) if known else _FALLBACK_PEAK


def _carry_flops(s: Schedule) -> float:
    """Operations spent re-basing accumulators between steps: count_ops(carry) per element per step."""
    total = 0.0
    for u in s.plan.states:
        if not u.carry:
            continue
        n = int(sp.count_ops(parse(u.carry)))
        total += n * _domain(s.smg, s.smg.space(u.base).dims) * s.num_steps
    return total


def _step_shares(s: Schedule, hw: HardwareModel) -> dict[str, float]:
    """Each unit's per-step time over the slowest unit's (warp-tile programs; zeros otherwise): which
    resource bounds a step, in a form that carries across workloads."""
    if s.warp_tile is None or hw.kind != "gpu":
        return {f"step_{u}_share": 0.0 for u in STEP_UNITS}
    c = step_cost(s, hw)
    times = (*c.units, c.latency_s)
    top = max(times) or 1.0
    return {f"step_{u}_share": t / top for u, t in zip(STEP_UNITS, times, strict=True)}


def features(s: Schedule, hw: HardwareModel) -> np.ndarray:
    """The feature vector of ``s`` on ``hw``, in ``FEATURE_NAMES`` order (float64).

    Registers per thread are estimated as ``min(255, 32 + 4 x fp32 values a
    thread holds in registers)``: the real count is only known after
    compilation, and the estimate only needs to move with the accumulator size.
    """
    smg = s.smg
    sizes = smg.dim_sizes
    # -- workload
    iter_points = sum(_domain(smg, op.iter_dims) for op in smg.ops)
    flops = float(sum(_domain(smg, op.iter_dims) * _op_flops_per_point(op) for op in smg.ops))
    in_bytes = sum(_space_bytes(smg, n) for n in smg.inputs)
    out_bytes = sum(_space_bytes(smg, n) for n in smg.outputs)
    dtype = max((smg.space(n).dtype for n in smg.inputs), key=itemsize, default="float32")
    item_bytes = itemsize(dtype)

    # -- schedule
    tiles = [t for _, t in s.block]
    threads = s.threads
    warps = math.ceil(threads / hw.warp_size)
    out_dims = smg.space(smg.outputs[0]).dims
    levels = dict(s.memory)
    carry = _carry_flops(s)

    # -- analytical
    tr = traffic(s)
    chip = dict(tr.on_chip)
    shared = sum(b for n, b in chip.items() if levels.get(n) == "shared")
    register = sum(b for n, b in chip.items() if levels.get(n) == "register")
    regs = min(hw.regs_per_thread_max, _REG_BASE + _REGS_PER_FLOAT * math.ceil(register / 4 / threads))
    fused = tr.fused_bytes
    blocks = s.num_blocks
    occ = hw.occupancy_blocks_per_sm(shared, threads, regs if hw.kind == "gpu" else 0)
    waves = blocks / (hw.num_sms * max(occ, 1))
    ceil_waves = math.ceil(waves)
    rounds = math.ceil(blocks / hw.num_sms)
    total_flops = flops + carry
    roofline_s = max(fused / hw.dram_bandwidth_bytes_per_s, total_flops / _simt_peak(hw, dtype))

    row = {
        "log2_iter_points": _log2(iter_points),
        "log2_flops": _log2(flops),
        "log2_input_bytes": _log2(in_bytes),
        "log2_output_bytes": _log2(out_bytes),
        "num_ops": len(smg.ops),
        "num_states": len(s.plan.states),
        "dtype_itemsize": item_bytes,
        "log2_num_blocks": _log2(blocks),
        "threads": threads,
        "log2_threads": _log2(threads),
        "warp_efficiency": threads / (warps * hw.warp_size),
        "log2_step": _log2(s.step),
        "num_steps": s.num_steps,
        "log2_num_steps": _log2(s.num_steps),
        "serial_tail": float(sizes[s.serial] % s.step != 0),
        "num_cut_dims": len(tiles),
        "num_tiled_dims": sum(1 for t in tiles if t > 1),
        "log2_tile_product": _log2(math.prod(tiles)),
        "log2_tile_max": _log2(max(tiles)),
        "log2_tile_min": _log2(min(tiles)),
        "log2_thread_dim_tile": _log2(s.tiles[s.thread_dim]),
        "thread_dim_innermost": float(s.thread_dim == out_dims[-1]),
        "second_pass": float(bool(s.plan.second_pass)),
        "log2_carry_flops": _log2(carry),
        "tensor_cores": float(s.tensor_cores),
        "warp_mtiles": s.warp_tile.warp_mtiles if s.warp_tile is not None else 0,
        **{name: _ENCODE[enc](getattr(getattr(s, KNOB_GROUP[knob]), knob)) for name, knob, enc in KNOB_COLUMNS},
        **{f"num_{level}_spaces": sum(1 for _, lv in s.memory if lv == level) for level in LEVELS},
        "shared_bytes_per_block": shared,
        "log2_shared_bytes_per_block": _log2(shared),
        "log2_register_bytes_per_block": _log2(register),
        "on_chip_bytes_per_block": tr.on_chip_bytes_per_block,
        "log2_on_chip_bytes_per_block": _log2(tr.on_chip_bytes_per_block),
        "regs_per_thread_est": regs,
        "fused_bytes": fused,
        "log2_fused_bytes": _log2(fused),
        "log2_reread_factor": math.log2(fused / max(1, in_bytes + out_bytes)) if fused else 0.0,
        "log2_bytes_per_block": _log2(fused / blocks),
        "log2_flops_per_block": _log2(total_flops / blocks),
        "fits": float(occ > 0),
        "occupancy_blocks_per_sm": occ,
        "waves": waves,
        "ceil_waves": ceil_waves,
        "wave_efficiency": waves / ceil_waves if ceil_waves else 1.0,
        "sm_utilization": blocks / (rounds * hw.num_sms) if rounds else 1.0,
        "log2_arith_intensity": _log2(total_flops / max(1, fused)),
        "log2_roofline_us": _log2(roofline_s * 1e6),
        "log2_analytical_us": _log2(estimate_us(s, hw)) if occ > 0 else _log2(roofline_s * 1e6),
        **_step_shares(s, hw),
    }
    assert tuple(row) == FEATURE_NAMES, "FEATURE_NAMES and the computed row drifted apart"
    return np.array([float(row[n]) for n in FEATURE_NAMES], dtype=np.float64)


def feature_matrix(schedules: Iterable[Schedule], hw: HardwareModel) -> np.ndarray:
    """Rows of ``features`` for each schedule, shape (n, len(FEATURE_NAMES))."""
    rows = [features(s, hw) for s in schedules]
    return np.vstack(rows) if rows else np.zeros((0, len(FEATURE_NAMES)), dtype=np.float64)
