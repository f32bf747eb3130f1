"""Expressions are parsed once, in ``smg.expr``, under one symbol table (issue 60, item 4).

The contracts: ``smg.expr.parse`` is the project's one call of sympy's parser; a name's assumptions follow
from the role its text gives it (a body's or derived text's names real, an index's dims integer, a
footprint's sizes positive integers), never from the consumer; the IR nodes hold the parse (``Op.expr``,
``Access.exprs``) beside the text, which stays the canonical form that the content keys hash.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest
import sympy as sp

from schedulers.temporal import plan_temporal
from smg import patterns
from smg.errors import ExpressionError
from smg.expr import Role, body_expr, index_symbol, index_symbols, names_of, parse, symbol
from smg.footprint import size_symbol
from smg.hashing import canonical_text, text_key
from smg.ops import Builder
from smg.serialize import smg_from_dict, smg_to_dict

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("smg", "schedulers", "search", "spacefusion")


def test_smg_expr_is_the_one_place_that_parses() -> None:
    """No library module but ``smg/expr.py`` calls sympy's parser (``sympify``/``parse_expr``/``S(text)``):
    a consumer reads the parse from the IR or asks ``smg.expr.parse``."""
    call = re.compile(r"\b(sympify|parse_expr)\s*\(")
    found = sorted(str(p.relative_to(ROOT)) for pkg in LIBRARY for p in (ROOT / pkg).rglob("*.py")
                   if call.search(p.read_text()))
    assert found == ["smg/expr.py"], found


def test_a_name_is_the_symbol_of_its_role() -> None:
    body = parse("Piecewise((Ss, l <= m), (-1e+30, True))")
    assert {s.name: s.is_real for s in body.free_symbols} == {"Ss": True, "l": True, "m": True}
    assert body.args[-1][1] is sp.true  # a keyword is sympy's constant, not a name
    assert parse("O__old*exp(P_max__old - P_max__new)").free_symbols == {
        symbol("O__old"), symbol("P_max__old"), symbol("P_max__new")}  # ``O`` is no Order term
    window = parse("y + ky - 1", Role.INDEX)
    assert window.free_symbols == {index_symbol("y"), index_symbol("ky")}
    assert all(s.is_integer for s in window.free_symbols)
    assert isinstance(parse("floor(x/2)", Role.INDEX), sp.floor)
    assert size_symbol("m").is_integer and size_symbol("m").is_positive
    assert symbol("l") != index_symbol("l")  # one name, two roles: two symbols, each from the table
    assert names_of("2*floor(x/2) + k", Role.INDEX) == {"x", "k"}


def test_each_text_is_parsed_once() -> None:
    """Equal texts give the one (immutable) expression, and the IR hands out the same one."""
    g = patterns.attention(1, 2, 64, 64, 32, causal=True)
    for op in g.ops:
        assert op.expr is parse(op.body) is body_expr(op) is op.expr
        for a in op.inputs:
            assert a.exprs == tuple(parse(c, Role.INDEX) for c in a.index)
            assert all(x is parse(c, Role.INDEX) for x, c in zip(a.exprs, a.index))
    mask = next(op for op in g.ops if op.kind == "mask")
    assert set(index_symbols(mask)) == {symbol("m"), symbol("l")}  # the dims the mask reads, as its body has them
    plan = plan_temporal(g, "l")
    assert all(parse(u.body) is parse(u.body) for u in plan.states)


def test_the_parse_is_beside_the_text_not_in_the_key() -> None:
    """Reading ``Op.expr``/``Access.exprs`` changes neither the canonical text nor the key, and a graph
    pickled after them (the export workers) is the same graph."""
    g = smg_from_dict(smg_to_dict(patterns.layernorm(64, 128)))
    text = canonical_text(g)
    for op in g.ops:
        _ = op.expr, [a.exprs for a in op.inputs]
    assert canonical_text(g) == text and g.key == text_key(text)
    assert "expr" not in smg_to_dict(g)["ops"][0]
    back = pickle.loads(pickle.dumps(g))
    assert back.key == g.key and [op.expr for op in back.ops] == [op.expr for op in g.ops]


def test_a_function_name_read_as_a_value_is_refused() -> None:
    b = Builder("t")
    x = b.input("X", {"m": 4})
    with pytest.raises(ExpressionError, match=r"reads 'exp' as a value"):
        b.map("exp + X", x)
