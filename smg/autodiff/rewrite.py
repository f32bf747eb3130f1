"""The algebra that turns the reverse sweep's adjoints into FlashAttention-style backward bodies.

Each rewrite is generic (nothing here names softmax or attention) and is recorded in words:

- ``inline``: forward element-wise spaces are replaced by their bodies, so every expression is over atoms
  (graph inputs, forward reductions, saved statistics, backward nodes, index dims).
- ``saved_statistics``: a forward reduction over ``r`` (or an element-wise function of one) that an op reads
  back along ``r`` (a One-to-All from an intermediate along a reduced dim: softmax's max and sum, a norm's
  mean and rstd) cannot be recomputed by a backward pass that blocks or walks ``r`` the other way: the
  forward saves it.
- ``compress``: several statistics of one row are replaced by one where the forward's normalised value is
  log-linear in them: ``log(exp(S - mx) / sm) = S - (mx + log sm)`` gives ``LSE = mx + log sm`` and
  ``P = exp(S - LSE)``; accepted only if every other statistic then cancels from every backward body.
- ``postpone``: a factor of a backward reduction's body that is constant along the reduced dims moves out of
  it (the temporal slicer's broadcast postposition, here on the backward).
- ``reassociate``: ``sum_l X * (sum_n Y * Z) = sum_n Y * (sum_l X * Z)`` where ``sum_l X * Z`` is an output
  the forward saved: FlashAttention's ``rowsum(dP * P) = rowsum(dO * O)``.
- ``bounded_logistic``: ``exp(a) / (1 + exp(a))**p`` (SiLU's derivative) as ``(1 - 1/(1 + exp(a))) /
  (1 + exp(a))**(p-1)``, which stays finite where ``exp(a)`` overflows (a float32 ``a`` over 88).
"""

from __future__ import annotations

import sympy as sp

from smg.autodiff.sweep import Node
from smg.expr import symbol
from smg.ir import SMG


def tidy(expr: sp.Expr) -> sp.Expr:
    """Expand then factor common terms: powers of one base cancel (``sm * sm**-1``) without ``simplify``,
    which folds a mask's Piecewise out of an ``exp`` and evaluates ``exp(-1e30)`` to a denormal constant."""
    return sp.factor_terms(sp.expand(expr, power_exp=False, log=False, mul=True, multinomial=False))


def bounded_logistic(expr: sp.Expr) -> sp.Expr:
    """Each product holding ``exp(a)`` and ``(1 + exp(a))**-p`` (p >= 1) with those two factors replaced by
    ``(1 - 1/(1 + exp(a))) * (1 + exp(a))**-(p-1)``: equal, and finite where ``exp(a)`` overflows to inf.  Why:
    sympy writes SiLU's derivative ``d/dz z/(1 + exp(-z))`` with ``z*exp(-z)/(1 + exp(-z))**2``, which a float32
    kernel evaluates as ``-inf/inf = NaN`` for z below about -88, where the true value is about 0."""

    def fix(e: sp.Expr) -> sp.Expr:
        if not e.args:
            return e
        e = e.func(*(fix(a) for a in e.args))
        if not isinstance(e, sp.Mul):
            return e
        factors = list(e.args)
        for i, f in enumerate(factors):
            if not isinstance(f, sp.exp):
                continue
            den = 1 + f
            for j, q in enumerate(factors):
                if isinstance(q, sp.Pow) and q.base == den and q.exp.is_Integer and q.exp <= -1:
                    rest = [x for k, x in enumerate(factors) if k not in (i, j)]
                    return sp.Mul(*rest, 1 - 1 / den, sp.Pow(den, q.exp + 1), evaluate=False)
        return e

    return fix(expr)


def dims_of(expr: sp.Expr, space_dims: dict[str, tuple[str, ...]], all_dims: set[str]) -> set[str]:
    out: set[str] = set()
    for s in expr.free_symbols:
        if s.name in space_dims:
            out |= set(space_dims[s.name])
        elif s.name in all_dims:
            out.add(s.name)
    return out


def inline(expr: sp.Expr, fwd: SMG, keep: set[str]) -> sp.Expr:
    """Replace forward element-wise spaces (not in ``keep``) by their bodies until none is left."""
    for _ in range(len(fwd.ops) + 1):
        subs = {}
        for s in expr.free_symbols:
            op = fwd.producer(s.name)
            if op is not None and not op.reduce and s.name not in keep:
                subs[s] = op.expr
        if not subs:
            return expr
        expr = expr.xreplace(subs)
    return expr  # pragma: no cover


def pull_logs(expr: sp.Expr) -> sp.Expr:
    """``exp(a + k log b) -> b**k exp(a)``: a statistic substituted into an exponent comes out as a factor,
    without splitting the exponential of a difference (which overflows)."""
    def fix(e: sp.exp) -> sp.Expr:
        logs, rest = [], []
        for t in sp.Add.make_args(sp.expand(e.args[0])):
            c, f = t.as_coeff_Mul()
            (logs if isinstance(f, sp.log) else rest).append((c, f))
        if not logs:
            return e
        factor = sp.Mul(*(f.args[0] ** c for c, f in logs))
        return factor * sp.exp(sp.Add(*(c * f for c, f in rest)))

    return expr.replace(lambda e: isinstance(e, sp.exp), fix)


def saved_statistics(fwd: SMG) -> dict[str, tuple[str, ...]]:
    """Forward spaces read back along a dim reduced upstream of them: name -> the dims they are read back along."""
    reduced: dict[str, set[str]] = {}
    for op in fwd.ops:
        reduced[op.out] = set(op.reduce).union(*(reduced.get(a.space, set()) for a in op.inputs))
    stats: dict[str, tuple[str, ...]] = {}
    for op in fwd.ops:
        for a in op.inputs:
            if a.space in fwd.outputs or a.space in fwd.inputs:
                continue
            back = tuple(d for d in op.iter_dims if d not in fwd.space(a.space).dims and d in reduced[a.space])
            if back:
                stats[a.space] = tuple(dict.fromkeys(stats.get(a.space, ()) + back))
    return stats


def log_linear(expr: sp.Expr, stats: list[sp.Symbol]) -> sp.Expr | None:
    """``c(stats)`` with ``log expr = f - c(stats)`` and ``f`` free of the statistics, else None."""
    if not set(stats) <= expr.free_symbols:
        return None
    logged = sp.expand_log(sp.log(expr), force=True)
    part = sp.Add(*(t for t in sp.Add.make_args(logged) if t.free_symbols & set(stats)))
    rest = logged - part
    if rest.free_symbols & set(stats) or part == 0:
        return None
    return tidy(-part)


def postpone(nodes: dict[str, Node], adjoints: dict[str, sp.Expr], space_dims: dict[str, tuple[str, ...]],
             all_dims: set[str]) -> list[str]:
    """Move factors constant along a reduction's dims out of its body, into the node's readers."""
    notes = []
    for name, node in list(nodes.items()):
        if not node.reduce:
            continue
        body = sp.factor_terms(sp.expand(node.body, power_exp=False))
        c, rest = body.as_coeff_Mul()
        out, keep = [c] if c != 1 else [], []
        for f in sp.Mul.make_args(rest):
            (keep if dims_of(f, space_dims, all_dims) & set(node.reduce) else out).append(f)
        if not out or not keep:
            continue
        factor = sp.Mul(*out)
        node.body = sp.Mul(*keep)
        sub = {symbol(name): factor * symbol(name)}
        for other in nodes.values():
            other.body = other.body.xreplace(sub)
        for k in adjoints:
            adjoints[k] = adjoints[k].xreplace(sub)
        notes.append(f"{name}: factor {factor} moved out of sum_{','.join(node.reduce)}")
    return notes


def reassociate(nodes: dict[str, Node], saved_outputs: dict[str, Node], space_dims: dict[str, tuple[str, ...]],
                all_dims: set[str]) -> list[str]:
    """``sum_L X * A`` with ``A = sum_N Y * Z`` (``Y`` constant along ``L``) becomes ``sum_N Y * F`` where the
    forward saved ``F = sum_L X * Z``."""
    notes = []
    for name, node in nodes.items():
        if not node.reduce:
            continue
        for f in sp.Mul.make_args(node.body):
            inner = nodes.get(getattr(f, "name", ""))
            if inner is None or not inner.reduce:
                continue
            x = sp.Mul(*(g for g in sp.Mul.make_args(node.body) if g != f))
            ys = [g for g in sp.Mul.make_args(inner.body) if not dims_of(g, space_dims, all_dims) & set(node.reduce)]
            y = sp.Mul(*ys)
            z = sp.Mul(*(g for g in sp.Mul.make_args(inner.body) if g not in ys))
            for out, fn in saved_outputs.items():
                if set(fn.reduce) != set(node.reduce) or set(fn.dims) != set(node.dims) | set(inner.reduce):
                    continue
                if tidy(fn.body - x * z) == 0:
                    notes.append(f"{name} = sum_{','.join(node.reduce)} {x} * {f.name} "
                                 f"= sum_{','.join(inner.reduce)} {y} * {out}   ({out} = sum_{','.join(fn.reduce)} "
                                 f"{fn.body}, saved by the forward)")
                    node.body = y * symbol(out)
                    node.reduce = inner.reduce
                    node.origin = "reassociated"
                    break
            else:
                continue
            break
    return notes
