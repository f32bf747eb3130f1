"""Scalar bodies of ops as sympy expressions (the one place that parses them)."""

from __future__ import annotations

from functools import lru_cache

import sympy as sp

from smg.ir import Op


@lru_cache(maxsize=4096)
def _parse(body: str, names: tuple[str, ...]) -> sp.Expr:
    local = {n: sp.Symbol(n, real=True) for n in names}
    return sp.sympify(body, locals=local)


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
