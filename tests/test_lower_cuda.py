"""CUDA emission: source and launch metadata, and nvcc compiling it (where nvcc exists)."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from schedulers.errors import ScheduleError
from schedulers.schedule import Schedule
from smg import patterns
from smg.workloads import mha, softmax_gemm
from spacefusion.api import build, schedule
from spacefusion.runtime.artefact import KernelArtefact


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_cuda_source_and_metadata(arch, dtype) -> None:
    s = schedule(mha(2, 3, 197, 197, 64, dtype=dtype), tiles={"m": 64}, step=32)
    art = build(s, f"cuda:{arch}")
    m = art.meta
    assert "__global__" in art.source and m["kernel_name"] in art.source
    assert m["grid"] == [2 * 3 * 4, 1, 1] and m["block"] == [64, 1, 1]
    assert sorted(m["param_order"]) == ["K", "O", "Q", "V"]
    assert {p["name"]: p["shape"] for p in m["params"]}["O"] == [2, 3, 197, 64]
    assert all(p["dtype"] == dtype for p in m["params"])
    assert m["static_smem_bytes"] == 2 * 32 * 64 * (2 if dtype == "float16" else 4)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_kernels_for_hopper_wait_for_the_grid_before_them_first(arch) -> None:
    """On sm_90+ every kernel's first statement is ``griddepcontrol.wait`` and its metadata says so (the
    runtime then launches it programmatically dependent); sm_80 has no such instruction."""
    from spacefusion.lower.build import GRID_WAIT

    g = patterns.gemm_epilogue(128, 128, 64, "relu", True, "float16")
    for s in (schedule(mha(1, 2, 64, 64, 64), tiles={"m": 64}, step=32),
              schedule(g, tiles={"m": 64, "n": 64}, serial="k", step=32, tensor_cores=True, stages=2)):
        art = build(s, f"cuda:{arch}")
        hopper = arch == "sm_90a"
        assert art.meta["grid_dependency_wait"] is hopper
        assert art.source.count(GRID_WAIT) == int(hopper)
        if hopper:  # the first statement of the kernel's definition
            body = art.source.split(f"{art.meta['kernel_name']}(", 2)[-1]
            assert body.split("{", 1)[1].lstrip().startswith(GRID_WAIT)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_nvcc_compiles_generated_cuda(tmp_path, arch) -> None:
    for g in (mha(1, 2, 197, 197, 64), softmax_gemm(300, 197, 64)):
        s = schedule(g, tiles={"m": 64}, step=32)
        folder = build(s, f"cuda:{arch}").save(tmp_path / f"{g.name}_{arch}")
        assert (folder / "kernel.cubin").stat().st_size > 0
        meta = json.loads((folder / "kernel.json").read_text())
        assert meta["cubin"] == "kernel.cubin"
        KernelArtefact.load(folder)  # the TVM-free runner accepts it


def test_shared_memory_above_48k_is_dynamic() -> None:
    """K and V tiles of 128 x 128 fp32 (128 KB) go to dynamic shared memory, opted in at launch."""
    s = schedule(mha(1, 1, 1024, 1024, 128, dtype="float32"), tiles={"m": 64}, step=128)
    art = build(s, "cuda")
    assert "extern __shared__" in art.source
    assert art.meta["dynamic_smem_bytes"] == 2 * 128 * 128 * 4 and art.meta["static_smem_bytes"] == 0
    small = build(schedule(mha(1, 1, 64, 64, 16), tiles={"m": 64}, step=16), "cuda")
    assert small.meta["dynamic_smem_bytes"] == 0 and "extern __shared__" not in small.source


def test_shared_memory_over_the_opt_in_limit_is_refused() -> None:
    s = schedule(mha(1, 1, 1024, 1024, 128, dtype="float32"), tiles={"m": 64}, step=256)
    with pytest.raises(ScheduleError, match="shared memory"):
        build(s, "cuda:sm_90a")


def test_lanes_reduce_with_warp_shuffles() -> None:
    """Lanes split each step's serial elements; their partial results meet in shuffles.  The CUDA
    path was checked on the H100 (softmax, residual LayerNorm, MHA, Softmax-GEMM, with tails); on
    llvm a thread does its lane group's work, so the numerics below are the CPU form."""
    from smg import patterns
    from smg.reference import evaluate, random_inputs
    from spacefusion.api import build

    g = patterns.residual_layernorm(10, 70, "float16")
    s = schedule(g, tiles={"m": 4}, step=16, lanes=8)
    assert s.threads == 32 and s.lanes == 8
    assert Schedule.from_json(s.to_json()) == s
    assert schedule(g, tiles={"m": 4}, step=16).to_dict().get("lanes") is None  # lanes=1 keeps old keys
    src = build(s, "cuda").source
    assert "__shfl_xor_sync" in src
    x = random_inputs(g, seed=0)
    got = build(s, "llvm")(x)["Y"].astype("float64")
    assert abs(got - evaluate(g, x)["Y"]).max() < 5e-3


def test_gemm_epilogue_on_tensor_cores() -> None:
    """GEMM + element-wise epilogue lowers into one tensor-core kernel: as a warp-tile program
    (mma.sync) when the tiles are multiples of 16, else through TVM's WMMA tensorizer (checked
    against torch on the H100); other plans are refused with the reason."""
    from smg import patterns

    g = patterns.gemm_epilogue(256, 192, 96, "silu", True, "float16")
    mma = build(schedule(g, tiles={"m": 64, "n": 64}, step=32, tensor_cores=True), "cuda")
    assert "mma.sync.aligned.m16n8k16" in mma.source and "wmma" not in mma.source
    assert mma.meta["grid"] == [4 * 3, 1, 1] and mma.meta["block"] == [128, 1, 1]
    s = schedule(g, tiles={"m": 8, "n": 64}, step=32, tensor_cores=True)  # rows not a multiple of 16
    assert Schedule.from_json(s.to_json()).tensor_cores
    art = build(s, "cuda")
    assert "wmma" in art.source
    assert len(re.findall(r"__global__ void[^;]*\{", art.source)) == 1  # one fused kernel (plus its declaration)
    assert art.meta["dynamic_smem_bytes"] > 0 and art.meta["block"][0] * art.meta["block"][1] > 32
    assert sorted(art.meta["param_order"]) == ["A", "Bw", "Y", "bias"]
    with pytest.raises(ScheduleError, match="tensor cores requested for 'layernorm'.*warp-tile program: outputs keep"):
        schedule(patterns.layernorm(64, 256, "float16"), tiles={"m": 16}, step=64, tensor_cores=True)


def test_spread_lanes_load_without_a_branch_per_element() -> None:
    """A split's stats kernel spreads its lanes over (chunks x channels); a step past the serial dim's end
    (80 channels in steps of 64) clamps the index and selects, so no load sits in a branch of its own:
    ptxas does not hoist loads across branches, and the H100 ran such a kernel's 40 loads a lane one memory
    latency after another (12.7 us for 1 MB)."""
    from schedulers.hardware import H100
    from schedulers.schedule import make_schedule
    from schedulers.split import decide_split

    split = decide_split(patterns.group_norm(2, 256, 32, 2560, "silu", dtype="float16"), H100)
    stats = split.kernels[1]
    assert stats.dim_sizes["c_part"] == 80
    s = make_schedule(stats, tiles={"n": 2, "g": 2}, serial="c_part", step=64, lanes=32)
    lines = [ln.strip() for ln in build(s, "cuda").source.splitlines() if ln.strip()]
    loads = [i for i, ln in enumerate(lines) if re.search(r"N_sum_p_ptr\[", ln)]
    assert loads and "min(" in "".join(lines[i] for i in loads)
    assert not [lines[i] for i in loads if lines[i - 1].startswith("if (")]


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_a_cuda_core_store_in_16_bits_takes_the_fast_exp_and_division(dtype) -> None:
    """A GroupNorm's SiLU pass (CUDA cores) stored in fp16: ``exp`` as ``exp2f`` (one ex2.approx) and the
    logistic's division as ``__fdividef``, as the warp-tile kernels' 16-bit values; stored in fp32 it keeps
    ``expf`` and IEEE division.  Its CPU build is the same either way (the numerics tests run it)."""
    from schedulers.hardware import H100
    from schedulers.split import decide_split

    got = decide_split(patterns.group_norm(2, 64 * 64, 32, 320, "silu", dtype=dtype), H100)
    assert not isinstance(got, str)
    apply = got.kernels[2]
    body = build(schedule(apply, tiles={"n": 1, "s": 32}), "cuda:sm_90a").source
    body = body[body.index("__global__"):]
    fast = dtype == "float16"
    assert ("exp2f(" in body) is fast and ("__fdividef(" in body) is fast
    assert ("expf(" in body) is not fast


def test_a_one_kernel_group_norm_after_an_add_spreads_its_lanes_over_the_channels() -> None:
    """The updates of a one-kernel GroupNorm of ``X + E`` recompute the sum from the inputs, so their lanes
    take consecutive channels (``% 40``: a group's channels, innermost) as the plain GroupNorm's do, not the
    per-lane tile, whose lanes sat 2560 bytes apart along the pixels (8x8x1280 on the H200: 4.7 -> 2.8 us)."""
    import re

    from spacefusion.frontend.schedules import ranked

    g = patterns.group_norm(2, 8 * 8, 32, 1280, "silu", dtype="float16", shift=True)
    s = ranked(g)[0]
    assert s.lanes > 1
    src = build(s, "cuda:sm_90a").source
    along = len(re.findall(r"E_ptr\[[^\]]*% 40\)+\]", src))  # reads of E at a lane's channel
    stores = len(re.findall(r"Y_ptr\[", src))  # the second pass's, which read E along the channels already
    assert along > 2 * stores, f"{along} reads of E along the channels: the updates read the per-lane tile"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_a_cubin_cache_that_cannot_be_written_leaves_a_whole_artefact(tmp_path) -> None:
    """A read-only cache (HOME not writable) only costs the cache: the artefact is written whole, with a
    warning naming the folder and the variable that moves it."""
    import os

    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder would be")  # mkdir fails under any user, root included
    art = build(schedule(patterns.layernorm(32, 64), tiles={"m": 8}), "cuda:sm_90a")
    with pytest.warns(RuntimeWarning, match="cannot be written.*SPACEFUSION_CUBIN_CACHE"):
        folder = art.save(tmp_path / "art", cache=blocked / "cubins")
    meta = json.loads((folder / "kernel.json").read_text())
    assert meta["cubin"] == "kernel.cubin" and (folder / "kernel.cubin").stat().st_size > 0
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
