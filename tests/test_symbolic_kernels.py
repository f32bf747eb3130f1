"""Kernels with a run-time size along one dim (issue 55, ``lower.symbolic``): one build, every size of its range.

Each symbolic kernel is built once and run at many sizes on llvm against the unfused float64 reference of the
graph at that size (``smg.evaluate``), including sizes that are no multiple of the tile, 1 and the range's
ends; the CUDA build of the same schedule is compiled with nvcc (no GPU here) and its artefact read back."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from schedulers.errors import ScheduleError
from schedulers.schedule import make_schedule
from smg import evaluate, random_inputs
from smg.patterns import gemm_epilogue, layernorm
from smg.workloads import softmax_gemm
from spacefusion.api import build, check_numerics
from spacefusion.lower.build_symbolic import SizeOutOfRange
from spacefusion.lower.symbolic import CODE, SymbolicDim, around, check, near_range
from spacefusion.runtime.artefact import FORMAT_TAG, SYMBOLIC_FORMAT_TAG, ArtefactError, KernelArtefact, check_cubin


def _gemm(m: int, dtype: str = "float32"):
    return gemm_epilogue(m, 48, 40, act="gelu", residual=True, dtype=dtype)


def _stacked(m: int, dtype: str = "float32"):
    return gemm_epilogue(m, 24, 32, act="none", stack=3, dtype=dtype)


def _norm(m: int, dtype: str = "float32"):
    return layernorm(m, 40, dtype)


# (graph at size m, schedule tiles, serial step, the size the schedule is picked at)
CASES = {
    "gemm_bias_gelu_residual": (_gemm, {"m": 16, "n": 16}, 16, 100),
    "gemm_row_per_block": (_gemm, {"m": 1, "n": 48}, 40, 64),
    "stacked_qkv_gemm": (_stacked, {"t": 1, "m": 8, "n": 24}, 16, 40),  # m is the middle dim of the output
    "layernorm_rows": (_norm, {"m": 4}, 40, 30),  # not a GEMM: rows cut, the reduction over n
}


def _check_at(fn, kernel, m: int, dtype: str, seed: int) -> None:
    g = fn(m, dtype)
    x = random_inputs(g, seed=seed)
    got = kernel(x)
    err, problem = check_numerics(g, evaluate(g, x), got, inputs=x)
    assert problem is None, f"m={m}: {problem}"
    assert all(got[k].shape == g.shape(k) for k in g.outputs)


@pytest.mark.parametrize("name", list(CASES))
def test_one_build_matches_the_reference_at_every_size(name: str) -> None:
    fn, tiles, step, m0 = CASES[name]
    s = make_schedule(fn(m0), tiles, step=step)
    sym = SymbolicDim("m", 1, 2 * m0)
    kernel = build(s, "llvm", symbolic=sym)
    tile = tiles["m"]
    sizes = sorted({1, 2, tile - 1 if tile > 1 else 3, tile + 1, m0 - 1, m0, m0 + 3, 2 * m0 - 1, 2 * m0})
    for i, m in enumerate(sizes):
        _check_at(fn, kernel, m, "float32", seed=i)


def test_half_precision_gemm() -> None:
    s = make_schedule(_gemm(64, "float16"), {"m": 16, "n": 16}, step=8)
    kernel = build(s, "llvm", symbolic=around(s, "m"))
    assert (kernel.symbolic.lo, kernel.symbolic.hi) == (32, 128)
    for i, m in enumerate((32, 45, 64, 127, 128)):
        _check_at(_gemm, kernel, m, "float16", seed=10 + i)


def test_sizes_outside_the_range_or_disagreeing_are_refused() -> None:
    s = make_schedule(_gemm(40), {"m": 8, "n": 16}, step=8)
    kernel = build(s, "llvm", symbolic=around(s, "m"))
    assert (kernel.symbolic.lo, kernel.symbolic.hi) == (20, 80)
    with pytest.raises(SizeOutOfRange, match=r"size 81 is outside the kernel's range \[20, 80\]"):
        kernel(random_inputs(_gemm(81), seed=0))
    with pytest.raises(SizeOutOfRange, match="size 19 is outside"):
        kernel(random_inputs(_gemm(19), seed=0))
    x = random_inputs(_gemm(40), seed=0)
    x["R"] = x["R"][:30]
    with pytest.raises(SizeOutOfRange, match="must agree"):
        kernel(x)
    x = random_inputs(_gemm(40), seed=0)
    x["Bw"] = x["Bw"][:, :8]
    with pytest.raises(ValueError, match="input 'Bw' has shape"):
        kernel(x)


def test_near_range_is_the_family_transfers() -> None:
    from spacefusion.frontend.families import NEAR

    assert near_range(100, NEAR) == (50, 200)
    assert near_range(1) == (1, 2)
    assert near_range(3) == (2, 6)


@pytest.mark.parametrize("what,make,sym,why", [
    ("serial", lambda: make_schedule(_gemm(32), {"m": 8, "n": 16}, step=8), SymbolicDim("k", 20, 40),
     "it is the serial dim"),
    ("not cut", lambda: make_schedule(softmax_gemm(64, 64, 16), {"m": 16}, step=16), SymbolicDim("n", 8, 32),
     "does not cut it into blocks"),
    ("reduced", lambda: make_schedule(_norm(32), {"m": 4}, step=40), SymbolicDim("n", 40, 40),
     "serial dim|reduces over it"),
    ("unknown dim", lambda: make_schedule(_gemm(32), {"m": 8}, step=8), SymbolicDim("q", 1, 2), "no such dim"),
    ("range", lambda: make_schedule(_gemm(32), {"m": 8}, step=8), SymbolicDim("m", 40, 80),
     "leaves out the size 32"),
    ("32-bit", lambda: make_schedule(_gemm(32), {"m": 8}, step=8), SymbolicDim("m", 1, 2**30),
     "32-bit indices"),
])
def test_what_cannot_be_a_run_time_size_is_refused_by_name(what: str, make, sym: SymbolicDim, why: str) -> None:
    with pytest.raises(ScheduleError, match=why) as info:
        check(make(), sym)
    assert info.value.code == CODE


def test_tensor_core_gemms_are_taken_but_split_k() -> None:
    """A warp-tile GEMM takes m at run time (``tests/test_symbolic_tensorcore.py`` builds them); one that slices
    its K steps over blocks (split-K: a workspace per row tile) is refused by name."""
    from spacefusion.api import hardware
    from spacefusion.frontend.schedules import ranked

    g = _gemm(128, "float16")
    tc = [s for s in ranked(g, hardware("h100"), head=64) if s.tensor_cores]
    sliced = next(s for s in tc if s.slices > 1)
    whole = next(s for s in tc if s.slices == 1)
    with pytest.raises(ScheduleError, match="slices") as info:
        check(sliced, around(sliced, "m"))
    assert info.value.code == CODE
    check(whole, around(whole, "m"))


def test_static_builds_are_unchanged() -> None:
    """The symbolic lowering is opt-in: a schedule built without it keeps its concrete shapes and key."""
    from spacefusion.lower.tir import build_primfunc

    s = make_schedule(_gemm(100), {"m": 16, "n": 16}, step=16)
    text = str(build_primfunc(s, "llvm"))
    assert "sf_m" not in text and "T.Buffer((100, 40)" in text
    sym_text = str(build_primfunc(s, "llvm", symbolic=around(s, "m")))
    assert 'T.Buffer(("sf_m", 40)' in sym_text and "(sf_m + 15) // 16 * 3" in sym_text


def test_cuda_artefact_records_the_size_and_compiles(tmp_path) -> None:
    s = make_schedule(_gemm(100, "float16"), {"m": 16, "n": 16}, step=16)
    sym = around(s, "m")
    static = build(s, "cuda:sm_90a")
    art = build(s, "cuda:sm_90a", symbolic=sym)
    assert "int sf_m" in art.source and "sf_m" not in static.source
    assert art.meta["kernel_name"] != static.meta["kernel_name"] and art.meta["kernel_name"].startswith(
        static.meta["kernel_name"] + "_dyn_")
    meta = art.meta
    assert meta["format"] == SYMBOLIC_FORMAT_TAG and static.meta["format"] == FORMAT_TAG
    assert meta["symbolic"] == {"dim": "m", "var": "sf_m", "range": [50, 200], "axes": {"A": 0, "R": 0, "Y": 0},
                                "grid": {"tile": 16, "times": 3}}
    assert meta["param_order"][-1] == "sf_m"  # TVM passes the size last, by value
    folder = art.save(tmp_path / "k", compile_cubin=shutil.which("nvcc") is not None, cache=tmp_path / "cache")
    loaded = KernelArtefact.load(folder)
    spec = loaded.symbolic
    assert spec is not None and (spec.lo, spec.hi) == (50, 200)
    assert spec.grid_at(100) == (21, 1, 1) and spec.grid_at(50) == (12, 1, 1) and spec.grid_at(200) == (39, 1, 1)
    assert spec.shape_at(loaded.param("A"), 77) == (77, 40) and spec.shape_at(loaded.param("Bw"), 77) == (40, 48)
    assert spec.size_of({"A": (77, 40), "R": (77, 48)}) == 77
    assert loaded.to_meta()["symbolic"] == meta["symbolic"]
    if shutil.which("nvcc"):
        check_cubin(folder / "kernel.cubin")


def test_artefact_format_and_symbolic_section_go_together(tmp_path) -> None:
    s = make_schedule(_gemm(64, "float16"), {"m": 16, "n": 16}, step=16)
    meta = json.loads(json.dumps(build(s, "cuda:sm_90a", symbolic=around(s, "m")).meta))
    KernelArtefact.from_meta(meta, tmp_path)
    with pytest.raises(ArtefactError, match="no run-time size"):
        KernelArtefact.from_meta(meta | {"format": FORMAT_TAG}, tmp_path)
    with pytest.raises(ArtefactError, match="needs a 'symbolic' object"):
        KernelArtefact.from_meta({k: v for k, v in meta.items() if k != "symbolic"}, tmp_path)
    bad = meta | {"symbolic": meta["symbolic"] | {"range": [10, 5]}}
    with pytest.raises(ArtefactError, match="symbolic range"):
        KernelArtefact.from_meta(bad, tmp_path)
    bad = meta | {"symbolic": meta["symbolic"] | {"axes": {"A": 2}}}
    with pytest.raises(ArtefactError, match="symbolic axes"):
        KernelArtefact.from_meta(bad, tmp_path)
    with pytest.raises(ArtefactError, match="size param"):
        KernelArtefact.from_meta(meta | {"params": [p | ({"dtype": "int64"} if p["role"] == "size" else {})
                                                    for p in meta["params"]]}, tmp_path)


def _saved_gemm_artefact(tmp_path, m0: int = 100):
    s = make_schedule(_gemm(m0, "float16"), {"m": 16, "n": 16}, step=16)
    sym = around(s, "m")
    return build(s, "cuda:sm_90a", symbolic=sym).save(tmp_path / "k", compile_cubin=False), sym


def test_the_runtime_reads_the_size_from_the_inputs(tmp_path) -> None:
    """The GPU runtime's checks, without a GPU: the size comes from the inputs' shapes, which must agree and
    lie in the range; the unchecked launcher is made for one size in the range."""
    from spacefusion.runtime.gpu import CudaKernel, KernelLaunchError

    folder, _ = _saved_gemm_artefact(tmp_path)
    kernel = CudaKernel(folder)
    assert kernel._size({"A": np.zeros((77, 40)), "R": np.zeros((77, 48))}) == 77
    with pytest.raises(KernelLaunchError, match="disagree"):
        kernel._size({"A": np.zeros((77, 40)), "R": np.zeros((78, 48))})
    with pytest.raises(KernelLaunchError, match=r"outside the kernel's range \[50, 200\]"):
        kernel._size({"A": np.zeros((201, 40))})
    with pytest.raises(KernelLaunchError, match="run-time size"):
        kernel(sf_m=np.int32(3))
    with pytest.raises(KernelLaunchError, match=r"launcher for one size in \[50, 200\], got size=None"):
        kernel.launcher(0)
    with pytest.raises(KernelLaunchError, match="got size=201"):
        kernel.launcher(0, size=201)


@pytest.mark.cuda
def test_one_symbolic_cuda_kernel_at_every_size_on_the_gpu(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The artefact built once, launched at sizes in its range (a tile's tail, the ends) against the float64
    reference of the graph at each size."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from spacefusion.runtime.gpu import CudaKernel

    monkeypatch.setenv("SPACEFUSION_CUBIN_CACHE", str(tmp_path / "cache"))
    folder, sym = _saved_gemm_artefact(tmp_path)
    kernel = CudaKernel(folder)
    for i, m in enumerate((sym.lo, 51, 64, 100, 177, sym.hi)):
        g = _gemm(m, "float16")
        x = random_inputs(g, seed=20 + i)
        out = kernel.launch({k: torch.from_numpy(v).cuda() for k, v in x.items()})
        torch.cuda.synchronize()
        got = {k: v.cpu().numpy() for k, v in out.items()}
        assert got["Y"].shape == (m, 48)
        err, problem = check_numerics(g, evaluate(g, x), got, inputs=x)
        assert problem is None, f"m={m}: {problem}"


def test_the_lowering_and_the_runtime_agree_on_the_format() -> None:
    from spacefusion.lower import symbolic
    from spacefusion.runtime import artefact

    assert (symbolic.SYMBOLIC_FORMAT_TAG, symbolic.SIZE_ROLE) == (artefact.SYMBOLIC_FORMAT_TAG, artefact.SIZE_ROLE)
