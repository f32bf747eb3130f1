"""Measure callback: the progress bar, and how well the cost models ranked records they had not seen."""

from __future__ import annotations

import math
import sys

import numpy as np

from search.cost import estimate_us
from search.metrics import spearman, top1_slowdown
from search.tuning.callback import MeasureCallback, MeasuredBatch, TuneState


class _Progress:
    """A one-line progress bar on stderr (no dependency)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.done = max(total, 1), enabled, 0

    def update(self, n: int, best: float) -> None:
        self.done += n
        if not self.enabled:
            return
        width = 30
        fill = int(width * min(self.done, self.total) / self.total)
        best_s = f"{best:.1f} us" if math.isfinite(best) else "-"
        sys.stderr.write(f"\r  [{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} measured, best {best_s}")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def quality(pred: list[float], measured: list[float]) -> dict[str, float]:
    """Spearman and top-1 slowdown of ``pred`` against the ``measured`` medians that are finite; {} under two."""
    ok = [(p, m) for p, m in zip(pred, measured) if math.isfinite(m)]
    if len(ok) < 2:
        return {}
    p, m = zip(*ok)
    return {"spearman": spearman(np.array(p), np.array(m)), "top1_slowdown": top1_slowdown(np.array(p), np.array(m)),
            "n": float(len(ok))}


class ReportProgress(MeasureCallback):
    """Draws the bar on stderr (when ``progress``; out of ``state.planned`` candidates) and keeps, per batch,
    the analytical estimates and the cost model's predictions made before measuring (``batch.predicted``),
    so ``summary.analytical`` and ``summary.learned`` score each model on records it had not learned from."""

    def __init__(self, progress: bool = True) -> None:
        self.progress = progress
        self._bar: _Progress | None = None
        self._held: dict[str, tuple[list[float], list[float]]] = {"analytical": ([], []), "learned": ([], [])}

    def _bar_of(self, state: TuneState) -> _Progress:
        if self._bar is None:
            self._bar = _Progress(state.planned, self.progress)
        return self._bar

    def after_batch(self, state: TuneState, batch: MeasuredBatch) -> None:
        meds = [r.median_us for r in batch.results]
        self._held["analytical"][0].extend(estimate_us(i.schedule, state.context.hw) for i in batch.inputs)
        self._held["analytical"][1].extend(meds)
        if batch.predicted is not None:
            self._held["learned"][0].extend(batch.predicted)
            self._held["learned"][1].extend(meds)
        self._bar_of(state).update(len(batch.inputs), state.best_us)

    def finish(self, state: TuneState) -> None:
        self._bar_of(state).close()
        state.summary.analytical = quality(*self._held["analytical"])
        state.summary.learned = quality(*self._held["learned"])
