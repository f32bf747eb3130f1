"""Numpy schedule interpreter: runs a Schedule block by block, step by step.

It executes exactly what the Schedule says (streamed ops per step, update
functions, postponed factors, finalisation), so slicing semantics are tested
without TVM.  Tails (sizes not divisible by tiles) are simply shorter slices.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import numpy as np

from schedulers.schedule import Schedule
from schedulers.temporal import new, old, parse
from smg.ir import Access, Op
from smg.reference import evaluate_op


def _dims_of(s: Schedule, name: str) -> tuple[str, ...]:
    base = name.replace("__old", "").replace("__new", "")
    return s.smg.space(base).dims


def _op(s: Schedule, out: str, out_index: tuple[str, ...], body: str,
        reduce: tuple[str, ...] = (), combiner: str = "none") -> Op:
    syms = sorted(x.name for x in parse(body).free_symbols)
    accs = tuple(Access(n, _dims_of(s, n)) for n in syms)
    return Op("update", out, out_index, accs, body, reduce, combiner)


def _slice(arr: np.ndarray, dims: tuple[str, ...], ranges: Mapping[str, slice]) -> np.ndarray:
    return arr[tuple(ranges.get(d, slice(None)) for d in dims)]


def interpret(s: Schedule, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Execute ``s`` on numpy inputs (float64 math); returns the outputs."""
    smg, plan = s.smg, s.plan
    sizes = smg.dim_sizes
    data = {n: np.asarray(inputs[n], dtype=np.float64) for n in smg.inputs}
    outs = {o: np.zeros(smg.shape(o)) for o in smg.outputs}
    streamed_ops = [smg.producer(n) for n in plan.streamed]
    body_ops = {u.state: _op(s, u.state, smg.space(u.state).dims, u.body, (s.serial,), u.combiner)
                for u in plan.states}
    corr_ops = {u.state: _op(s, u.state, smg.space(u.state).dims, u.correction) for u in plan.states}
    fin_ops = {o: _op(s, o, smg.space(o).dims, e) for o, e in plan.finalize}
    starts = [range(0, sizes[d], t) for d, t in s.block]
    for origin in itertools.product(*starts):
        ranges = {d: slice(o, min(o + t, sizes[d])) for (d, t), o in zip(s.block, origin)}
        state: dict[str, np.ndarray] = {}
        for u in plan.states:
            shape = tuple(len(range(*ranges[d].indices(sizes[d]))) if d in ranges else sizes[d]
                          for d in smg.space(u.state).dims)
            state[u.state] = np.full(shape, u.init)
        for t0 in range(0, sizes[s.serial], s.step):
            rng = {**ranges, s.serial: slice(t0, min(t0 + s.step, sizes[s.serial]))}
            env = {n: _slice(a, smg.space(n).dims, rng) for n, a in data.items()}
            for op in streamed_ops:
                env[op.out] = evaluate_op(op, env)
            prev = dict(state)
            for u in plan.states:
                env.update(state)
                env.update({old(k): v for k, v in prev.items()})
                env.update({new(k): v for k, v in state.items()})
                part = evaluate_op(body_ops[u.state], env)
                if u.combiner == "max":
                    state[u.state] = np.maximum(state[u.state], part)
                else:
                    env[new(u.state)] = state[u.state]
                    state[u.state] = state[u.state] * evaluate_op(corr_ops[u.state], env) + part
        for o, op in fin_ops.items():  # finalize reads accumulators (postponed factors included)
            outs[o][tuple(ranges.get(d, slice(None)) for d in smg.space(o).dims)] = evaluate_op(op, state)
    return outs
