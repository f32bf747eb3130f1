"""The learned cost model (``search.learned.LearnedCostModel``, an XGBoost ranker) as a ``CostModel``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from schedulers.schedule import Schedule
from search.learned import LearnedCostModel
from search.records import MeasureResult
from search.tuning.context import TuningContext
from search.tuning.cost_model import CostModel

#: successful records a tune needs before its learned model is fitted (fewer rank nothing worth trusting)
MIN_RECORDS_TO_LEARN = 8


class XGBoostCostModel(CostModel):
    """A pairwise ranker over the schedule features, fitted on the tune's records once ``min_records`` of them
    succeeded.  Each ``update`` refits from scratch on the records given (all of the key's so far: a few
    hundred records train in well under a second, and the model does not depend on the order batches came
    in).  The ranker is built for the first context's hardware model (its features use that machine's
    numbers); ``learned`` wraps an existing one (e.g. loaded)."""

    def __init__(self, *, min_records: int = MIN_RECORDS_TO_LEARN, learned: LearnedCostModel | None = None) -> None:
        self.min_records = int(min_records)
        self.learned = learned

    @property
    def fitted(self) -> bool:
        return self.learned is not None and self.learned.is_trained

    def predict(self, context: TuningContext, schedules: Sequence[Schedule]) -> np.ndarray:
        if not self.fitted:
            raise RuntimeError(f"the XGBoost cost model is not fitted: it needs {self.min_records} successful "
                               f"records first (see .fitted)")
        return self.learned.predict(list(schedules))  # type: ignore[union-attr]

    def update(self, context: TuningContext, schedules: Sequence[Schedule], results: Sequence[MeasureResult]) -> None:
        if sum(r.ok for r in results) < self.min_records:
            return
        if self.learned is None:
            self.learned = LearnedCostModel(context.hw)
        self.learned.fit(list(schedules), list(results), ["tune"] * len(schedules))  # one workload: one group

    def save(self, path: str | Path) -> None:
        if self.learned is None:
            raise RuntimeError("nothing to save: the XGBoost cost model has not been fitted")
        self.learned.save(path)

    @classmethod
    def load(cls, path: str | Path) -> XGBoostCostModel:
        return cls(learned=LearnedCostModel.load(path))
