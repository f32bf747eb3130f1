"""Unfused numpy evaluation of any SMG: the ground truth for every test."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import sympy as sp

from smg.errors import ShapeError
from smg.expr import Role, body_expr, index_symbols, parse, symbol
from smg.ir import SMG, Op
from smg.loads import loads_of, resolve
from smg.tolerance import compare


class _Broadcasting:
    """numpy's ``logical_and``/``logical_or`` whose ``reduce`` (what sympy prints for ``And``/``Or``) takes
    operands of broadcastable shapes: a mask over Keep[b, l] and ``l <= m`` is one predicate."""

    def __init__(self, fn: np.ufunc) -> None:
        self.fn = fn

    def __call__(self, *args):
        return self.fn(*args)

    def reduce(self, args):
        out = args[0]
        for a in args[1:]:
            out = self.fn(out, a)
        return out


def _lambdify(op: Op):
    from math import erf

    mods = [{"Max": np.maximum, "Min": np.minimum, "erf": np.vectorize(erf),
             "logical_and": _Broadcasting(np.logical_and), "logical_or": _Broadcasting(np.logical_or)}, "numpy"]
    args = [symbol(a.space) for a in op.inputs] + list(index_symbols(op))
    return sp.lambdify(args, body_expr(op), modules=mods)


def _aligned(arr: np.ndarray, index: tuple[str, ...], iter_dims: tuple[str, ...]) -> np.ndarray:
    """View ``arr`` (dims ``index``) with axes in ``iter_dims`` order, size 1 where absent."""
    perm = [index.index(d) for d in iter_dims if d in index]
    arr = np.transpose(arr, perm)
    shape = [arr.shape[perm.index(index.index(d))] if d in index else 1 for d in iter_dims]
    return arr.reshape(shape)


def _component(text: str, dims: tuple[str, ...]):
    """An index expression as a function of integer grids, in exact integer arithmetic: ``floor(e/c)`` is
    ``e // c`` (lambdify's ``floor((1/7)*m)`` is float and gives 6 at m = 49)."""
    e = parse(text, Role.INDEX)

    def go(x: sp.Expr, env: dict[str, np.ndarray]):
        if x.is_Symbol:
            return env[x.name]
        if x.is_Integer:
            return int(x)
        if x.is_Add:
            return sum((go(a, env) for a in x.args[1:]), go(x.args[0], env))
        if x.is_Mul and sum(not a.is_Integer for a in x.args) <= 1:
            out = 1
            for a in x.args:
                out = out * go(a, env)
            return out
        if isinstance(x, sp.floor):
            num, den = sp.together(x.args[0]).as_numer_denom()
            if den.is_Integer:
                return go(sp.expand(num), env) // int(den)
        raise ValueError(f"index expression {text!r}: {x} is not affine with floor(e/c)")

    return lambda *grids: go(e, dict(zip(dims, grids)))


def _gather(arr: np.ndarray, index: tuple[str, ...], iter_dims: tuple[str, ...], shape: tuple[int, ...],
            starts: Mapping[str, int] | None) -> np.ndarray:
    """``arr`` read at index expressions over the iteration space; outside reads are 0 (padding)."""
    grids = [(np.arange(n) + (starts or {}).get(d, 0)).reshape([-1 if i == j else 1 for j in range(len(shape))])
             for i, (d, n) in enumerate(zip(iter_dims, shape))]
    ok = np.ones((1,) * len(shape), dtype=bool)
    idx = []
    for comp, size in zip(index, arr.shape):
        v = np.floor(np.asarray(_component(comp, iter_dims)(*grids), dtype=np.float64)).astype(np.int64)
        ok = ok & (v >= 0) & (v < size)
        idx.append(np.clip(v, 0, size - 1))
    return np.where(ok, arr[tuple(np.broadcast_arrays(*idx))], 0.0)


def evaluate_op(op: Op, env: Mapping[str, np.ndarray], sizes: Mapping[str, int] | None = None,
                starts: Mapping[str, int] | None = None) -> np.ndarray:
    """Evaluate one op on arrays whose axes follow each space's dims.

    ``sizes`` gives the extent of every iteration dim; it matters when a dim
    is read by no input (e.g. a sum over a constant counts its elements).
    ``starts`` gives the global index of the first element along each dim when
    the arrays are slices (index-dependent bodies such as masks read it).
    """
    ins = [env[a.space] for a in op.inputs]
    expr = body_expr(op)
    syms = [symbol(a.space) for a in op.inputs]
    plain = all(a.plain for a in op.inputs)
    if plain and op.combiner == "sum" and len(ins) == 2 and expr.is_Mul and set(expr.free_symbols) == set(syms):
        coeff, rest = expr.as_coeff_Mul()
        if rest == syms[0] * syms[1]:
            letters = {d: chr(97 + i) for i, d in enumerate(op.iter_dims)}
            spec = ",".join("".join(letters[d] for d in a.index) for a in op.inputs)
            out = "".join(letters[d] for d in op.out_index)
            return float(coeff) * np.einsum(f"{spec}->{out}", *ins, optimize=True)
    if sizes is not None:
        shape = tuple(sizes[d] for d in op.iter_dims)
    elif plain:
        shape = np.broadcast_shapes(*(_aligned(x, a.index, op.iter_dims).shape for x, a in zip(ins, op.inputs)))
    else:
        raise ValueError(f"op {op.out!r} gathers through index expressions: pass the iteration sizes")
    args = [_aligned(x, a.index, op.iter_dims) if a.plain else _gather(x, a.index, op.iter_dims, shape, starts)
            for x, a in zip(ins, op.inputs)]
    for sym in index_symbols(op):
        axis = op.iter_dims.index(sym.name)
        idx = np.arange(shape[axis], dtype=np.float64) + (starts or {}).get(sym.name, 0)
        args.append(idx.reshape([-1 if i == axis else 1 for i in range(len(shape))]))
    val = np.broadcast_to(np.asarray(_lambdify(op)(*args), dtype=np.float64), shape)
    axes = tuple(range(len(op.out_index), len(op.iter_dims)))
    if op.combiner == "sum":
        return val.sum(axis=axes)
    if op.combiner == "max":
        return val.max(axis=axes)
    return np.array(val)


def guarded_reads(smg: SMG, op: Op) -> dict[str, str]:
    """The reads of ``op`` that follow FlashAttention's (and torch SDPA's) rules for a row whose every value
    is -inf, as the kernels do (``spacefusion.lower.exprs``), by input space: ``"max"``, a max reduction
    ``M`` of a space that ``op`` reads too (softmax's ``x - M``), read as 0 where it is -inf (there
    ``-inf - -inf`` is NaN, and every ``x`` is -inf: ``x - 0`` is -inf); ``"sum"``, a sum of exponentials that
    ``op`` divides by, read as 1 where it is 0 (every term was ``exp(-inf)``: what it divides is 0 too).
    Such a row's softmax is then 0, SDPA's value, where an IEEE evaluation gives 0 / 0; no other value
    changes (each rule replaces only what made a NaN)."""
    out: dict[str, str] = {}
    expr = body_expr(op)
    read = {a.space for a in op.inputs}
    for a in op.inputs:
        prod = smg.producer(a.space)
        if prod is None or not prod.reduce:
            continue
        if prod.combiner == "max" and any(b.space in read for b in prod.inputs):
            out[a.space] = "max"
        elif prod.combiner == "sum" and len(prod.inputs) == 1:
            term = smg.producer(prod.inputs[0].space)
            sym = symbol(a.space)
            divides = any(p.base == sym and p.exp.is_negative for p in expr.atoms(sp.Pow))
            if term is not None and not term.reduce and isinstance(body_expr(term), sp.exp) and divides:
                out[a.space] = "sum"
    return out


def _guarded(x: np.ndarray, rule: str) -> np.ndarray:
    return np.where(x == -np.inf, 0.0, x) if rule == "max" else np.where(x == 0.0, 1.0, x)


def evaluate(smg: SMG, inputs: Mapping[str, np.ndarray], keep: bool = False) -> dict[str, np.ndarray]:
    """Run every op of ``smg`` unfused, in float64.  Returns outputs (or all spaces).  A row whose every
    value is -inf has softmax 0 (``guarded_reads``), as the kernels give it.  An input read at run-time rows
    (``smg.loads``) may be given as its table and ids, as its kernel takes it: gathered first."""
    inputs = resolve(smg, inputs)
    env: dict[str, np.ndarray] = {}
    for name in smg.inputs:
        if name not in inputs:
            raise KeyError(f"missing input {name!r} for graph {smg.name!r}")
        arr = np.asarray(inputs[name], dtype=np.float64)
        want = smg.shape(name)
        if arr.shape != want:
            raise ShapeError(f"input {name!r} has shape {arr.shape}, graph {smg.name!r} expects {want}")
        env[name] = arr
    for op in smg.ops:
        rules = guarded_reads(smg, op)
        reads = {**env, **{n: _guarded(env[n], r) for n, r in rules.items()}} if rules else env
        env[op.out] = evaluate_op(op, reads, smg.dim_sizes)
    return env if keep else {o: env[o] for o in smg.outputs}


def random_inputs(smg: SMG, seed: int = 0, scale: float = 1.0) -> dict[str, np.ndarray]:
    """Seeded standard-normal inputs, rounded to each input's dtype; an input read at run-time rows
    (``smg.loads``) as its kernel takes it: a standard-normal table and ids uniform over its rows."""
    rng = np.random.default_rng(seed)
    loaded = {ld.value: ld for ld in loads_of(smg)}
    out = {}
    for n in smg.inputs:
        ld = loaded.get(n)
        if ld is None:
            out[n] = (rng.standard_normal(smg.shape(n)) * scale).astype(smg.space(n).dtype)
        else:
            out[ld.table] = (rng.standard_normal(ld.table_shape(smg)) * scale).astype(smg.space(n).dtype)
            out[ld.ids] = rng.integers(0, ld.length, ld.ids_shape(smg))
    return out


def produced_inputs(consumer: SMG, producer: SMG, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs of ``consumer`` where each one named ``<out>_p`` or ``<out>`` of ``producer``'s outputs
    is that output, computed from ``producer``'s seeded random inputs (same elements, reshaped; rounded to
    the input's dtype); the others seeded random.  A split reduction's ``stats`` kernel reads its partial's
    sums (``schedulers.split``: ``<name>_p``): random ones are sums of nothing, and the variance a GroupNorm
    derives from them can be near zero or negative, whose ``1 / sqrt`` magnifies float32 rounding past any
    tolerance (60 of 176 stats candidates of the UNet's round failed so)."""
    x = random_inputs(consumer, seed)
    produced = evaluate(producer, random_inputs(producer, seed))
    used = 0
    for name in consumer.inputs:
        src = name[:-2] if name.endswith("_p") and name[:-2] in produced else name if name in produced else None
        if src is None:
            continue
        shape = consumer.shape(name)
        if produced[src].size != math.prod(shape):
            raise ShapeError(f"{consumer.name!r} input {name!r} {list(shape)} cannot take {producer.name!r} output "
                             f"{src!r} {list(produced[src].shape)}: {produced[src].size} elements")
        x[name] = produced[src].reshape(shape).astype(consumer.space(name).dtype)
        used += 1
    if not used:
        raise ShapeError(f"{consumer.name!r} reads none of {producer.name!r}'s outputs {sorted(produced)} (its "
                         f"inputs: {list(consumer.inputs)})")
    return x


def reduction_length(smg: SMG) -> int:
    """The most terms any one reduction of ``smg`` sums (1 if nothing is reduced): the ``K`` of the
    tolerance's accumulation term (``smg.tolerance``)."""
    sizes = smg.dim_sizes
    return max((math.prod(sizes[d] for d in op.reduce) for op in smg.ops if op.reduce), default=1)


def float32_error_scales(smg: SMG, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``smg.error_model.error_scales`` of the float32 outputs (none where there is none).  Why float32 only:
    the error model is for an evaluation in float32; a 16-bit output's kernels round intermediates to 16 bits
    too (a softmax's probabilities before P @ V), which the fixed rule's units of its own roundoff were
    validated on, kernel by kernel on the GPU."""
    if not any(smg.space(o).dtype == "float32" for o in smg.outputs):
        return {}
    from smg.error_model import error_scales

    return {o: e for o, e in error_scales(smg, inputs).items() if smg.space(o).dtype == "float32"}


def check_numerics(smg: SMG, ref: Mapping[str, np.ndarray], got: Mapping[str, Any],
                   inputs: Mapping[str, np.ndarray] | None = None,
                   scales: Mapping[str, np.ndarray] | None = None) -> tuple[float | None, str | None]:
    """Compare every output with the float64 reference under ``smg.tolerance``'s rule:
    ``(max_abs_err, error)``, error None when all pass.

    ``inputs`` (those ``ref`` was computed from) give the rule's error-model form: the bound of each output
    element follows the error a correct float32 evaluation of this graph leaves there (``E``: the sizes of
    the terms each sum adds, the condition of each op on its inputs' errors, each op's own roundings;
    ``smg.tolerance``'s docstring), which this function derives op by op beside a float64 evaluation (the
    work of a few evaluations).  Without them only the outputs are known, and the fixed rule (the output's RMS
    times ``sqrt(K)``) rejects correct float32 results where an activation squeezes a large pre-activation
    (tanh) or a softmax amplifies its scores' errors: callers that hold the inputs should pass them.  The
    model applies to float32 outputs (``float32_error_scales``); ``scales``, those already derived for these
    inputs, saves a caller that checks many kernels of one graph deriving them again.

    Non-finite values where the reference is finite (an element never written, an overflow) give
    ``max_abs_err=None`` and an error saying so, rather than a NaN/inf that strict JSON cannot hold.
    """
    if scales is None:
        scales = float32_error_scales(smg, inputs) if inputs is not None else {}
    worst = 0.0
    k = reduction_length(smg)
    for name, r in ref.items():
        if name not in got:
            return None, f"numerics: kernel returned no output {name!r} (got {sorted(got)})"
        c = compare(got[name], r, smg.space(name).dtype, k, name=f"output {name!r}", error_scale=scales.get(name))
        if c.max_abs_err is None:
            return None, f"numerics: {c.problem}"
        worst = max(worst, c.max_abs_err)
        if c.problem is not None:
            return worst, f"numerics: {c.problem}"
    return worst, None
