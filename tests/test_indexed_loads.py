"""Indexed loads (``smg.loads``, ``spacefusion.lower.loads``): an SMG input read from a caller's table at rows
picked by ids read at run time, ``E[b, s, n] = Table[Ids[b, s], n]`` (``F.embedding``).

The IR attribute keys only graphs that have loads (what stores and loads share is ``smg.indexed``); the
reference gathers as ``np.take`` does, zeros for an id outside the table; the llvm kernel reads the same values
as the reference, its runs wide along a kept dim and element by element along a gathered one, a block's tile
staged element by element from the gathered rows; the CUDA source reads the table through ``Ids`` and compiles
with nvcc; warp-tile (tensor-core) schedules are refused by name; the ids' dim may be a run-time size."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schedulers.errors import ScheduleError
from smg.errors import UnknownAxisError
from smg.loads import LOADS_ATTR, IndexedLoad, IndexOutOfRange, check_ids, gather, loads_of, resolve, with_loads
from smg.ops import Builder
from smg.reference import evaluate, random_inputs
from spacefusion.api import build, first_pick, schedule
from spacefusion.frontend import builders
from spacefusion.lower.stores import LoweringError
from spacefusion.lower.symbolic import SymbolicDim, check
from spacefusion.lower.tir import signature


def _scaled(m: int, k: int, vocab: int, dtype: str = "float32", rows_inner: bool = False):
    """``Y = 2 * E`` with E[m, k] gathered from Table[vocab, k] by Ids[m] (``rows_inner``: E declared [k, m],
    the gathered dim innermost): the plain graph and with the load."""
    g = Builder("scaled", dtype)
    dims = {"k": k, "m": m} if rows_inner else {"m": m, "k": k}
    y = g.map("2*E", g.input("E", dims), name="Y")
    plain = g.build(y)
    return plain, with_loads(plain, (IndexedLoad("E", "Table", "Ids", ("m",), vocab),))


def _embedding_norm(b: int, s: int, n: int, vocab: int, dtype: str = "float32", keep_sum: bool = False):
    """BERT's embeddings: word rows gathered, a token-type term [b, s, n] and a position term [s, n] added, a
    LayerNorm (``keep_sum``: the sum an output too, LLaMA's residual stream)."""
    g = builders.embedding_norm("layernorm", {"b": b, "s": s}, n, 1, (("b", "s"), ("s",)), keep_sum, dtype, 1e-12)
    return with_loads(g, (IndexedLoad("E0", "Table0", "Ids0", ("b", "s"), vocab),))


def _inputs(smg, seed: int, bad: bool = False) -> dict[str, np.ndarray]:
    """Random inputs of ``smg``'s kernel parameters; ids in the table (``bad``: some outside, both ways)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape, dtype, _ in signature(first_pick(smg)).params:
        if dtype == "int64":
            (ld,) = [ld for ld in loads_of(smg) if ld.ids == name]
            ids = rng.integers(0, ld.length, shape)
            if bad:
                flat = ids.reshape(-1)
                flat[:2] = (-1, ld.length)[:flat.size]
            out[name] = ids
        elif name in smg.inputs or any(ld.table == name for ld in loads_of(smg)):
            out[name] = rng.standard_normal(shape).astype(dtype)
    return out


def test_loads_live_in_attrs_and_key_only_graphs_that_have_them() -> None:
    plain, g = _scaled(6, 8, 10)
    assert with_loads(plain, ()) is plain and loads_of(plain) == ()
    assert dict(g.attrs)[LOADS_ATTR] and g.key != plain.key and g.ops == plain.ops and g.inputs == plain.inputs
    assert loads_of(g) == (IndexedLoad("E", "Table", "Ids", ("m",), 10),)
    assert loads_of(g)[0].table_shape(g) == (10, 8) and loads_of(g)[0].ids_shape(g) == (6,)


def test_a_load_that_is_not_the_graphs_is_refused_by_name() -> None:
    plain, _ = _scaled(6, 8, 10)
    with pytest.raises(UnknownAxisError, match="must be an input"):
        with_loads(plain, (IndexedLoad("Y", "T", "I", ("m",), 10),))
    with pytest.raises(UnknownAxisError, match="distinct dims"):
        with_loads(plain, (IndexedLoad("E", "T", "I", ("x",), 10),))
    with pytest.raises(ValueError, match="clash"):
        with_loads(plain, (IndexedLoad("E", "Y", "I", ("m",), 10),))


@settings(max_examples=15, deadline=None, derandomize=True)
@given(b=st.integers(1, 3), s=st.integers(1, 5), n=st.integers(1, 6), vocab=st.integers(1, 9),
       seed=st.integers(0, 2**16))
def test_the_reference_gathers_as_take_and_reads_zeros_outside_the_table(b: int, s: int, n: int, vocab: int,
                                                                          seed: int) -> None:
    g = _embedding_norm(b, s, n, vocab)
    (ld,) = loads_of(g)
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((vocab, n)).astype("float32")
    ids = rng.integers(-2, vocab + 2, (b, s))
    got = gather(ld, g, table, ids)
    ok = (ids >= 0) & (ids < vocab)
    want = np.where(ok[..., None], np.take(table, np.clip(ids, 0, vocab - 1), axis=0), 0)
    np.testing.assert_array_equal(got, want)
    if not ok.all():
        with pytest.raises(IndexOutOfRange, match="out of range"):
            check_ids(g, {"Ids0": ids})


@settings(max_examples=4, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(b=st.integers(1, 2), s=st.integers(1, 6), n=st.sampled_from([8, 24, 64]), vocab=st.integers(2, 40),
       keep_sum=st.booleans(), seed=st.integers(0, 2**16))
def test_llvm_kernel_reads_the_gathered_rows_as_the_reference(b: int, s: int, n: int, vocab: int, keep_sum: bool,
                                                              seed: int) -> None:
    g = _embedding_norm(b, s, n, vocab, keep_sum=keep_sum)
    x = _inputs(g, seed, bad=True)  # an id each side of the table: zeros, never a read past it
    want = evaluate(g, resolve(g, x))
    got = build(first_pick(g), "llvm")(x)
    for name in g.outputs:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("serial", ["m", "k"])
def test_vector_runs_are_wide_along_a_kept_dim_only(serial: str) -> None:
    """A run along the gathered dim reads element by element (unrelated rows), along the kept dim one wide load;
    both read the reference's values."""
    _, g = _scaled(12, 16, 7, rows_inner=serial == "m")
    other = "k" if serial == "m" else "m"
    s = schedule(g, tiles={other: 2}, serial=serial, step=12 if serial == "m" else 16, vector=4)
    assert s.vector == 4
    x = _inputs(g, 3, bad=True)
    np.testing.assert_allclose(build(s, "llvm")(x)["Y"], evaluate(g, resolve(g, x))["Y"], rtol=1e-6)


def test_signature_replaces_a_loaded_input_by_its_table_and_ids() -> None:
    g = _embedding_norm(2, 3, 8, 11, keep_sum=True)
    params = {name: (shape, dtype, role) for name, shape, dtype, role in signature(first_pick(g)).params}
    assert "E0" not in params
    assert params["Table0"] == ((11, 8), "float32", "input") and params["Ids0"] == ((2, 3), "int64", "input")
    assert params["T"][2] == "output" and params["Y"][2] == "output"


def test_tensor_core_schedules_are_refused_and_run_time_rows_taken() -> None:
    """A warp-tile kernel copies contiguous operand tiles: refused.  The ids' dim may be a run-time size
    (``lower.symbolic``; built and run in ``tests/test_symbolic_indexed.py``)."""
    g = Builder("gathered_gemm", "float16")
    y = g.matmul(g.input("A", {"m": 64, "k": 64}), g.input("B", {"k": 64, "n": 64}), reduce="k", name="Y")
    gemm = with_loads(g.build(y), (IndexedLoad("A", "Table", "Ids", ("m",), 100),))
    with pytest.raises(LoweringError, match="tensor-core"):
        build(schedule(gemm, tiles={"m": 64, "n": 64}, serial="k", step=32, tensor_cores=True), "cuda:sm_90a")
    _, scaled = _scaled(8, 16, 5)
    s = schedule(scaled, tiles={"m": 2}, serial="k", step=16)
    assert check(s, SymbolicDim("m", 2, 16)) is None
    with pytest.raises(ScheduleError, match="serial dim"):
        check(s, SymbolicDim("k", 8, 32))


def _nvcc() -> bool:
    return shutil.which("nvcc") is not None or Path("/usr/local/cuda/bin/nvcc").is_file()


def test_cuda_source_reads_the_table_through_the_ids() -> None:
    art = build(first_pick(_embedding_norm(2, 128, 768, 30522, "float16")), "cuda:sm_90a")
    src = art.source.split("__global__")[-1]
    assert "Ids0_ptr[" in src and "Table0_ptr" in src and "E0_ptr" not in src
    assert "uint4*)(Table0_ptr" in src  # a gathered row read 16 bytes at a time along n


@pytest.mark.skipif(not _nvcc(), reason="nvcc not installed")
def test_cuda_gather_kernel_compiles_and_its_artefact_loads(tmp_path: Path) -> None:
    from spacefusion.runtime.artefact import KernelArtefact

    g = _embedding_norm(2, 7, 256, 1000, "float16", keep_sum=True)
    folder = build(first_pick(g), "cuda:sm_90a").save(tmp_path / "emb", compile_cubin=True)
    assert (folder / "kernel.cubin").stat().st_size > 0
    art = KernelArtefact.load(folder)
    assert {p.name for p in art.inputs} == {"Table0", "Ids0", "C0", "C1", "W", "B"}
    assert {p.name for p in art.outputs} == {"Y", "T"} and art.param("Ids0").dtype == "int64"


def test_random_inputs_and_evaluate_take_the_table_and_ids_as_the_kernel_does() -> None:
    """What a measuring loop draws (``random_inputs``) is the kernel's parameters, ids inside the table, and
    ``evaluate`` gathers from them: the kernel and the reference agree on the same dict."""
    g = _embedding_norm(2, 3, 8, 11)
    x = random_inputs(g, 4)
    assert set(x) == {"Table0", "Ids0", "C0", "C1", "W", "B"}
    assert x["Ids0"].dtype == np.int64 and x["Ids0"].min() >= 0 and x["Ids0"].max() < 11
    np.testing.assert_allclose(build(first_pick(g), "llvm")(x)["Y"], evaluate(g, x)["Y"], rtol=1e-5, atol=1e-5)
