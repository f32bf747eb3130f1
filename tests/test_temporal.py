"""Temporal slicer: derived update functions (online softmax) and refused chains."""

from __future__ import annotations

import ast
import io
import tokenize
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import sympy as sp
from hypothesis import given, seed, settings
from hypothesis import strategies as st

from schedulers.errors import ScheduleError, TemporalSliceError
from schedulers.temporal import TemporalPlan, UpdateFunction, plan_temporal, run_chain
from smg import SMG, Builder
from smg.expr import parse
from smg.workloads import mha, simplified_mha, softmax_gemm

REPO = Path(__file__).resolve().parents[1]
# f-strings are single STRING tokens before Python 3.12 and FSTRING_* tokens after
_NOT_CODE = {getattr(tokenize, n) for n in ("COMMENT", "STRING", "FSTRING_START", "FSTRING_MIDDLE",
                                            "FSTRING_END") if hasattr(tokenize, n)}

WORKLOADS = {
    "mha": lambda: mha(2, 2, 16, 24, 8),
    "softmax_gemm": lambda: softmax_gemm(16, 24, 8),
    "simplified_mha": lambda: simplified_mha(24, 8),  # same chain, other op names
}


@cache
def plan_of(name: str) -> TemporalPlan:
    return plan_temporal(WORKLOADS[name](), "l")


def sym(name: str) -> sp.Symbol:
    return sp.Symbol(name, real=True)


def roles(plan: TemporalPlan) -> tuple[UpdateFunction, UpdateFunction, UpdateFunction]:
    mx, sm, mm = plan.states
    return mx, sm, mm


# -- the derived online softmax -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mha", "softmax_gemm", "simplified_mha"])
def test_three_states_in_order_max_sum_gemm(name: str) -> None:
    g = WORKLOADS[name]()
    plan = plan_of(name)
    assert plan.serial == "l"
    assert len(plan.states) == 3
    mx, sm, mm = roles(plan)
    assert [u.combiner for u in plan.states] == ["max", "sum", "sum"]
    # the states are exactly the ops reducing over l, in graph order; the GEMM one is the output
    assert [u.state for u in plan.states] == [op.out for op in g.ops if "l" in op.reduce]
    assert mm.state == g.outputs[0]
    assert g.producer(mx.state).combiner == "max"
    assert g.producer(sm.state).combiner == "sum"


@pytest.mark.parametrize("name", ["mha", "softmax_gemm", "simplified_mha"])
def test_max_state_is_a_plain_max(name: str) -> None:
    g = WORKLOADS[name]()
    mx, _, _ = roles(plan_of(name))
    # body is the streamed logits themselves (the space the max op reads), no correction
    assert parse(mx.body) == sym(g.producer(mx.state).inputs[0].space)
    assert parse(mx.correction) == 1
    assert parse(mx.postponed) == 1
    assert parse(mx.value) == sym(mx.state)
    assert mx.init == -np.inf
    assert mx.describe("l") == f"{mx.state}' = max({mx.state}, max_l {mx.body})"


@pytest.mark.parametrize("name", ["mha", "softmax_gemm", "simplified_mha"])
def test_sum_and_gemm_corrections_are_exp_of_max_difference(name: str) -> None:
    mx, sm, mm = roles(plan_of(name))
    m_old, m_new = sym(f"{mx.state}__old"), sym(f"{mx.state}__new")
    want = sp.exp(m_old - m_new)
    for u in (sm, mm):
        c = parse(u.correction)
        assert sp.simplify(c - want) == 0, (u.state, u.correction)
        assert c.free_symbols == {m_old, m_new}
    assert sm.init == 0.0 and mm.init == 0.0


@pytest.mark.parametrize("name", ["mha", "softmax_gemm", "simplified_mha"])
def test_sum_body_is_shifted_exponential(name: str) -> None:
    g = WORKLOADS[name]()
    mx, sm, _ = roles(plan_of(name))
    x = sym(g.producer(mx.state).inputs[0].space)
    assert sp.simplify(parse(sm.body) - sp.exp(x - sym(mx.state))) == 0
    assert parse(sm.postponed) == 1
    assert parse(sm.value) == sym(sm.state)


@pytest.mark.parametrize("name", ["mha", "softmax_gemm", "simplified_mha"])
def test_gemm_state_postpones_one_over_sum(name: str) -> None:
    g = WORKLOADS[name]()
    mx, sm, mm = roles(plan_of(name))
    out_op = g.producer(mm.state)
    x = sym(g.producer(mx.state).inputs[0].space)
    v = sym(out_op.inputs[1].space)
    # broadcast postposition: 1/sum is moved out of the GEMM body, applied after the loop
    assert sp.simplify(parse(mm.postponed) - 1 / sym(sm.state)) == 0
    assert sym(sm.state) not in parse(mm.body).free_symbols
    assert sp.simplify(parse(mm.body) - v * sp.exp(x - sym(mx.state))) == 0
    assert sp.simplify(parse(mm.value) - sym(mm.state) / sym(sm.state)) == 0
    # finalize: O = O / sum
    plan = plan_of(name)
    assert [o for o, _ in plan.finalize] == [mm.state]
    assert sp.simplify(parse(dict(plan.finalize)[mm.state]) - sym(mm.state) / sym(sm.state)) == 0


def test_mha_streamed_and_inlined_spaces() -> None:
    plan = plan_of("mha")
    assert plan.streamed == ("S", "Ss")
    assert plan.inlined == ("P_sub", "P_exp", "P")


# -- nothing is hard-coded ----------------------------------------------------------------------


def _code_and_literals(path: Path) -> tuple[str, list[tuple[ast.Constant, list[ast.AST]]]]:
    """Code with comments and strings removed, and every non-docstring string literal
    together with its chain of enclosing nodes."""
    src = path.read_text()
    code = []
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type not in _NOT_CODE:
            code.append(tok.string)
    tree = ast.parse(src)
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    literals: list[tuple[ast.Constant, list[ast.AST]]] = []

    def walk(node: ast.AST, parents: list[ast.AST]) -> None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            literals.append((node, parents))
        for child in ast.iter_child_nodes(node):
            walk(child, [*parents, node])

    walk(tree, [])
    return "".join(code), literals


def test_schedulers_source_does_not_name_the_recurrence() -> None:
    # hardware presets and display code hold descriptive text, not analysis
    files = sorted(f for f in (REPO / "schedulers").glob("*.py") if f.name not in ("hardware.py", "display.py"))
    assert files
    for f in files:
        text = f.read_text()
        for needle in ("P_max", "P_sum", "exp(-"):
            assert needle not in text, f"{f.name} contains {needle!r}: the recurrence must be derived"
        code, literals = _code_and_literals(f)
        # the one exponential allowed is sympy's *matrix* exponential, the flow of the
        # derivative operator from which every correction is derived
        code = code.replace(".exp()", ".matrix_exponential")
        assert "exp(" not in code, f"{f.name} calls exp outside docstrings"
        for lit, _ in literals:
            low = lit.value.lower()
            for needle in ("exp(", "online", "softmax", "flash"):
                assert needle not in low, f"{f.name} line {lit.lineno}: literal {lit.value!r}"


def test_exp_only_in_operator_templates_and_workload_definitions() -> None:
    """In smg/, ``exp(`` appears only in the UNARY templates of ops.py and in workload
    definitions (graphs written by the user); never in analysis code."""
    for f in sorted((REPO / "smg").glob("*.py")):
        code, literals = _code_and_literals(f)
        assert "exp(" not in code, f"{f.name} calls exp in code"
        for lit, parents in literals:
            if "exp(" not in lit.value:
                continue
            if f.name == "ops.py":
                assigns = [p for p in parents if isinstance(p, (ast.Assign, ast.AnnAssign))]
                targets = [getattr(a, "target", None) or a.targets[0] for a in assigns]
                assert any(isinstance(t, ast.Name) and t.id == "UNARY" for t in targets), (
                    f"ops.py line {lit.lineno}: exp outside UNARY: {lit.value!r}")
            elif f.name == "workloads.py":
                funcs = [p.name for p in parents if isinstance(p, ast.FunctionDef)]
                assert funcs == ["simplified_mha"], f"workloads.py line {lit.lineno}: {lit.value!r}"
            else:
                pytest.fail(f"{f.name} line {lit.lineno} has exp in a literal: {lit.value!r}")
    temporal = (REPO / "schedulers" / "temporal.py").read_text()
    assert "_TRANSCENDENTAL = (sp.exp" in temporal


# -- derived functions against exact softmax on random data ---------------------------------------


def _names(plan: TemporalPlan) -> tuple[str, str]:
    """The streamed logits and values the chain reads (taken from the plan, not hard-coded)."""
    states = {u.state for u in plan.states}
    mx, _, mm = roles(plan)
    x = mx.body
    (v,) = {s.name for s in parse(mm.body).free_symbols} - states - {x}
    return x, v


def _exact(x: np.ndarray, v: np.ndarray) -> tuple[float, float, float]:
    e = np.exp(x - x.max())
    return float(x.max()), float(e.sum()), float(np.sum(e / e.sum() * v))


@pytest.mark.parametrize("name", ["mha", "softmax_gemm"])
@seed(20250301)
@settings(max_examples=30, deadline=None)
@given(
    tiles=st.lists(st.integers(1, 9), min_size=1, max_size=8),
    data_seed=st.integers(0, 2**32 - 1),
    scale=st.sampled_from([0.1, 1.0, 10.0, 200.0]),
)
def test_run_chain_matches_exact_softmax(name: str, tiles: list[int], data_seed: int, scale: float) -> None:
    plan = plan_of(name)
    x_name, v_name = _names(plan)
    mx, sm, mm = roles(plan)
    n = sum(tiles)
    rng = np.random.default_rng(data_seed)
    x = rng.standard_normal(n) * scale  # large scales: exp(x) alone would overflow
    v = rng.standard_normal(n)
    got = run_chain(plan, {x_name: x, v_name: v}, tiles)
    want_max, want_sum, want_out = _exact(x, v)
    assert got[mx.state] == want_max
    assert got[sm.state] == pytest.approx(want_sum, rel=1e-12)
    assert got[mm.state] == pytest.approx(want_out, rel=1e-9, abs=1e-12 * np.abs(v).max())
    # slicing does not matter: one tile gives the same as many
    whole = run_chain(plan, {x_name: x, v_name: v}, [n])
    for k in whole:
        assert got[k] == pytest.approx(whole[k], rel=1e-12, abs=1e-14)


def test_run_chain_single_element_tiles() -> None:
    plan = plan_of("softmax_gemm")
    x_name, v_name = _names(plan)
    x = np.array([3.0, -1.0, 7.5, 7.5, 0.0])
    v = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    got = run_chain(plan, {x_name: x, v_name: v}, [1] * 5)
    mx, sm, mm = roles(plan)
    want_max, want_sum, want_out = _exact(x, v)
    assert got[mx.state] == 7.5
    assert got[sm.state] == pytest.approx(want_sum, rel=1e-14)
    assert got[mm.state] == pytest.approx(want_out, rel=1e-14)


# -- refused chains -------------------------------------------------------------------------------


def variance_graph() -> SMG:
    g = Builder("variance")
    x = g.input("X", {"m": 4, "l": 16})
    total = g.reduce(x, "l", "sum", name="Xsum")
    mean = g.scale(total, 1.0 / 16, name="mean")
    sq = g.map("(X - mean)**2", x, mean, name="sq")
    return g.build(g.reduce(sq, "l", "sum", name="var"))


def test_variance_chain_gets_derived_moment_updates() -> None:
    """(X - mean)^2 is not a rescaling of itself, but its derivatives by the running sum
    close after three terms: the slicer derives the Chan/Welford moment update."""
    plan = plan_temporal(variance_graph(), "l")
    assert [u.state for u in plan.states] == ["Xsum", "var", "var__d1", "var__d2"]
    var, d1, d2 = plan.states[1:]
    assert d1.space == d2.space == "var"  # auxiliary accumulators have var's shape
    a = sp.Rational(1, 16)
    x, s = sym("X"), sym("Xsum")
    assert sp.simplify(parse(var.body) - (x - a * s) ** 2) == 0
    assert sp.simplify(parse(d1.body) - sp.diff((x - a * s) ** 2, s)) == 0
    assert sp.simplify(parse(d2.body) - 2 * a**2) == 0
    # var' = var + delta*d1 + delta^2/2*d2 with delta = Xsum' - Xsum (Taylor, exact for a quadratic)
    delta = sym("Xsum__new") - sym("Xsum__old")
    want = sym("var__old") + delta * sym("var__d1__old") + delta**2 / 2 * sym("var__d2__old")
    assert sp.simplify(parse(var.carry) - want) == 0
    with pytest.raises(TemporalSliceError, match="not a plain rescaling"):
        var.correction  # noqa: B018 - the property refuses a non-multiplicative carry
    xs = np.random.default_rng(5).standard_normal(16) * 3 + 7
    got = run_chain(plan, {"X": xs}, [5, 1, 7, 3])
    assert got["var"] == pytest.approx(((xs - xs.sum() / 16) ** 2).sum(), rel=1e-10)


def test_body_not_closed_under_differentiation_is_refused() -> None:
    g = Builder("inverse_deviation")
    x = g.input("X", {"m": 4, "l": 16})
    total = g.reduce(x, "l", "sum", name="Xsum")
    inv = g.map("1/(X - Xsum)", x, total, name="inv")
    with pytest.raises(TemporalSliceError) as exc:
        plan_temporal(g.build(g.reduce(inv, "l", "sum", name="acc")), "l")
    msg = str(exc.value)
    assert "state 'acc'" in msg and "Xsum" in msg
    assert "not closed under differentiation" in msg
    assert isinstance(exc.value, ScheduleError)


def test_variance_chain_is_fine_when_not_dependent() -> None:
    """Control: the same graph sliced along m is not a temporal question (no reduce over m)."""
    with pytest.raises(TemporalSliceError, match="nothing to slice"):
        plan_temporal(variance_graph(), "m")


def test_max_over_running_sum_is_refused() -> None:
    g = Builder("max_of_ratio")
    x = g.input("X", {"m": 4, "l": 16})
    total = g.reduce(x, "l", "sum", name="Xsum")
    ratio = g.binary("div", x, total, name="ratio")
    smg = g.build(g.reduce(ratio, "l", "max", name="rmax"))
    with pytest.raises(TemporalSliceError) as exc:
        plan_temporal(smg, "l")
    msg = str(exc.value)
    assert "max cannot be corrected" in msg
    assert "'rmax'" in msg and "Xsum" in msg


def test_output_keeping_serial_dim_is_written_in_a_second_pass() -> None:
    g = Builder("plain_softmax")
    x = g.input("X", {"m": 4, "l": 16})
    plan = plan_temporal(g.build(g.softmax(x, "l", name="P")), "l")
    assert plan.second_pass == ("P",)
    mx, sm = plan.states
    assert sp.simplify(parse(sm.correction) - sp.exp(sym(f"{mx.state}__old") - sym(f"{mx.state}__new"))) == 0
    fin = parse(dict(plan.finalize)["P"])
    assert sp.simplify(fin - sp.exp(sym("X") - sym(mx.state)) / sym(sm.state)) == 0


def test_unknown_serial_dim_is_refused() -> None:
    with pytest.raises(TemporalSliceError, match="'z' is not a dimension"):
        plan_temporal(softmax_gemm(4, 8, 2), "z")


def test_logsumexp_chain_is_accepted_and_exact() -> None:
    """A chain that is not softmax-then-GEMM still gets the right correction."""
    g = Builder("lse")
    x = g.input("X", {"m": 3, "l": 16})
    mx = g.reduce(x, "l", "max", name="M")
    e = g.map("exp(X - M)", x, mx, name="E")
    z = g.reduce(e, "l", "sum", name="Z")
    plan = plan_temporal(g.build(g.map("log(Z) + M", z, mx, name="lse")), "l")
    assert [u.state for u in plan.states] == ["M", "Z"]
    assert sp.simplify(parse(plan.states[1].correction) - sp.exp(sym("M__old") - sym("M__new"))) == 0
    xs = np.random.default_rng(3).standard_normal(16) * 30
    got = run_chain(plan, {"X": xs}, [5, 1, 7, 3])
    assert got["Z"] == pytest.approx(np.exp(xs - xs.max()).sum(), rel=1e-12)
    assert sp.simplify(parse(dict(plan.finalize)["lse"]) - (sp.log(sym("Z")) + sym("M"))) == 0
