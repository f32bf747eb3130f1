"""Memory-traffic model (islpy footprints) and SMG partition under a hardware budget."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from schedulers.errors import ScheduleError
from schedulers.hardware import H100
from schedulers.partition import budget_bytes, partition
from schedulers.schedule import make_schedule
from schedulers.traffic import fused_kernel, on_chip, traffic, unfused_kernels
from smg import patterns as P
from smg.reference import evaluate, random_inputs, reduction_length
from smg.tolerance import assert_close
from smg.workloads import mha
from spacefusion.api import build

# -- the design notes' examples -----------------------------------------------------------------


def test_seed_004_layernorm_of_sum_four_accesses_down_to_two() -> None:
    """y = LayerNorm(x + z): unfused reads x, z / writes t / reads t / writes y; fused reads x, z and writes y."""
    g = P.residual_layernorm(64, 256, "float16")
    tr = traffic(make_schedule(g, {"m": 16}, step=256))  # the row fits: one step
    assert [k.name for k in tr.unfused] == ["T", "Y"]
    assert tr.unfused_accesses == 4
    assert tr.fused_accesses == 2
    b = 64 * 256 * 2
    vec = 256 * 2
    assert tr.unfused_bytes == 2 * b + b + (b + 2 * vec) + b  # add: X, R -> T; LN: T, W, B -> Y
    assert tr.fused_bytes == 2 * b + (64 // 16) * 2 * vec + b  # W, B are re-read by each row block


def test_two_pass_reads_the_row_again() -> None:
    g = P.residual_layernorm(64, 256, "float16")
    k = fused_kernel(make_schedule(g, {"m": 16}, step=64))  # row sliced in 4 steps: X, R re-read
    assert k.accesses == 3
    assert dict(k.reads)["X"] == dict(k.reads)["R"] == 2 * 64 * 256 * 2


def test_mha_unfused_operators_and_fused_kernel() -> None:
    g = mha(2, 3, 40, 56, 8)
    tr = traffic(make_schedule(g, {"m": 16}, step=16))
    assert [k.name for k in tr.unfused] == ["S", "Ss", "P", "O"]
    assert tr.unfused_accesses == 8 and tr.fused_accesses == 2
    assert 0 < tr.fused_bytes < tr.unfused_bytes


@pytest.mark.parametrize("tiles,step", [({"m": 16}, 16), ({"m": 7}, 5), ({"b": 1, "h": 1, "m": 40}, 56)])
def test_fused_reads_match_a_brute_force_block_count(tiles: dict[str, int], step: int) -> None:
    """Per block, each input is read over its own dims restricted to the block's tile."""
    g = mha(2, 3, 40, 56, 8)
    s = make_schedule(g, tiles, step=step)
    sizes = g.dim_sizes
    starts = [range(0, sizes[d], t) for d, t in s.block]
    want = dict.fromkeys(g.inputs, 0)
    for origin in itertools.product(*starts):
        ext = {d: min(t, sizes[d] - o) for (d, t), o in zip(s.block, origin)}
        for name in g.inputs:
            want[name] += math.prod(ext.get(d, sizes[d]) for d in g.space(name).dims)
    got = dict(fused_kernel(s).reads)
    assert got == {n: e * 2 for n, e in want.items()}  # float16


def test_on_chip_bytes_of_an_mha_block() -> None:
    g = mha(1, 1, 64, 64, 16)
    s = make_schedule(g, {"m": 32}, step=8)
    chip = dict(on_chip(s))
    assert chip["S"] == 32 * 8 * 4  # one step of scores per block, fp32
    assert chip["O"] == 32 * 16 * 4
    assert chip["K"] == 8 * 16 * 2 and chip["V"] == 8 * 16 * 2  # staged fp16 tiles


def test_unfused_layernorm_is_one_kernel_not_six() -> None:
    ks = unfused_kernels(P.layernorm(8, 32))
    assert [k.name for k in ks] == ["Y"]
    assert [r for r, _ in ks[0].reads] == ["X", "W", "B"]


# -- SMG partition -------------------------------------------------------------------------------


def _run(p, x: dict) -> dict:
    env = dict(x)
    for s in p.kernels:
        env.update(build(s, "llvm")({n: env[n] for n in s.smg.inputs}))
    return env


SMALL = dataclasses.replace(H100, name="small", smem_per_block_bytes=32 * 1024, smem_per_sm_bytes=32 * 1024,
                            smem_static_per_block_bytes=32 * 1024, regs_per_block=8192)


def test_gemm_layernorm_whose_row_does_not_fit_is_split_and_still_correct() -> None:
    g = P.gemm_layernorm(24, 640, 40)
    assert partition(g, H100, {"m": 16, "n": 32}, step=128).fused  # fits the real H100
    p = partition(g, SMALL, {"m": 16, "n": 32}, step=128)
    assert len(p.kernels) == 2 and p.materialised == ("C",)
    assert p.kernels[0].smg.outputs == ("C",) and p.kernels[1].smg.inputs[0] == "C"
    assert "recompute C" in p.reasons[0] and "KiB on chip" in p.reasons[0]
    assert "cut before 'Y'" in p.reasons[1]
    x = random_inputs(g, seed=0)
    got = _run(p, x)["Y"]
    assert_close(got, evaluate(g, x)["Y"], g.space("Y").dtype, reduction_length(g))  # smg/tolerance.py


def test_small_gemm_layernorm_stays_fused() -> None:
    p = partition(P.gemm_layernorm(24, 64, 40), H100, {"m": 8}, step=16)
    assert p.fused and p.kernels[0].num_steps == 1  # the row is kept on chip, not recomputed


def test_long_layernorm_row_is_sliced_temporally_not_split() -> None:
    tiny = dataclasses.replace(H100, name="tiny", smem_per_block_bytes=16 * 1024, smem_per_sm_bytes=16 * 1024,
                               smem_static_per_block_bytes=16 * 1024, regs_per_block=1024)
    g = P.residual_layernorm(16, 8192)
    p = partition(g, tiny, {"m": 16}, step=256)
    assert p.fused and p.kernels[0].num_steps == 32
    assert sum(b for _, b in on_chip(p.kernels[0])) <= budget_bytes(tiny)


def test_operator_that_fits_nowhere_is_a_clear_error() -> None:
    tiny = dataclasses.replace(H100, name="tiny", smem_per_block_bytes=1024, smem_per_sm_bytes=1024,
                               smem_static_per_block_bytes=1024, regs_per_block=32)
    with pytest.raises(ScheduleError, match=r"does not fit tiny even alone.*KiB on chip"):
        partition(P.gemm_layernorm(64, 640, 40), tiny, {"m": 16, "n": 64}, step=64)
