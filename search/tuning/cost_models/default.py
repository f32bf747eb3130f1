"""The tuner's default ranking as a ``CostModel``: the analytical model, its ties broken by the prior, until the
XGBoost model is fitted on the tune's records; from then on the XGBoost model."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from schedulers.schedule import Schedule
from search.prior import first_round_order
from search.records import MeasureResult
from search.tuning.context import TuningContext
from search.tuning.cost_model import CostModel
from search.tuning.cost_models.analytical import AnalyticalCostModel
from search.tuning.cost_models.prior import PriorCostModel
from search.tuning.cost_models.xgboost_model import XGBoostCostModel


class DefaultCostModel(CostModel):
    """Before ``learned`` is fitted, a candidate's cost is its place in ``search.prior.first_round_order``
    (ascending ``analytical`` estimate; estimates within 1% of each other ordered by ``prior``, None: by key);
    after, ``learned``'s prediction.  ``update`` and ``save`` go to ``learned``; ``load`` reads a learned
    model and keeps the analytical one and the shipped prior for before it is fitted (it is, once loaded)."""

    def __init__(self, *, analytical: AnalyticalCostModel | None = None, prior: PriorCostModel | None = None,
                 learned: XGBoostCostModel | None = None, use_prior: bool = True) -> None:
        self.analytical = analytical if analytical is not None else AnalyticalCostModel()
        self.prior = (prior if prior is not None else PriorCostModel()) if use_prior else None
        self.learned = learned if learned is not None else XGBoostCostModel()

    @property
    def fitted(self) -> bool:
        return self.learned.fitted

    def predict(self, context: TuningContext, schedules: Sequence[Schedule]) -> np.ndarray:
        if self.learned.fitted:
            return self.learned.predict(context, schedules)
        cands = {s.key: s for s in schedules}
        est = dict(zip(cands, self.analytical.predict(context, list(cands.values()))))
        ranker = None if self.prior is None else self.prior.ranker_for(context)
        place = {k: float(i) for i, k in enumerate(first_round_order(cands, est, ranker))}
        return np.array([place[s.key] for s in schedules], dtype=np.float64)

    def update(self, context: TuningContext, schedules: Sequence[Schedule], results: Sequence[MeasureResult]) -> None:
        self.learned.update(context, schedules, results)

    def save(self, path: str | Path) -> None:
        self.learned.save(path)

    @classmethod
    def load(cls, path: str | Path) -> DefaultCostModel:
        return cls(learned=XGBoostCostModel.load(path))
