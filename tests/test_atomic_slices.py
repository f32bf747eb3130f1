"""``atomic_slices``: blocks slicing a row tile's steps add their partial sums into one workspace part with
atomicAdd, and the last block reads that part alone and zeroes it (instead of reading every slice's part).

The knob is declared in ``schedulers/options.py`` (field, check, refusal codes, summary phrase; not offered by the
search) and lowered in ``spacefusion/lower/mma_out.py``; the schedule JSON, ``make_schedule``'s keyword, the CLI
flag, the learned model's column and the refusal codes come from the declaration.  The kernels are CUDA only:
here their source and cubin, on a GPU their outputs against the numpy reference (``cuda``-marked)."""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest

from experiments.mma_cases import CASES
from schedulers.errors import ScheduleError
from schedulers.hardware import H100
from schedulers.schedule import Schedule
from search.features import FEATURE_NAMES
from search.space import SearchSpace
from smg import patterns
from smg.reference import evaluate, reduction_length
from smg.tolerance import assert_close
from smg.workloads import softmax_gemm
from spacefusion.api import build, schedule
from spacefusion.frontend.builders import gated_gemm

#: sliced GEMMs: wgmma + TMA on two warpgroups, a gated GEMM's two accumulators, a stacked GEMM in 4 slices,
#: mma.sync in 3 uneven slices, and warp groups splitting each slice's steps (every group adds its part)
GEMMS = {
    "wgmma_tma": ("gemm_wgmma_tma_slices2", {}),
    "gated": ("gemm_gated_wgmma_slices2", {}),
    "stacked": ("gemm_stacked_tma_slices4", {}),
    "mma_sync": (lambda: patterns.gemm_epilogue(200, 200, 224, "sigmoid", True, "float16"),
                 dict(tiles={"m": 64, "n": 64}, step=32, stages=2, slices=3)),
    "split2": (lambda: patterns.gemm_epilogue(100, 128, 256, "relu", True, "float16"),
               dict(tiles={"m": 64, "n": 64}, step=32, stages=2, slices=2, split=2)),
}


def _gemm(name: str, atomic: bool = True) -> Schedule:
    case, kw = GEMMS[name]
    if isinstance(case, str):
        mk, tiles, step, stages, knobs = CASES[case]
        return schedule(mk(), tiles=tiles, serial="k", step=step, tensor_cores=True, stages=stages, **knobs,
                        atomic_slices=atomic)
    return schedule(case(), serial="k", tensor_cores=True, atomic_slices=atomic, **kw)


def test_the_knob_is_a_schedules_and_the_searchs_default_is_off() -> None:
    s, plain = _gemm("wgmma_tma"), _gemm("wgmma_tma", atomic=False)
    assert s.atomic_slices and s.warp_tile.warp.atomic_slices and not plain.atomic_slices
    assert s.to_dict()["atomic_slices"] is True and "atomic_slices" not in plain.to_dict()  # old keys hold
    assert Schedule.from_json(s.to_json()).key == s.key != plain.key
    assert "added into one workspace part by atomics" in str(s) and "atomics" not in str(plain)
    assert "atomic_slices" in FEATURE_NAMES
    sliced = SearchSpace(patterns.gemm_epilogue(256, 256, 512, "relu", True, "float16"), H100).candidates()
    assert any(c.slices > 1 for c in sliced) and not any(c.atomic_slices for c in sliced)


@pytest.mark.parametrize("make, kw, code", [
    (lambda: patterns.gemm_epilogue(128, 128, 256, "relu", True, "float16"),
     dict(tiles={"m": 64, "n": 64}, serial="k", step=32, stages=2), "atomic_slices.no_slices"),
    (lambda: softmax_gemm(100, 296, 64), dict(tiles={"m": 32}, step=32, stages=2, slices=3), "atomic_slices.not_sums"),
    (lambda: patterns.attention(1, 4, 16, 1024, 128), dict(tiles={"m": 16}, step=64, stages=2, slices=8),
     "atomic_slices.not_sums"),
])
def test_it_is_refused_without_slices_and_where_the_states_do_not_merge_by_a_sum(make, kw, code) -> None:
    with pytest.raises(ScheduleError) as info:
        schedule(make(), tensor_cores=True, atomic_slices=True, **kw)
    assert info.value.code == code and info.value.knob == "atomic_slices"
    with pytest.raises(ScheduleError) as info:  # a CUDA-core schedule
        schedule(patterns.layernorm(64, 256, "float16"), {"m": 1}, atomic_slices=True)
    assert info.value.code == "options.need_tensor_cores"


@pytest.mark.parametrize("name", sorted(GEMMS))
def test_the_parts_are_added_by_atomics_and_the_last_block_reads_one(name, tmp_path) -> None:
    """Every block adds each float of its part (atomicAdd on the workspace; one more counts the arrivals), the
    last reads one part back (``__ldcg``) where it read all ``slices x split`` before, and zeroes it; the rest of
    the kernel is the one without the knob.  It builds for sm_90a (nvcc, where present)."""
    s, plain = _gemm(name), _gemm(name, atomic=False)
    p = s.warp_tile
    floats, parts = p.merge_floats(), p.warp.slices * p.warp.split
    src, before = build(s, "cuda:sm_90a").source, build(plain, "cuda:sm_90a").source
    assert len(re.findall(r"atomicAdd\(\(&\(sf_partials", src)) == floats
    assert src.count("atomicAdd") == floats + 1 and before.count("atomicAdd") == 1
    assert before.count("__ldcg") == parts * floats and src.count("__ldcg") == floats
    assert len(re.findall(r"sf_partials_ptr\[[^\]]*\] = 0x0p\+0f", src)) == floats
    assert s.num_blocks == plain.num_blocks and s.threads == plain.threads
    if shutil.which("nvcc"):
        assert (build(s, "cuda:sm_90a").save(tmp_path / name) / "kernel.cubin").stat().st_size > 0


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(GEMMS))
def test_atomic_slices_match_numpy_on_gpu_and_leave_the_workspace_zeroed(name, tmp_path) -> None:
    """Two launches, each within the tolerance of the numpy reference: the second finds the part the first
    zeroed (a part left holding sums would add them in)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from spacefusion.runtime.gpu import CudaKernel

    s = _gemm(name)
    kernel = CudaKernel(build(s, "cuda").save(tmp_path / name))
    rng = np.random.default_rng(0)
    dtype = getattr(torch, s.smg.space(s.smg.inputs[0]).dtype)
    xs = {n: torch.from_numpy(rng.standard_normal(s.smg.shape(n))).to(dtype) for n in s.smg.inputs}
    ref = evaluate(s.smg, {n: v.double().numpy() for n, v in xs.items()})
    for _ in range(2):
        out = kernel.launch({n: v.to("cuda") for n, v in xs.items()})
        for n, v in out.items():
            assert_close(v.double().cpu().numpy(), ref[n], s.smg.space(n).dtype, reduction_length(s.smg), name=n)


def test_a_gated_gemms_two_accumulators_are_both_added() -> None:
    s = schedule(gated_gemm(200, 320, 256, "silu", "float16"), tiles={"m": 128, "n": 64}, serial="k", step=64,
                 tensor_cores=True, stages=2, wgmma=True, slices=2, atomic_slices=True)
    assert [g.update.state for g in s.warp_tile.gemm_states] == ["G", "U"]
    src = build(s, "cuda:sm_90a").source
    assert src.count("atomicAdd") == s.warp_tile.merge_floats() + 1
