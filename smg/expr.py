"""Expressions of the IR, parsed in one place under one symbol table.

Every expression of the compiler is text: an op's body (``Op.body``), an access's index components
(``Access.index``), and the temporal slicer's derived texts (an update function's ``body``, ``carry`` and
``value``, a plan's ``finalize``).  The text is the canonical form: it is what the content keys hash (SMG
and Schedule keys are sha256 over canonical JSON of it), so it never changes.  The parsed sympy
expression is derived from it here, once per (text, role), by ``parse``; the IR nodes hand it out
(``Op.expr``, ``Access.exprs``) and every consumer reads it from there instead of re-parsing.  Why: each
consumer used to parse for itself, under its own symbol assumptions, and a ranking spent a quarter of its
time parsing the same few texts again.

The symbol table (``Role``): the sympy assumptions a name is parsed under follow from the role the text
gives it, never from the consumer:

- ``Role.VALUE`` (real): every identifier of a body or a derived text: an element of a space, a running
  state and its ``X__old``/``X__new``/``X__d1`` accumulators, and an iteration dim read as a value (a
  causal mask's ``l <= m``).
- ``Role.INDEX`` (integer): every identifier of an index component (``y + ky - 1``, ``floor(x/2)``): the
  iteration dims, which the exact-integer evaluators and the affine analyses need as integers.
- ``Role.SIZE`` (positive integer): a dim's extent in a footprint polynomial (``N_m``); built, not parsed.

A dim is real inside a body and integer inside an index because the two are different texts: every
derived update function (and so every committed schedule key and kernel) was derived with the body's
dims real, and sympy may simplify an integer symbol differently.  The table is the same for every SMG
(a name's assumptions depend on its role only), so the memo keys on (text, role) and the SMGs of a
model share their parses.
"""

from __future__ import annotations

import ast
import enum
import keyword
import re
from collections.abc import Iterable
from functools import lru_cache
from typing import TYPE_CHECKING

import sympy as sp

from smg.errors import ExpressionError

if TYPE_CHECKING:
    from smg.ir import Op

#: The functions an op body may call: exactly those every evaluator of a body handles (the numpy reference's
#: lambdify and the TIR lowering's ``spacefusion.lower.exprs.to_tir``; a test lowers each).  Checked when the
#: op is built, so an unknown one is refused there and not first deep inside the lowering.
FUNCTIONS = frozenset({"exp", "log", "sqrt", "tanh", "erf", "Abs", "Max", "Min", "Piecewise",
                       "Eq", "Ne", "Not", "And", "Or"})
#: -inf in an op body: bodies hold numbers, not named constants (``check_body``), and this one is -inf in
#: every float the kernels and the references evaluate it in (sympy keeps it as a finite big float, below
#: any mask fill the analyses compare with, and its derivative rules treat it as a constant).  Spelled with a
#: mantissa so that a derived body prints it back short (sympy prints ``-1e400`` as its 401 digits)
MINUS_INF = "-1.0e+400"
#: +inf in an op body, likewise
PLUS_INF = "1.0e+400"
#: Python syntax a body may contain: arithmetic, comparisons, calls, numbers, names and Piecewise's tuples
_SYNTAX = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Compare, ast.Call, ast.Name, ast.Constant, ast.Tuple,
           ast.Load, ast.operator, ast.unaryop, ast.cmpop)


class Role(enum.Enum):
    """The role a text gives its names, and so the symbols they are parsed as: the one symbol table."""

    VALUE = "value"
    INDEX = "index"
    SIZE = "size"

    @property
    def assumptions(self) -> dict[str, bool]:
        """The sympy assumptions of a name in this role."""
        return _ASSUMPTIONS[self]

    def symbol(self, name: str) -> sp.Symbol:
        """The symbol that ``name`` is in this role (sympy interns it: equal calls give the same symbol)."""
        return sp.Symbol(name, **_ASSUMPTIONS[self])


_ASSUMPTIONS: dict[Role, dict[str, bool]] = {
    Role.VALUE: {"real": True},
    Role.INDEX: {"integer": True},
    Role.SIZE: {"integer": True, "positive": True},
}

#: a name of a text: an identifier not called (``exp(`` and ``floor(`` are sympy's functions)
_NAME = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*\b(?!\s*\()")


def parse(text: str, role: Role = Role.VALUE) -> sp.Expr:
    """``text`` as a sympy expression, each of its names (identifiers not called) the symbol of ``role``;
    every other identifier is sympy's own (``exp``, ``floor``, ``Piecewise``; ``True``).  The one parser of
    the project: memoised per (text, role), so each text is parsed once per process, and equal texts give
    the same (immutable) expression.  Raises what sympy raises for a text that is no expression."""
    return _parse(text, role)


@lru_cache(maxsize=1 << 16)
def _parse(text: str, role: Role) -> sp.Expr:
    names = {n for n in _NAME.findall(text) if not keyword.iskeyword(n)}
    return sp.sympify(text, locals={n: role.symbol(n) for n in names})


def symbol(name: str) -> sp.Symbol:
    """The symbol that stands for one element of space ``name`` (or a state, or a dim read as a value)."""
    return Role.VALUE.symbol(name)


def index_symbol(name: str) -> sp.Symbol:
    """The symbol of iteration dim ``name`` inside an index component."""
    return Role.INDEX.symbol(name)


def names_of(text: str, role: Role = Role.VALUE) -> frozenset[str]:
    """The names ``text`` reads (its free symbols' names), from its one parse."""
    return _names(text, role)


@lru_cache(maxsize=1 << 14)
def _names(text: str, role: Role) -> frozenset[str]:
    return frozenset(s.name for s in _parse(text, role).free_symbols)


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
        expr = parse(body)
    except Exception as exc:  # sympy raises many types (SympifyError, TypeError on a chained comparison, ...)
        raise ExpressionError(f"{where}: body {body!r} does not parse as a sympy expression: "
                              f"{type(exc).__name__}: {exc}") from None
    if not isinstance(expr, sp.Basic):
        raise ExpressionError(f"{where}: body {body!r} is a {type(expr).__name__}, not one expression")
    stray = sorted(s.name for s in expr.free_symbols if s.name not in names)
    if stray:  # a function's name read as a value (``exp + X``): parsed as a name, it is none of the op's
        raise ExpressionError(f"{where}: body {body!r} reads {', '.join(map(repr, stray))} as a value; it may "
                              f"read its inputs and index dims {sorted(names)}")
    return expr


def body_expr(op: Op) -> sp.Expr:
    """``op``'s body parsed (``Op.expr``): each accessed space and each iteration dim it reads (masks) a
    real symbol."""
    return op.expr


def index_symbols(op: Op) -> tuple[sp.Symbol, ...]:
    """The iteration dims that ``op``'s body reads as values (e.g. ``l <= m``)."""
    free = op.expr.free_symbols
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
