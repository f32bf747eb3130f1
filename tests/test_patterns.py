"""Fusion patterns beyond attention: every one goes SMG -> slicers -> TVM llvm and is checked
against the unfused float64 numpy reference, fp32 and fp16, at sizes the tiles don't divide;
the CUDA kernel is generated and compiled (not run: no GPU here)."""

from __future__ import annotations

import shutil
from collections.abc import Callable

import numpy as np
import pytest
import sympy as sp
from hypothesis import given, settings
from hypothesis import strategies as st

from schedulers.errors import ScheduleError
from schedulers.interpreter import interpret
from schedulers.schedule import make_schedule
from smg import patterns as P
from smg.errors import ShapeError, UnknownAxisError, UnknownOperatorError
from smg.expr import parse
from smg.ir import Kind
from smg.ops import Builder
from smg.reference import check_numerics, evaluate, random_inputs
from spacefusion.api import build

# name -> (graph maker(dtype), tiles, step); sizes are prime-ish so tails are exercised
CASES: dict[str, tuple[Callable[[str], object], dict[str, int], int]] = {
    "layernorm": (lambda dt: P.layernorm(5, 37, dt), {"m": 2}, 8),
    "rmsnorm": (lambda dt: P.rmsnorm(5, 37, dt), {"m": 3}, 8),
    "residual_layernorm": (lambda dt: P.residual_layernorm(5, 37, dt), {"m": 4}, 37),
    "softmax": (lambda dt: P.softmax(5, 37, dt), {"m": 2}, 8),
    "gemm_sigmoid_bias": (lambda dt: P.gemm_epilogue(5, 19, 13, "sigmoid", True, dt), {"n": 8}, 4),
    "gemm_relu": (lambda dt: P.gemm_epilogue(5, 19, 13, "relu", True, dt), {"n": 8}, 5),
    "gemm_gelu": (lambda dt: P.gemm_epilogue(5, 19, 13, "gelu", False, dt), {"n": 8}, 4),
    "gemm_silu": (lambda dt: P.gemm_epilogue(5, 19, 13, "silu", True, dt), {"n": 8}, 6),
    "gemm_layernorm": (lambda dt: P.gemm_layernorm(5, 19, 13, dt), {"m": 2}, 4),
    "mlp": (lambda dt: P.mlp(5, 13, 17, 11, dtype=dt), {"m": 2}, 4),
    "mlp_recompute": (lambda dt: P.mlp(5, 13, 17, 11, dtype=dt), {"m": 1, "n": 4}, 4),
    "lstm_cell": (lambda dt: P.lstm_cell(3, 13, 9, dt), {"n": 4}, 4),
    "horizontal_adaln": (lambda dt: P.horizontal_gemms(5, 13, 9, dtype=dt), {"n": 4}, 4),
    "horizontal_qkv": (lambda dt: P.horizontal_gemms(5, 13, 9, ("Q", "K", "V"), dt), {"n": 8}, 3),
    "causal_attention": (lambda dt: P.attention(1, 2, 9, 9, 8, causal=True, dtype=dt), {"m": 4}, 4),
    "causal_cross_lengths": (lambda dt: P.attention(1, 2, 7, 13, 8, causal=True, dtype=dt), {"m": 4}, 5),
    "gqa": (lambda dt: P.attention(1, 4, 9, 11, 8, kv_heads=2, dtype=dt), {"m": 4}, 4),
    "attention_d80": (lambda dt: P.attention(1, 2, 6, 10, 80, dtype=dt), {"m": 4}, 4),
    "attention_d128": (lambda dt: P.attention(1, 1, 5, 7, 128, dtype=dt), {"m": 4}, 3),
}


def _schedule(name: str, dtype: str):
    mk, tiles, step = CASES[name]
    g = mk(dtype)
    return g, make_schedule(g, tiles, step=step, recompute=name.endswith("_recompute"))


def _max_rel_err(ref: dict, got: dict, outputs: tuple[str, ...]) -> float:
    err = 0.0
    for o in outputs:
        r, x = ref[o], np.asarray(got[o], dtype=np.float64)
        assert x.shape == r.shape and np.all(np.isfinite(x)), o
        err = max(err, float(np.abs(x - r).max() / (1.0 + np.abs(r).max())))
    return err


@pytest.mark.parametrize("name", sorted(CASES))
def test_interpreter_matches_reference_exactly(name: str) -> None:
    g, s = _schedule(name, "float32")
    x = random_inputs(g, seed=1)
    assert _max_rel_err(evaluate(g, x), interpret(s, x), g.outputs) < 1e-12


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_llvm_kernel_matches_reference(name: str, dtype: str) -> None:
    g, s = _schedule(name, dtype)
    x = random_inputs(g, seed=2)
    err, problem = check_numerics(g, evaluate(g, x), build(s, "llvm")(x))  # the one rule, smg/tolerance.py
    assert problem is None, problem


@pytest.mark.parametrize("name", sorted(CASES))
def test_cuda_kernel_is_generated(name: str, tmp_path) -> None:
    _, s = _schedule(name, "float16")
    art = build(s, "cuda")
    assert "__global__" in art.source
    if shutil.which("nvcc"):  # compile for sm_90a where nvcc exists (CI has it)
        art.save(tmp_path)
        assert any(p.suffix == ".cubin" for p in tmp_path.iterdir())


# -- what the slicers derive for each pattern ------------------------------------------------------


def test_layernorm_two_reductions_and_a_second_pass() -> None:
    _, s = _schedule("layernorm", "float32")
    assert s.serial == "n"
    assert [u.state for u in s.plan.states] == ["Y_sum", "Y_sqsum", "Y_sqsum__d1", "Y_sqsum__d2"]
    assert s.plan.second_pass == ("Y",)  # the output keeps n: written once the statistics are final
    fin = parse(dict(s.plan.finalize)["Y"])
    assert {x.name for x in fin.free_symbols} == {"X", "W", "B", "Y_sum", "Y_sqsum"}


def test_residual_add_is_streamed_not_materialised() -> None:
    _, s = _schedule("residual_layernorm", "float32")
    assert "T" in s.plan.streamed
    assert s.level("T") == "register"


def test_gemm_epilogue_is_applied_after_the_k_loop() -> None:
    g, s = _schedule("gemm_sigmoid_bias", "float32")
    assert s.serial == "k" and [u.state for u in s.plan.states] == ["C"]
    assert s.plan.second_pass == ()
    fin = parse(dict(s.plan.finalize)["Y"])
    assert sp.simplify(fin - 1 / (1 + sp.exp(-(sp.Symbol("C", real=True) + sp.Symbol("bias", real=True))))) == 0


def test_mlp_streams_the_hidden_dim() -> None:
    _, s = _schedule("mlp", "float32")
    assert s.serial == "h"
    assert "H" in s.plan.streamed  # X@W1 tile computed per step, never written to device memory
    assert [u.state for u in s.plan.states] == ["Y"]


def test_mlp_output_columns_are_cut_only_on_request() -> None:
    g = P.mlp(5, 13, 17, 11)
    with pytest.raises(ScheduleError, match=r"intermediate Ha.*recompute=True"):
        make_schedule(g, {"n": 4}, step=4)
    s = make_schedule(g, {"m": 1, "n": 4}, step=4, recompute=True)
    d = next(x for x in s.spatial if x.dim == "n")
    assert d.cut and d.recomputes == ("Ha",)


def test_lstm_cell_writes_both_states_in_one_kernel() -> None:
    g, s = _schedule("lstm_cell", "float32")
    assert set(g.outputs) == {"Hn", "Cn"}
    other = "j" if s.serial == "k" else "k"
    # the GEMMs over the other reduced dim have no serial dim: computed once per block
    once = [n for n in s.plan.streamed if other in g.producer(n).reduce]
    assert len(once) == 4


def test_horizontal_fusion_is_a_join_on_the_shared_input() -> None:
    g, s = _schedule("horizontal_adaln", "float32")
    assert g.outputs == ("shift", "scale", "gate")
    readers = [op.out for op in g.ops if any(a.space == "X" for a in op.inputs)]
    assert readers == ["shift", "scale", "gate"]
    assert s.num_blocks == 5 * 3  # one grid covers all three outputs: one launch


def test_gqa_is_a_broadcast_over_the_group() -> None:
    g = P.attention(1, 8, 16, 16, 8, kv_heads=2)
    assert g.shape("Q") == (1, 2, 4, 16, 8) and g.shape("K") == (1, 2, 16, 8)
    edge = next(e for e in g.edges if e.src == "K")
    assert edge.kind("r") is Kind.ONE_TO_ALL
    s = make_schedule(g, {"m": 8}, step=4)
    assert {d for d, _ in s.block} >= {"b", "h", "r", "m"}


def test_causal_mask_reads_the_indices() -> None:
    g = P.attention(1, 1, 4, 4, 2, causal=True, dtype="float32")
    x = random_inputs(g, seed=0)
    p = evaluate(g, x, keep=True)["P"]
    assert np.allclose(np.triu(p[0, 0], 1), 0.0)  # no weight above the diagonal
    assert np.allclose(p[0, 0].sum(-1), 1.0)


# -- unsupported input gets a clear error ----------------------------------------------------------


def test_bad_pattern_arguments_are_named() -> None:
    with pytest.raises(ShapeError, match="multiple of kv heads"):
        P.attention(1, 6, 8, 8, 8, kv_heads=4)
    with pytest.raises(UnknownOperatorError, match="unknown activation 'swish'"):
        P.gemm_epilogue(4, 4, 4, act="swish")
    with pytest.raises(UnknownOperatorError, match="unknown activation"):
        P.mlp(4, 4, 4, 4, act="nope")
    g = Builder("bad_mask")
    x = g.input("X", {"m": 4, "n": 4})
    with pytest.raises(UnknownAxisError, match="reads index 'k'"):
        g.input("Y", {"k": 3})
        g.map("Piecewise((X, k <= m), (0, True))", x)
    with pytest.raises(ValueError, match="'n' is already a dimension"):
        P.horizontal_gemms(4, 4, 4, ("q", "n"))


def test_tile_that_does_not_fit_is_refused() -> None:
    with pytest.raises(ScheduleError, match="larger than the dim"):
        make_schedule(P.layernorm(4, 16), {"m": 8}, step=4)


# -- property: any shape/tiling of the norms matches the reference ----------------------------------


@settings(max_examples=12, deadline=None)
@given(m=st.integers(1, 6), n=st.integers(2, 40), tile=st.integers(1, 6), step=st.integers(1, 40),
       which=st.sampled_from(["layernorm", "rmsnorm", "softmax", "residual_layernorm"]))
def test_norms_any_tiling(m: int, n: int, tile: int, step: int, which: str) -> None:
    g = getattr(P, which)(m, n)
    s = make_schedule(g, {"m": min(tile, m)}, step=min(step, n))
    x = random_inputs(g, seed=m * 100 + n)
    assert _max_rel_err(evaluate(g, x), interpret(s, x), g.outputs) < 1e-10
