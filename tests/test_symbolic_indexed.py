"""Issue 55 for gathered rows and scattered positions: a kernel with an indexed load (``smg.loads``: BERT's
embeddings gathered into their LayerNorm, an MoE layer's expert GEMM) or an indexed store (``smg.stores``) built
once with the ids' (the positions') dim a run-time size (``lower.symbolic``).

The llvm kernel is built once and run at sizes across its range (tile tails, the ends) against the float64
reference of the graph at each size (``smg.loads.resolve`` + ``smg.evaluate``; numpy's scatter for a store),
ids on both sides of the table included (zeros, the static kernel's contract); a size outside the range is
refused naming it; the table (and a store's tensor) keeps its extents, a dim it holds is refused by name; the
32-bit bound holds; the CUDA build records the ids' axis for the launcher and compiles with nvcc (no GPU here;
the ``cuda`` test runs it)."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schedulers.errors import ScheduleError
from smg.loads import IndexedLoad, loads_of, resolve, with_loads
from smg.ops import Builder
from smg.reference import evaluate
from smg.stores import IndexedStore, scatter, stores_of, with_stores
from spacefusion.api import build, first_pick, schedule
from spacefusion.frontend import builders
from spacefusion.lower.build_symbolic import SizeOutOfRange
from spacefusion.lower.symbolic import CODE, SymbolicDim, around, check
from spacefusion.lower.tir import signature

VOCAB, N, S0 = 50, 24, 12


def _emb(s: int, b: int = 2, n: int = N, vocab: int = VOCAB, dtype: str = "float32"):
    """BERT's embeddings at sequence length ``s``: word rows gathered by Ids0 [b, s], a token-type term [b, s, n]
    and a position term [s, n] added, a LayerNorm, the sum kept (LLaMA's residual stream)."""
    g = builders.embedding_norm("layernorm", {"b": b, "s": s}, n, 1, (("b", "s"), ("s",)), True, dtype, 1e-12)
    return with_loads(g, (IndexedLoad("E0", "Table0", "Ids0", ("b", "s"), vocab),))


def _inputs(smg, seed: int) -> dict[str, np.ndarray]:
    """Random values of ``smg``'s kernel parameters (its inputs, the gathered E0 as its table and ids); ids in
    the table but one on each side of it."""
    rng = np.random.default_rng(seed)
    (ld,) = loads_of(smg)
    ids = rng.integers(0, ld.length, ld.ids_shape(smg))
    ids.reshape(-1)[:2] = (-1, ld.length)
    dtype = smg.space(ld.value).dtype
    out = {ld.ids: ids, ld.table: rng.standard_normal(ld.table_shape(smg)).astype(dtype)}
    return out | {n: rng.standard_normal(smg.shape(n)).astype(dtype) for n in smg.inputs if n != ld.value}


@functools.cache
def _emb_kernel():
    """The schedule picked at s = 12, built once with s a run-time size over [6, 24]."""
    s = first_pick(_emb(S0))
    sym = around(s, "s")
    assert (sym.lo, sym.hi) == (6, 24) and dict(s.block)["s"] < 24  # several blocks along s: tails at odd sizes
    return s, build(s, "llvm", symbolic=sym)


@settings(max_examples=4, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(size=st.integers(6, 24), seed=st.integers(0, 2**16))
def test_one_gather_kernel_matches_the_reference_across_its_range(size: int, seed: int) -> None:
    _, kernel = _emb_kernel()
    g = _emb(size)
    x = _inputs(g, seed)
    want = evaluate(g, resolve(g, x))  # the out-of-table ids read zeros there too
    got = kernel(x)
    assert got["Y"].shape == (2, size, N) and got["T"].shape == (2, size, N)
    for name in g.outputs:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("size", [6, 7, 24])
def test_the_range_ends_and_a_tiles_tail(size: int) -> None:
    s, kernel = _emb_kernel()
    g = _emb(size)
    x = _inputs(g, 100 + size)
    assert set(x) == {name for name, _, _, role in signature(s).params if role == "input"}
    want = evaluate(g, resolve(g, x))
    got = kernel(x)
    np.testing.assert_allclose(got["T"][0, 0], x["C0"][0, 0] + x["C1"][0], rtol=1e-6)  # id -1 gathered zeros
    for name in g.outputs:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5)


def test_sizes_outside_the_range_or_disagreeing_are_refused() -> None:
    _, kernel = _emb_kernel()
    for size in (5, 25):
        with pytest.raises(SizeOutOfRange, match=rf"size {size} is outside the kernel's range \[6, 24\]"):
            kernel(_inputs(_emb(size), 0))
    x = _inputs(_emb(10), 0)
    x["Ids0"] = x["Ids0"][:, :9]
    with pytest.raises(SizeOutOfRange, match="must agree"):
        kernel(x)
    x = _inputs(_emb(10), 0)
    x["Table0"] = x["Table0"][:40]  # the table keeps its rows at every size
    with pytest.raises(ValueError, match=r"input 'Table0' has shape \(40, 24\)"):
        kernel(x)


def _gathered_cols(m: int = 8, j: int = 8, k: int = 16):
    """``Y = 2 * E``, E[m, j, k] gathered from Table[vocab, j, k] by Ids[m]: j is a dim of the table."""
    g = Builder("scaled", "float32")
    y = g.map("2*E", g.input("E", {"m": m, "j": j, "k": k}), name="Y")
    return with_loads(g.build(y), (IndexedLoad("E", "Table", "Ids", ("m",), 5),))


def test_a_dim_the_table_holds_and_the_32_bit_bound_are_refused_by_name() -> None:
    g = _gathered_cols()
    s = schedule(g, tiles={"m": 2, "j": 2}, serial="k", step=16)
    check(s, SymbolicDim("m", 4, 16))  # the ids' dim: taken
    with pytest.raises(ScheduleError, match="gathered from Table, which holds it") as info:
        check(s, SymbolicDim("j", 4, 16))
    assert info.value.code == CODE
    emb = first_pick(_emb(S0))
    with pytest.raises(ScheduleError, match="32-bit indices") as info:
        check(emb, SymbolicDim("s", 6, 2**30))
    assert info.value.code == CODE
    top = (2**31 - 1) // (2 * N)  # the largest [2, s, 24] buffer 32-bit indices address
    assert around(emb, "s", near=2**28).hi == top


def test_a_gather_along_cut_rows_reads_wide_runs_along_the_table() -> None:
    """Ids over the cut rows m (tile 2), each row's run along k one wide load of its gathered table row."""
    s = schedule(_gathered_cols(), tiles={"m": 2, "j": 2}, serial="k", step=16, vector=4)
    kernel = build(s, "llvm", symbolic=around(s, "m"))
    assert (kernel.symbolic.lo, kernel.symbolic.hi) == (4, 16)
    rng = np.random.default_rng(7)
    table = rng.standard_normal((5, 8, 16)).astype(np.float32)
    for m in (4, 5, 11, 16):
        g = _gathered_cols(m)
        ids = rng.integers(-1, 6, m)  # -1 and 5 lie outside the table: zeros
        want = evaluate(g, resolve(g, {"Table": table, "Ids": ids}))["Y"]
        np.testing.assert_allclose(kernel({"Table": table, "Ids": ids})["Y"], want, rtol=1e-6)


def test_an_expert_gemm_takes_its_rows_at_run_time() -> None:
    """An MoE layer's GEMM reads each row's expert weight through the row's expert id (``frontend.experts``):
    its rows ``m`` are the frontend's run-time dim (``symbolic_dim``), the experts' table static."""
    from spacefusion.frontend.experts import expert_gemm
    from spacefusion.frontend.symbolic_kernels import symbolic_dim

    s = first_pick(expert_gemm(24, 16, 32, 4, "float32"))
    sym = symbolic_dim(s, s.smg)
    assert sym is not None and (sym.dim, sym.lo, sym.hi) == ("m", 12, 48)
    kernel = build(s, "llvm", symbolic=sym)
    rng = np.random.default_rng(3)
    experts = rng.standard_normal((4, 16, 32)).astype(np.float32)
    for m in (12, 13, 37, 48):
        g = expert_gemm(m, 16, 32, 4, "float32")
        x = {"X": rng.standard_normal((m, 32)).astype(np.float32), "Experts": experts,
             "Expert": rng.integers(-1, 5, m)}  # -1 and 4 lie outside the table: a row of zeros
        np.testing.assert_allclose(kernel(x)["Y"], evaluate(g, resolve(g, x))["Y"], rtol=1e-5, atol=1e-5)


def test_the_cuda_backend_serves_an_embeddings_norm_of_another_length(tmp_path: Path) -> None:
    """Inside ``sizes_per_call`` the gathered norm is exported once with its sequence a run-time size (the
    ids' last dim, ``symbolic_kernels.rows``); another length in range is served by it, no export."""
    from spacefusion.frontend.backends import CudaBackend
    from spacefusion.frontend.symbolic_kernels import rows

    def emb(s: int):
        return _emb(s, n=256, vocab=1000, dtype="float16")

    assert rows(emb(40)) == "s"
    kernels = CudaBackend(tmp_path, build_missing=True, load=False, symbolic=True)
    with kernels.sizes_per_call():
        kernels.compile(emb(40))
        folder = kernels.artefact_path(emb(40))
        assert (folder.parent.name, len(list(tmp_path.rglob("timing.json")))) == ("symbolic", 1)
        kernels.compile(emb(23))
        assert kernels.artefact_path(emb(23)) == folder and len(list(tmp_path.rglob("timing.json"))) == 1
        assert kernels.artefact_path(emb(81)) != folder  # past [20, 80]
        assert kernels.artefact_path(_emb(40, b=3, n=256, vocab=1000, dtype="float16")) != folder  # another batch


def _nvcc() -> bool:
    return shutil.which("nvcc") is not None or Path("/usr/local/cuda/bin/nvcc").is_file()


def _cuda_emb(tmp_path: Path, compile_cubin: bool, dtype: str = "float16"):
    s = first_pick(_emb(40, n=256, vocab=1000, dtype=dtype))
    sym = around(s, "s")
    art = build(s, "cuda:sm_90a", symbolic=sym)
    return art, art.save(tmp_path / "emb", compile_cubin=compile_cubin, cache=tmp_path / "cache"), sym


def test_cuda_gather_kernel_takes_the_size_and_records_the_ids_axis(tmp_path: Path) -> None:
    from spacefusion.runtime.artefact import SYMBOLIC_FORMAT_TAG, KernelArtefact, check_cubin
    from spacefusion.runtime.gpu import CudaKernel, KernelLaunchError

    art, folder, sym = _cuda_emb(tmp_path, compile_cubin=_nvcc())
    assert (sym.lo, sym.hi) == (20, 80)
    src = art.source.split("__global__")[-1]
    assert "int sf_s" in src and "Ids0_ptr[" in src and "Table0_ptr" in src and "E0_ptr" not in src
    meta = art.meta
    assert meta["format"] == SYMBOLIC_FORMAT_TAG and meta["param_order"][-1] == "sf_s"
    assert meta["symbolic"]["axes"] == {"Ids0": 1, "C0": 1, "C1": 0, "Y": 1, "T": 1}  # the table: static
    loaded = KernelArtefact.load(folder)
    spec = loaded.symbolic
    assert spec.shape_at(loaded.param("Ids0"), 33) == (2, 33) and spec.shape_at(loaded.param("Table0"), 33) == (
        1000, 256)
    assert spec.size_of({"Ids0": (2, 33), "C0": (2, 33, 256), "C1": (33, 256)}) == 33
    kernel = CudaKernel(folder)  # the launcher's checks, without a GPU
    assert kernel._size({"Ids0": np.zeros((2, 57), np.int64), "C1": np.zeros((57, 256))}) == 57
    with pytest.raises(KernelLaunchError, match="disagree"):
        kernel._size({"Ids0": np.zeros((2, 57), np.int64), "C1": np.zeros((56, 256))})
    with pytest.raises(KernelLaunchError, match=r"outside the kernel's range \[20, 80\]"):
        kernel._size({"Ids0": np.zeros((2, 81), np.int64)})
    if _nvcc():
        check_cubin(folder / "kernel.cubin")


@pytest.mark.cuda
def test_one_gather_kernel_at_every_size_on_the_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Built once (float32), launched at sizes across its range with an id on each side of the table (zeros
    there, no read past it) against the float64 reference at each size."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from spacefusion.runtime.gpu import CudaKernel

    monkeypatch.setenv("SPACEFUSION_CUBIN_CACHE", str(tmp_path / "cache"))
    _, folder, sym = _cuda_emb(tmp_path, compile_cubin=False, dtype="float32")
    kernel = CudaKernel(folder)
    for i, size in enumerate((sym.lo, 21, 40, 47, sym.hi)):
        g = _emb(size, n=256, vocab=1000)
        x = _inputs(g, 30 + i)
        out = kernel.launch({k: torch.from_numpy(v).cuda() for k, v in x.items()})
        torch.cuda.synchronize()
        want = evaluate(g, resolve(g, x))
        for name in g.outputs:
            assert tuple(out[name].shape) == (2, size, 256)
            np.testing.assert_allclose(out[name].cpu().numpy(), want[name], rtol=1e-4, atol=1e-4)


# -- indexed stores: the positions take the size, the caller's tensor keeps its extents ----------------------

LENGTH = 20


def _stored(s: int, offset: bool = False):
    """``Y = 2 * X + 1`` over [b, s, d] stored into Kc [b, LENGTH, d] at Pos[s] along s (``offset``: Pos[0] + s)."""
    g = Builder("scaled_kv", "float32")
    y = g.map("2*X + 1", g.input("X", {"b": 2, "s": s, "d": 16}), name="Y")
    return with_stores(g.build(y), (IndexedStore("Y", "Kc", "Pos", "s", ("b", "s", "d"), LENGTH, offset),))


@functools.cache
def _store_kernel(offset: bool):
    s = schedule(_stored(6, offset), tiles={"b": 1, "s": 4}, serial="d", step=16)
    sym = around(s, "s")
    assert (sym.lo, sym.hi) == (3, 12)
    return build(s, "llvm", symbolic=sym)


@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize("size", [3, 5, 9, 12])
def test_one_store_kernel_writes_the_callers_tensor_across_its_range(size: int, offset: bool) -> None:
    kernel = _store_kernel(offset)
    g = _stored(size, offset)
    rng = np.random.default_rng(size)
    x = rng.standard_normal((2, size, 16)).astype(np.float32)
    if offset:
        pos = np.array([LENGTH - size + 2])  # the last two run past the tensor: not written
    else:
        pos = rng.permutation(LENGTH)[:size].astype(np.int64)
        pos[0] = LENGTH  # outside: not written
    cache = rng.standard_normal((2, LENGTH, 16)).astype(np.float32)
    want = cache.copy()
    (st,) = stores_of(g)
    scatter(st, g, evaluate(g, {"X": x})["Y"], want, pos)
    assert kernel({"X": x, "Kc": cache, "Pos": pos}) == {}
    np.testing.assert_allclose(cache, want, rtol=1e-6)


def test_store_range_is_cut_to_the_tensor_and_its_other_dims_are_refused() -> None:
    s = schedule(_stored(6), tiles={"b": 1, "s": 4}, serial="d", step=16)
    with pytest.raises(ScheduleError, match="more positions than the 20 of Kc"):
        check(s, SymbolicDim("s", 3, 21))
    with pytest.raises(ScheduleError, match="stored into Kc, which holds it"):
        check(s, SymbolicDim("b", 1, 4))
    kernel = _store_kernel(False)
    with pytest.raises(SizeOutOfRange, match=r"size 13 is outside the kernel's range \[3, 12\]"):
        kernel({"X": np.zeros((2, 13, 16), np.float32), "Kc": np.zeros((2, LENGTH, 16), np.float32),
                "Pos": np.arange(13)})


def test_cuda_store_kernel_takes_the_size_and_records_the_positions_axis(tmp_path: Path) -> None:
    from spacefusion.runtime.artefact import KernelArtefact

    s = schedule(_stored(6), tiles={"b": 1, "s": 4}, serial="d", step=16)
    art = build(s, "cuda:sm_90a", symbolic=around(s, "s"))
    assert "int sf_s" in art.source and "Pos_ptr[" in art.source
    assert art.meta["symbolic"]["axes"] == {"X": 1, "Pos": 0}  # the cache (inout): static
    loaded = KernelArtefact.load(art.save(tmp_path / "kv", compile_cubin=_nvcc(), cache=tmp_path / "cache"))
    assert loaded.symbolic.shape_at(loaded.param("Kc"), 9) == (2, LENGTH, 16)
    assert loaded.symbolic.shape_at(loaded.param("Pos"), 9) == (9,)
