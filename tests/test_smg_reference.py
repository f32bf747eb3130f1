"""The unfused numpy reference evaluator against direct numpy."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, seed, settings
from hypothesis import strategies as st

from smg import Builder, evaluate, random_inputs
from smg.ops import BINARY, UNARY
from smg.workloads import gemm, mha, simplified_mha, softmax_gemm

TOL = {"rtol": 1e-12, "atol": 1e-12}


def np_softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


_erf = np.vectorize(math.erf)

UNARY_REF = {
    "exp": np.exp,
    "log": np.log,
    "neg": np.negative,
    "abs": np.abs,
    "sqrt": np.sqrt,
    "rsqrt": lambda x: 1.0 / np.sqrt(x),
    "recip": lambda x: 1.0 / x,
    "tanh": np.tanh,
    "sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)),
    "relu": lambda x: np.maximum(x, 0.0),
    "relu6": lambda x: np.clip(x, 0.0, 6.0),
    "silu": lambda x: x / (1.0 + np.exp(-x)),
    "gelu": lambda x: x * (1.0 + _erf(x / math.sqrt(2.0))) / 2.0,
    "gelu_tanh": lambda x: 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3))),
}
POSITIVE_ONLY = {"log", "sqrt", "rsqrt", "recip"}

BINARY_REF = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "div": np.divide,
    "max": np.maximum,
    "min": np.minimum,
}


def test_every_op_has_a_reference() -> None:
    assert set(UNARY_REF) == set(UNARY)
    assert set(BINARY_REF) == set(BINARY)


# -- workloads --------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [None, 0.3])
def test_mha(scale: float | None) -> None:
    b, h, m, l, d = 2, 3, 4, 5, 8
    g = mha(b, h, m, l, d, scale=scale)
    ins = random_inputs(g, seed=1)
    assert {k: v.dtype for k, v in ins.items()} == {k: np.dtype("float16") for k in ("Q", "K", "V")}
    q, k, v = (ins[n].astype(np.float64) for n in ("Q", "K", "V"))
    s = np.einsum("bhmd,bhld->bhml", q, k) * (1.0 / math.sqrt(d) if scale is None else scale)
    want = np.einsum("bhml,bhln->bhmn", np_softmax(s), v)
    got = evaluate(g, ins)
    assert set(got) == {"O"}
    assert got["O"].shape == (b, h, m, d) and got["O"].dtype == np.float64
    np.testing.assert_allclose(got["O"], want, **TOL)


def test_mha_keep_intermediates() -> None:
    g = mha(1, 2, 3, 4, 8)
    ins = random_inputs(g, seed=3)
    env = evaluate(g, ins, keep=True)
    assert set(env) == {s.name for s in g.spaces}
    np.testing.assert_allclose(env["P"].sum(axis=-1), 1.0, rtol=1e-12)
    for name in g.spaces:
        assert env[name.name].shape == g.shape(name.name)


def test_softmax_gemm() -> None:
    g = softmax_gemm(5, 7, 3)
    ins = random_inputs(g, seed=2, scale=3.0)
    s, v = ins["S"].astype(np.float64), ins["V"].astype(np.float64)
    np.testing.assert_allclose(evaluate(g, ins)["O"], np_softmax(s) @ v, **TOL)


def test_gemm() -> None:
    g = gemm(4, 6, 5)
    ins = random_inputs(g, seed=4)
    a, b = ins["A"].astype(np.float64), ins["B"].astype(np.float64)
    assert a.shape == (4, 5) and b.shape == (6, 5)
    np.testing.assert_allclose(evaluate(g, ins)["C"], a @ b.T, **TOL)


def test_simplified_mha() -> None:
    g = simplified_mha(6, 4)
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((6, 4)), rng.standard_normal((6, 4)), rng.standard_normal((6, 4))
    got = evaluate(g, {"Query": q, "Key": k, "Value": v})["Out"]
    np.testing.assert_allclose(got, np_softmax(q @ k.T) @ v, **TOL)


def test_random_inputs_seeded() -> None:
    g = gemm(3, 4, 5)
    a, b = random_inputs(g, seed=9), random_inputs(g, seed=9)
    c = random_inputs(g, seed=10)
    for n in g.inputs:
        np.testing.assert_array_equal(a[n], b[n])
        assert a[n].dtype == np.float32
    assert not np.array_equal(a["A"], c["A"])


# -- element-wise and reductions --------------------------------------------------------------


@pytest.mark.parametrize("fn", sorted(UNARY))
def test_unary(fn: str) -> None:
    rng = np.random.default_rng(sorted(UNARY).index(fn))
    x = rng.standard_normal((3, 5)) * 2.0
    if fn in POSITIVE_ONLY:
        x = np.abs(x) + 0.1
    b = Builder("u", "float64")
    t = b.input("x", {"m": 3, "l": 5})
    g = b.build(b.unary(fn, t, name="y"))
    got = evaluate(g, {"x": x})["y"]
    assert got.shape == (3, 5)
    np.testing.assert_allclose(got, UNARY_REF[fn](x), **TOL)


def test_gelu_matches_math_erf_pointwise() -> None:
    xs = np.array([-3.0, -1.0, -0.25, 0.0, 0.5, 1.0, 2.5])
    b = Builder("g", "float64")
    g = b.build(b.unary("gelu", b.input("x", {"m": xs.size}), name="y"))
    got = evaluate(g, {"x": xs})["y"]
    for x, y in zip(xs, got, strict=True):
        assert y == pytest.approx(0.5 * x * (1.0 + math.erf(x / math.sqrt(2.0))), rel=1e-14, abs=1e-15)


@pytest.mark.parametrize("fn", sorted(BINARY))
@pytest.mark.parametrize("broadcast", [False, True], ids=["same", "broadcast"])
def test_binary(fn: str, broadcast: bool) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 5))
    y = rng.standard_normal((3,) if broadcast else (3, 5))
    if fn == "div":
        y = np.where(np.abs(y) < 0.1, 0.5, y)
    b = Builder("b", "float64")
    tx = b.input("x", {"m": 3, "l": 5})
    ty = b.input("y", {"m": 3} if broadcast else {"m": 3, "l": 5})
    g = b.build(b.binary(fn, tx, ty, name="z"))
    got = evaluate(g, {"x": x, "y": y})["z"]
    want = BINARY_REF[fn](x, y[:, None] if broadcast else y)
    assert got.shape == (3, 5)
    np.testing.assert_allclose(got, want, **TOL)


def test_binary_broadcast_transposed_layouts() -> None:
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal((3, 5)), rng.standard_normal((5, 3))
    b = Builder("t", "float64")
    g = b.build(b.binary("sub", b.input("x", {"m": 3, "l": 5}), b.input("y", {"l": 5, "m": 3}), name="z"))
    np.testing.assert_allclose(evaluate(g, {"x": x, "y": y})["z"], x - y.T, **TOL)


def test_binary_same_tensor_twice() -> None:
    x = np.array([-1.0, 2.0, 3.0])
    b = Builder("s", "float64")
    t = b.input("x", {"m": 3})
    g = b.build(b.binary("mul", t, t, name="sq"))
    np.testing.assert_allclose(evaluate(g, {"x": x})["sq"], x * x, **TOL)


@pytest.mark.parametrize("combiner", ["sum", "max"])
@pytest.mark.parametrize("axis", [0, 1, 2])
def test_reduce(combiner: str, axis: int) -> None:
    rng = np.random.default_rng(axis)
    x = rng.standard_normal((2, 3, 4))
    dims = {"a": 2, "m": 3, "l": 4}
    b = Builder("r", "float64")
    t = b.input("x", dims)
    g = b.build(b.reduce(t, list(dims)[axis], combiner, name="r"))
    want = x.sum(axis=axis) if combiner == "sum" else x.max(axis=axis)
    np.testing.assert_allclose(evaluate(g, {"x": x})["r"], want, **TOL)


def test_scale_and_map() -> None:
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((3, 4)), rng.standard_normal(4)
    b = Builder("m", "float64")
    tx, ty = b.input("x", {"m": 3, "l": 4}), b.input("y", {"l": 4})
    s = b.scale(tx, 0.25, name="s")
    g = b.build(b.map("exp(s - y) * y", s, ty, name="o"))
    np.testing.assert_allclose(evaluate(g, {"x": x, "y": y})["o"], np.exp(0.25 * x - y) * y, **TOL)


def test_softmax_builder() -> None:
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 4, 5)) * 4
    b = Builder("sm", "float64")
    t = b.input("x", {"m": 3, "l": 4, "n": 5})
    g = b.build(b.softmax(t, "l", name="P"))
    np.testing.assert_allclose(evaluate(g, {"x": x})["P"], np_softmax(x, axis=1), **TOL)


# -- property tests ---------------------------------------------------------------------------

dim = st.integers(min_value=1, max_value=6)


@seed(20250101)
@settings(max_examples=25, deadline=None)
@given(m=dim, l=dim, n=dim, data_seed=st.integers(0, 2**32 - 1), spread=st.floats(0.1, 30.0))
def test_softmax_rows_sum_to_one(m: int, l: int, n: int, data_seed: int, spread: float) -> None:
    x = np.random.default_rng(data_seed).standard_normal((m, l, n)) * spread
    b = Builder("sm", "float64")
    t = b.input("x", {"m": m, "l": l, "n": n})
    g = b.build(b.softmax(t, "l", name="P"))
    p = evaluate(g, {"x": x})["P"]
    assert p.shape == (m, l, n)
    assert np.all(p >= 0.0) and np.all(p <= 1.0)
    np.testing.assert_allclose(p.sum(axis=1), 1.0, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(p, np_softmax(x, axis=1), rtol=1e-12, atol=1e-15)


@seed(20250102)
@settings(max_examples=25, deadline=None)
@given(
    batch=dim, m=dim, k=dim, n=dim, b_transposed=st.booleans(), data_seed=st.integers(0, 2**32 - 1)
)
def test_matmul_matches_einsum(batch: int, m: int, k: int, n: int, b_transposed: bool,
                               data_seed: int) -> None:
    rng = np.random.default_rng(data_seed)
    a = rng.standard_normal((batch, m, k))
    c = rng.standard_normal((batch, n, k) if b_transposed else (batch, k, n))
    g = Builder("mm", "float64")
    ta = g.input("a", {"b": batch, "m": m, "k": k})
    cdims = {"b": batch, "n": n, "k": k} if b_transposed else {"b": batch, "k": k, "n": n}
    tc = g.input("c", cdims)
    graph = g.build(g.matmul(ta, tc, reduce="k", name="o"))
    got = evaluate(graph, {"a": a, "c": c})["o"]
    want = np.einsum("bmk,bnk->bmn" if b_transposed else "bmk,bkn->bmn", a, c)
    assert got.shape == (batch, m, n)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


# -- regressions for bugs found in smg/ ---------------


def test_matmul_of_a_tensor_with_itself() -> None:
    x = np.arange(6.0).reshape(2, 3)
    b = Builder("self", "float64")
    t = b.input("x", {"m": 2, "k": 3})
    g = b.build(b.matmul(t, t, reduce="k", name="sq"))  # shared m is a batch dim
    np.testing.assert_allclose(evaluate(g, {"x": x})["sq"], (x * x).sum(axis=1), **TOL)


def test_chained_unary_with_default_names() -> None:
    x = np.array([0.1, 0.2, 0.3])
    b = Builder("chain", "float64")
    e = b.unary("exp", b.input("x", {"m": 3}))  # named "exp" by default
    g = b.build(b.unary("exp", e))  # body "exp(exp)"
    np.testing.assert_allclose(evaluate(g, {"x": x})[g.outputs[0]], np.exp(np.exp(x)), **TOL)
