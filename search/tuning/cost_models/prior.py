"""The first-round prior (``search.prior``: a ranker trained on every committed measurement) as a ``CostModel``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from schedulers.schedule import Schedule
from search.learned import LearnedCostModel
from search.prior import prior_for
from search.records import MeasureResult
from search.tuning.context import TuningContext
from search.tuning.cost_model import CostModel


class PriorCostModel(CostModel):
    """The ranker learned from other workloads' measurements; fixed during a tune (``update`` learns nothing).

    ``ranker`` None: the shipped prior of the context's hardware (``search.prior.prior_for``), for CUDA
    targets only: it was learned from GPU kernels and says nothing about a CPU's."""

    def __init__(self, ranker: LearnedCostModel | None = None) -> None:
        self.ranker = ranker

    def ranker_for(self, context: TuningContext) -> LearnedCostModel | None:
        """The ranker that scores ``context``'s candidates; None where there is none (a CPU target, or no
        prior ships for a machine that is not a GPU)."""
        if self.ranker is not None:
            return self.ranker
        return prior_for(context.hw).model if context.target.startswith("cuda") else None

    def predict(self, context: TuningContext, schedules: Sequence[Schedule]) -> np.ndarray:
        ranker = self.ranker_for(context)
        if ranker is None:
            raise RuntimeError(f"no prior ranks {context.target} candidates for the {context.hw.name} "
                               f"({prior_for(context.hw).why})")
        return ranker.predict(list(schedules))

    def update(self, context: TuningContext, schedules: Sequence[Schedule], results: Sequence[MeasureResult]) -> None:
        """Nothing: a prior is what was known before this tune (``experiments/tuning/train_prior.py`` rebuilds it)."""

    def save(self, path: str | Path) -> None:
        if self.ranker is None:
            raise RuntimeError("nothing to save: this prior is the shipped one (search/data/prior_<hw>.json)")
        self.ranker.save(path)

    @classmethod
    def load(cls, path: str | Path) -> PriorCostModel:
        return cls(LearnedCostModel.load(path))
