"""Tensor-core GEMM (+ epilogue) kernels with a run-time row count (issue 55, ``lower.symbolic`` over ``lower.mma``).

Without a GPU: which warp-tile forms ``symbolic.check`` accepts and which it refuses by name (code
``lower.symbolic``); each accepted form's CUDA source takes ``int sf_m``, counts its grid (a persistent grid's
tile loop too) from it and compiles with nvcc (cubin; sm_90a, and sm_80 for mma.sync); the artefact records the
grid rule, a persistent grid's cap included, and the runtime rescales the grid and the tensor maps' shapes by it.
On a GPU (``cuda``): each kernel, built once, launched through ``runtime.gpu`` at sizes across its range (the
ends, tails of the row tile, the size it was picked at) against torch's float32 GEMM of the same inputs."""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest

from schedulers.errors import ScheduleError
from smg.patterns import gemm_epilogue
from spacefusion.api import build, schedule
from spacefusion.lower.symbolic import CODE, SymbolicDim, around, blocks, check, grid_rule
from spacefusion.runtime.artefact import KernelArtefact, check_cubin

NVCC = shutil.which("nvcc") is not None


def _gemm(m: int, n: int = 256, k: int = 192, act: str = "gelu", residual: bool = False):
    """``Y = act(A @ Bw.T + bias (+ R))`` in fp16, ``Bw`` an ``nn.Linear`` weight [n, k]."""
    return gemm_epilogue(m, n, k, act=act, residual=residual, dtype="float16", b_layout="nk")


#: the warp-tile forms the GEMM lowering has, each as schedule knobs (the size it is picked at: 300, no
#: multiple of any row tile here, so the static kernel has a tail too)
FORMS = {
    "mma_sync_cp_async": dict(tiles={"m": 64, "n": 64}, step=32, stages=3),
    "wgmma_tma": dict(tiles={"m": 64, "n": 128}, step=64, stages=3, wgmma=True, tma=True),
    "wgmma_tma_producer": dict(tiles={"m": 128, "n": 128}, step=64, stages=4, wgmma=True, tma=True, producer=True),
    "persistent": dict(tiles={"m": 64, "n": 128}, step=64, stages=4, wgmma=True, tma=True, producer=True,
                       persistent=4),
    "persistent_pingpong": dict(tiles={"m": 64, "n": 128}, step=64, stages=4, wgmma=True, tma=True, producer=True,
                                persistent=3, pingpong=True),
}
M0 = 300


def _schedule(form: str, m: int = M0, residual: bool = False):
    knobs = dict(FORMS[form])
    tiles, step = knobs.pop("tiles"), knobs.pop("step")
    return schedule(_gemm(m, residual=residual), tiles=tiles, serial="k", step=step, tensor_cores=True, hw="h100",
                    **knobs)


def _arch(form: str) -> str:
    return "sm_80" if form == "mma_sync_cp_async" else "sm_90a"


@pytest.mark.parametrize("form", list(FORMS))
def test_each_gemm_form_builds_with_a_run_time_row_count(form: str, tmp_path) -> None:
    s = _schedule(form)
    assert s.warp_tile is not None and s.warp_tile.row == "m"
    sym = around(s, "m")
    check(s, sym)
    static = build(s, f"cuda:{_arch(form)}")
    art = build(s, f"cuda:{_arch(form)}", symbolic=sym)
    assert "int sf_m" in art.source and "sf_m" not in static.source
    assert art.meta["kernel_name"].startswith(static.meta["kernel_name"] + "_dyn_")
    assert art.meta["grid"] == static.meta["grid"] == [s.num_blocks, 1, 1]
    assert "sf_m" in art.meta["param_order"] and not any(n.startswith("cse_") for n in art.meta["param_order"])
    rule = art.meta["symbolic"]["grid"]
    assert rule == grid_rule(s, sym) and rule["tile"] == s.tiles["m"]
    assert ("cap" in rule) == bool(s.persistent)
    assert blocks(rule, M0) == s.num_blocks  # the rule at the size it was picked at is the static grid
    folder = art.save(tmp_path / form, compile_cubin=NVCC, cache=tmp_path / "cache")
    loaded = KernelArtefact.load(folder)
    spec = loaded.symbolic
    assert spec is not None and loaded.to_meta()["symbolic"] == art.meta["symbolic"]
    for m in (sym.lo, M0, sym.hi, sym.lo + 1):
        assert spec.grid_at(m) == (blocks(rule, m), 1, 1)
    if NVCC:
        check_cubin(folder / "kernel.cubin")


def test_a_persistent_grid_is_capped_and_its_tile_loop_counted_at_run_time() -> None:
    s = _schedule("persistent")
    sym = around(s, "m")
    rule = grid_rule(s, sym)
    tiles_per_row_tile = rule["times"]
    assert rule["cap"] == 4 and blocks(rule, 1) == min(4, tiles_per_row_tile)
    assert blocks(rule, sym.hi) == 4
    art = build(s, "cuda:sm_90a", symbolic=sym)
    # the loop over a block's tiles (the producer's and the MMA warpgroups'): ceil(tiles / 4) iterations, tiles
    # an expression of the argument (2 column tiles: TVM folds it to ceil(m / 128)); the static one a constant
    loops = re.findall(r"for \(int \w+ = 0; \w+ < ([^;]*sf_m[^;]*);", art.source)
    assert len(loops) == 2 and all("127) >> 7" in b for b in loops), loops


def test_static_tensor_core_builds_do_not_name_the_size() -> None:
    """Static kernels are as before (the comparison of whole sources before and after is in the report): no
    size argument, format /1, the grid TVM emitted."""
    for form in FORMS:
        s = _schedule(form)
        meta = build(s, f"cuda:{_arch(form)}").meta
        assert meta["format"] == "spacefusion-kernel/1" and "symbolic" not in meta
        assert all(not n.startswith("sf_m") for n in meta["param_order"])


def test_the_ranking_picks_for_bert_shapes_are_accepted() -> None:
    """The tensor-core picks the H100 ranking makes for BERT-base's and Qwen2-0.5B's projections take m at run
    time, but for split-K (slices) and TVM's WMMA path, refused by name."""
    from spacefusion.api import hardware
    from spacefusion.frontend.schedules import ranked

    seen = 0
    for n, k in ((768, 768), (3072, 768), (896, 4864)):
        for s in [s for s in ranked(_gemm(1024, n, k, act="none"), hardware("h100"), head=8) if s.tensor_cores]:
            sym = around(s, "m")
            if s.slices > 1 or s.warp_tile is None:
                with pytest.raises(ScheduleError, match="slices" if s.slices > 1 else "WMMA") as info:
                    check(s, sym)
                assert info.value.code == CODE
                continue
            check(s, sym)
            seen += 1
    assert seen >= 8


@pytest.mark.parametrize("what,make,why", [
    ("split-K", lambda: schedule(_gemm(M0), tiles={"m": 64, "n": 128}, serial="k", step=64, tensor_cores=True,
                                 hw="h100", stages=2, wgmma=True, slices=2), "slices"),
    ("a run-time column count", lambda: _schedule("wgmma_tma"), "counts only its row dim"),
])
def test_forms_not_done_are_refused_by_name(what: str, make, why: str) -> None:
    s = make()
    sym = around(s, "m") if why != "counts only its row dim" else SymbolicDim("n", 128, 512)
    with pytest.raises(ScheduleError, match=why) as info:
        check(s, sym)
    assert info.value.code == CODE
    with pytest.raises(ScheduleError, match=why):
        build(s, "cuda:sm_90a", symbolic=sym)


def test_attention_warp_tiles_are_refused() -> None:
    from smg.patterns import attention

    s = schedule(attention(1, 2, 128, 128, 64), tiles={"m": 32}, step=32, tensor_cores=True, stages=2)
    assert s.warp_tile is not None and s.warp_tile.gemm is not None and s.warp_tile.row == "m"
    with pytest.raises(ScheduleError, match="score GEMM") as info:
        check(s, around(s, "m"))
    assert info.value.code == CODE


@pytest.mark.cuda
@pytest.mark.parametrize("form", list(FORMS))
def test_one_tensor_core_kernel_at_every_size_on_the_gpu(form: str, tmp_path, monkeypatch) -> None:
    """One build, launched at sizes across its range through ``launch`` (tensor maps encoded per call at the
    run-time shapes) and through a ``launcher`` made per size; the inputs of two sizes share one allocation
    (same address and strides: a tensor map cached by address alone would be reused at the wrong size).  Each
    against torch's float32 GEMM + bias + GELU + residual of the same fp16 inputs."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from spacefusion.runtime.gpu import CudaKernel

    monkeypatch.setenv("SPACEFUSION_CUBIN_CACHE", str(tmp_path / "cache"))
    s = _schedule(form, residual=True)
    sym = around(s, "m")
    kernel = CudaKernel(build(s, "cuda:sm_90a", symbolic=sym).save(tmp_path / "k", compile_cubin=False))
    tile = s.tiles["m"]
    sizes = sorted({sym.lo, sym.lo + 1, tile * (sym.lo // tile + 2) + 1, M0, M0 + tile - 1, sym.hi - 1, sym.hi})
    n, k = s.smg.dim_sizes["n"], s.smg.dim_sizes["k"]
    gen = torch.Generator(device="cuda").manual_seed(55)
    big_a = torch.randn(sym.hi, k, generator=gen, device="cuda").half()
    big_r = torch.randn(sym.hi, n, generator=gen, device="cuda").half()
    w = (torch.randn(n, k, generator=gen, device="cuda") / k ** 0.5).half()
    bias = torch.randn(n, generator=gen, device="cuda").half()
    for m in sizes:
        a, r = big_a[:m], big_r[:m]  # one address for every size
        want = torch.nn.functional.gelu(a.float() @ w.float().T + bias.float() + r.float())
        got = kernel.launch({"A": a, "Bw": w, "bias": bias, "R": r})["Y"]
        run = kernel.launcher(torch.cuda.current_device(), size=m)  # the frontend's path: one launcher a size
        named = {"A": a, "Bw": w, "bias": bias, "R": r}
        (again,) = run(*(named[p.name] for p in kernel.artefact.inputs))
        torch.cuda.synchronize()
        for out in (got, again):
            assert out.shape == (m, n)
            err = (out.float() - want).abs().max().item()
            assert err <= 2e-2 * max(1.0, want.abs().max().item()), f"{form} m={m}: max error {err}"
        assert np.isfinite(got.float().cpu().numpy()).all()


def test_the_artefact_checks_a_persistent_grids_cap(tmp_path) -> None:
    from spacefusion.runtime.artefact import ArtefactError

    s = _schedule("persistent")
    meta = build(s, "cuda:sm_90a", symbolic=around(s, "m")).meta
    spec = KernelArtefact.from_meta(meta, tmp_path).symbolic
    assert spec.cap == 4 and spec.grid_at(1) == (min(4, spec.times), 1, 1) and spec.grid_at(M0) == (4, 1, 1)
    for bad in ({"cap": 0}, {"cap": "4"}, {"blocks": 4}):
        with pytest.raises(ArtefactError, match="symbolic grid"):
            KernelArtefact.from_meta(meta | {"symbolic": meta["symbolic"] | {"grid": meta["symbolic"]["grid"] | bad}},
                                     tmp_path)
