"""The search space's cheap prunes: CUDA-core candidates skipped where even their floor loses to the
tensor cores, tensor-core tiles that are whole MMA tiles, and 192-column tiles."""

from __future__ import annotations

import itertools

import pytest

from schedulers.errors import ScheduleError
from schedulers.hardware import H100
from search.cost import SIMT_SKIP_FACTOR, estimate_us, simt_floor_us, simt_veto
from search.space import SearchSpace
from smg import patterns


@pytest.mark.parametrize("graph", [
    patterns.gemm_epilogue(256, 512, 384, "gelu", True, "float16"),
    patterns.gemm_epilogue(1, 1024, 512, "none", False, "float16"),
    patterns.attention(1, 2, 128, 128, 64),
    patterns.layernorm(64, 768),
], ids=["gemm", "gemv", "attention", "layernorm"])
def test_simt_floor_is_below_every_cuda_core_estimate(graph) -> None:
    """The veto is sound against the ranking: no CUDA-core schedule estimates under the floor."""
    space = SearchSpace(graph, H100)
    floor = simt_floor_us(graph, H100)
    checked = 0
    for k in itertools.islice(space.knobs(tc=False), 0, None, 7):
        try:
            s = space._schedule(k)
        except ScheduleError:
            continue
        assert not s.tensor_cores and estimate_us(s, H100) >= floor - 1e-9
        checked += 1
        if checked >= 60:
            break
    assert checked > 0


def test_deep_gemm_skips_cuda_core_candidates_and_a_gemv_keeps_them() -> None:
    gemm = SearchSpace(patterns.gemm_epilogue(1024, 768, 1024, "none", True, "float16"), H100)
    cands = gemm.candidates(skip_simt=simt_veto(H100))
    best_tc = min(estimate_us(s, H100) for s in cands)
    assert cands and all(s.tensor_cores for s in cands)
    assert simt_floor_us(gemm.smg, H100) > SIMT_SKIP_FACTOR * best_tc
    assert "compute floor" in gemm.report.skipped and "skipped" in str(gemm.report)
    gemv = SearchSpace(patterns.gemm_epilogue(1, 1024, 512, "none", False, "float16"), H100)
    kept = gemv.candidates(skip_simt=simt_veto(H100))
    assert any(not s.tensor_cores for s in kept) and any(s.tensor_cores for s in kept)
    assert not gemv.report.skipped


def test_tensor_core_tiles_are_whole_mma_tiles_and_include_192_columns() -> None:
    space = SearchSpace(patterns.gemm_epilogue(1024, 768, 256, "none", True, "float16"), H100)
    tiles = {tuple(sorted(dict(s.block).items())) for s in space.candidates(skip_simt=simt_veto(H100))}
    assert (("m", 128), ("n", 192)) in tiles
    assert all(t % 8 == 0 for tile in tiles for _, t in tile if t > 1)
    small = SearchSpace(patterns.gemm_epilogue(128, 128, 256, "none", True, "float16"), H100)
    assert not any(192 in dict(s.block).values() for s in small.candidates(skip_simt=simt_veto(H100)))
