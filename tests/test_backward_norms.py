"""Derived backwards of norms, GEMM epilogues and MLPs (smg.autodiff) on llvm against float64 numpy."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schedulers.passes import backward_passes
from smg import patterns
from smg.autodiff import derive_backward
from smg.ops import Builder
from tests.backward_helpers import (
    act_and_grad,
    gemm_epilogue_grads,
    layernorm_grads,
    rel_err,
    rmsnorm_grads,
    run_backward_llvm,
)

FAST = settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
TOL = 5e-5  # float32 kernels against float64, relative to the gradient's largest element


def _run(g, seed):
    bw = derive_backward(g)
    rng = np.random.default_rng(seed)
    x = {n: rng.standard_normal(g.shape(n)).astype(np.float32) for n in g.inputs}
    seeds = {s: rng.standard_normal(g.shape(o)).astype(np.float32) for o, s in bw.seeds}
    return bw, x, seeds, run_backward_llvm(bw, x, seeds)


@FAST
@given(m=st.integers(1, 9), n=st.integers(2, 40))
def test_layernorm_backward(m, n) -> None:
    bw, x, seeds, got = _run(patterns.layernorm(m, n, dtype="float32"), m * 100 + n)
    assert bw.saved == ("Y_mean", "Y_rstd")  # not log-linear together: both saved
    want = layernorm_grads(x["X"], x["W"], x["B"], seeds["dY"], 1e-5)
    for name in ("Y", "dX", "dW", "dB"):
        assert rel_err(got[name], want[name], want["scale"] if name == "dX" else 0.0) < TOL, name


@FAST
@given(m=st.integers(1, 9), n=st.integers(2, 40))
def test_rmsnorm_backward(m, n) -> None:
    bw, x, seeds, got = _run(patterns.rmsnorm(m, n, dtype="float32"), m * 100 + n)
    assert bw.saved == ("Y_rstd",)
    assert "Y_rstd -> Y_ms: dY_rstd * (-Y_rstd**3/2)" in "\n".join(bw.derivation)  # rsqrt' over its output
    want = rmsnorm_grads(x["X"], x["W"], seeds["dY"], 1e-6)
    for name in ("Y", "dX", "dW"):
        assert rel_err(got[name], want[name], want["scale"] if name == "dX" else 0.0) < TOL, name


@pytest.mark.parametrize("act", ["gelu", "silu", "gelu_tanh", "sigmoid", "tanh", "none"])
@FAST
@given(m=st.integers(1, 12), n=st.integers(1, 12), k=st.integers(1, 20), bias=st.booleans())
def test_gemm_epilogue_backward(act, m, n, k, bias) -> None:
    g = patterns.gemm_epilogue(m, n, k, act=act, bias=bias, dtype="float32")
    bw, x, seeds, got = _run(g, m * 1000 + n * 10 + k)
    want = gemm_epilogue_grads(x["A"], x["Bw"], x.get("bias"), seeds["dY"], act)
    assert {w for w, _ in bw.grads} == set(g.inputs)
    for name in want:
        assert rel_err(got[name], want[name]) < TOL, name


@pytest.mark.parametrize("act", ["gelu", "silu"])
def test_mlp_backward(act) -> None:
    g = patterns.mlp(6, 10, 12, 7, act=act, dtype="float32")
    bw, x, seeds, got = _run(g, 5)
    X, W1, W2, dy = (t.astype(np.float64) for t in (x["X"], x["W1"], x["W2"], seeds["dY"]))
    ha, d = act_and_grad(act, X @ W1)
    dh = (dy @ W2.T) * d
    want = {"Y": ha @ W2, "dX": dh @ W1.T, "dW1": X.T @ dh, "dW2": ha.T @ dy}
    for name in want:
        assert rel_err(got[name], want[name]) < TOL, name


def test_gated_mlp_backward() -> None:
    """``Y = (silu(X Wg) * (X Wu)) Wd``: the gate's and the up projection's gradients meet in dX."""
    g = Builder("gated_mlp", "float32")
    x = g.input("X", {"m": 5, "k": 8})
    wg, wu, wd = g.input("Wg", {"k": 8, "h": 6}), g.input("Wu", {"k": 8, "h": 6}), g.input("Wd", {"h": 6, "n": 4})
    gate = g.unary("silu", g.matmul(x, wg, reduce="k", name="G"), name="Ga")
    hid = g.binary("mul", gate, g.matmul(x, wu, reduce="k", name="U"), name="Hg")
    smg = g.build(g.matmul(hid, wd, reduce="h", name="Y"))
    bw, x, seeds, got = _run(smg, 7)
    X, Wg, Wu, Wd, dy = (t.astype(np.float64) for t in (x["X"], x["Wg"], x["Wu"], x["Wd"], seeds["dY"]))
    ga, dga = act_and_grad("silu", X @ Wg)
    u = X @ Wu
    dhid = dy @ Wd.T
    dG, dU = dhid * u * dga, dhid * ga
    want = {"dX": dG @ Wg.T + dU @ Wu.T, "dWg": X.T @ dG, "dWu": X.T @ dU, "dWd": (ga * u).T @ dy}
    for name in want:
        assert rel_err(got[name], want[name]) < TOL, name


def test_norm_passes_are_rows_then_columns() -> None:
    bw = derive_backward(patterns.layernorm(4, 8, dtype="float32"))
    assert [(p.name, p.smg.outputs) for p in backward_passes(bw)] == [("dX", ("dX",)), ("dW_dB", ("dW", "dB"))]
