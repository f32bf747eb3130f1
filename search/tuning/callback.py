"""The measure-callback interface: what runs after each batch of measurements, and what it is handed."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from search.records import MeasureInput, MeasureResult
from search.tuning.context import TuningContext
from search.tuning.cost_model import CostModel
from search.tuning.database import Database


@dataclass
class TuneState:
    """The running tune as the callbacks see it: its context, the database ``key`` (and its ``parts``) the
    records go under, the database, the cost model, the ``summary`` being filled (a ``TuneSummary``), when
    it started (``time.perf_counter``), the best median so far (us; inf: none yet) and how many candidates
    it means to measure (``planned``: the trials left, or fewer where fewer are unmeasured)."""

    context: TuningContext
    key: str
    parts: dict[str, Any]
    database: Database
    cost_model: CostModel
    summary: Any
    t_start: float
    best_us: float
    planned: int = 0


@dataclass(frozen=True)
class MeasuredBatch:
    """One measured batch: the ``inputs`` and their ``results`` in order (environmental failures, which are
    neither stored nor counted, already left out), and ``predicted``: the cost model's costs for them made
    BEFORE they were measured, where the model was ``fitted`` then (None otherwise), so a callback can score
    the model on records it had not learned from."""

    inputs: tuple[MeasureInput, ...]
    results: tuple[MeasureResult, ...]
    predicted: tuple[float, ...] | None = None


class MeasureCallback(ABC):
    """Called by the tuner after each measured batch, in the order of the tune's callback list, and once
    when the tune ends (``finish``), however it ended but by an exception."""

    @abstractmethod
    def after_batch(self, state: TuneState, batch: MeasuredBatch) -> None:
        """React to ``batch``."""

    def finish(self, state: TuneState) -> None:
        """The tune is over (no more batches); default: nothing."""
        return None
