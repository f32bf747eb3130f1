"""A row's reductions over a thread-block cluster (``SimtOptions.cluster``, ``lower.cluster``).

A GroupNorm row spread over ``cluster`` blocks: each block reduces its share, the blocks' results meet in
distributed shared memory, and each block stores its share of the row in the second pass."""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest

from schedulers.errors import ScheduleError
from schedulers.schedule import make_schedule
from smg import patterns
from smg.reference import check_numerics, evaluate, random_inputs
from spacefusion.api import build

#: (pixels, channels, groups, SiLU, the time embedding's add, cluster, lanes, step): rows of 2560 to 40960
#: elements; a pixel step with a tail (100 pixels in steps of 64: several steps, so carries between them)
CASES = [
    (4096, 320, 32, True, True, 8, 512, 4096),
    (1024, 640, 32, False, False, 4, 1024, 1024),
    (256, 1280, 32, True, True, 8, 256, 256),
    (100, 256, 8, True, False, 2, 64, 64),
]


def _smg(case):
    px, c, groups, silu, add = case[:5]
    return patterns.group_norm(2, px, groups, c, "silu" if silu else "none", dtype="float16", shift=add)


def _schedule(case):
    cluster, lanes, step = case[5:]
    return make_schedule(_smg(case), tiles={"n": 1, "g": 1}, serial="s", step=step, lanes=lanes, cluster=cluster)


def test_a_cluster_multiplies_the_blocks_and_the_row_lanes() -> None:
    s = _schedule(CASES[0])
    assert s.num_blocks == 2 * 32 * 8 and s.threads == 512 and s.row_lanes == 4096
    assert make_schedule(_smg(CASES[0]), tiles={"n": 1, "g": 1}, serial="s", step=4096, lanes=512).num_blocks == 64


@pytest.mark.parametrize("case", CASES[:3])
def test_the_kernel_is_declared_a_cluster_and_meets_in_distributed_shared_memory(case) -> None:
    """The source declares the cluster shape, defines the helpers once, and every reduction of a step crosses
    the cluster between two cluster barriers, reading each block's result once."""
    s = _schedule(case)
    art = build(s, "cuda")
    src = art.source
    cluster = case[5]
    assert art.meta["cluster"] == [cluster, 1, 1] and art.meta["grid"] == [s.num_blocks, 1, 1]
    kernel = re.findall(r'extern "C" __global__ void (__cluster_dims__\(\d+, 1, 1\)) __launch_bounds__\((\d+)\)', src)
    assert kernel and all(k == (f"__cluster_dims__({cluster}, 1, 1)", str(s.threads)) for k in kernel)
    assert src.count("void sf_cluster_sync()") == 1 and src.count("float sf_cluster_load(") == 1
    body = src.split("__launch_bounds__", 2)[-1]
    syncs, loads = body.count("sf_cluster_sync()"), body.count("sf_cluster_load(")
    assert syncs >= 2 and loads == syncs // 2 * cluster
    ranks = re.findall(r"sf_cluster_load\(\(&\(\w+\[0\]\)\), (\d+)\)", body)
    assert len(ranks) == loads and sorted({int(r) for r in ranks}) == list(range(cluster))


def test_a_plain_schedule_has_no_cluster() -> None:
    s = make_schedule(_smg(CASES[0]), tiles={"n": 1, "g": 1}, serial="s", step=4096, lanes=512)
    art = build(s, "cuda")
    assert "cluster" not in art.meta and "__cluster_dims__" not in art.source and "sf_cluster" not in art.source


@pytest.mark.parametrize("knobs,code", [
    ({"tiles": {"n": 1, "g": 2}, "lanes": 256}, "cluster.lanes"),  # two rows a block
    ({"tiles": {"n": 1, "g": 1}, "lanes": 16}, "cluster.lanes"),  # less than a warp
    ({"tiles": {"n": 1, "g": 1}, "lanes": 32, "vector": 2, "step": 64}, "cluster.scalar"),
    ({"tiles": {"n": 1, "g": 1}, "lanes": 64, "cluster": 3}, "cluster.range"),
])
def test_a_cluster_that_cannot_apply_is_refused_with_its_code(knobs, code) -> None:
    kw = {"serial": "s", "step": 256, "cluster": 4} | knobs
    with pytest.raises(ScheduleError) as info:
        make_schedule(_smg(CASES[2]), **kw)
    assert info.value.code == code and info.value.knob == "cluster" and str(info.value)


def test_a_cluster_for_an_arch_without_clusters_is_refused() -> None:
    from spacefusion.lower.build import build_cuda

    with pytest.raises(ScheduleError, match="cluster 8: thread-block clusters exist on sm_90"):
        build_cuda(_schedule(CASES[0]), "sm_80")


def test_on_the_cpu_a_cluster_schedule_runs_as_one_thread_a_row() -> None:
    """The llvm lowering has no lanes or clusters: the same schedule runs and matches the reference there."""
    s = _schedule(CASES[3])
    xs = random_inputs(s.smg, seed=3)
    got = build(s, "llvm")(xs)
    ref = evaluate(s.smg, {n: v.astype(np.float64) for n, v in xs.items()})
    _, why = check_numerics(s.smg, ref, got)
    assert why is None, why


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_nvcc_compiles_the_cluster_kernels(tmp_path) -> None:
    for i, case in enumerate(CASES):
        folder = build(_schedule(case), "cuda").save(tmp_path / f"gn{i}", cache=None)
        assert (folder / "kernel.cubin").stat().st_size > 0


@pytest.mark.cuda
@pytest.mark.parametrize("case", CASES)
def test_cluster_kernels_match_numpy_on_the_gpu(case, tmp_path) -> None:
    """Each cluster kernel against the unfused float64 reference, on inputs with a mean away from 0."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("thread-block clusters need sm_90")
    from spacefusion.runtime.gpu import CudaKernel

    s = _schedule(case)
    kernel = CudaKernel(build(s, "cuda").save(tmp_path / "k"))
    xs = random_inputs(s.smg, seed=7)
    xs["X"] = (xs["X"].astype(np.float32) * 2 + 0.5).astype(np.float16)
    for _ in range(2):  # twice: the exchange slot and the barriers leave nothing behind for the next launch
        got = kernel.launch({n: torch.from_numpy(v).cuda() for n, v in xs.items()})
        torch.cuda.synchronize()
        ref = evaluate(s.smg, {n: v.astype(np.float64) for n, v in xs.items()})
        _, why = check_numerics(s.smg, ref, {n: t.float().cpu().numpy() for n, t in got.items()})
        assert why is None, why
