"""sympy -> TVM PrimExpr, for op bodies and derived update functions."""

from __future__ import annotations

from collections.abc import Callable

import sympy as sp
from tvm import tirx

from smg.expr import Role, logistic_arg, parse

F32 = "float32"


def _const(v: float) -> tirx.PrimExpr:
    return tirx.FloatImm(F32, float(v))


LOG2E = 1.4426950408889634

#: the identity of a running max (and of every max reduction the kernels emit): -inf itself.  It was the
#: finite -3e38, which lies above float32's lowest value: a query row masked everywhere with HF's
#: ``finfo(float32).min`` (-3.4e38) never raised the max, every ``exp(s - m)`` underflowed to 0 and the row
#: was 0 / 0 = NaN (issue 59).  With -inf, a row of finite scores, however low, has its own max and its exact
#: softmax (all equal: the mean of V, as eager's); readers subtract the max through ``subtracted_max``.
MAX_IDENTITY = float("-inf")


def subtracted_max(v: tirx.PrimExpr) -> tirx.PrimExpr:
    """A running max ``m`` as the update functions, carries and second passes read it: 0 where it is still
    -inf (FlashAttention-2's guard).  It is -inf only where every value it has seen is -inf, and those
    values' terms ``exp(s - m)`` are then ``exp(-inf - 0) = 0``, where ``-inf - -inf`` was NaN: a tile whose
    every score a -inf mask removes (the first steps of a left-padded row) adds nothing, and a later step
    with a finite max rescales the nothing by ``exp(m_old - m_new) = exp(-inf) = 0``.  ``m_old`` (``__old``)
    is read as it is: a guarded -inf there would rescale by ``exp(0 - m_new)``."""
    return tirx.Select(v == _const(MAX_IDENTITY), _const(0.0), v)


def nonzero_sum(v: tirx.PrimExpr) -> tirx.PrimExpr:
    """A row sum of exponentials as a divisor: 1 where it is 0.  It is 0 only where every term was
    ``exp(-inf)`` (a row whose every score is -inf), and what it divides is then 0 too: the row is 0,
    torch's SDPA's (and FlexAttention's, FlashAttention's) value for such a row, where eager's
    ``softmax`` divides 0 by 0 (NaN, which a next layer's attention spreads to every row)."""
    return tirx.Select(v == _const(0.0), _const(1.0), v)


def to_tir(expr: sp.Expr, load: Callable[[str], tirx.PrimExpr], exp2: bool = False,
           fold_log2e: bool = False, fast_div: bool = False,
           tanh: Callable[[tirx.PrimExpr], tirx.PrimExpr] | None = None, branch_free: bool = False,
           sums: frozenset[str] = frozenset()) -> tirx.PrimExpr:
    """Print ``expr`` as fp32 TIR; ``load(name)`` gives the value of a symbol.  With ``exp2``,
    ``exp(x)`` becomes ``exp2(x * log2 e)`` (one ex2.approx on the GPU instead of expf's range
    reduction).  With ``fold_log2e`` too, ``log2 e`` is distributed over the terms of ``x`` so
    that constant factors fold: ``exp(c*s - m)`` is ``exp2((c*log2e)*s + (-log2e)*m)``, one FFMA
    and one MUFU per element (``-log2e*m`` is the same for the whole row, computed once).  Only
    for finite, moderate operands: ``s - m`` is no longer exactly 0 when ``s == m``, so two equal
    sentinels (a -1e30 mask fill) would give exp2 of the rounding residual, which overflows.
    With ``fast_div``, ``a / b`` is CUDA's ``__fdividef`` (a reciprocal and a multiply, 2 ulp,
    no slow-path branch): for values stored in fp16 / bf16 only, whose rounding is far coarser;
    where it differs from IEEE (|b| > 2**126, or an infinite a) the value is 0 or NaN.
    With ``tanh`` (an emitter of the GPU's ``tanh.approx.f32``), ``tanh(x)`` is that instruction
    and a logistic ``1 / (1 + exp(z))`` is ``0.5 - 0.5 * tanh(z / 2)``: one special-function op
    where tanhf is a software routine and the logistic an exp2 and a reciprocal.
    With ``branch_free``, ``erf(x)`` is ``erf_fast`` and, where no ``tanh`` emitter is given, ``tanh(x)`` is
    ``tanh_fast`` (absolute errors under 1e-6, far below a 16-bit store's rounding: for values stored in
    fp16 / bf16 only).
    ``sums``: the names of row sums of exponentials; a division by one of them is by ``nonzero_sum``."""

    def div(a: tirx.PrimExpr, b: sp.Expr) -> tirx.PrimExpr:
        logistic = logistic_arg(b) if tanh is not None else None
        if logistic is not None:
            half = _const(0.5)
            return a * (half - half * tanh(go(sp.expand(logistic / 2))))
        den = nonzero_sum(go(b)) if b.is_Symbol and b.name in sums else go(b)
        return tirx.call_pure_extern(F32, "__fdividef", a, den) if fast_div else a / den

    def go(e: sp.Expr) -> tirx.PrimExpr:
        if e.is_Symbol:
            return load(e.name)
        if e.is_Number:
            return _const(float(e))
        if e.is_Add:
            out = go(e.args[0])
            for a in e.args[1:]:
                out = out + go(a)
            return out
        if e.is_Mul:
            num = [a for a in e.args if not (a.is_Pow and a.exp.is_negative)]
            den = [a.base ** -a.exp for a in e.args if a.is_Pow and a.exp.is_negative]
            out = go(num[0]) if num else _const(1.0)
            for a in num[1:]:
                out = out * go(a)
            for a in den:
                out = div(out, a)
            return out
        if e.is_Pow:
            base, ex = e.args
            if ex == -1:
                return div(_const(1.0), base)
            if ex == sp.Rational(1, 2):
                return tirx.sqrt(go(base))
            if ex == sp.Rational(-1, 2):
                return tirx.rsqrt(go(base))
            if ex.is_Integer and 0 < int(ex) <= 4:
                b = go(base)
                out = b
                for _ in range(int(ex) - 1):
                    out = out * b
                return out
            return tirx.power(go(base), go(ex))
        if exp2 and isinstance(e, sp.exp):
            if fold_log2e:
                return tirx.exp2(go(sp.Add(*[sp.Float(LOG2E) * a for a in sp.Add.make_args(e.args[0])])))
            return tirx.exp2(go(e.args[0]) * _const(LOG2E))
        if tanh is not None and isinstance(e, sp.tanh):
            return tanh(go(e.args[0]))
        if branch_free and isinstance(e, sp.erf):
            return erf_fast(go(e.args[0]))
        if branch_free and isinstance(e, sp.tanh):
            return tanh_fast(go(e.args[0]))
        fns = {sp.exp: tirx.exp, sp.log: tirx.log, sp.tanh: tirx.tanh, sp.erf: tirx.erf,
               sp.Abs: tirx.abs}
        for f, g in fns.items():
            if isinstance(e, f):
                return g(go(e.args[0]))
        if isinstance(e, (sp.Max, sp.Min)):
            fn = tirx.max if isinstance(e, sp.Max) else tirx.min
            out = go(e.args[0])
            for a in e.args[1:]:
                out = fn(out, go(a))
            return out
        if isinstance(e, sp.Piecewise):
            out = None
            for val, cond in reversed(e.args):
                out = go(val) if cond is sp.true else tirx.if_then_else(go(cond), go(val), out)
            if out is None:  # pragma: no cover - sympy always ends Piecewise with True here
                raise NotImplementedError(f"Piecewise without a default branch: {e}")
            return out
        rel = {sp.LessThan: lambda a, b: a <= b, sp.StrictLessThan: lambda a, b: a < b,
               sp.GreaterThan: lambda a, b: a >= b, sp.StrictGreaterThan: lambda a, b: a > b,
               sp.Equality: tirx.EQ, sp.Unequality: tirx.NE}
        for f, g in rel.items():
            if isinstance(e, f):
                return g(go(e.lhs), go(e.rhs))
        if isinstance(e, (sp.And, sp.Or)):
            fn = tirx.all if isinstance(e, sp.And) else tirx.any
            return fn(*[go(a) for a in e.args])
        if isinstance(e, sp.Not):
            return tirx.Not(go(e.args[0]))
        raise NotImplementedError(f"cannot lower expression {e} ({type(e).__name__}) to TIR")

    return go(expr)


#: Abramowitz & Stegun 7.1.26: erf(a) = 1 - t (a1 + t (a2 + t (a3 + t (a4 + t a5)))) exp(-a^2), t = 1 / (1 + p a)
ERF_P, ERF_A = 0.3275911, (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


def erf_fast(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """``erf(x)`` branch-free: a fast reciprocal, five FMAs and one ex2 (A&S 7.1.26, |error| < 1.5e-7).
    Why: CUDA's ``erff`` is a two-branch routine of about twice the dependent operations, and in a GEMM's
    GELU epilogue (one block per SM, 8 warps, ~100 erfs a thread) that chain is the epilogue's time:
    BERT's 1024 x 3072 x 768 GEMM + GELU took 22 us where the same schedule with ReLU took 10."""
    a = tirx.abs(x)
    t = tirx.call_pure_extern(F32, "__fdividef", _const(1.0), _const(1.0) + _const(ERF_P) * a)
    poly = _const(ERF_A[-1])
    for c in reversed(ERF_A[:-1]):
        poly = poly * t + _const(c)
    y = _const(1.0) - poly * t * tirx.exp2(a * a * _const(-LOG2E))
    return tirx.copysign(y, x)


def tanh_fast(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """``tanh(x)`` branch-free as ``1 - 2 / (1 + exp(2|x|))`` with its sign: one ex2 and a fast division
    (absolute error about 2e-7; ``exp`` overflowing to inf gives 1).  Why: CUDA's ``tanhf`` is a two-branch
    routine, the same dependent chain in a GEMM's GELU-tanh epilogue (GPT-2's and ALBERT's ``gelu_new``) as
    ``erff`` was in GELU's (``erf_fast``)."""
    e = tirx.exp2(tirx.abs(x) * _const(2.0 * LOG2E))
    y = _const(1.0) - tirx.call_pure_extern(F32, "__fdividef", _const(2.0), _const(1.0) + e)
    return tirx.copysign(y, x)


def to_tir_int(text: str, value: Callable[[str], tirx.PrimExpr]) -> tirx.PrimExpr:
    """An integer index expression (affine, with ``floor(e/c)``) as int32 TIR."""
    e = parse(text, Role.INDEX)

    def go(x: sp.Expr) -> tirx.PrimExpr:
        if x.is_Symbol:
            return value(x.name)
        if x.is_Integer:
            return tirx.const(int(x), "int32")
        if x.is_Add:
            out = go(x.args[0])
            for a in x.args[1:]:
                out = out + go(a)
            return out
        if x.is_Mul and sum(not a.is_Integer for a in x.args) <= 1:  # a constant times one term (2*floor(m/7))
            out = go(x.args[0])
            for a in x.args[1:]:
                out = out * go(a)
            return out
        if isinstance(x, sp.floor):
            num, den = sp.together(x.args[0]).as_numer_denom()
            if den.is_Integer:
                return tirx.floordiv(go(sp.expand(num)), int(den))
        raise NotImplementedError(f"index expression {text!r}: cannot lower {x} to integer TIR")

    return go(e)
