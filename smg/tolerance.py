"""When is a kernel's output close enough to its reference?  The one rule every check uses.

Element by element, with ``u`` a dtype's unit roundoff (fp16 2^-11, bf16 2^-8, fp32 2^-24), in one of two
forms.  Where the graph and its inputs are at hand (``smg.reference.check_numerics(..., inputs=)``), the bound
follows the computation's own error model ``E`` (below)::

    |out - ref| <= MODEL_UNITS * u(float32) * E  +  rtol' * |ref|  +  atol' * scale  +  floor
    rtol' = RTOL_UNITS * (u(dtype) - u(float32))       atol' = ATOL_UNITS * (u(dtype) - u(float32))
    floor = max(smallest_normal(dtype), 2^-102)        (rtol' = atol' = 0 for a float32 output)

Where only the outputs are (the GPU scripts' torch reference, a caller without the inputs), the fixed rule::

    |out - ref| <= atol + rtol * |ref|
    eps   = u(dtype) + u(float32) * sqrt(K)     K: the longest reduction behind the output (1 if none)
    rtol  = RTOL_UNITS * eps
    atol  = ATOL_UNITS * eps * scale + smallest_normal(dtype)
    scale = max(rms of the element's row of ref, rms of all of ref)     row: along the last dim

The error model ``E``: a first-order running error analysis (Wilkinson; Higham, *Accuracy and Stability of
Numerical Algorithms*, ch. 3-4) of the graph evaluated in float32, the accumulator every kernel computes in,
carried element by element in float64 beside the reference, in units of ``u(float32)``:

* a graph input: ``E = 0`` (the reference reads the same rounded values).
* each term ``t = f(x_1, ..., x_n)`` of an op: ``e_t = sum_i D_i + R``.  ``D_i = max(|f(x_i +- u E_i) - f|) / u``
  is an input's error carried through ``f``: ``|df/dx_i| E_i``, the op's condition (tanh passes ``1 - tanh^2``
  of it, exp multiplies it by the value, so a softmax turns its scores' absolute error into the probabilities'
  relative one), taken as a secant so that relu's kink and exp's curvature count (``secant_error``).
  ``R = sum_n |df/dn| err(n)``: the roundings of the body's own operations ``n``, ``err(n) = |n|`` for
  ``+ - * /`` and sqrt (correctly rounded), ``FUNCTION_UNITS`` for the library's exp, tanh, erf, log, 0 for
  the exact ones (a select, max, abs, a product by a power of 2).
* an element-wise op: ``E = e_t``.
* a max: ``E = max_terms(e_t - (out - t) / u)``: the computed max is one of the computed terms, and which one
  can change only among those within their errors of the maximum.  Where only one can (``sole_maximum``), a
  later ``x - max(x)`` reads one computed value twice, and its errors cancel: a softmax's largest probability
  carries none of its score's error, which independent errors would count twice.
* a sum: ``E = sqrt(sum e_t^2) + ACC_UNITS * sqrt(steps * (out^2 + sum t^2))`` (``sum_error_scale``).  The first
  part: the terms' own errors, independent of each other, add as a random walk (an input every term reads,
  one the reduced dims broadcast, adds its share coherently).  The second: the accumulator rounds each partial
  sum ``s_j`` by up to ``u |s_j|``, and these add like a random walk, ``~ u sqrt(sum_j s_j^2)``.  The partial
  sums have the size of the *terms summed*, not of the result: they grow like the result where the terms share
  a sign and like a random walk of the terms, ``sqrt(sum t^2)``, where they cancel, so a small result (an
  output near zero, a pre-activation tanh squeezes) still carries the error of its large terms.  ``steps`` is
  ``K`` less the terms too small to round (``accumulation_steps``: adding ``t`` rounds by at most ``|t|``, so a
  masked probability of 0 adds no error).  ``sqrt(K (out^2 + sum t^2))`` is ``sqrt(sum_j s_j^2)`` within a
  factor of about 1.4 in any order of summation; the sequential loop is the worst of the usual orders, and
  measured, one float32 accumulator (``np.cumsum``) and numpy's OpenBLAS sgemm at K = 16 ... 4096 stay below
  1.4 of the term per element (0.2 in RMS).

Why a model rather than a multiple of the output: a computation's error is not proportional to the size of its
result.  tanh(A @ B + bias) is about 1 where the pre-activation is 16, yet its unsaturated elements carry the
pre-activation's error, ``u sqrt(K) * 16``; inputs scaled by ``s`` scale attention's scores by ``s^2``, whose
absolute error the softmax's exp makes a relative error of the probabilities, which P @ V averages into an
output that can be much smaller than the values.  The fixed rule measured all of these against the output's
RMS and rejected numpy's own float32 results (tanh at K = 256 on 4 of 4 seeds, attention with inputs x2 to x4).
``E`` follows each element instead: where tanh or sigmoid saturate, relu cuts, or gelu, silu and a softmax's
small probabilities go flat, it shrinks to the function's own rounding, and an error of a few ulps is caught.

Why each term of the bound:

* ``MODEL_UNITS`` (2): about 1.4 times the largest accumulation error measured against the model (above), for
  the second-order terms and the model's estimates.  Over the sweep of tests/test_tolerance.py (GEMM + none,
  relu, tanh, gelu, sigmoid, silu, exp at K = 16 ... 4096 and inputs x1 ... x8, attention, softmax) numpy's
  float32 results came within 0.57 of the bound, TVM's llvm kernels within 0.53 (GEMM epilogues), 0.43
  (attention) and pass as well for norms, convolutions, RoPE, the LSTM cell.
* ``rtol'``, ``atol'``: what a 16-bit output adds to the float32 model: its own rounding (half an ulp,
  ``u * |ref|``; a fixed atol could not pass fp16's half-ulp of 0.25 at 1000) and the intermediates kernels
  round to the dtype (a softmax's probabilities before P@V, the first GEMM of a stack), an absolute error of
  a few ``u`` of the row's typical element (below).  For a float32 output both are 0: the model's roundings
  are that output's own, and a few ``u`` of the row's RMS on every element would hide a 10-ulp error where
  the output saturates (tanh's bound there is ``2 u (2 + 1)``, 6 of tanh's ulps).
* ``floor``: subnormal results may be flushed to zero (nvcc's ``-ftz``); and below 2^-102 (the smallest normal
  float32 over ``u``) a float32 result's error is set by the range, not by ``u``: silu's ``z / (1 + e^-z)`` of
  about -1e-37 at z = -90 comes out 0 because ``e^90`` overflows float32.
* ``rtol`` (fixed rule; a few ``u``): a correctly rounded output is off by at most ``u * |ref|``, so it always
  passes at any magnitude; the rest of the margin is for the GPU's approximate intrinsics (``tanh.approx`` is
  good to about 2^-11, ``ex2.approx`` to 2^-22) and for intermediates rounded to the dtype.
* ``atol`` (fixed rule; a few ``u`` of the reference's typical magnitude): near zero an element is a sum of
  terms of about its neighbours' size that cancelled, and every intermediate a kernel rounds to the dtype
  leaves an absolute error of that size, not of the small result.  A root mean square, not the maximum, sets
  that size, so one large element cannot loosen the check for the others, and an error of a few ulps of a
  typical element (a bias dropped on one column) still fails.  The row's RMS counts where it is larger than
  the whole output's: rows of one output can differ in size by an order of magnitude (a causal attention's
  first query rows average a few values, its last ones thousands), and each row's errors scale with that row.
* ``u(float32) * sqrt(K)`` (fixed rule): kernels accumulate in fp32 at least; the random walk above, measured
  against the output's own size: right for a plain GEMM, too small after a squeezing activation or a softmax,
  hence the model where the inputs are known.  Negligible beside ``u`` for fp16/bf16 outputs.

What it catches.  With the model: an element off by more than ``2 u E``.  An error of 10 ulps of its row's
typical (RMS) element is caught wherever the computation is more accurate than that: over the sweep, at 93-94% of
the elements of tanh and sigmoid epilogues, about half of relu's, gelu's and silu's (their flat half), 92% of a
peaked softmax's (inputs x2 and more), 3 to 22% of attention's (the rows a peaked softmax makes one value row).
Not where a correct float32 evaluation's own error is that large: a K-term sum rounds by about
``u sqrt(2K)`` of its typical element, so a plain GEMM's 10-ulp errors are caught at 62% of the elements at
K = 16 and 4% from K = 64 on, where numpy's own sgemm is off by more than 10 ulps somewhere; attention's P @ V
with flat rows likewise.  Limits: the random walks assume terms whose low bits vary (seeded normal inputs do):
a sum of one value repeated to within 1e-4 of itself rounds alike at every step, up to ``u K |out| / 2``, and
an order that first grows the partial sums and then cancels them exceeds ``sqrt(K (out^2 + sum t^2))``.  The
fixed rule: an element off by more than about ``ATOL_UNITS`` ulps of a typical element of its row; a bias (of
typical size 1) dropped on one column of a GEMM + bias epilogue fails it in fp16 for any K up to tens of
thousands and in bf16 up to K of about 1000 (tests/test_tolerance.py; the model's form likewise); below that
size an error is lost in the bf16 rounding of intermediates that correct kernels make.  Systems that are not
ours (the harness's baselines) are held to ``BASELINE_SLACK`` times every term.

The reference is float64 (``smg.reference.evaluate``) or float32 (the GPU scripts' torch reference);
its own error is far below ``u`` of a 16-bit output and within the ``sqrt(K)`` term of an fp32 one.
Where the reference is not finite (a masked row's -inf) the output must be the same value exactly.

Numpy only, importing nothing of ours: the GPU scripts load this file by its path
(``experiments/gpu_runtime.py``) where the ``smg`` package, which needs sympy, is not wanted.  The graph walk
that feeds the model (op bodies, their derivatives) is ``smg.reference.check_numerics``'s; the arithmetic of
each op's error (``op_error_scale``, ``sum_error_scale``, ``accumulation_steps``, ``sole_maximum``) is here,
beside the bound it sets.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

#: unit roundoff (half the spacing of the numbers in [1, 2)) of each output dtype
UNIT_ROUNDOFF: dict[str, float] = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24,
                                   "float64": 2.0**-53}
#: smallest positive normal number of each dtype (subnormals below it may be flushed to zero)
SMALLEST_NORMAL: dict[str, float] = {"float16": 2.0**-14, "bfloat16": 2.0**-126, "float32": 2.0**-126,
                                     "float64": 2.0**-1022}
#: the dtype kernels accumulate in, at least (tensor-core MMA and the CUDA-core/llvm loops alike)
ACCUMULATOR = "float32"
#: the H100 kernels of tests/test_mma.py used at most 2.5 (rtol, on elements above the RMS) and 1.4 (atol)
RTOL_UNITS = 4.0
ATOL_UNITS = 4.0
#: the bound's multiple of the error model's ``u * E`` (module docstring: 1.4 times the worst accumulation error
#: measured against the model; at most 2.5 keeps a 10-ulp error at a saturated tanh caught)
MODEL_UNITS = 2.0
#: the accumulation term of a sum, ``ACC_UNITS * sqrt(steps * (out^2 + sum t^2))``: sequential float32 sums and
#: OpenBLAS's sgemm stayed below 1.4 of it per element (K 16 ... 4096, 4096 elements each), 0.2 in RMS
ACC_UNITS = 1.0
#: the error of the library functions a kernel calls, ``rel * u * |f| + abs * u`` (``(rel, abs)``): numpy's
#: float32 SIMD exp is off by up to 3.3 u |f|, tanh 0.8 u |f| + 0.5 u, log 1.1 u |f| + u; TVM's llvm kernels
#: (its legalisations) exp 1 u |f|, tanh 0.7 u |f| + u (it is (1 - e^-2x) / (1 + e^-2x), which cancels near 0:
#: 1.5 u there, whatever the size of tanh), erf 0.5 u |f| + 0.5 u, log 0.7 u |f| + u.  A function whose value
#: crosses 0 (tanh, erf, log at 1) is computed from an expression that cancels there, hence the absolute part;
#: a function not named here gets ``pow``'s (x^y as exp(y log x))
FUNCTION_UNITS: dict[str, tuple[float, float]] = {"exp": (4.0, 0.0), "tanh": (2.0, 1.0), "erf": (2.0, 1.0),
                                                  "log": (2.0, 1.0), "pow": (8.0, 0.0)}
#: how much more a third-party baseline (eager PyTorch, torch.compile, SDPA backends) may be off: the harness
#: only asks that it computes the same function, and eager attention rounds its scores to fp16 before the
#: softmax, an error of about u * |s| in every logit, which cost it up to 39 units of ``u * rms`` on the H100
BASELINE_SLACK = 16.0
#: the rule in words, as results files record it
RULE = ("|out - ref| <= atol + rtol * |ref| per element; eps = u(dtype) + u(float32) * sqrt(K), "
        f"rtol = {RTOL_UNITS:g} eps, atol = {ATOL_UNITS:g} eps * max(rms(ref row), rms(ref)) + "
        "smallest_normal(dtype); u: unit roundoff (fp16 2^-11, bf16 2^-8, fp32 2^-24), K: longest reduction "
        "behind the output, row: along the last dim.  Given the graph's inputs: |out - ref| <= "
        f"{MODEL_UNITS:g} u(float32) E + {RTOL_UNITS:g} (u(dtype) - u(float32)) |ref| + {ATOL_UNITS:g} "
        "(u(dtype) - u(float32)) max(rms(ref row), rms(ref)) + max(smallest_normal(dtype), 2^-102), E the "
        "float32 evaluation's error scale of each element from the graph's first-order error model "
        f"(smg/tolerance.py: a sum {ACC_UNITS:g} sqrt(K (out^2 + sum t^2)) plus its terms' errors, "
        "each op its own roundings plus its inputs' errors through its derivative)")


def unit_roundoff(dtype: str) -> float:
    """``u`` of a float dtype; a ValueError naming the dtype for any other."""
    if dtype not in UNIT_ROUNDOFF:
        raise ValueError(f"no tolerance for dtype {dtype!r}; known: {sorted(UNIT_ROUNDOFF)}")
    return UNIT_ROUNDOFF[dtype]


@dataclass(frozen=True)
class Tolerance:
    """``|out - ref| <= atol(scale) + rtol * |ref| + model_per_scale * E`` per element, ``atol(scale) =
    atol_per_scale * scale + atol_floor``, ``scale`` the magnitude of the element's row (``scale()``), ``E``
    the element's error scale from the graph's error model (``model_per_scale`` 0 under the fixed rule)."""

    dtype: str
    rtol: float
    atol_per_scale: float
    atol_floor: float
    model_per_scale: float = 0.0

    def atol(self, scale: Any) -> Any:
        return self.atol_per_scale * scale + self.atol_floor

    def bound(self, ref: Any, scale: Any, error_scale: Any = None) -> Any:
        """The allowed |out - ref| of each element (numpy or torch arrays alike); ``error_scale`` (``E``) is
        required exactly when the tolerance is the model's (``model_per_scale`` > 0)."""
        if (error_scale is None) != (self.model_per_scale == 0):
            raise ValueError("an error scale goes with the model's tolerance, and only with it")
        b = self.atol(scale) + self.rtol * abs(ref)
        return b if error_scale is None else b + self.model_per_scale * error_scale

    def as_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "rtol": self.rtol, "atol_per_scale": self.atol_per_scale,
                "atol_floor": self.atol_floor, "model_per_scale": self.model_per_scale}


def rms(ref: Any) -> float:
    """Root mean square of the finite elements (0 when there are none)."""
    finite = np.asarray(ref, dtype=np.float64)
    finite = finite[np.isfinite(finite)]
    return float(np.sqrt(np.mean(finite * finite))) if finite.size else 0.0


def scale(ref: Any) -> np.ndarray:
    """Each element's magnitude scale: max(RMS of its row, the last dim; RMS of the whole), finite elements
    only; shaped to broadcast against ``ref``."""
    r = np.asarray(ref, dtype=np.float64)
    whole = rms(r)
    if r.ndim < 2:
        return np.full(r.shape[:-1] + (1,) if r.ndim else (), whole)
    fin = np.isfinite(r)
    sq = np.where(fin, r, 0.0) ** 2
    rows = np.sqrt(sq.sum(axis=-1, keepdims=True) / np.maximum(fin.sum(axis=-1, keepdims=True), 1))
    return np.maximum(rows, whole)


def tolerance(dtype: str, reduction_len: int = 1, slack: float = 1.0, model: bool = False) -> Tolerance:
    """The rule's terms for an output of ``dtype`` whose longest reduction sums ``reduction_len`` terms
    (``slack``: BASELINE_SLACK for a baseline, else 1).  ``model``: the form that takes the graph's error
    scale ``E``, in which ``reduction_len`` plays no part (the model counts every sum's terms itself) and the
    dtype terms keep only what a dtype coarser than the float32 accumulator adds."""
    u = unit_roundoff(dtype)
    if model:
        excess = slack * max(u - UNIT_ROUNDOFF[ACCUMULATOR], 0.0)
        floor = max(SMALLEST_NORMAL[dtype], SMALLEST_NORMAL[ACCUMULATOR] / UNIT_ROUNDOFF[ACCUMULATOR])
        return Tolerance(dtype, RTOL_UNITS * excess, ATOL_UNITS * excess, floor,
                         slack * MODEL_UNITS * UNIT_ROUNDOFF[ACCUMULATOR])
    eps = slack * (u + UNIT_ROUNDOFF[ACCUMULATOR] * math.sqrt(max(1, int(reduction_len))))
    return Tolerance(dtype, RTOL_UNITS * eps, ATOL_UNITS * eps, SMALLEST_NORMAL[dtype])


# ---- the error model: each op's error scale, in units of u(ACCUMULATOR) ---------------------------------


def sum_error_scale(out: Any, steps: Any, terms_sq: Any, term_errors_sq: Any, coherent: Any = 0.0) -> np.ndarray:
    """``E`` of a sum: ``sqrt(term_errors_sq) + coherent + ACC_UNITS * sqrt(steps * (out^2 + terms_sq))``, with
    ``terms_sq`` the sum of the squared terms, ``term_errors_sq`` the sum of their squared independent errors
    (``e_t^2``), ``coherent`` the errors every term shares (an input the reduction broadcasts) and ``steps``
    the additions that round (``K``, less the terms too small to: ``accumulation_steps``), all per output
    element, errors in units of ``u``.  Why: module docstring (a random walk of the partial sums' roundings,
    whose size is the larger of the result's and the terms' own)."""
    out = np.asarray(out, dtype=np.float64)
    partial_sq = out * out + np.asarray(terms_sq, dtype=np.float64)
    acc = ACC_UNITS * np.sqrt(np.asarray(steps, dtype=np.float64) * partial_sq)
    return np.sqrt(np.asarray(term_errors_sq, dtype=np.float64)) + coherent + acc


def accumulation_steps(terms: Any, partial_sq: Any, n_reduce: int) -> np.ndarray:
    """How many of a sum's additions round, per output element: ``sum_t min(1, t^2 / (u^2 partial_sq))``.
    Adding ``t`` to a partial sum ``s`` rounds by at most ``min(u |s + t|, |t|)`` (``s`` itself is a float, and
    ``s + t`` is within ``|t|`` of it), so a term that is 0 (a masked probability, padding) adds no error and one
    far below ``u`` times the partial sums (a peaked softmax's other probabilities) adds only itself: a causal
    attention's row sums its few keys, not all ``K``.  ``partial_sq``: the partial sums' squared size,
    ``out^2 + sum t^2``, shaped to broadcast against ``terms``, whose last ``n_reduce`` axes are summed."""
    u = UNIT_ROUNDOFF[ACCUMULATOR]
    t = np.asarray(terms, dtype=np.float64)
    axes = tuple(range(t.ndim - n_reduce, t.ndim))
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.minimum(1.0, t * t / (u * u * np.asarray(partial_sq, dtype=np.float64)))
    return np.nan_to_num(share, nan=0.0).sum(axis=axes)


def secant_error(f: Callable[..., Any], args: Sequence[Any], moves: Mapping[int, Any],
                 shape: tuple[int, ...]) -> np.ndarray:
    """``D``: how far ``f(*args)`` moves, in units of ``u``, when each ``args[i]`` of ``moves`` moves by its
    error ``u * moves[i]`` (together, the same way; either way): ``|df/dx_i| * E_i`` where ``f`` is smooth, and
    the true change across a kink (relu near 0, a select) or a steep curve (exp of a large argument), which a
    derivative would miss.  Moving two arguments together is for two reads of one computed value."""
    u = UNIT_ROUNDOFF[ACCUMULATOR]
    base = np.broadcast_to(np.asarray(f(*args), dtype=np.float64), shape)
    worst = np.zeros(shape)
    for sign in (1.0, -1.0):
        moved = list(args)
        for i, err in moves.items():
            moved[i] = args[i] + sign * u * err
        diff = np.abs(np.broadcast_to(np.asarray(f(*moved), dtype=np.float64), shape) - base)
        worst = np.maximum(worst, np.where(np.isnan(diff), np.inf, diff))
    return worst / u


def sole_maximum(terms: Any, term_errors: Any, out: Any, n_reduce: int) -> np.ndarray:
    """Where a max over the last ``n_reduce`` axes of ``terms`` is sure to pick its reference maximum: no other
    term is within their errors (``term_errors``, units of ``u``) of it.  There the computed max *is* that
    term, rounding and all, so ``x - max(x)`` is exactly 0 at it (``op_error_scale``'s ``same``): a softmax's
    largest probability carries no error of its score, which a model of independent errors would double."""
    u = UNIT_ROUNDOFF[ACCUMULATOR]
    t, e = np.asarray(terms, dtype=np.float64), np.asarray(term_errors, dtype=np.float64)
    axes = tuple(range(t.ndim - n_reduce, t.ndim))
    o = np.asarray(out, dtype=np.float64).reshape(t.shape[:t.ndim - n_reduce] + (1,) * n_reduce)
    top = np.where(t == o, e, 0.0).max(axis=axes, keepdims=True)  # the maximum's own error
    with np.errstate(invalid="ignore"):
        near = (t + u * e >= o - u * top).sum(axis=axes)
    return near == 1


def op_error_scale(combiner: str, f: Callable[..., Any], args: Sequence[Any], errors: Sequence[Any],
                   rounding: Any, out: Any, shape: tuple[int, ...], n_reduce: int,
                   same: Sequence[tuple[int, int, Any]] = ()) -> np.ndarray:
    """``E`` of one op's output (units of ``u``) from its inputs' error scales (module docstring).

    ``f(*args)`` is the op's body over its iteration space ``shape`` (output dims, then the ``n_reduce``
    reduced ones, as ``smg.ir.Op.iter_dims``); ``args`` broadcast to it, the data inputs first (``errors``:
    one per data input, its ``E`` aligned like it, None where exact) and any index grids after; ``rounding``
    (``R``) the body's own roundings over the iteration space (None: it has none); ``out`` the op's reference
    output; ``combiner`` "none", "sum" or "max".  ``same``: ``(i, j, mask)``, where ``mask`` (broadcast to
    ``shape``) holds, ``args[i]`` is the very value ``args[j]`` is (a max that can only be that term), so their
    errors move together (``sole_maximum``)."""
    u = UNIT_ROUNDOFF[ACCUMULATOR]
    axes = tuple(range(len(shape) - n_reduce, len(shape)))
    own = np.zeros(shape) if rounding is None else np.broadcast_to(np.abs(np.asarray(rounding, np.float64)), shape)
    d = [None if err is None else secant_error(f, args, {i: err}, shape) for i, err in enumerate(errors)]
    for i, j, mask in same:
        if errors[j] is None:
            continue
        together = secant_error(f, args, {i: errors[j], j: errors[j]}, shape)
        mask = np.broadcast_to(np.asarray(mask, dtype=bool), shape)
        d[i] = np.where(mask, 0.0, d[i] if d[i] is not None else 0.0)
        d[j] = np.where(mask, together, d[j])
    terms_err = own.copy()
    coherent = np.zeros(shape[:len(shape) - n_reduce])
    for i, di in enumerate(d):
        if di is None:
            continue
        shared = combiner == "sum" and any(np.shape(args[i])[a] == 1 < shape[a] for a in axes)
        if shared:  # the same input element in every term: its errors add with one sign, not as a random walk
            coherent = coherent + di.sum(axis=axes)
        else:
            terms_err = terms_err + di if combiner != "sum" else np.sqrt(terms_err * terms_err + di * di)
    if combiner == "none":
        return terms_err
    t = np.broadcast_to(np.asarray(f(*args), dtype=np.float64), shape)
    o = np.asarray(out, dtype=np.float64).reshape(shape[:len(shape) - n_reduce] + (1,) * n_reduce)
    if combiner == "max":
        with np.errstate(invalid="ignore"):
            reach = terms_err - (o - t) / u
        return np.maximum(np.nan_to_num(reach, nan=0.0, neginf=0.0).max(axis=axes), 0.0)
    if combiner != "sum":
        raise ValueError(f"no error model for combiner {combiner!r}")
    terms_sq = (t * t).sum(axis=axes, keepdims=True)
    steps = accumulation_steps(t, o * o + terms_sq, n_reduce)
    return sum_error_scale(o.reshape(coherent.shape), steps, terms_sq.reshape(coherent.shape),
                           (terms_err * terms_err).sum(axis=axes), coherent)


@dataclass(frozen=True)
class Comparison:
    """The outcome of one output's check: ``problem`` is None when every element is within its bound."""

    tolerance: Tolerance
    size: int
    max_abs_err: float | None  # None where the output is not finite and the reference is
    over: int  # elements outside their bound
    atol: float  # the atol of a row no larger than the whole output (larger rows get more)
    problem: str | None

    @property
    def ok(self) -> bool:
        return self.problem is None


def compare(out: Any, ref: Any, dtype: str, reduction_len: int = 1, name: str = "output",
            slack: float = 1.0, error_scale: Any = None) -> Comparison:
    """Check ``out`` against ``ref`` (same number of elements; either may be any array-like, on the CPU)
    under the rule of this module, for an output stored as ``dtype``.  ``error_scale``: the graph's error
    model ``E`` of each element (``smg.reference.check_numerics`` with the inputs; units of u(float32),
    ``ref``'s shape), which selects the model's form of the rule; None: the fixed rule with ``reduction_len``."""
    r = np.asarray(ref, dtype=np.float64)
    o = np.asarray(out, dtype=np.float64)
    model = error_scale is not None
    tol = tolerance(dtype, reduction_len, slack, model=model)
    atol = float(tol.atol(rms(r)))
    if o.size != r.size:
        return Comparison(tol, r.size, None, r.size, atol, f"{name} has {o.size} elements, the reference {r.size}")
    o = o.reshape(r.shape)
    fin = np.isfinite(r)
    if not np.isfinite(o[fin]).all() or not np.array_equal(o[~fin], r[~fin], equal_nan=True):
        bad = int((~np.isfinite(o[fin])).sum() + (o[~fin] != r[~fin]).sum())
        return Comparison(tol, r.size, None, bad, atol, f"{name} has non-finite values where the reference is "
                                                        "finite (or differs where it is not)")
    if not fin.any():
        return Comparison(tol, r.size, 0.0, 0, atol, None)
    r0 = np.where(fin, r, 0.0)
    err = np.where(fin, np.abs(o - r0), 0.0)
    if model:
        e = np.broadcast_to(np.asarray(error_scale, dtype=np.float64), r.shape)
        # a NaN scale (inf - inf in the model) would pass everything: count it as no error at all instead
        bound = tol.bound(r0, scale(r), np.where(fin & ~np.isnan(e), e, 0.0))
    else:
        bound = tol.bound(r0, scale(r))
    over = err > bound
    n_over = int(over.sum())
    max_err = float(err.max())
    if not n_over:
        return Comparison(tol, r.size, max_err, 0, atol, None)
    worst = np.unravel_index(int(np.argmax(err - bound)), r.shape)
    where = tuple(int(i) for i in worst)
    form = "atol + rtol*|ref|" + (" + model" if model else "")
    terms = (f"rtol {tol.rtol:.3g}, atol {atol:.3g} or more in larger rows"
             + (f", model {MODEL_UNITS:g} u E, E here {e[worst]:.3g}" if model else ""))
    problem = (f"{name}: {n_over} of {r.size} elements over {form} ({terms}, {dtype}); worst at {where}: "
               f"out {o[worst]:.6g}, ref {r[worst]:.6g}, |diff| {err[worst]:.3g} > {bound[worst]:.3g}; "
               f"max abs err {max_err:.3g}")
    return Comparison(tol, r.size, max_err, n_over, atol, problem)


def assert_close(out: Any, ref: Any, dtype: str, reduction_len: int = 1, name: str = "output") -> None:
    """``compare`` for tests: an AssertionError with the worst element when the check fails."""
    c = compare(out, ref, dtype, reduction_len, name)
    if c.problem is not None:
        raise AssertionError(c.problem)


__all__ = ["ACCUMULATOR", "ACC_UNITS", "ATOL_UNITS", "BASELINE_SLACK", "FUNCTION_UNITS", "MODEL_UNITS", "RTOL_UNITS",
           "RULE", "SMALLEST_NORMAL", "UNIT_ROUNDOFF", "Comparison", "Tolerance", "accumulation_steps", "assert_close",
           "compare", "op_error_scale", "rms", "scale", "secant_error", "sole_maximum", "sum_error_scale", "tolerance",
           "unit_roundoff"]
