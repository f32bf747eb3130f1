"""Temporal slicer: serial steps over one reduced dim, with derived update functions.

Given the serial dim ``t``, every op falls in one class:
- *streamed*: iterates over ``t`` without reducing it and needs no running state
  (e.g. S = Q K^T): materialised per step;
- *state*: reduces over ``t`` (max, sum, the final GEMM): carried across steps;
- *dependent*: element-wise over ``t`` but reads a state (exp(S - max), P / sum):
  inlined into the bodies of the states that read it;
- *post*: has no ``t`` and reads states (final outputs): applied after the loop.

For a dependent chain the slicer first applies *broadcast postposition*: a
state factor that is algebraic and separable (e.g. 1/sum inside the GEMM) is
moved behind the reduction.  It then derives each remaining correction
``c = body(x; B_new) / body(x; B_old)`` with sympy and accepts it only if ``c``
is free of the streamed values (update-then-aggregate).  For softmax-then-GEMM
this yields FlashAttention's online softmax; nothing here names softmax.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import sympy as sp

from schedulers.errors import TemporalSliceError
from smg.expr import body_expr, symbol
from smg.ir import SMG

_TRANSCENDENTAL = (sp.exp, sp.log, sp.sin, sp.cos, sp.tanh, sp.erf)


def old(name: str) -> str:
    return f"{name}__old"


def new(name: str) -> str:
    return f"{name}__new"


@dataclass(frozen=True)
class UpdateFunction:
    """How one state is carried across serial steps.

    Step rule: ``max``: ``S = max(S, max_t body)``; ``sum``:
    ``S = S * correction + sum_t body``.  ``body`` and ``correction`` may read
    other states (their updated values) and ``<state>__old`` / ``__new``.
    ``value`` gives the state's true value from its accumulator after the
    loop (postponed broadcasts live there).
    """

    state: str
    combiner: str
    body: str
    correction: str = "1"
    value: str = ""
    postponed: str = "1"

    @property
    def init(self) -> float:
        return -np.inf if self.combiner == "max" else 0.0

    def describe(self, serial: str, states: tuple[str, ...] = ()) -> str:
        """Readable recurrence; primes mark values after this step's update."""
        s = self.state
        if self.combiner == "max":
            return f"{s}' = max({s}, max_{serial} {self.body})"
        corr = "" if self.correction == "1" else f" * {self.correction}"
        text = f"{s}' = {s}{corr} + sum_{serial} {_primed(self.body, states)}"
        return text.replace("__new", "'").replace("__old", "")


def _primed(text: str, states: tuple[str, ...]) -> str:
    for name in states:
        text = re.sub(rf"\b{name}\b(?!__)", f"{name}'", text)
    return text


@dataclass(frozen=True)
class TemporalPlan:
    serial: str
    streamed: tuple[str, ...]
    states: tuple[UpdateFunction, ...]
    finalize: tuple[tuple[str, str], ...]  # output space -> expression over state values
    inlined: tuple[str, ...]


def _depends_on(smg: SMG, space: str, targets: set[str], memo: dict[str, bool]) -> bool:
    if space in memo:
        return memo[space]
    op = smg.producer(space)
    res = op is not None and any(a.space in targets or _depends_on(smg, a.space, targets, memo)
                                 for a in op.inputs)
    memo[space] = res
    return res


def classify(smg: SMG, serial: str) -> dict[str, str]:
    """Class of each op (keyed by its output space) under serial dim ``serial``."""
    states = {op.out for op in smg.ops if serial in op.reduce}
    memo: dict[str, bool] = {}
    cls = {}
    for op in smg.ops:
        if op.out in states:
            cls[op.out] = "state"
        elif serial in op.iter_dims:
            cls[op.out] = "dependent" if _depends_on(smg, op.out, states, memo) else "streamed"
        else:
            cls[op.out] = "post" if _depends_on(smg, op.out, states, memo) else "streamed"
    return cls


def _inline(smg: SMG, expr: sp.Expr, cls: dict[str, str]) -> sp.Expr:
    """Substitute dependent and post ops by their bodies until only streamed
    spaces, inputs and state symbols remain."""
    for _ in range(len(smg.ops) + 1):
        subs = {}
        for s in expr.free_symbols:
            op = smg.producer(s.name)
            if op is not None and cls[op.out] in ("dependent", "post"):
                if op.reduce:
                    raise TemporalSliceError(
                        f"op {op.out!r} reduces over {op.reduce} while depending on a running state"
                    )
                subs[s] = body_expr(op)
        if not subs:
            return expr
        expr = expr.xreplace(subs)
    raise TemporalSliceError("cyclic inlining")  # pragma: no cover


def _free_of(expr: sp.Expr, allowed: set[sp.Symbol]) -> bool:
    return expr.free_symbols <= allowed


def _postpone(body: sp.Expr, state_syms: set[sp.Symbol]) -> tuple[sp.Expr, sp.Expr]:
    """Broadcast postposition: split ``body = g(B) * h`` for algebraic separable g."""
    factor = sp.Integer(1)
    for b in sorted(body.free_symbols & state_syms, key=str):
        b1, b2 = sp.Symbol("b__1", real=True), sp.Symbol("b__2", real=True)
        ratio = sp.simplify(body.subs(b, b1) / body.subs(b, b2))
        if not _free_of(ratio, {b1, b2}) or ratio.has(*_TRANSCENDENTAL):
            continue
        for ref in (1, 2, 3):
            h = body.subs(b, ref)
            if h != 0 and not h.has(sp.zoo, sp.nan):
                g = sp.simplify(body / h)
                if _free_of(g, {b}):
                    body, factor = h, factor * g
                    break
    return body, sp.simplify(factor)


def _correction(body: sp.Expr, running: list[sp.Symbol]) -> tuple[sp.Expr, set[sp.Symbol]]:
    """``body(B_new) / body(B_old)`` and the old/new symbols it may depend on."""
    olds = {b: sp.Symbol(old(b.name), real=True) for b in running}
    news = {b: sp.Symbol(new(b.name), real=True) for b in running}
    return sp.simplify(body.xreplace(news) / body.xreplace(olds)), set(olds.values()) | set(news.values())


def plan_temporal(smg: SMG, serial: str) -> TemporalPlan:
    """Derive the streamed spaces, update functions and finalisation for ``serial``."""
    if serial not in smg.dim_sizes:
        raise TemporalSliceError(f"serial dim {serial!r} is not a dimension of {smg.name!r}")
    cls = classify(smg, serial)
    state_ops = [op for op in smg.ops if cls[op.out] == "state"]
    if not state_ops:
        raise TemporalSliceError(f"no op of {smg.name!r} reduces over {serial!r}; nothing to slice")
    for o in smg.outputs:
        if serial in smg.space(o).dims:
            raise TemporalSliceError(
                f"output {o!r} keeps the serial dim {serial!r}: writing it needs the final value of "
                f"the reductions over {serial!r}, i.e. a second pass"
            )
    state_syms = {symbol(op.out) for op in state_ops}
    states: list[UpdateFunction] = []
    postponed: dict[str, sp.Expr] = {}
    for op in state_ops:
        body = _inline(smg, body_expr(op), cls)
        for s in body.free_symbols & state_syms:
            if s.name in postponed and postponed[s.name] != 1:
                raise TemporalSliceError(
                    f"state {op.out!r} reads state {s.name!r}, whose value carries a postponed factor"
                )
        if op.combiner == "max":
            if body.free_symbols & state_syms:
                raise TemporalSliceError(
                    f"max-reduction {op.out!r} reads running state(s) "
                    f"{sorted(str(s) for s in body.free_symbols & state_syms)}: a max cannot be corrected"
                )
            states.append(UpdateFunction(op.out, "max", str(body), value=op.out))
            postponed[op.out] = sp.Integer(1)
            continue
        body, factor = _postpone(body, state_syms)
        running = sorted(body.free_symbols & state_syms, key=str)
        corr = sp.Integer(1)
        if running:
            corr, allowed = _correction(body, running)
            if not _free_of(corr, allowed):
                raise TemporalSliceError(
                    f"state {op.out!r}: its body {body} is not a product of a factor of the running "
                    f"state(s) {[str(r) for r in running]} and the streamed values, so update-then-"
                    f"aggregate cannot correct a partial result (correction would be {corr})"
                )
        postponed[op.out] = factor
        value = sp.simplify(factor * symbol(op.out))
        states.append(UpdateFunction(op.out, "sum", str(body), str(corr), str(value), str(factor)))
    values = {symbol(u.state): parse(u.value) for u in states}
    fin = []
    for o in smg.outputs:
        e = _inline(smg, symbol(o), cls)
        fin.append((o, str(e.xreplace(values))))
    plan = TemporalPlan(
        serial=serial,
        streamed=tuple(op.out for op in smg.ops if cls[op.out] == "streamed"),
        states=tuple(states),
        finalize=tuple(fin),
        inlined=tuple(op.out for op in smg.ops if cls[op.out] in ("dependent", "post")),
    )
    check_update_functions(plan)
    return plan


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?!\s*\()")


def parse(text: str) -> sp.Expr:
    """Parse an update-function expression: identifiers followed by ``(`` are
    sympy functions, every other identifier is a real space/state symbol."""
    names = set(_IDENT.findall(text))
    return sp.sympify(text, locals={n: sp.Symbol(n, real=True) for n in names})


def check_update_functions(plan: TemporalPlan, seed: int = 0) -> None:
    """Check the derived functions: identity, composition, and a sliced run on
    random data against the unsliced reduction chain."""
    for u in plan.states:
        c = parse(u.correction)
        subs = {s: sp.Symbol(s.name.replace("__old", "__new"), real=True) for s in c.free_symbols}
        if sp.simplify(c.xreplace(subs) - 1) != 0:
            raise TemporalSliceError(f"correction of {u.state!r} is not 1 when nothing changed: {c}")
    rng = np.random.default_rng(seed)
    streamed = set()
    for u in plan.states:
        streamed |= {s.name for s in parse(u.body).free_symbols} - {v.state for v in plan.states}
    n = 11
    data = {s: rng.standard_normal(n) for s in sorted(streamed)}
    exact = run_chain(plan, data, [n])
    sliced = run_chain(plan, data, [3, 4, 4])
    for k in exact:
        if not np.allclose(exact[k], sliced[k], rtol=1e-9, atol=1e-12):
            raise TemporalSliceError(f"derived update for {k!r} disagrees with the exact chain")


def run_chain(plan: TemporalPlan, data: dict[str, np.ndarray], steps: list[int]) -> dict[str, float]:
    """Run the update functions over 1-D streamed data cut into ``steps`` (scalar states)."""
    env: dict[str, float] = {u.state: u.init for u in plan.states}
    start = 0
    for step in steps:
        tile = {k: v[start:start + step] for k, v in data.items()}
        prev = dict(env)
        for u in plan.states:
            args = {**tile, **{k: env[k] for k in env}}
            args |= {old(k): prev[k] for k in prev} | {new(k): env[k] for k in env}
            b = _lambda(u.body)(args)
            if u.combiner == "max":
                env[u.state] = max(env[u.state], float(np.max(b)))
            else:
                args[new(u.state)] = env[u.state]
                env[u.state] = env[u.state] * float(_lambda(u.correction)(args)) + float(np.sum(b))
        start += step
    return {u.state: float(_lambda(u.value)(env)) for u in plan.states}


def _lambda(text: str):
    expr = parse(text)
    names = sorted(s.name for s in expr.free_symbols)
    f = sp.lambdify([sp.Symbol(n, real=True) for n in names], expr, modules="numpy")
    return lambda env: f(*(env[n] for n in names))
