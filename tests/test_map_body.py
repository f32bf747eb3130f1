"""``Builder.map`` parses its body when the op is built: a malformed body, an unknown name or an unknown
function is an ExpressionError naming the body and the problem, never a sympy/TVM error in the lowering."""

from __future__ import annotations

import keyword

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from smg import evaluate, random_inputs
from smg.errors import ExpressionError, SpaceFusionError, UnknownAxisError
from smg.expr import FUNCTIONS
from smg.ops import Builder


def _builder():
    b = Builder("t")
    return b, b.input("X", {"m": 4, "n": 8})


@pytest.mark.parametrize("body,problem", [
    ("exp(X - )", "invalid syntax"),
    ("exp(X", "not an expression"),
    ("", "not an expression"),
    ("X +* 2", "invalid syntax"),
    ("X and X", "BoolOp syntax"),
    ("X.real", "Attribute syntax"),
    ("X[0]", "Subscript syntax"),
    ("'X'", "holds the constant 'X'"),
    ("(X, X)", "not one expression"),
    ("0 < X < 1", "does not parse as a sympy expression"),
    ("Max(X, 0, evaluate=False)", "no keyword arguments"),
])
def test_malformed_body_is_refused_at_map(body: str, problem: str) -> None:
    b, x = _builder()
    with pytest.raises(ExpressionError, match="body") as info:
        b.map(body, x, name="Y")
    assert problem in str(info.value) and repr(body) in str(info.value) and "graph 't'" in str(info.value)
    assert "Y" not in b.spaces  # nothing was emitted


def test_reproduction_messages() -> None:
    """The three reported cases, with their exact messages."""
    b, x = _builder()
    with pytest.raises(ExpressionError, match=r"body 'exp\(X - \)' is not an expression: invalid syntax"):
        b.map("exp(X - )", x)
    with pytest.raises(ExpressionError, match=r"body 'exp\(X - Y\)' reads unknown name 'Y'"):
        b.map("exp(X - Y)", x)
    with pytest.raises(ExpressionError, match=r"body 'foo\(X\)' calls unknown function 'foo'; known: Abs"):
        b.map("foo(X)", x)


_SAFE = {"X", "m", "n"} | FUNCTIONS


@settings(max_examples=40, deadline=None)
@given(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,5}", fullmatch=True).filter(
    lambda s: s not in _SAFE and not keyword.iskeyword(s)))
def test_any_unknown_name_is_named(name: str) -> None:
    b, x = _builder()
    with pytest.raises(ExpressionError, match=f"'{name}'"):
        b.map(f"exp(X - {name})", x)
    with pytest.raises(ExpressionError, match=f"unknown function '{name}'"):
        b.map(f"{name}(X)", x)


def test_a_space_not_passed_is_pointed_out() -> None:
    b, x = _builder()
    b.input("Z", {"m": 4})
    with pytest.raises(ExpressionError, match=r"reads unknown name 'Z'.*\['Z'\] are spaces of graph 't': pass them"):
        b.map("X + Z", x)


def test_a_dim_of_another_tensor_stays_an_axis_error() -> None:
    b, x = _builder()
    b.input("Z", {"k": 3})
    with pytest.raises(UnknownAxisError, match="reads index 'k'"):
        b.map("X + k", x)
    assert issubclass(ExpressionError, SpaceFusionError) and issubclass(ExpressionError, ValueError)


def test_every_known_function_lowers_and_matches_the_reference() -> None:
    """The contract of ``FUNCTIONS``: each one the numpy reference and the TIR lowering both evaluate."""
    from spacefusion.api import build, check_numerics, schedule

    b = Builder("fns")
    x = b.input("X", {"m": 4, "n": 8})
    w = b.input("W", {"n": 8})
    body = ("Piecewise((exp(X) + log(Abs(W) + 1) + sqrt(Abs(X)) + tanh(X) + erf(W) + Max(X, W) + Min(X, 0),"
            " Or(Eq(m, 1), Ne(n, 2)) & Not(X > 2) | And(m > 2, n < 3)), (-1.0, True))")
    g = b.build(b.map(body, x, w, name="Y"))
    assert {f for f in FUNCTIONS if f + "(" in body} == FUNCTIONS
    inputs = random_inputs(g, seed=0)
    ref = evaluate(g, inputs)
    assert np.isfinite(ref["Y"]).all() and (ref["Y"] != -1.0).any() and (ref["Y"] == -1.0).any()
    got = build(schedule(g), "llvm")(inputs)
    assert check_numerics(g, ref, got)[1] is None
