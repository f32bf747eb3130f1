"""The error a correct float32 evaluation of a graph leaves in each output element (``E``, in units of u32).

``check_numerics`` bounds a float32 output's error by this (``smg.tolerance``'s error-model form) where it has
the inputs: the fixed rule (the output's RMS times ``sqrt(K)``) rejected correct float32 results where an
activation squeezes a large pre-activation (tanh of a GEMM) or a softmax amplifies its scores' errors.  ``E``
is derived op by op beside a float64 evaluation: each op carries its inputs' errors through its body (the
slope there, by a secant so a kink or a curve counts), adds its own roundings (each ``+ - * /`` and sqrt a
unit of its value, a library function its measured accuracy, ``tolerance.FUNCTION_UNITS``), and a sum adds
its accumulator's roundings, which follow the size of the terms summed, not of the result
(``tolerance.sum_error_scale``).  A GEMM's sums of squares are einsums, without the iteration space.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import sympy as sp

from smg.expr import body_expr, index_symbols, symbol
from smg.ir import SMG
from smg.reference import _aligned, _gather, _lambdify, evaluate
from smg.tolerance import FUNCTION_UNITS, op_error_scale, sole_maximum, sum_error_scale


def _power_of_two(c: float) -> bool:
    """Whether multiplying by ``c`` is exact (a power of two: only the exponent moves)."""
    return c > 0 and float(c).hex().startswith("0x1.0000000000000p")


def _roundings(expr: sp.Expr, data: set[sp.Basic]) -> sp.Expr:
    """``R`` of a body: ``sum_n |df/dn| err(n)`` over its operations ``n``, ``err(n)`` the most one
    rounds, in ``u``: ``|n|`` for ``+ - * /`` and sqrt (an n-ary add rounds its partial sums too, each at
    most the sum of its terms' sizes; a division is one rounding), ``FUNCTION_UNITS`` for a library
    function, 0 for the exact ones (a select, max, abs, a product by a power of 2)."""
    total, seen, stack = sp.Integer(0), set(), [(expr, False)]
    while stack:
        e, in_mul = stack.pop()
        if e.is_Atom or not (e.free_symbols & data) or (e, in_mul) in seen:
            continue
        seen.add((e, in_mul))
        if isinstance(e, sp.Piecewise):  # a select is exact; its conditions are not computed values
            stack += [(pair.expr, False) for pair in e.args]
            continue
        err: sp.Expr = sp.Integer(0)
        if isinstance(e, sp.Add):
            err = sp.Abs(e) + (len(e.args) - 2) * sum(sp.Abs(a) for a in e.args)
        elif isinstance(e, sp.Mul):
            coeff = abs(float(sp.Mul(*[a for a in e.args if a.is_number])))
            err = (len([a for a in e.args if not a.is_number]) - 1 + (not _power_of_two(coeff))) * sp.Abs(e)
        elif isinstance(e, sp.Pow):  # x^n: |n| - 1 products, and a division for n < 0 unless a product's
            ex, div = e.exp, 0 if in_mul else 1
            if ex.is_Integer:
                err = (abs(int(ex)) - 1 + (div if int(ex) < 0 else 0)) * sp.Abs(e)
            elif ex in (sp.Rational(1, 2), sp.Rational(-1, 2)):  # sqrt, rsqrt
                err = (1 + (div if ex < 0 else 0)) * sp.Abs(e)
            else:
                err = FUNCTION_UNITS["pow"][0] * sp.Abs(e) + FUNCTION_UNITS["pow"][1]
        elif isinstance(e, sp.Function) and not isinstance(e, (sp.Abs, sp.Max, sp.Min, sp.sign,
                                                               sp.Heaviside, sp.floor, sp.ceiling)):
            rel, absolute = FUNCTION_UNITS.get(type(e).__name__, FUNCTION_UNITS["pow"])
            err = rel * sp.Abs(e) + absolute
        if err != 0:
            d = sp.Dummy()
            total += sp.Abs(sp.diff(expr.xreplace({e: d}), d).xreplace({d: e})) * err
        stack += [(a, isinstance(e, sp.Mul)) for a in e.args]
    return total


def error_scales(smg: SMG, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``E`` of every output of ``smg`` evaluated in float32 on ``inputs`` (arrays shaped as the outputs)."""
    with np.errstate(over="ignore", invalid="ignore"):  # the caller's reference warned already
        data_env = evaluate(smg, inputs, keep=True)
    errs: dict[str, np.ndarray | None] = dict.fromkeys(smg.inputs)
    sole: dict[str, tuple[str, np.ndarray]] = {}  # max of x -> (x, where it can only be its reference argmax)
    sizes = smg.dim_sizes

    for op in smg.ops:
        expr, syms = body_expr(op), [symbol(a.space) for a in op.inputs]
        ins, in_errs = [data_env[a.space] for a in op.inputs], [errs[a.space] for a in op.inputs]
        coeff, rest = expr.as_coeff_Mul()
        if (all(a.plain for a in op.inputs) and op.combiner == "sum" and len(ins) == 2 and rest == syms[0] * syms[1]
                and all(d in a.index for a in op.inputs for d in op.reduce)):
            # a GEMM: its sums of squares as einsums, without the iteration space the general path builds
            letters = {d: chr(97 + i) for i, d in enumerate(op.iter_dims)}
            spec = ",".join("".join(letters[d] for d in a.index) for a in op.inputs)
            spec += "->" + "".join(letters[d] for d in op.out_index)
            c2 = float(coeff) ** 2
            terms_sq = c2 * np.einsum(spec, ins[0] ** 2, ins[1] ** 2, optimize=True)
            own = 1 + (not _power_of_two(abs(float(coeff))))  # the product, and the scale unless 2^k
            err_sq = own * own * terms_sq
            for j in (0, 1):
                if in_errs[j] is not None:
                    pair = [ins[0] ** 2, ins[1] ** 2]
                    pair[j] = in_errs[j] ** 2
                    err_sq = err_sq + c2 * np.einsum(spec, *pair, optimize=True)
            # the additions that round: the terms that are not 0 (a masked probability adds nothing)
            steps = np.einsum(spec, (ins[0] != 0).astype(np.float64), (ins[1] != 0).astype(np.float64),
                              optimize=True)
            errs[op.out] = sum_error_scale(data_env[op.out], steps, terms_sq, err_sq)
            continue
        shape = tuple(sizes[d] for d in op.iter_dims)

        def on_iteration(arr: np.ndarray, a: Any, shape: tuple[int, ...] = shape, op: Any = op) -> np.ndarray:
            return (_aligned(arr, a.index, op.iter_dims) if a.plain
                    else _gather(arr, a.index, op.iter_dims, shape, None))

        grids = [np.arange(shape[op.iter_dims.index(s.name)], dtype=np.float64).reshape(
            [-1 if d == s.name else 1 for d in op.iter_dims]) for s in index_symbols(op)]
        args = [on_iteration(x, a) for x, a in zip(ins, op.inputs)] + grids
        aligned_errs = [None if e is None else on_iteration(e, a) for e, a in zip(in_errs, op.inputs)]
        rexpr = _roundings(expr, set(syms))
        same = [(i, j, (args[j] == args[i]) & _aligned(sole[a.space][1], a.index, op.iter_dims))
                for i, a in enumerate(op.inputs) if a.plain and a.space in sole
                for j, b in enumerate(op.inputs) if b.plain and b.space == sole[a.space][0]]
        with np.errstate(all="ignore"):  # the float64 model overflows where the reference itself does
            rounding = None
            if rexpr != 0:
                mods = [{"Max": np.maximum, "Min": np.minimum, "erf": np.vectorize(math.erf)}, "numpy"]
                rounding = sp.lambdify(syms + list(index_symbols(op)), rexpr, modules=mods)(*args)
            errs[op.out] = op_error_scale(op.combiner, _lambdify(op), args, aligned_errs, rounding,
                                          data_env[op.out], shape, len(op.reduce), same)
            if op.combiner == "max" and len(syms) == 1 and expr == syms[0] and op.inputs[0].plain:
                e0 = np.zeros(shape) if aligned_errs[0] is None else np.broadcast_to(aligned_errs[0], shape)
                sole[op.out] = (op.inputs[0].space, sole_maximum(np.broadcast_to(args[0], shape), e0,
                                                                 data_env[op.out], len(op.reduce)))
    return {o: errs[o] for o in smg.outputs}
