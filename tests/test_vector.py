"""Vector loads/stores of the CUDA-core lowering (``Schedule.vector``): runs of consecutive serial
elements per lane, checked on llvm against the numpy reference and compiled for CUDA."""

from __future__ import annotations

import re
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedulers.errors import ScheduleError
from schedulers.hardware import get_hardware
from schedulers.schedule import Schedule
from search.space import SearchSpace
from smg import patterns as P
from smg import workloads as W
from smg.reference import reduction_length
from smg.tolerance import assert_close
from spacefusion.api import build, evaluate, random_inputs, schedule


def _check_llvm(g, **kw) -> None:
    ins = random_inputs(g, seed=0)
    out = build(schedule(g, **kw), "llvm")(ins)
    ref = evaluate(g, ins)
    for name, want in ref.items():
        assert_close(out[name], want, g.space(name).dtype, reduction_length(g), name)  # smg/tolerance.py


@settings(max_examples=6, deadline=None)
@given(rows=st.integers(1, 9), n4=st.integers(2, 40), step=st.sampled_from([8, 16, 64]),
       vec=st.sampled_from([2, 4]))
def test_vector_layernorm_matches_reference(rows, n4, step, vec) -> None:
    """Steps that do not divide the row (a partial last step) and one-step rows alike."""
    n = 4 * n4
    _check_llvm(P.residual_layernorm(rows, n, "float32"), tiles={"m": min(4, rows)}, serial="n",
                step=min(step, n - n % vec), vector=vec)


@pytest.mark.parametrize("g,kw", [
    (W.softmax_gemm(37, 300, 16), dict(tiles={"m": 8}, serial="l", step=32)),
    (P.softmax(10, 300, "float32"), dict(tiles={"m": 4}, serial="n", step=300)),
])
def test_vector_streamed_and_second_pass(g, kw) -> None:
    _check_llvm(g, vector=4, **kw)


def test_vector_cuda_source_has_wide_accesses() -> None:
    g = P.residual_layernorm(100, 300, "float16")
    s = schedule(g, tiles={"m": 4}, serial="n", step=300, lanes=1, vector=4)
    src = build(s, "cuda").source
    # X and R are read, Y written, as half4 (8 bytes) at a time
    assert re.search(r"\*\(half4\*\)\(X_ptr", src) and re.search(r"\*\(half4\*\)\(R_ptr", src)
    assert re.search(r"\*\(half4\*\)\(Y_ptr", src)
    g8 = P.residual_layernorm(100, 304, "float16")
    src8 = build(schedule(g8, tiles={"m": 4}, serial="n", step=304, lanes=1, vector=8), "cuda").source
    assert re.search(r"\*\(uint4\*\)\(X_ptr", src8) and re.search(r"\*\(uint4\*\)\(Y_ptr", src8)
    scalar = build(schedule(g, tiles={"m": 4}, serial="n", step=300), "cuda").source
    assert "half4" not in scalar.split("__global__")[-1]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_nvcc_compiles_vector_kernels_with_lanes(tmp_path) -> None:
    for g, kw in [
        (P.residual_layernorm(100, 300, "float16"), dict(tiles={"m": 4}, serial="n", step=128, lanes=32)),
        (W.softmax_gemm(100, 300, 16, dtype="float16"), dict(tiles={"m": 8}, serial="l", step=64, lanes=8)),
    ]:
        art = build(schedule(g, vector=4, **kw), "cuda")
        assert art.save(tmp_path / g.name).joinpath("kernel.cubin").stat().st_size > 0


@pytest.mark.parametrize("kw,msg", [
    (dict(vector=16), "must be one of"),
    (dict(vector=3), "must be one of"),
    (dict(step=24, lanes=8, vector=4), "multiple of lanes x vector"),
    (dict(vector=4, tensor_cores=True), "vector applies to CUDA-core kernels"),
])
def test_vector_refusals_name_the_problem(kw, msg) -> None:
    g = P.residual_layernorm(64, 256, "float16")
    with pytest.raises(ScheduleError, match=msg):
        schedule(g, tiles={"m": 16}, serial="n", **{"step": 32, **kw})


def test_vector_at_most_16_bytes() -> None:
    schedule(P.residual_layernorm(8, 256, "float16"), tiles={"m": 4}, serial="n", step=32, vector=8)
    with pytest.raises(ScheduleError, match="is 32 bytes"):
        schedule(P.residual_layernorm(8, 256, "float32"), tiles={"m": 4}, serial="n", step=32, vector=8)


def test_vector_not_straddling_the_dim_end() -> None:
    with pytest.raises(ScheduleError, match="multiple of vector 4"):
        schedule(P.residual_layernorm(8, 302, "float16"), tiles={"m": 4}, serial="n", step=32, vector=4)


def test_vector_round_trips_and_keeps_old_keys() -> None:
    g = P.residual_layernorm(64, 256, "float16")
    s = schedule(g, tiles={"m": 4}, serial="n", step=64, lanes=8, vector=4)
    assert Schedule.from_json(s.to_json()) == s and s.to_dict()["vector"] == 4
    assert "vector" not in schedule(g, tiles={"m": 4}, serial="n", step=64).to_dict()


def test_search_space_offers_vectors_on_gpu_only() -> None:
    g = P.residual_layernorm(64, 256, "float16")
    gpu = {s.vector for s in SearchSpace(g, get_hardware("h100")).candidates()}
    cpu = {s.vector for s in SearchSpace(g, get_hardware("h100"), cuda=False).candidates()}
    assert gpu == {1, 8} and cpu == {1}  # 8 fp16 elements: 16-byte accesses


def test_lanes_beyond_a_warp_reduce_through_shared_memory() -> None:
    """A row over 4 warps: shuffles within each warp, then the warps' partial sums in shared memory."""
    g = P.residual_layernorm(64, 4096, "float16")
    s = schedule(g, tiles={"m": 1}, serial="n", step=4096, lanes=128, vector=8)
    assert s.threads == 128
    src = build(s, "cuda").source.split("__global__")[-1]
    # 2 states, 2 barriers each: the third (N_sqsum's auxiliary accumulator) only carries into a later step,
    # and this kernel has one
    assert s.num_steps == 1 and any(u.space for u in s.plan.states)
    assert "__shfl_xor_sync" in src and src.count("__syncthreads()") == 2 * 2
    assert re.search(r"__shared__ alignas\(\d+\) float _ptr\w*\[4\]", src)  # one partial per warp
    with pytest.raises(ScheduleError, match="lanes 2048 must be a power of two up to 1024"):
        schedule(g, tiles={"m": 1}, serial="n", step=4096, lanes=2048)
    _check_llvm(P.residual_layernorm(5, 304, "float32"), tiles={"m": 1}, serial="n", step=256, lanes=128)
