"""A one-kernel GroupNorm's second pass: the lanes spread over the whole row as its state updates do.

A row reduced over (pixels, channels) with lanes on the channels stored its output one pixel after
another on the lanes that held a channel (40 of 128 at SD 1.5's 8x8x1280); the pass now spreads the lanes
over the flattened (pixels x channels) of the step, channels innermost (``lower.tir._pass_spread``)."""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest

from schedulers.schedule import make_schedule
from smg import patterns
from smg.reference import check_numerics, evaluate, random_inputs
from spacefusion.api import build

#: (pixels, channels, groups, SiLU, the time embedding's add, tiles, serial, step, lanes): channels in steps
#: with a tail (80 in steps of 64), a pixel step with one (100 pixels in steps of 64), lanes of one warp and
#: of four, one (image, group) per block or two
CASES = [
    (64, 1280, 32, True, False, {"n": 2, "g": 1}, "c", 40, 128),
    (64, 2560, 32, True, False, {"n": 1, "g": 2}, "c", 64, 128),
    (100, 256, 8, False, True, {"n": 1, "g": 1}, "s", 64, 32),
    (64, 640, 32, True, True, {"n": 2, "g": 2}, "s", 64, 128),
    # wide lanes (``schedulers.options.WIDE_LANES``): a row over 16 or 32 warps, whose results meet in shared memory
    (256, 1280, 32, True, True, {"n": 1, "g": 1}, "s", 256, 1024),
    (100, 256, 8, True, False, {"n": 1, "g": 1}, "s", 64, 512),
]


def _schedule(case):
    px, c, groups, silu, add, tiles, serial, step, lanes = case
    g = patterns.group_norm(2, px, groups, c, "silu" if silu else "none", dtype="float16", shift=add)
    return make_schedule(g, tiles=tiles, serial=serial, step=step, lanes=lanes)


@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[3]])
def test_the_pass_stores_every_lanes_share_unrolled(case) -> None:
    """The store runs unrolled over the lane's share of the row (no loop over pixels) and no lane is left
    out by a channel guard (``(tid & 127) < 40``); with the time embedding's add, ``X + E`` is recomputed in
    the pass (a lane's register tile holds only its own pixels)."""
    s = _schedule(case)
    src = build(s, "cuda").source
    body = src.split("sf_group_norm", 2)[-1]
    stores = [ln for ln in body.splitlines() if re.search(r"\bY_ptr\[", ln.split("=")[0])]
    px, c, groups = case[0], case[1], case[2]
    cg = c // groups
    per_step = min(s.step, cg) * px if s.serial == "c" else min(s.step, px) * cg  # a step's elements
    assert len(stores) == -(-per_step // s.lanes)  # one store per trip of the spread, in the loop over steps
    assert not re.search(rf"for \(int v = 0; v < {px};", body)
    assert not re.search(rf"\) & 127\) < {cg}\)", body)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_nvcc_compiles_the_spread_passes(tmp_path) -> None:
    for i, case in enumerate(CASES):
        folder = build(_schedule(case), "cuda").save(tmp_path / f"gn{i}")
        assert (folder / "kernel.cubin").stat().st_size > 0


@pytest.mark.cuda
@pytest.mark.parametrize("case", CASES)
def test_spread_passes_match_numpy_on_the_gpu(case, tmp_path) -> None:
    """Each schedule's kernel against the unfused float64 reference, on inputs with a mean away from 0."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from spacefusion.runtime.gpu import CudaKernel

    s = _schedule(case)
    kernel = CudaKernel(build(s, "cuda").save(tmp_path / "k"))
    xs = random_inputs(s.smg, seed=7)
    xs["X"] = (xs["X"].astype(np.float32) * 2 + 0.5).astype(np.float16)
    got = kernel.launch({n: torch.from_numpy(v).cuda() for n, v in xs.items()})
    torch.cuda.synchronize()
    ref = evaluate(s.smg, {n: v.astype(np.float64) for n, v in xs.items()})
    err, why = check_numerics(s.smg, ref, {n: t.float().cpu().numpy() for n, t in got.items()})
    assert why is None, why
