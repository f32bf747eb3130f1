"""Local derivatives of one op's body (sympy), and their rewriting in terms of the op's own output.

``d body / d x`` is sympy's ``diff`` of the op's parsed body by the symbol of the space ``x`` it reads.
A derivative that is a function of the op's output ``y`` alone (``exp``: ``y``; ``rsqrt``: ``-y**3/2``;
``sigmoid``: ``y (1 - y)``; ``tanh``: ``1 - y**2``) is rewritten so: the backward then reads the saved or
recomputed ``y`` and needs no input of it (``rsqrt(var)``'s derivative needs the saved ``rstd``, not ``var``).
"""

from __future__ import annotations

import numpy as np
import sympy as sp

from smg.errors import BackwardError
from smg.expr import symbol
from smg.ir import Op


def partial(op: Op, space: str) -> sp.Expr:
    """``d body / d space`` of ``op`` (the sum over every read of ``space`` in the body)."""
    x = symbol(space)
    try:
        d = sp.diff(op.expr, x)
    except Exception as exc:  # pragma: no cover - sympy differentiates every function a body may call
        raise BackwardError(f"op {op.out!r} ({op.kind}): no derivative of body {op.body!r} by {space!r}: "
                            f"{exc}") from None
    if d.has(sp.Derivative, sp.Subs):
        raise BackwardError(f"op {op.out!r} ({op.kind}): body {op.body!r} has no closed-form derivative by "
                            f"{space!r} ({d})")
    if d.has(sp.DiracDelta, sp.Heaviside) or any(isinstance(a, sp.Max | sp.Min) for a in sp.preorder_traversal(d)):
        raise BackwardError(f"op {op.out!r} ({op.kind}): body {op.body!r} is not differentiable by {space!r} in "
                            f"closed form here (its derivative {d} has a kink: Max/Min/Abs are not supported yet)")
    return d


def in_terms_of_output(op: Op, space: str, d: sp.Expr) -> sp.Expr:
    """``d`` rewritten over the op's output where that removes ``space`` from it (checked at random points),
    else ``d`` unchanged.  Only for element-wise ops of one input."""
    y, x = symbol(op.out), symbol(space)
    if op.reduce or len(op.inputs) != 1 or x not in d.free_symbols:
        return d
    if sp.simplify(d - op.expr) == 0:
        return y
    if sum(1 for t in sp.preorder_traversal(op.expr) if t == x) != 1:
        return d  # an inverse by sympy's solve only where x occurs once (a chain of invertible steps)
    yp = sp.Dummy("y", positive=True)
    try:
        sols = sp.solve(sp.Eq(yp, op.expr), x)
    except Exception:  # noqa: BLE001 - no inverse: keep the derivative over the input
        return d
    rng = np.random.default_rng(0)
    for sol in sols if isinstance(sols, list) else []:
        cand = sp.simplify(sp.powsimp(d.xreplace({x: sol}), force=True))
        if x in cand.free_symbols:
            continue
        cand = cand.xreplace({yp: y})
        f_d = sp.lambdify([x], d)
        f_y = sp.lambdify([x], op.expr)
        f_c = sp.lambdify([y], cand)
        pts = np.concatenate([rng.uniform(0.2, 2.0, 5), -rng.uniform(0.2, 2.0, 5)])  # both signs: x**2
        ok, seen = True, 0
        with np.errstate(all="ignore"):
            for p in pts:
                try:
                    want, at = complex(f_d(p)), complex(f_y(p))
                except (TypeError, ValueError, ZeroDivisionError):
                    continue
                if want.imag or at.imag or not np.isfinite(want.real) or not np.isfinite(at.real):
                    continue  # outside the op's domain (rsqrt of a negative)
                seen += 1
                try:
                    got = complex(f_c(at.real))
                except (TypeError, ValueError, ZeroDivisionError):
                    got = complex(np.nan)
                ok = ok and bool(np.isclose(got, want.real, rtol=1e-9))
        ok = ok and seen >= 3
        if ok and sp.count_ops(cand) <= sp.count_ops(d) + 2:
            return cand
    return d
