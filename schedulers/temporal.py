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

import math
import re
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import sympy as sp

from schedulers.errors import TemporalSliceError
from schedulers.spatial import elementwise_serial
from smg.expr import body_expr, parse, symbol  # parse: also read from here by schedulers.warp_tile
from smg.ir import SMG

_TRANSCENDENTAL = (sp.exp, sp.log, sp.sin, sp.cos, sp.tanh, sp.erf)
#: lambdify's modules for the checks: numpy has no erf (a GELU inside a state's body, a derived backward's dW2)
_MODULES = [{"erf": np.vectorize(math.erf, otypes=[float])}, "numpy"]


def old(name: str) -> str:
    return f"{name}__old"


def new(name: str) -> str:
    return f"{name}__new"


@dataclass(frozen=True)
class UpdateFunction:
    """How one state is carried across serial steps.

    Step rule: ``max``: ``S = max(S, max_t body)``; ``sum``:
    ``S = carry + sum_t body``, where ``carry`` re-bases the accumulator to
    the running states' new values; it reads the pre-step accumulators
    (``X__old``) and running states (``b__old``, ``b__new``).  An empty
    ``carry`` keeps the accumulator as it is.  ``value`` gives the state's
    true value from its accumulator after the loop (postponed broadcasts live
    there).  ``space`` is the SMG space whose shape the accumulator has (an
    auxiliary accumulator ``X__d1`` of a derived update has ``X``'s shape).
    """

    state: str
    combiner: str
    body: str
    carry: str = ""
    value: str = ""
    postponed: str = "1"
    space: str = ""

    @property
    def init(self) -> float:
        return -np.inf if self.combiner == "max" else 0.0

    @property
    def base(self) -> str:
        return self.space or self.state

    @property
    def correction(self) -> str:
        """The multiplicative correction ``carry / X__old`` when the carry is one."""
        if not self.carry:
            return "1"
        ratio = sp.simplify(parse(self.carry) / symbol(old(self.state)))
        if any(s.name.split("__")[0] == self.state.split("__")[0] or not s.name.endswith(("__old", "__new"))
               for s in ratio.free_symbols):
            raise TemporalSliceError(f"update of {self.state!r} is not a plain rescaling: {self.carry}",
                                     code="temporal.not_rescaling")
        return str(ratio)

    def describe(self, serial: str, states: tuple[str, ...] = ()) -> str:
        """Readable recurrence; primes mark values after this step's update."""
        s = self.state
        if self.combiner == "max":
            return f"{s}' = max({s}, max_{serial} {self.body})"
        try:
            corr = self.correction
            carry = s if corr == "1" else f"{s} * {corr}"
        except TemporalSliceError:
            carry = self.carry
        text = f"{s}' = {carry} + sum_{serial} {_primed(self.body, states)}"
        return text.replace("__new", "'").replace("__old", "")


def exp_sums(states: tuple[UpdateFunction, ...]) -> frozenset[str]:
    """The sum states whose every term is an exponential: the softmax denominators a finalize or second pass
    divides by.  Such a sum is 0 only where every term was the exponential of -inf (a row of nothing but -inf),
    and the kernels and the interpreter then divide by 1: the row is 0, torch SDPA's value, not 0 / 0
    (``spacefusion.lower.exprs.nonzero_sum``)."""
    return frozenset(u.state for u in states if u.combiner == "sum" and isinstance(parse(u.body), sp.exp))


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
    #: outputs that keep the serial dim: written in a second pass over the steps,
    #: once the reductions over the serial dim are final
    second_pass: tuple[str, ...] = ()


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
                _plain_only(op, "inlined into an update function")
                if op.reduce:
                    raise TemporalSliceError(
                        f"op {op.out!r} reduces over {op.reduce} while depending on a running state",
                        code="temporal.reduce_dependent",
                    )
                subs[s] = body_expr(op)
        if not subs:
            return expr
        expr = expr.xreplace(subs)
    raise TemporalSliceError("cyclic inlining", code="temporal.cyclic")  # pragma: no cover


def _plain_only(op, role: str) -> None:
    """Bodies merged by substitution lose their accesses' index expressions: such ops must be streamed."""
    for a in op.inputs:
        if not a.plain:
            raise TemporalSliceError(f"op {op.out!r} reads {a.space!r} at {a.index} and would be {role}; "
                                     f"an op that gathers or windows must be streamed (materialised per step)",
                                     code="temporal.gather_inlined")


def _windowed_state(smg: SMG, op) -> bool:
    """Whether ``op`` may be a running state though it reads through a window (a depthwise convolution's
    ``sum_{ky, kx} W * X[.., p + ky - pad, ..]``): every space it reads is a graph input that no other op
    reads, so its update's body names only its own accesses, and the lowering evaluates the update with the
    op's index expressions (``lower.tir``'s ``_emit_update``)."""
    if not op.reduce or any(a.space not in smg.inputs for a in op.inputs):
        return False
    windowed = {a.space for a in op.inputs if not a.plain}
    return all(a.space not in windowed for o in smg.ops if o is not op for a in o.inputs)


def _free_of(expr: sp.Expr, allowed: set[sp.Symbol]) -> bool:
    return expr.free_symbols <= allowed


def _postpone(body: sp.Expr, state_syms: set[sp.Symbol]) -> tuple[sp.Expr, sp.Expr]:
    """Broadcast postposition: split ``body = g(B) * h`` for algebraic separable g.  A constant that the split
    leaves in ``h`` moves to the factor: ``h`` is what the loop accumulates, in fp16 on tensor cores, and
    ``rmsnorm(X) @ W`` split at ``B = 1`` kept ``sqrt(K) * G * X`` there (an overflow at a few thousand for
    K = 4096); the factor is applied in fp32 after the loop."""
    factor = sp.Integer(1)
    for b in sorted(body.free_symbols & state_syms, key=str):
        b1, b2 = symbol("b__1"), symbol("b__2")
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
    if factor != 1:
        c, rest = body.as_coeff_Mul()
        if c.is_Number and c != 1 and not rest.is_Number:
            body, factor = rest, factor * c
    return body, sp.simplify(factor)


def _samples(exprs: list[sp.Expr], syms: list[sp.Symbol], pts: np.ndarray) -> np.ndarray:
    """Values of ``exprs`` at the points ``pts`` (one row per point)."""
    cols = []
    for e in exprs:
        f = sp.lambdify(syms, e, modules=_MODULES)
        cols.append(np.broadcast_to(np.asarray(f(*pts.T), dtype=np.float64), (len(pts),)))
    return np.stack(cols, axis=1) if cols else np.zeros((len(pts), 0))


def _coefficients(g: sp.Expr, basis: list[sp.Expr], syms: list[sp.Symbol],
                  rng: np.random.Generator) -> np.ndarray | None:
    """Constant ``c`` with ``g == sum c_j basis_j`` identically, or None.

    Fitted at random points (positive, away from poles), then verified at
    fresh ones: a coefficient that secretly depends on a variable fails there.
    """
    n = len(basis) + 6
    fit_pts, check_pts = rng.uniform(0.3, 1.7, size=(2, n, len(syms)))
    a, a2 = _samples(basis, syms, fit_pts), _samples(basis, syms, check_pts)
    y, y2 = _samples([g], syms, fit_pts)[:, 0], _samples([g], syms, check_pts)[:, 0]
    if not all(np.all(np.isfinite(v)) for v in (a, a2, y, y2)):
        return None
    if not np.any(y) and not np.any(y2):
        return np.zeros(len(basis))  # g vanishes: exact zeros keep a polynomial body's D nilpotent
    # columns scaled to unit norm and the tolerance relative to g's own scale: a mean's 1/N is ~1e-6 at a
    # GroupNorm's group size, so its second derivative's 1/N^2 must neither vanish against an absolute
    # tolerance nor be cut as a small singular value
    scale = np.where(np.abs(a).max(axis=0) > 0, np.abs(a).max(axis=0), 1.0) if basis else np.ones(0)
    c = np.linalg.lstsq(a / scale, y, rcond=None)[0] / scale if basis else np.zeros(0)
    if np.allclose(a2 @ c, y2, rtol=1e-9, atol=1e-12 * np.abs(y2).max()):
        return c
    return None


def _derivative_closure(body: sp.Expr, running: list[sp.Symbol], streamed: list[sp.Symbol],
                        state: str, limit: int = 6) -> tuple[list[sp.Expr], dict[sp.Symbol, sp.Matrix]]:
    """Smallest basis ``F = [body, ...]`` closed under d/db for every running
    state ``b``, with constant matrices ``D_b`` such that ``dF/db = D_b F``.

    Then each partial accumulator ``A = sum_seen F(x; b)`` obeys
    ``A(b_new) = expm((b_new - b_old) D_b) A(b_old)``: the update-then-aggregate
    rule, exact for any body in this class (exponentials give online softmax,
    polynomials give the Welford/Chan moment updates).
    """
    syms = streamed + running
    rng = np.random.default_rng(0)
    basis = [body]
    rows: dict[sp.Symbol, list[np.ndarray]] = {b: [] for b in running}
    i = 0
    while i < len(basis):
        for b in running:
            g = sp.diff(basis[i], b)
            c = _coefficients(g, basis, syms, rng)
            if c is None:
                if len(basis) >= limit:
                    raise TemporalSliceError(
                        f"state {state!r}: its body {body} is not closed under differentiation by the "
                        f"running state(s) {[str(r) for r in running]} within {limit} terms, so no "
                        f"update-then-aggregate rule corrects a partial result",
                        code="temporal.not_closed",
                    )
                basis.append(sp.simplify(g))
                c = np.eye(len(basis))[-1]
            rows[b].append(c)
        i += 1
    mats = {}
    for b in running:
        mats[b] = sp.Matrix([[_nice(x) for x in np.pad(r, (0, len(basis) - len(r)))] for r in rows[b]])
    return basis, mats


def _nice(x: float) -> sp.Expr:
    """A short rational where one is within 1e-12 of ``x`` relative to its size, else ``x``'s exact binary
    value: an absolute tolerance turned a mean's 1/N^2 into a nearby fraction that broke nilpotency."""
    if abs(x) <= 1e-300:
        return sp.Integer(0)
    short = sp.nsimplify(float(x), rational=True, tolerance=1e-12 * abs(x))
    return short if abs(float(short) - x) <= 1e-12 * abs(x) else sp.Rational(float(x))


def _flow(d: sp.Matrix, delta: sp.Expr) -> sp.Matrix:
    """``expm(delta * D)``: a finite Taylor sum when D is nilpotent (polynomial bodies)."""
    k = d.shape[0]
    if (d**k).is_zero_matrix:
        term, out = sp.eye(k), sp.eye(k)
        for j in range(1, k):
            term = term * d * delta / j
            out += term
        return out.applyfunc(sp.expand)
    return (d * delta).exp().applyfunc(sp.simplify)


def _carries(names: list[str], running: list[sp.Symbol], mats: dict[sp.Symbol, sp.Matrix]) -> list[sp.Expr]:
    """``expm(delta_b D_b) @ A_old`` for each running state, composed."""
    e = sp.eye(len(names))
    for b in running:
        delta = symbol(new(b.name)) - symbol(old(b.name))
        e = _flow(mats[b], delta) * e
    accs = sp.Matrix([symbol(old(n)) for n in names])
    # expand products but never split an exponential of a difference into a product: it overflows
    return [sp.expand(x, power_exp=False) for x in (e * accs)]


def _sum_states(op_out: str, body: sp.Expr, running: list[sp.Symbol], factor: sp.Expr) -> list[UpdateFunction]:
    """The update functions of one sum state (plus auxiliary accumulators)."""
    value = str(sp.simplify(factor * symbol(op_out)))
    if not running:
        return [UpdateFunction(op_out, "sum", str(body), "", value, str(factor))]
    streamed = sorted(body.free_symbols - set(running), key=str)
    basis, mats = _derivative_closure(body, running, streamed, op_out)
    names = [op_out] + [f"{op_out}__d{i}" for i in range(1, len(basis))]
    carries = _carries(names, running, mats)
    out = [UpdateFunction(op_out, "sum", str(body), str(carries[0]), value, str(factor))]
    for n, f, c in zip(names[1:], basis[1:], carries[1:]):
        out.append(UpdateFunction(n, "sum", str(f), str(c), n, "1", op_out))
    return out


@lru_cache(maxsize=512)
def plan_temporal(smg: SMG, serial: str) -> TemporalPlan:
    """Derive the streamed spaces, update functions and finalisation for ``serial``.

    Pure in (smg, serial) and both are immutable, so plans are memoised in-process
    (the search asks for the same plan for every tiling)."""
    if serial not in smg.dim_sizes:
        raise TemporalSliceError(f"serial dim {serial!r} is not a dimension of {smg.name!r}",
                                 code="temporal.serial_unknown")
    cls = classify(smg, serial)
    state_ops = [op for op in smg.ops if cls[op.out] == "state"]
    if not state_ops and serial == elementwise_serial(smg):
        return _elementwise_plan(smg, serial)
    if not state_ops:
        raise TemporalSliceError(f"no op of {smg.name!r} reduces over {serial!r}; nothing to slice",
                                 code="temporal.no_reduction")
    for o in smg.outputs:
        if cls[o] == "state" and serial in smg.space(o).dims:  # pragma: no cover - reduce drops the dim
            raise TemporalSliceError(f"output {o!r} both reduces and keeps {serial!r}",
                                     code="temporal.output_keeps_serial")
    state_syms = {symbol(op.out) for op in state_ops}
    states: list[UpdateFunction] = []
    postponed: dict[str, sp.Expr] = {}
    for op in state_ops:
        if not _windowed_state(smg, op):
            _plain_only(op, "a running state")
        body = _inline(smg, body_expr(op), cls)
        for s in body.free_symbols & state_syms:
            if s.name in postponed and postponed[s.name] != 1:
                raise TemporalSliceError(
                    f"state {op.out!r} reads state {s.name!r}, whose value carries a postponed factor",
                    code="temporal.postponed_read",
                )
        if op.combiner == "max":
            if body.free_symbols & state_syms:
                raise TemporalSliceError(
                    f"max-reduction {op.out!r} reads running state(s) "
                    f"{sorted(str(s) for s in body.free_symbols & state_syms)}: a max cannot be corrected",
                    code="temporal.max_reads_state",
                )
            states.append(UpdateFunction(op.out, "max", str(body), value=op.out))
            postponed[op.out] = sp.Integer(1)
            continue
        body, factor = _postpone(body, state_syms)
        running = sorted(body.free_symbols & state_syms, key=str)
        postponed[op.out] = factor
        states.extend(_sum_states(op.out, body, running, factor))
    values = {symbol(u.state): parse(u.value) for u in states if u.space == ""}
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
        second_pass=tuple(o for o in smg.outputs if serial in smg.space(o).dims),
    )
    check_update_functions(plan)
    return plan


def _elementwise_plan(smg: SMG, serial: str) -> TemporalPlan:
    """The plan of a graph no op reduces, along its rows' dim: no states, every output stored in the pass
    over the steps.  An output whose accesses are plain and that no op reads is inlined into its store (the
    store's vector reads take its inputs); the other ops are streamed, materialised per step: one that
    gathers (``j +- c``) would lose its accesses' index expressions in an inlined body."""
    inlined = tuple(o for o in smg.outputs
                    if all(a.plain for a in smg.producer(o).inputs) and not smg.consumers(o))
    cls = {op.out: "post" if op.out in inlined else "streamed" for op in smg.ops}
    return TemporalPlan(
        serial=serial,
        streamed=tuple(op.out for op in smg.ops if op.out not in inlined),
        states=(),
        finalize=tuple((o, str(_inline(smg, symbol(o), cls))) for o in smg.outputs),
        inlined=inlined,
        second_pass=tuple(smg.outputs),
    )


def check_update_functions(plan: TemporalPlan, seed: int = 0) -> None:
    """Check the derived functions: identity, composition, and a sliced run on
    random data against the unsliced reduction chain."""
    for u in plan.states:
        if not u.carry:
            continue
        c = parse(u.carry)
        subs = {s: symbol(s.name.replace("__new", "__old")) for s in c.free_symbols}
        if sp.simplify(c.xreplace(subs) - symbol(old(u.state))) != 0:
            raise TemporalSliceError(f"update of {u.state!r} changes the accumulator when nothing changed: {c}",
                                     code="temporal.carry_not_identity")
    rng = np.random.default_rng(seed)
    streamed = set()
    for u in plan.states:
        streamed |= {s.name for s in parse(u.body).free_symbols} - {v.state for v in plan.states}
    n = 11
    data = {s: rng.standard_normal(n) for s in sorted(streamed)}
    with np.errstate(all="ignore"):
        exact = run_chain(plan, data, [n])
    if not all(np.isfinite(v).all() for v in exact.values()):
        # outside the chain's domain: the streamed values are drawn independently, so a sum of squares may
        # come out negative under a sqrt (RMSNorm before a GEMM); positive values are in every domain here
        data = {s: np.abs(v) + 0.1 for s, v in data.items()}
        exact = run_chain(plan, data, [n])
    sliced = run_chain(plan, data, [3, 4, 4])
    for k in exact:
        if not np.allclose(exact[k], sliced[k], rtol=1e-9, atol=1e-12):
            raise TemporalSliceError(f"derived update for {k!r} disagrees with the exact chain",
                                     code="temporal.check_failed")


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
            b = np.broadcast_to(_lambda(u.body)(args), (step,))  # a constant body still counts per element
            if u.combiner == "max":
                env[u.state] = max(env[u.state], float(np.max(b)))
            else:
                carried = float(_lambda(u.carry)(args)) if u.carry else env[u.state]
                env[u.state] = carried + float(np.sum(b))
        start += step
    return {u.state: float(_lambda(u.value or u.state)(env)) for u in plan.states}


def _lambda(text: str):
    expr = parse(text)
    names = sorted(s.name for s in expr.free_symbols)
    f = sp.lambdify([symbol(n) for n in names], expr, modules=_MODULES)
    return lambda env: f(*(env[n] for n in names))
