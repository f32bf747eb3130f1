"""Numpy schedule interpreter: runs a Schedule block by block, step by step.

It executes exactly what the Schedule says (streamed ops per step, update
functions with their carries, postponed factors, the second pass for outputs
that keep the serial dim), so slicing semantics are tested without TVM.
Tails (sizes not divisible by tiles) are simply shorter slices.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import numpy as np
import sympy as sp

from schedulers.errors import ScheduleError
from schedulers.schedule import Schedule
from schedulers.temporal import exp_sums, new, old
from smg.expr import parse
from smg.ir import Access, Op
from smg.reference import evaluate_op


def _dims_of(s: Schedule, name: str) -> tuple[str, ...]:
    return s.smg.space(name.split("__")[0]).dims  # X, X__old, X__d1, X__d1__new all have X's dims


def _op(s: Schedule, out: str, out_index: tuple[str, ...], body: str,
        reduce: tuple[str, ...] = (), combiner: str = "none") -> Op:
    syms = sorted(x.name for x in parse(body).free_symbols if x.name not in s.smg.dim_sizes)
    accs = tuple(Access(n, _dims_of(s, n)) for n in syms)
    return Op("update", out, out_index, accs, body, reduce, combiner)


def _slice(arr: np.ndarray, dims: tuple[str, ...], ranges: Mapping[str, slice]) -> np.ndarray:
    return arr[tuple(ranges.get(d, slice(None)) for d in dims)]


def _extents(sizes: Mapping[str, int], ranges: Mapping[str, slice]) -> dict[str, int]:
    return {d: len(range(*ranges[d].indices(n))) if d in ranges else n for d, n in sizes.items()}


def _starts(ranges: Mapping[str, slice]) -> dict[str, int]:
    return {d: r.start for d, r in ranges.items()}


def interpret(s: Schedule, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Execute ``s`` on numpy inputs (float64 math); returns the outputs."""
    smg, plan = s.smg, s.plan
    for op in smg.ops:
        for a in op.inputs:
            if not a.plain:
                raise ScheduleError(f"the schedule interpreter slices tensors per block and cannot follow "
                                    f"{op.out!r} reading {a.space!r} at {a.index}; check the llvm kernel instead",
                                    code="interpreter.gather")
    sizes = smg.dim_sizes
    data = {n: np.asarray(inputs[n], dtype=np.float64) for n in smg.inputs}
    outs = {o: np.zeros(smg.shape(o)) for o in smg.outputs}
    # streamed ops without the serial dim are computed once per block, before the loop
    streamed_ops = [smg.producer(n) for n in plan.streamed if s.serial in smg.producer(n).iter_dims]
    once_ops = [smg.producer(n) for n in plan.streamed if s.serial not in smg.producer(n).iter_dims]
    body_ops = {u.state: _op(s, u.state, _dims_of(s, u.state), u.body, (s.serial,), u.combiner)
                for u in plan.states}
    carry_ops = {u.state: _op(s, u.state, _dims_of(s, u.state), u.carry) for u in plan.states if u.carry}
    fin_ops = {o: _op(s, o, smg.space(o).dims, e) for o, e in plan.finalize}
    starts = [range(0, sizes[d], t) for d, t in s.block]
    maxima = {u.state for u in plan.states if u.combiner == "max"}
    sums = exp_sums(plan.states)

    def step_env(ranges: dict[str, slice], t0: int) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        rng = {**ranges, s.serial: slice(t0, min(t0 + s.step, sizes[s.serial]))}
        ext = _extents(sizes, rng)
        env = {n: _slice(a, smg.space(n).dims, rng) for n, a in data.items()} | once
        for op in streamed_ops:
            env[op.out] = evaluate_op(op, env, ext, _starts(rng))
        return env, ext

    for origin in itertools.product(*starts):
        ranges = {d: slice(o, min(o + t, sizes[d])) for (d, t), o in zip(s.block, origin)}
        block_ext = _extents(sizes, ranges)
        once = {n: _slice(a, smg.space(n).dims, ranges) for n, a in data.items() if s.serial not in smg.space(n).dims}
        for op in once_ops:
            once[op.out] = evaluate_op(op, once, block_ext, _starts(ranges))
        state = {u.state: np.full(tuple(block_ext[d] for d in _dims_of(s, u.state)), u.init) for u in plan.states}
        for t0 in range(0, sizes[s.serial], s.step):
            env, ext = step_env(ranges, t0)
            prev = dict(state)
            for u in plan.states:
                env.update(_subtracted(state, maxima))
                env.update({old(k): v for k, v in prev.items()})
                env.update({new(k): v for k, v in _subtracted(state, maxima).items()})
                part = evaluate_op(body_ops[u.state], env, ext, _starts({**ranges, s.serial: slice(t0, None)}))
                if u.combiner == "max":
                    state[u.state] = np.maximum(state[u.state], part)
                else:
                    carried = evaluate_op(carry_ops[u.state], env, ext) if u.carry else state[u.state]
                    state[u.state] = carried + part
        for o, op in fin_ops.items():  # finalize reads accumulators (postponed factors included)
            dims = smg.space(o).dims
            final = _divided(state, sums, op)
            if o not in plan.second_pass:
                outs[o][tuple(ranges.get(d, slice(None)) for d in dims)] = evaluate_op(
                    op, once | final, block_ext, _starts(ranges))
                continue
            for t0 in range(0, sizes[s.serial], s.step):  # second pass: the reductions are final now
                env, ext = step_env(ranges, t0)
                env.update(_subtracted(final, maxima))
                rng = {**ranges, s.serial: slice(t0, min(t0 + s.step, sizes[s.serial]))}
                outs[o][tuple(rng.get(d, slice(None)) for d in dims)] = evaluate_op(op, env, ext, _starts(rng))
    return outs


def _divided(state: dict[str, np.ndarray], sums: frozenset[str], op: Op) -> dict[str, np.ndarray]:
    """``state`` as finalize ``op`` reads it, by the kernels' rule for a row of nothing but -inf: a sum of
    exponentials ``op`` divides by is 1 where it is 0 (``spacefusion.lower.exprs.nonzero_sum``); one it
    reads otherwise (an LSE's ``log(l)``, guarded in its own body) as it is."""
    e = parse(op.body)
    divisors = {p.base.name for p in e.atoms(sp.Pow) if p.exp.is_negative and p.base.is_Symbol}
    return {k: np.where(v == 0.0, 1.0, v) if k in sums and k in divisors else v for k, v in state.items()}


def _subtracted(state: dict[str, np.ndarray], maxima: set[str]) -> dict[str, np.ndarray]:
    """``state`` with each running max read as the kernels' updates read it: 0 where it is still -inf
    (FlashAttention-2's guard, ``spacefusion.lower.exprs.subtracted_max``): no ``-inf - -inf``."""
    return {k: np.where(v == -np.inf, 0.0, v) if k in maxima else v for k, v in state.items()}
