"""Dependency kinds of SMG mappings, derived from the operators' index expressions.

Each operator's edges are checked against the paper's Table 1 (as we read it):
element-wise ops are One-to-One everywhere, broadcasts are One-to-All along the
broadcast dims, reductions are All-to-One along the reduced dims, and a GEMM is
One-to-All along the dimension of the *other* operand and All-to-One along k.
"""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp

from smg import SMG, Builder, Edge, Kind, evaluate
from smg.footprint import dependency_footprint, size_symbol
from smg.ops import BINARY, UNARY
from smg.reference import evaluate_op
from smg.workloads import gemm, mha, simplified_mha

O2O, O2A, A2O = Kind.ONE_TO_ONE, Kind.ONE_TO_ALL, Kind.ALL_TO_ONE


def edge(g: SMG, src: str, dst: str) -> Edge:
    found = [e for e in g.edges if e.src == src and e.dst == dst]
    assert len(found) == 1, f"expected one edge {src} -> {dst}, found {found}"
    return found[0]


def kinds(g: SMG, src: str, dst: str) -> dict[str, Kind]:
    return dict(edge(g, src, dst).kinds)


def non_o2o(g: SMG) -> set[tuple[str, str, str, Kind]]:
    """Every (src, dst, dim, kind) whose kind is not One-to-One."""
    return {(e.src, e.dst, d, k) for e in g.edges for d, k in e.kinds if k is not O2O}


# -- GEMM -------------------------------------------------------------------------------------


def test_gemm_edges() -> None:
    g = gemm(8, 16, 32)
    assert g.inputs == ("A", "B") and g.outputs == ("C",)
    assert g.producer("C").iter_dims == ("m", "n", "k")
    assert kinds(g, "A", "C.it") == {"m": O2O, "n": O2A, "k": O2O}
    assert kinds(g, "B", "C.it") == {"m": O2A, "n": O2O, "k": O2O}
    assert kinds(g, "C.it", "C") == {"m": O2O, "n": O2O, "k": A2O}
    assert len(g.edges) == 3
    assert g.count_kinds() == {O2O: 6, O2A: 2, A2O: 1}


def test_edge_helpers() -> None:
    e = edge(gemm(2, 3, 4), "A", "C.it")
    assert e.kind("n") is O2A
    assert e.kind("k") is O2O
    assert e.kind("nope") is None
    assert e.count(O2A) == 1 and e.count(O2O) == 2 and e.count(A2O) == 0


def test_kind_short_names() -> None:
    assert (O2O.short, O2A.short, A2O.short) == ("1:1", "1:A", "A:1")
    assert O2O.value == "One-to-One" and O2A.value == "One-to-All" and A2O.value == "All-to-One"


# -- element-wise -----------------------------------------------------------------------------


@pytest.mark.parametrize("fn", sorted(UNARY))
def test_unary_is_one_to_one_only(fn: str) -> None:
    b = Builder("u")
    x = b.input("x", {"m": 3, "l": 5})
    y = b.unary(fn, x, name="y")
    g = b.build(y)
    assert kinds(g, "x", "y.it") == {"m": O2O, "l": O2O}
    assert kinds(g, "y.it", "y") == {"m": O2O, "l": O2O}
    assert g.count_kinds() == {O2O: 4, O2A: 0, A2O: 0}
    assert non_o2o(g) == set()


@pytest.mark.parametrize("fn", sorted(BINARY))
def test_binary_same_shape_is_one_to_one_only(fn: str) -> None:
    b = Builder("bin")
    x = b.input("x", {"m": 3, "l": 5})
    y = b.input("y", {"m": 3, "l": 5})
    g = b.build(b.binary(fn, x, y, name="z"))
    assert non_o2o(g) == set()
    assert g.count_kinds()[O2O] == 6


@pytest.mark.parametrize("fn", sorted(BINARY))
def test_binary_broadcast_is_one_to_all_along_missing_dim(fn: str) -> None:
    # x[m, l] (op) y[m]: y is broadcast along l.
    b = Builder("bcast")
    x = b.input("x", {"m": 3, "l": 5})
    y = b.input("y", {"m": 3})
    g = b.build(b.binary(fn, x, y, name="z"))
    assert g.space("z").dims == ("m", "l")
    assert kinds(g, "x", "z.it") == {"m": O2O, "l": O2O}
    assert kinds(g, "y", "z.it") == {"m": O2O, "l": O2A}
    assert kinds(g, "z.it", "z") == {"m": O2O, "l": O2O}
    assert non_o2o(g) == {("y", "z.it", "l", O2A)}


def test_binary_broadcast_left_operand_smaller() -> None:
    b = Builder("bcast")
    y = b.input("y", {"m": 3})
    x = b.input("x", {"m": 3, "l": 5})
    g = b.build(b.binary("sub", y, x, name="z"))
    assert g.space("z").dims == ("m", "l")
    assert non_o2o(g) == {("y", "z.it", "l", O2A)}


def test_scale_and_map_are_one_to_one() -> None:
    b = Builder("m")
    x = b.input("x", {"m": 3, "l": 5})
    s = b.scale(x, 0.5, name="s")
    g = b.build(b.map("s*s + 1", s, name="t"))
    assert non_o2o(g) == set()


# -- reductions and softmax -------------------------------------------------------------------


@pytest.mark.parametrize("combiner", ["sum", "max"])
def test_reduce_is_all_to_one_along_reduced_dim_only(combiner: str) -> None:
    b = Builder("r")
    x = b.input("x", {"m": 3, "l": 5})
    g = b.build(b.reduce(x, "l", combiner, name="r"))
    assert g.space("r").dims == ("m",)
    assert g.producer("r").iter_dims == ("m", "l")
    assert kinds(g, "x", "r.it") == {"m": O2O, "l": O2O}
    assert kinds(g, "r.it", "r") == {"m": O2O, "l": A2O}
    assert non_o2o(g) == {("r.it", "r", "l", A2O)}
    assert g.count_kinds() == {O2O: 3, O2A: 0, A2O: 1}


def test_softmax_composition() -> None:
    b = Builder("sm")
    x = b.input("x", {"m": 3, "l": 5})
    g = b.build(b.softmax(x, "l", name="P"))
    assert [op.kind for op in g.ops] == ["reduce_max", "sub", "exp", "reduce_sum", "div"]
    # max and sum reduce along l; the broadcasts of max and sum back are One-to-All along l.
    assert non_o2o(g) == {
        ("P_max.it", "P_max", "l", A2O),
        ("P_max", "P_sub.it", "l", O2A),
        ("P_sum.it", "P_sum", "l", A2O),
        ("P_sum", "P.it", "l", O2A),
    }
    assert g.count_kinds()[O2A] == 2 and g.count_kinds()[A2O] == 2
    for e in g.edges:
        assert e.kind("m") is O2O


# -- batched matmul ---------------------------------------------------------------------------


def test_batched_matmul_batch_dims_one_to_one() -> None:
    b = Builder("bmm")
    a = b.input("a", {"b": 2, "m": 3, "k": 4})
    c = b.input("c", {"b": 2, "k": 4, "n": 5})
    g = b.build(b.matmul(a, c, reduce="k", name="o"))
    assert g.space("o").dims == ("b", "m", "n")
    for e in g.edges:
        assert e.kind("b") is O2O
    assert kinds(g, "a", "o.it") == {"b": O2O, "m": O2O, "n": O2A, "k": O2O}
    assert kinds(g, "c", "o.it") == {"b": O2O, "m": O2A, "n": O2O, "k": O2O}
    assert kinds(g, "o.it", "o") == {"b": O2O, "m": O2O, "n": O2O, "k": A2O}


def test_mha_batch_and_head_dims_one_to_one_everywhere() -> None:
    g = mha(2, 3, 4, 5, 8)
    for e in g.edges:
        assert e.kind("b") is O2O
        assert e.kind("h") is O2O
    assert kinds(g, "S.it", "S") == {"b": O2O, "h": O2O, "m": O2O, "l": O2O, "d": A2O}
    assert kinds(g, "O.it", "O")["l"] is A2O


# -- the simplified MHA of Figure 1 -----------------------------------------------------------

SOURCES = ("Query", "Key", "QK", "Max", "Exp", "Sum", "Softmax", "Value")


@pytest.fixture(scope="module")
def fig1() -> SMG:
    return simplified_mha(4, 3)


@pytest.fixture(scope="module")
def fig1_footprint(fig1: SMG) -> dict[str, sp.Expr]:
    return dependency_footprint(fig1, "Out").as_dict()


def nesting_depth(g: SMG, space: str) -> int:
    """Number of ops on the longest chain from an input to ``space``."""
    op = g.producer(space)
    if op is None:
        return 0
    return 1 + max(nesting_depth(g, a.space) for a in op.inputs)


def longest_chain(g: SMG, space: str) -> list[str]:
    op = g.producer(space)
    if op is None:
        return []
    best = max((longest_chain(g, a.space) for a in op.inputs), key=len)
    return [*best, space]


def test_fig1_structure(fig1: SMG) -> None:
    assert fig1.outputs == ("Out",)
    assert set(fig1.inputs) == {"Query", "Key", "Value"}
    assert {s.name for s in fig1.spaces} - {"Out"} == set(SOURCES)
    counts = fig1.count_kinds()
    assert counts[O2A] == 6
    assert counts[A2O] == 4
    assert non_o2o(fig1) == {
        ("Query", "QK.it", "l", O2A),
        ("Key", "QK.it", "m", O2A),
        ("QK.it", "QK", "k", A2O),
        ("Max.it", "Max", "l", A2O),
        ("Max", "Exp.it", "l", O2A),
        ("Sum.it", "Sum", "l", A2O),
        ("Sum", "Softmax.it", "l", O2A),
        ("Softmax", "Out.it", "n", O2A),
        ("Value", "Out.it", "m", O2A),
        ("Out.it", "Out", "l", A2O),
    }


def test_fig1_nesting_depth(fig1: SMG) -> None:
    assert nesting_depth(fig1, "Out") == 6
    assert longest_chain(fig1, "Out") == ["QK", "Max", "Exp", "Sum", "Softmax", "Out"]


def test_fig1_dependency_footprint(fig1_footprint: dict[str, sp.Expr]) -> None:
    """Exact dependency footprint of one element of Out in the paper's Figure 1.

    Seed 002 states the footprint as ``2LK + 4K + 2``.  Our exact count of
    *distinct* elements (islpy) differs: one Out element reads one row of Query
    (K elements, not L*K), all of Key (K*L), one column of Value (L), one row of
    QK, Exp and Softmax (rows of the softmax have length L, not K) and one
    element each of Max and Sum, i.e. ``K*L + K + 4*L + 2``.  The structural
    claims of the paper do match: 8 source tensors, 6 One-to-All and 4
    All-to-One mappings, and 6 nesting levels (see the tests above).
    """
    L, K = sp.symbols("L K", positive=True, integer=True)
    sub = {size_symbol("m"): L, size_symbol("l"): L, size_symbol("k"): K, size_symbol("n"): K}
    fp = {n: sp.expand(c.subs(sub)) for n, c in fig1_footprint.items()}
    assert set(fp) == set(SOURCES)
    assert fp["Key"] == K * L
    assert fp["Query"] == K
    assert fp["Max"] == 1 and fp["Sum"] == 1
    for name in ("QK", "Exp", "Softmax", "Value"):
        assert fp[name] == L, name
    total = sp.expand(sum(fp.values()))
    assert total == K * L + K + 4 * L + 2
    assert total != 2 * L * K + 4 * K + 2


def test_fig1_footprint_total_unsubstituted(fig1: SMG) -> None:
    fp = dependency_footprint(fig1)
    Nk, Nl = size_symbol("k"), size_symbol("l")
    assert fp.total() == Nk * Nl + Nk + 4 * Nl + 2
    assert fp.total(exclude=("Key",)) == Nk + 4 * Nl + 2


def _influencers(g: SMG, env: dict[str, np.ndarray], space: str) -> set[tuple[int, ...]]:
    """Elements of ``space`` whose perturbation changes Out[0, 0] (re-running later ops)."""
    start = 0 if g.producer(space) is None else g.ops.index(g.producer(space)) + 1
    base = env["Out"][0, 0]
    hits = set()
    for idx in np.ndindex(env[space].shape):
        local = dict(env)
        arr = env[space].copy()
        arr[idx] += 0.75
        local[space] = arr
        for op in g.ops[start:]:
            local[op.out] = evaluate_op(op, local)
        if abs(local["Out"][0, 0] - base) > 1e-9 * max(1.0, abs(base)):
            hits.add(idx)
    return hits


def test_fig1_footprint_matches_brute_force(fig1: SMG, fig1_footprint: dict[str, sp.Expr]) -> None:
    L, K = 4, 3
    sizes = {size_symbol(d.name): d.size for d in fig1.dims}
    assert sizes == {size_symbol("m"): L, size_symbol("l"): L, size_symbol("k"): K, size_symbol("n"): K}
    rng = np.random.default_rng(7)
    inputs = {n: rng.standard_normal(fig1.shape(n)) for n in fig1.inputs}
    env = evaluate(fig1, inputs, keep=True)
    hits = {n: _influencers(fig1, env, n) for n in ("Query", "Key", "Value")}
    for name in ("Query", "Key", "Value"):
        assert len(hits[name]) == int(fig1_footprint[name].subs(sizes)), name
    assert hits["Query"] == {(0, k) for k in range(K)}
    assert hits["Key"] == {(l, k) for l in range(L) for k in range(K)}
    assert hits["Value"] == {(l, 0) for l in range(L)}


def test_fig1_intermediate_footprint_matches_brute_force(
    fig1: SMG, fig1_footprint: dict[str, sp.Expr]
) -> None:
    # Max is left out on purpose: softmax is invariant under a shift of its row,
    # so perturbing Max alone cancels out numerically although Out depends on it.
    sizes = {size_symbol(d.name): d.size for d in fig1.dims}
    rng = np.random.default_rng(11)
    inputs = {n: rng.standard_normal(fig1.shape(n)) for n in fig1.inputs}
    env = evaluate(fig1, inputs, keep=True)
    for name in ("QK", "Exp", "Sum", "Softmax"):
        hits = _influencers(fig1, env, name)
        assert len(hits) == int(fig1_footprint[name].subs(sizes)), name
        assert all(idx[0] == 0 for idx in hits), name


def test_gemm_dependency_footprint() -> None:
    fp = dependency_footprint(gemm(4, 5, 6)).as_dict()
    Nk = size_symbol("k")
    assert fp == {"A": Nk, "B": Nk}
