"""Seed 000's vertical chain: Upsample(2x) -> Conv2d 3x3 -> GroupNorm -> SiLU, through windowed
(halo) and gather mappings, the derived GroupNorm moment updates, and the traffic model."""

from __future__ import annotations

import numpy as np
import pytest

from schedulers.errors import ScheduleError, TemporalSliceError
from schedulers.interpreter import interpret
from schedulers.schedule import make_schedule
from schedulers.temporal import plan_temporal
from schedulers.traffic import traffic
from smg import patterns as P
from smg.ir import Kind
from smg.reference import evaluate, random_inputs
from spacefusion.api import build

SHAPE = (2, 3, 4, 5, 6, 2)  # batch, c_in, c_out, height, width, groups: tails everywhere


def numpy_chain(x: dict[str, np.ndarray], c_out: int, groups: int) -> np.ndarray:
    """The chain written directly in numpy, independent of the SMG."""
    inp = x["In"].astype(np.float64)
    n, c, h, w = inp.shape
    up = np.pad(inp.repeat(2, 2).repeat(2, 3), ((0, 0), (0, 0), (1, 1), (1, 1)))
    wc = x["Wc"].astype(np.float64).reshape(c_out, c, 3, 3)
    conv = np.zeros((n, c_out, 2 * h, 2 * w))
    for ky in range(3):
        for kx in range(3):
            conv += np.einsum("oc,ncyx->noyx", wc[:, :, ky, kx], up[:, :, ky:ky + 2 * h, kx:kx + 2 * w])
    cg = conv.reshape(n, groups, c_out // groups, 2 * h, 2 * w)
    mu, var = cg.mean(axis=(2, 3, 4), keepdims=True), cg.var(axis=(2, 3, 4), keepdims=True)
    gn = (cg - mu) / np.sqrt(var + 1e-6) * x["gw"][None, :, :, None, None] + x["gb"][None, :, :, None, None]
    return gn / (1 + np.exp(-gn))


def test_reference_matches_plain_numpy() -> None:
    g = P.vae_decoder_block(*SHAPE)
    x = random_inputs(g, seed=0)
    np.testing.assert_allclose(evaluate(g, x)["Out"], numpy_chain(x, SHAPE[2], SHAPE[5]), rtol=1e-12, atol=1e-12)


def test_window_and_gather_mappings() -> None:
    g = P.vae_decoder_block(*SHAPE)
    conv_in = next(e for e in g.edges if e.src == "U" and e.dst == "Cv.it")
    assert {d: conv_in.kind(d) for d in ("y", "x", "ky", "kx")} == dict.fromkeys(("y", "x", "ky", "kx"), Kind.WINDOWED)
    up = next(e for e in g.edges if e.src == "In")
    assert up.kind("y") is Kind.ONE_TO_ONE  # floor(y/2): each output row reads one input row
    assert g.count_kinds()[Kind.WINDOWED] == 4


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("step", [10, 4, 3])
def test_llvm_kernel_matches_reference(dtype: str, step: int) -> None:
    g = P.vae_decoder_block(*SHAPE, dtype=dtype)
    s = make_schedule(g, serial="y", step=step)
    assert s.plan.streamed == ("U", "Cv") and s.plan.second_pass == ("Out",)
    x = random_inputs(g, seed=1)
    got = build(s, "llvm")(x)["Out"].astype(np.float64)
    ref = evaluate(g, x)["Out"]
    assert np.abs(got - ref).max() < (2e-5 if dtype == "float32" else 5e-3)


def test_cuda_kernel_is_generated() -> None:
    s = make_schedule(P.vae_decoder_block(*SHAPE, dtype="float16"), serial="y", step=4)
    assert "__global__" in build(s, "cuda").source


def test_seed_000_eight_accesses_down_to_two() -> None:
    """Unfused: each of Upsample, Conv, GroupNorm, SiLU reads and writes device memory (8);
    fused with the rows on chip: read the input once, write the output once (2)."""
    g = P.vae_decoder_block(*SHAPE)
    tr = traffic(make_schedule(g, serial="y", step=10))
    assert [k.name for k in tr.unfused] == ["U", "Cv", "GN", "Out"]
    assert tr.unfused_accesses == 8
    assert tr.fused_accesses == 2
    assert tr.fused_bytes < tr.unfused_bytes
    # sliced rows: the second pass recomputes the convolution from the input, read again
    assert traffic(make_schedule(g, serial="y", step=4)).fused_accesses == 3


def test_unsupported_paths_say_why() -> None:
    g = P.vae_decoder_block(*SHAPE)
    with pytest.raises(ScheduleError, match="cannot follow 'U' reading 'In'"):
        interpret(make_schedule(g, serial="y", step=4), random_inputs(g, seed=0))
    with pytest.raises(TemporalSliceError, match="must be streamed"):
        plan_temporal(g, "c")  # the convolution would be the running state: it windows its input
