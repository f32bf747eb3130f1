"""``nn.Linear``'s weight as stored, B [n, k] (K-major), as a warp-tile GEMM operand: mma.sync reads it with
ldmatrix without ``.trans``, wgmma as its B without transposition, TMA in [64, n_tile] boxes.  Numerics of
the kernels are the GPU's (``test_mma.py::test_warp_tile_kernel_matches_numpy_on_gpu`` runs the ``gemm_nk_*``
and ``gemm_rms_*`` cases of ``experiments/mma_cases.py``)."""

from __future__ import annotations

import re

import pytest

from experiments.mma_cases import _schedule
from schedulers.hardware import H100
from schedulers.warp_tile import smem_layout, tma_maps, warp_tile_program
from smg import patterns
from spacefusion.api import build, schedule
from spacefusion.frontend.schedules import model_pick


def _nk(**kw) -> object:
    g = patterns.gemm_epilogue(200, 256, 192, "sigmoid", True, "float16", b_layout="nk")
    return schedule(g, tiles={"m": 64, "n": 128}, tensor_cores=True, **kw)


def test_a_weight_stored_n_k_is_a_k_major_gemm_state() -> None:
    """Refused before ("GEMM operand 'Bw' ('n', 'k') must be [.., k, .., n]"): its tiles are [n_tile, step],
    rows padded for ldmatrix, or one 128 B-swizzled band of 64 k for wgmma."""
    s = _nk(step=32, stages=2)
    (gs,) = warp_tile_program(s).gemm_states
    assert (gs.x, gs.n, gs.factor, gs.n_tile, gs.k_major) == ("Bw", "n", "A", 128, True)
    assert smem_layout(s, s.warp_tile)["Bw"] == (2, 128, 32 + 8)
    w = _nk(step=64, stages=3, wgmma=True)
    assert w.warp_tile.wgmma_ss and smem_layout(w, w.warp_tile)["Bw"] == (3, 128, 64)
    kn = schedule(patterns.gemm_epilogue(200, 256, 192, "sigmoid", True, "float16"), tiles={"m": 64, "n": 128},
                  tensor_cores=True, step=32, stages=2)
    assert not kn.warp_tile.gemm_states[0].k_major and smem_layout(kn, kn.warp_tile)["Bw"] == (2, 32, 128 + 8)


def test_k_major_b_is_read_without_a_transpose() -> None:
    """mma.sync: ldmatrix without .trans (the [k, n] layout's is transposed); wgmma: the instruction's
    imm-trans-b 0 (1 for [k, n]); TMA: a [64 k, 128 n] box of the [n, k] tensor, innermost first."""
    src = build(_nk(step=32, stages=2), "cuda").source
    assert "ldmatrix.sync.aligned.m8n8.x4" in src and ".trans" not in src
    nk = build(_nk(step=64, stages=3, wgmma=True), "cuda").source
    kn = build(schedule(patterns.gemm_epilogue(200, 256, 192, "sigmoid", True, "float16"), tiles={"m": 64, "n": 128},
                        tensor_cores=True, step=64, stages=3, wgmma=True), "cuda").source
    last = r"ps0, 1, 1, 0, (\d);"
    assert set(re.findall(last, nk)) == {"0"} and set(re.findall(last, kn)) == {"1"}
    t = _nk(step=64, stages=3, wgmma=True, tma=True, producer=True)
    assert tma_maps(t, t.warp_tile)["Bw__tmap"] == {"tensor": "Bw", "box": [64, 128], "swizzle": 128}


@pytest.mark.parametrize("name", ["gemm_gated_nk_wgmma_tma", "gemm_stacked_nk_gelu"])
def test_gated_and_stacked_gemms_take_k_major_weights(name: str) -> None:
    p = _schedule(name).warp_tile
    assert p.gemm_states and all(g.k_major for g in p.gemm_states)


def test_the_first_picks_of_small_linears_stay_on_cuda_cores() -> None:
    """Decoding's GEMVs (B [n, k] below 16 rows) now have tensor-core candidates too; the model still ranks
    the CUDA-core GEMV first, so their first picks are unchanged."""
    for g in (patterns.gemm_epilogue(1, 4096, 4096, "none", False, "float16", "nk"),
              patterns.gemm_epilogue(8, 896, 896, "none", True, "float16", "nk")):
        s, _ = model_pick(g, H100)
        assert not s.tensor_cores, g.name
