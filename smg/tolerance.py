"""When is a kernel's output close enough to its reference?  The one rule every check uses.

Element by element, with ``u`` the output dtype's unit roundoff (fp16 2^-11, bf16 2^-8, fp32 2^-24)::

    |out - ref| <= atol + rtol * |ref|
    eps   = u(dtype) + u(float32) * sqrt(K)     K: the longest reduction behind the output (1 if none)
    rtol  = RTOL_UNITS * eps
    atol  = ATOL_UNITS * eps * scale + smallest_normal(dtype)
    scale = max(rms of the element's row of ref, rms of all of ref)     row: along the last dim

Why each term:

* ``rtol`` (a few ``u``): a correctly rounded output is off by at most ``u * |ref|`` (half a unit in the
  last place), so it always passes, at any magnitude; the rest of the margin is for the GPU's
  approximate intrinsics (``tanh.approx`` is good to about 2^-11, ``ex2.approx`` to 2^-22) and for
  intermediates rounded to the dtype, each a ``u`` of its own.  A fixed ``atol`` alone cannot do this:
  fp16's half-ulp at 1000 is 0.25.
* ``atol`` (a few ``u`` of the reference's typical magnitude): near zero an element is a sum of terms of
  about its neighbours' size that cancelled, and every intermediate a kernel rounds to the dtype (a
  softmax's probabilities before P@V, the first GEMM of a stack) leaves an absolute error of that size,
  not of the small result.  A root mean square, not the maximum, sets that size, so one large element
  cannot loosen the check for the others, and an error of a few ulps of a typical element (a bias dropped
  on one column) still fails.  The row's RMS counts where it is larger than the whole output's: rows of
  one output can differ in size by an order of magnitude (a causal attention's first query rows average
  a few values, its last ones thousands), and each row's errors scale with that row.
* ``u(float32) * sqrt(K)``: kernels accumulate in fp32 at least; a sum of ``K`` terms drifts like a
  random walk of ``K`` roundings.  It is what makes fp32 outputs (the CPU llvm kernels) checkable, and is
  negligible beside ``u`` for fp16/bf16 outputs until K is in the tens of millions.
* ``smallest_normal(dtype)``: subnormal results may be flushed to zero (nvcc's ``-ftz``).

What it catches: an element off by more than about ``ATOL_UNITS`` ulps of a typical element of its row.  A
bias (of typical size 1) dropped on one column of a GEMM + bias epilogue fails it in fp16 for any K up to
tens of thousands and in bf16 up to K of about 1000 (tests/test_tolerance.py); below that size an error is
lost in the bf16 rounding of intermediates that correct kernels make.  Systems that are not ours (the
harness's baselines) are held to ``BASELINE_SLACK`` times both terms.

The reference is float64 (``smg.reference.evaluate``) or float32 (the GPU scripts' torch reference);
its own error is far below ``u`` of a 16-bit output and within the ``sqrt(K)`` term of an fp32 one.
Where the reference is not finite (a masked row's -inf) the output must be the same value exactly.

Numpy only, importing nothing of ours: the GPU scripts load this file by its path
(``experiments/gpu_runtime.py``) where the ``smg`` package, which needs sympy, is not wanted.
"""

from __future__ import annotations

import math
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
#: how much more a third-party baseline (eager PyTorch, torch.compile, SDPA backends) may be off: the harness
#: only asks that it computes the same function, and eager attention rounds its scores to fp16 before the
#: softmax, an error of about u * |s| in every logit, which cost it up to 39 units of ``u * rms`` on the H100
BASELINE_SLACK = 16.0
#: the rule in words, as results files record it
RULE = ("|out - ref| <= atol + rtol * |ref| per element; eps = u(dtype) + u(float32) * sqrt(K), "
        f"rtol = {RTOL_UNITS:g} eps, atol = {ATOL_UNITS:g} eps * max(rms(ref row), rms(ref)) + "
        "smallest_normal(dtype); u: unit roundoff (fp16 2^-11, bf16 2^-8, fp32 2^-24), K: longest reduction "
        "behind the output, row: along the last dim")


def unit_roundoff(dtype: str) -> float:
    """``u`` of a float dtype; a ValueError naming the dtype for any other."""
    if dtype not in UNIT_ROUNDOFF:
        raise ValueError(f"no tolerance for dtype {dtype!r}; known: {sorted(UNIT_ROUNDOFF)}")
    return UNIT_ROUNDOFF[dtype]


@dataclass(frozen=True)
class Tolerance:
    """``|out - ref| <= atol(scale) + rtol * |ref|`` per element, ``atol(scale) = atol_per_scale * scale +
    atol_floor``, ``scale`` the magnitude of the element's row (``scale()``)."""

    dtype: str
    rtol: float
    atol_per_scale: float
    atol_floor: float

    def atol(self, scale: Any) -> Any:
        return self.atol_per_scale * scale + self.atol_floor

    def bound(self, ref: Any, scale: Any) -> Any:
        """The allowed |out - ref| of each element (numpy or torch arrays alike)."""
        return self.atol(scale) + self.rtol * abs(ref)

    def as_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "rtol": self.rtol, "atol_per_scale": self.atol_per_scale,
                "atol_floor": self.atol_floor}


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


def tolerance(dtype: str, reduction_len: int = 1, slack: float = 1.0) -> Tolerance:
    """The rule's terms for an output of ``dtype`` whose longest reduction sums ``reduction_len`` terms
    (``slack``: BASELINE_SLACK for a baseline, else 1)."""
    eps = slack * (unit_roundoff(dtype) + UNIT_ROUNDOFF[ACCUMULATOR] * math.sqrt(max(1, int(reduction_len))))
    return Tolerance(dtype, RTOL_UNITS * eps, ATOL_UNITS * eps, SMALLEST_NORMAL[dtype])


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
            slack: float = 1.0) -> Comparison:
    """Check ``out`` against ``ref`` (same number of elements; either may be any array-like, on the CPU)
    under the rule of this module, for an output stored as ``dtype``."""
    r = np.asarray(ref, dtype=np.float64)
    o = np.asarray(out, dtype=np.float64)
    tol = tolerance(dtype, reduction_len, slack)
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
    bound = tol.bound(r0, scale(r))
    over = err > bound
    n_over = int(over.sum())
    max_err = float(err.max())
    if not n_over:
        return Comparison(tol, r.size, max_err, 0, atol, None)
    worst = np.unravel_index(int(np.argmax(err - bound)), r.shape)
    where = tuple(int(i) for i in worst)
    problem = (f"{name}: {n_over} of {r.size} elements over atol + rtol*|ref| (rtol {tol.rtol:.3g}, atol "
               f"{atol:.3g} or more in larger rows, {dtype}); worst at {where}: out {o[worst]:.6g}, ref "
               f"{r[worst]:.6g}, |diff| {err[worst]:.3g} > {bound[worst]:.3g}; max abs err {max_err:.3g}")
    return Comparison(tol, r.size, max_err, n_over, atol, problem)


def assert_close(out: Any, ref: Any, dtype: str, reduction_len: int = 1, name: str = "output") -> None:
    """``compare`` for tests: an AssertionError with the worst element when the check fails."""
    c = compare(out, ref, dtype, reduction_len, name)
    if c.problem is not None:
        raise AssertionError(c.problem)


__all__ = ["ACCUMULATOR", "ATOL_UNITS", "BASELINE_SLACK", "RTOL_UNITS", "RULE", "SMALLEST_NORMAL", "UNIT_ROUNDOFF",
           "Comparison", "Tolerance", "assert_close", "compare", "rms", "scale", "tolerance", "unit_roundoff"]
