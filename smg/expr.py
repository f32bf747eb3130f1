"""Scalar bodies of ops as sympy expressions (the one place that parses them)."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from functools import lru_cache

import sympy as sp

from smg.errors import ExpressionError
from smg.ir import Op

#: The functions an op body may call: exactly those every evaluator of a body handles (the numpy reference's
#: lambdify and the TIR lowering's ``spacefusion.lower.exprs.to_tir``; a test lowers each).  Checked when the
#: op is built, so an unknown one is refused there and not first deep inside the lowering.
FUNCTIONS = frozenset({"exp", "log", "sqrt", "tanh", "erf", "Abs", "Max", "Min", "Piecewise",
                       "Eq", "Ne", "Not", "And", "Or"})
#: Python syntax a body may contain: arithmetic, comparisons, calls, numbers, names and Piecewise's tuples
_SYNTAX = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Compare, ast.Call, ast.Name, ast.Constant, ast.Tuple,
           ast.Load, ast.operator, ast.unaryop, ast.cmpop)


@lru_cache(maxsize=4096)
def _parse(body: str, names: tuple[str, ...]) -> sp.Expr:
    local = {n: sp.Symbol(n, real=True) for n in names}
    return sp.sympify(body, locals=local)


def check_body(body: str, names: Iterable[str], where: str) -> sp.Basic:
    """Parse ``body`` as an op body over ``names`` (its input spaces and index dims) and return it.

    The contract: the body is one Python expression of numbers, ``names`` and calls of ``FUNCTIONS`` (no
    named constants: other passes read every identifier of a body as a space or a dim); anything else
    raises ExpressionError naming ``where``, the body and the syntax problem or the unknown name.  Why at
    construction: sympy would read an unknown name as a free symbol and an unknown function as an
    undefined one, so the mistake surfaced only in the lowering (a KeyError or a NotImplementedError
    inside TVM code) or as a wrong value (``E`` silently being Euler's number)."""
    names = frozenset(names)
    if not isinstance(body, str):
        raise ExpressionError(f"{where}: body must be a string, got {type(body).__name__} {body!r}")
    try:
        tree = ast.parse(body.strip(), mode="eval")
    except SyntaxError as exc:
        raise ExpressionError(f"{where}: body {body!r} is not an expression: {exc.msg} "
                              f"(column {exc.offset})") from None
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            fn = node.func.id if isinstance(node.func, ast.Name) else None
            if fn not in FUNCTIONS:
                raise ExpressionError(f"{where}: body {body!r} calls unknown function "
                                      f"{fn or ast.unparse(node.func)!r}; known: {', '.join(sorted(FUNCTIONS))}")
            if node.keywords:
                raise ExpressionError(f"{where}: body {body!r}: {fn}() takes no keyword arguments")
        elif isinstance(node, ast.Name) and node.id not in names | FUNCTIONS:
            raise ExpressionError(f"{where}: body {body!r} reads unknown name {node.id!r}; it may read its inputs "
                                  f"and index dims {sorted(names)} and call "
                                  f"{', '.join(sorted(FUNCTIONS))}")
        elif isinstance(node, ast.Constant) and not isinstance(node.value, int | float):
            raise ExpressionError(f"{where}: body {body!r} holds the constant {node.value!r}; only numbers "
                                  f"and True/False are allowed")
        elif not isinstance(node, _SYNTAX):
            raise ExpressionError(f"{where}: body {body!r} uses {type(node).__name__} syntax "
                                  f"({ast.unparse(node) if isinstance(node, ast.expr) else type(node).__name__!r}); "
                                  f"a body is arithmetic, comparisons (combined with & and |) and function calls")
    try:
        expr = _parse(body, tuple(sorted(names)))
    except Exception as exc:  # sympy raises many types (SympifyError, TypeError on a chained comparison, ...)
        raise ExpressionError(f"{where}: body {body!r} does not parse as a sympy expression: "
                              f"{type(exc).__name__}: {exc}") from None
    if not isinstance(expr, sp.Basic):
        raise ExpressionError(f"{where}: body {body!r} is a {type(expr).__name__}, not one expression")
    return expr


def symbol(name: str) -> sp.Symbol:
    """The symbol that stands for one element of space ``name``."""
    return sp.Symbol(name, real=True)


def body_expr(op: Op) -> sp.Expr:
    """Parse ``op.body`` with each accessed space name and each iteration dim
    (index-dependent bodies, e.g. masks) bound to a real symbol."""
    return _parse(op.body, tuple(a.space for a in op.inputs) + op.iter_dims)


def index_symbols(op: Op) -> tuple[sp.Symbol, ...]:
    """The iteration dims that ``op``'s body reads as values (e.g. ``l <= m``)."""
    free = body_expr(op).free_symbols
    return tuple(symbol(d) for d in op.iter_dims if symbol(d) in free)


def logistic_arg(e: sp.Expr) -> sp.Expr | None:
    """``z`` when ``e`` is ``1 + exp(z)``, the denominator of a logistic ``1 / (1 + exp(z))``
    (a sigmoid is ``z = -x``), else None."""
    terms = sp.Add.make_args(e)
    if len(terms) == 2 and sp.S.One in terms:
        other = terms[1] if terms[0] == 1 else terms[0]
        if isinstance(other, sp.exp):
            return other.args[0]
    return None
