"""Ranking metrics for cost models (numpy only).

A tuner only uses a cost model to *order* candidates, so what matters is rank
agreement (Spearman) and what picking the model's favourite costs against the
true best (top-1 slowdown, top-k recall).

Convention: ``pred`` / ``predicted_scores`` are predicted *costs*, lower is
better (``LearnedCostModel.predict`` returns them that way); ``measured`` are
latencies in µs, lower is better, ``inf`` for a failed candidate.  Ties are
broken by position (the first listed wins), so results are deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

ArrayLike = Sequence[float] | np.ndarray


def _vec(x: ArrayLike) -> np.ndarray:
    return np.asarray(x, dtype=np.float64).reshape(-1)


def _pair(a: ArrayLike, b: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    x, y = _vec(a), _vec(b)
    if x.shape != y.shape:
        raise ValueError(f"need equally long sequences, got {x.size} and {y.size}")
    return x, y


def rankdata(x: ArrayLike) -> np.ndarray:
    """Ranks 1..n with ties given their average rank (``scipy.stats.rankdata(method='average')``)."""
    a = _vec(x)
    order = np.argsort(a, kind="mergesort")
    sorted_a = a[order]
    # start of each run of equal values in sorted order
    starts = np.flatnonzero(np.r_[True, sorted_a[1:] != sorted_a[:-1]])
    ends = np.r_[starts[1:], a.size]
    avg = (starts + ends + 1) / 2.0  # mean of ranks starts+1 .. ends
    ranks = np.empty(a.size, dtype=np.float64)
    ranks[order] = np.repeat(avg, ends - starts)
    return ranks


def spearman(a: ArrayLike, b: ArrayLike) -> float:
    """Spearman rank correlation with average ranks for ties.

    Pairs where either value is NaN are dropped; ``inf`` is an ordinary (largest)
    value.  Returns 0.0 rather than NaN when fewer than two pairs remain or either
    side is constant: "no ranking information" should not poison a mean over groups.
    """
    x, y = _pair(a, b)
    keep = ~(np.isnan(x) | np.isnan(y))
    x, y = x[keep], y[keep]
    if x.size < 2:
        return 0.0
    rx, ry = rankdata(x), rankdata(y)
    rx -= rx.mean()
    ry -= ry.mean()
    den = float(np.sqrt((rx * rx).sum() * (ry * ry).sum()))
    if den == 0.0:
        return 0.0
    return float(np.clip((rx * ry).sum() / den, -1.0, 1.0))


def top1_slowdown(predicted_scores: ArrayLike, measured_us: ArrayLike) -> float:
    """Measured latency of the candidate with the lowest predicted cost over the best measured latency.

    ``predicted_scores`` are costs (lower is better); negate a "higher is
    better" score first.  1.0 means the model's pick is the true best; ``inf``
    when its pick failed while another candidate ran; NaN when none ran.
    """
    p, m = _pair(predicted_scores, measured_us)
    if p.size == 0:
        raise ValueError("top1_slowdown of no candidates")
    best = float(np.min(m))
    if not np.isfinite(best):
        return float("nan")
    pick = int(np.argmin(np.where(np.isnan(p), np.inf, p)))
    if m[pick] == best:
        return 1.0
    return float(m[pick] / best) if best > 0 else float("inf")


def top_k_recall(pred: ArrayLike, measured: ArrayLike, k: int) -> float:
    """Fraction of the measured top-``k`` (fastest) found among the ``k`` lowest predicted costs.

    ``k`` is clipped to the number of candidates; ties are broken by position.
    """
    p, m = _pair(pred, measured)
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")
    k = min(k, p.size)
    if k == 0:
        return 0.0
    true_top = set(np.argsort(m, kind="stable")[:k].tolist())
    pred_top = set(np.argsort(np.where(np.isnan(p), np.inf, p), kind="stable")[:k].tolist())
    return len(true_top & pred_top) / k
