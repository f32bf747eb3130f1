"""Indexed stores (``smg.stores``, ``spacefusion.lower.stores``): an SMG output stored into a caller's tensor at
run-time positions along one dim, ``Cache[b, h, Pos[s], d] = K[b, s, h, d]`` (a KV cache's ``index_copy_``).

The IR attribute keys only graphs that have stores; the reference scatters as ``index_copy_`` does; the llvm
kernel writes the caller's array itself (no copy), with the same values as the reference, vector runs or
not; the CUDA source stores through ``Pos_ptr`` into an ``inout`` parameter and compiles with nvcc; kernels
the store paths do not cover (reductions) and RoPE's sequence as a run-time size (it reads through index
expressions) are refused by name."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from schedulers.errors import ScheduleError
from smg import patterns
from smg.errors import UnknownAxisError
from smg.ops import Builder
from smg.reference import evaluate, random_inputs
from smg.stores import STORES_ATTR, IndexedStore, scatter, stores_of, with_stores
from spacefusion.api import build, first_pick, schedule
from spacefusion.frontend.backends import LLVMBackend, ReferenceBackend
from spacefusion.lower.stores import LoweringError
from spacefusion.lower.symbolic import SymbolicDim, check
from spacefusion.lower.tir import signature

LENGTH = 9
ORDER = ("b", "h", "s", "j")


def _kv(b: int = 2, s: int = 3, h: int = 2, d: int = 16, dtype: str = "float32", length: int = LENGTH,
        offset: bool = False):
    """RoPE carrying V, its Y and Vo stored into [b, h, length, d] caches at ``Pos`` along ``s`` (``offset``:
    at ``Pos[0] + s``)."""
    g = patterns.rope(b, s, h, d, "shared", dtype, "bshd", carry=True)
    return g, with_stores(g, (IndexedStore("Y", "Kc", "Pos", "s", ORDER, length, offset),
                              IndexedStore("Vo", "Vc", "Pos", "s", ORDER, length, offset)))


def _eager(g, inputs: dict[str, np.ndarray], pos: torch.Tensor, shape: tuple[int, ...]):
    """torch's ``index_copy_`` of the plain graph's outputs (as [b, h, s, d]) into zero caches."""
    out = evaluate(g, inputs)
    caches = []
    for name in ("Y", "Vo"):
        c = torch.zeros(shape)
        c.index_copy_(2, pos, torch.from_numpy(np.asarray(out[name], np.float32)).permute(0, 2, 1, 3))
        caches.append(c)
    return caches


def test_stores_live_in_attrs_and_key_only_graphs_that_have_them() -> None:
    g, kv = _kv()
    assert with_stores(g, ()) is g and stores_of(g) == ()
    assert dict(kv.attrs)[STORES_ATTR] and kv.key != g.key and kv.ops == g.ops and kv.outputs == g.outputs
    assert stores_of(kv)[0] == IndexedStore("Y", "Kc", "Pos", "s", ORDER, LENGTH)
    assert stores_of(kv)[0].shape(kv) == (2, 2, LENGTH, 16)
    # the plain RoPE's key is what it was (carry off, no store): committed keys stay
    assert patterns.rope(2, 3, 2, 16, "shared", "float32", "bshd").key == patterns.rope(
        2, 3, 2, 16, "shared", "float32", "bshd", carry=False).key


@pytest.mark.parametrize("bad,what", [
    (IndexedStore("Xlo", "Kc", "Pos", "s", ORDER, LENGTH), "output"),  # an intermediate, read by Y
    (IndexedStore("Y", "Kc", "Pos", "s", ("b", "h", "j"), LENGTH), "layout"),
    (IndexedStore("Y", "Kc", "Pos", "s", ORDER, 2), "positions along"),
    (IndexedStore("Y", "X", "Pos", "s", ORDER, LENGTH), "clash"),
])
def test_a_store_that_does_not_fit_its_graph_is_refused_by_name(bad: IndexedStore, what: str) -> None:
    g, _ = _kv()
    with pytest.raises((UnknownAxisError, ValueError), match=what):
        with_stores(g, (bad,))


def test_reference_and_llvm_write_the_callers_caches_as_index_copy() -> None:
    g, kv = _kv()
    inputs = random_inputs(g)
    pos = torch.tensor([7, 0, 4])
    want = _eager(g, inputs, pos, (2, 2, LENGTH, 16))
    for backend in (ReferenceBackend(), LLVMBackend()):
        kc, vc = torch.zeros(2, 2, LENGTH, 16), torch.zeros(2, 2, LENGTH, 16)
        ptrs = (kc.data_ptr(), vc.data_ptr())
        out = backend.compile(kv)({**{k: torch.from_numpy(v) for k, v in inputs.items()}, "Kc": kc, "Vc": vc,
                                   "Pos": pos})
        assert out == {}  # the stored outputs are not returned
        assert (kc.data_ptr(), vc.data_ptr()) == ptrs
        torch.testing.assert_close(kc, want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(vc, want[1], rtol=0, atol=0)


@pytest.mark.parametrize("kw", [dict(step=16, vector=1), dict(step=16, vector=4), dict(step=8, vector=4, lanes=2)])
def test_llvm_vector_runs_store_at_the_positions(kw: dict) -> None:
    g, kv = _kv(s=5)
    inputs = random_inputs(g, seed=3)
    pos = torch.tensor([8, 2, 3, 0, 6])
    want = _eager(g, inputs, pos, (2, 2, LENGTH, 16))
    kc, vc = np.zeros((2, 2, LENGTH, 16), np.float32), np.zeros((2, 2, LENGTH, 16), np.float32)
    kernel = build(schedule(kv, tiles={"b": 1, "s": 2, "h": 2}, serial="j", **kw), "llvm")
    assert kernel({**inputs, "Kc": kc, "Vc": vc, "Pos": pos.numpy()}) == {}
    np.testing.assert_allclose(kc, want[0].numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(vc, want[1].numpy())


def test_positions_along_the_serial_dim_store_element_by_element() -> None:
    """A store whose positions index the serial dim: consecutive elements land at unrelated places, so a run
    is stored one element at a time (no vector store)."""
    g = Builder("scale_rows", "float32")
    y = g.map("2*X", g.input("X", {"m": 3, "n": 8}), name="Y")
    plain = g.build(y)
    st = IndexedStore("Y", "C", "P", "n", ("m", "n"), 12)
    x = random_inputs(plain)["X"]
    pos = np.array([11, 0, 5, 3, 2, 9, 7, 1])
    c = np.full((3, 12), -1.0, np.float32)
    build(schedule(with_stores(plain, (st,)), tiles={"m": 1}, serial="n", step=8, vector=4), "llvm")(
        {"X": x, "C": c, "P": pos})
    want = np.full((3, 12), -1.0, np.float32)
    scatter(st, plain, 2 * x, want, pos)
    np.testing.assert_array_equal(c, want)
    assert (want[:, pos] == 2 * x).all()


def test_a_misaligned_or_strided_cache_is_still_written_in_place() -> None:
    """Where TVM cannot take the caller's memory (not 64-byte aligned), the kernel runs on a copy that is
    written back: same values in the caller's array."""
    g, kv = _kv()
    inputs = random_inputs(g)
    pos = torch.tensor([1, 2, 3])
    want = _eager(g, inputs, pos, (2, 2, LENGTH, 16))
    big = np.zeros(2 * 2 * LENGTH * 16 + 1, np.float32)
    kc = big[1:].reshape(2, 2, LENGTH, 16)  # 4 bytes off the allocation's alignment
    vc = np.zeros((2, 2, LENGTH, 16), np.float32)
    build(first_pick(kv), "llvm")({**inputs, "Kc": kc, "Vc": vc, "Pos": pos.numpy()})
    np.testing.assert_allclose(kc, want[0].numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("base", [2, LENGTH - 2, -1])
def test_offset_positions_start_at_a_counter_and_nothing_lands_outside(base: int) -> None:
    """``offset``: the positions are ``Pos[0] + s`` (HF's ``arange(s) + cumulative_length``); a position
    outside the cache (past its end, or negative) is not written, and nothing else of the cache changes."""
    g = patterns.rope(2, 3, 2, 16, "shared", "float32", "bshd", carry=True)
    kv = with_stores(g, (IndexedStore("Y", "Kc", "Pos", "s", ORDER, LENGTH, True),
                         IndexedStore("Vo", "Vc", "Pos", "s", ORDER, LENGTH, True)))
    assert stores_of(kv)[0].positions_shape(kv) == (1,)
    inputs = random_inputs(g)
    pos = torch.arange(3) + base
    inside = (pos >= 0) & (pos < LENGTH)
    want = _eager(g, {k: v for k, v in inputs.items()}, pos[inside], (2, 2, LENGTH, 16)) if inside.all() else None
    for backend in (ReferenceBackend(), LLVMBackend()):
        kc, vc = torch.full((2, 2, LENGTH, 16), 7.0), torch.full((2, 2, LENGTH, 16), 7.0)
        backend.compile(kv)({**{k: torch.from_numpy(v) for k, v in inputs.items()}, "Kc": kc, "Vc": vc,
                             "Pos": torch.tensor([base])})
        rows = set(pos[inside].tolist())
        untouched = [i for i in range(LENGTH) if i not in rows]
        assert (kc[:, :, untouched] == 7).all() and (vc[:, :, untouched] == 7).all()
        np.testing.assert_array_equal(vc[:, :, pos[inside]].numpy(),
                                      inputs["V"].transpose(0, 2, 1, 3)[:, :, inside.numpy()])
        if want is not None:
            torch.testing.assert_close(kc[:, :, pos], want[0][:, :, pos], rtol=1e-5, atol=1e-5)


def test_signature_replaces_stored_outputs_by_the_cache_and_positions() -> None:
    _, kv = _kv()
    params = {name: (shape, dtype, role) for name, shape, dtype, role in signature(first_pick(kv)).params}
    assert "Y" not in params and "Vo" not in params
    assert params["Kc"] == ((2, 2, LENGTH, 16), "float32", "inout") == params["Vc"]
    assert params["Pos"] == ((3,), "int64", "input")


def test_kernels_the_store_paths_do_not_cover_are_refused() -> None:
    g = Builder("row_sum", "float32")
    y = g.reduce(g.input("X", {"m": 4, "n": 8}), "n", "sum", name="Y")
    with pytest.raises(LoweringError, match="element-wise"):
        build(schedule(with_stores(g.build(y), (IndexedStore("Y", "C", "P", "m", ("m",), 6),)), tiles={"m": 1},
                       serial="n", step=8), "llvm")
    _, kv = _kv(s=4)
    s = schedule(kv, tiles={"b": 1, "s": 2, "h": 2}, serial="j", step=16)
    with pytest.raises(ScheduleError, match="index expression"):
        check(s, SymbolicDim("s", 2, 8))


def _nvcc() -> bool:
    return shutil.which("nvcc") is not None or Path("/usr/local/cuda/bin/nvcc").is_file()


def test_cuda_source_stores_through_the_positions_into_an_inout_cache() -> None:
    _, kv = _kv(b=1, s=1, h=2, d=64, dtype="float16", length=2048)
    art = build(first_pick(kv), "cuda:sm_90a")
    src = art.source.split("__global__")[-1]
    assert "Pos_ptr[" in src and "Kc_ptr" in src and "Vc_ptr" in src
    assert "uint4*)(Kc_ptr" in src  # 16-byte stores along the head dim, at the cache row Pos[s]


@pytest.mark.skipif(not _nvcc(), reason="nvcc not installed")
@pytest.mark.parametrize("offset", [False, True])
def test_cuda_store_kernel_compiles_and_its_artefact_loads(tmp_path: Path, offset: bool) -> None:
    from spacefusion.runtime.artefact import KernelArtefact

    _, kv = _kv(b=2, s=7, h=2, d=64, dtype="float16", length=2048, offset=offset)
    folder = build(first_pick(kv), "cuda:sm_90a").save(tmp_path / "kv", compile_cubin=True)
    assert (folder / "kernel.cubin").stat().st_size > 0
    art = KernelArtefact.load(folder)
    assert [p.name for p in art.outputs] == []
    assert {p.name for p in art.inputs} == {"X", "Cos", "Sin", "V", "Kc", "Vc", "Pos"}
    assert art.param("Pos").shape == ((1,) if offset else (7,))


def test_the_rewrite_orders_in_place_effects_around_the_kernel() -> None:
    """No data edge links a cache write to the attention reading the cache input, nor a kernel's read of a
    counter to the ``add_`` that bumps it: ``in_place.order_in_place`` does.  A reader of the written cache
    after the kernel waits for it, one before is waited for; the counter's in-place writer after the
    kernel's read of it waits for the kernel."""
    from torch import fx

    from spacefusion.frontend.in_place import order_in_place
    from spacefusion.frontend.records import Operand, Subgraph

    graph = fx.Graph()
    cache, k, count = graph.placeholder("cache"), graph.placeholder("k"), graph.placeholder("count")
    early = graph.call_method("sum", (cache,))  # reads the cache before the write
    pos = graph.call_function(torch.add, (k, count))  # the kernel's read of the counter
    bump = graph.call_method("add_", (count, 1))  # torch bumps it after that read
    write = graph.call_method("index_copy_", (cache, 2, pos, k))
    late = graph.call_method("mean", (cache,))  # reads the cache after the write
    graph.output((early, late, bump))
    nodes = list(graph.nodes)
    sub = Subgraph("rope", "", (pos.name, write.name), None,  # type: ignore[arg-type]
                   (Operand("Kc", "value", "cache", ()), Operand("Pos", "value", "count", ())), (), ("cache",))
    unit = {n.name: ("n", n.name) for n in nodes} | {pos.name: ("k", 0), write.name: ("k", 0)}
    deps: dict[tuple, set] = {u: set() for u in unit.values()}
    order_in_place([sub], {n.name: n for n in nodes}, unit, {n.name: i for i, n in enumerate(nodes)}, deps)
    assert deps[("n", late.name)] == {("k", 0)} and deps[("n", bump.name)] == {("k", 0)}
    assert deps[("k", 0)] == {("n", early.name)}
