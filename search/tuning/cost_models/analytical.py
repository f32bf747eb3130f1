"""The analytical cost model (``search.cost.estimate_us``) as a ``CostModel``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from schedulers.schedule import Schedule
from search.cost import estimate_us
from search.records import MeasureResult
from search.tuning.context import TuningContext
from search.tuning.cost_model import CostModel

FORMAT = "spacefusion-analytical-cost-model/1"


class AnalyticalCostModel(CostModel):
    """Estimated microseconds on the context's hardware model; learns nothing from measurements.

    Estimates are remembered per (hardware, schedule key): a tune ranks the same candidates every batch."""

    def __init__(self) -> None:
        self._memo: dict[tuple[str, str], float] = {}

    def estimate(self, context: TuningContext, schedule: Schedule) -> float:
        """``estimate_us`` of one schedule on ``context.hw``."""
        at = (context.hw.name, schedule.key)
        if at not in self._memo:
            self._memo[at] = estimate_us(schedule, context.hw)
        return self._memo[at]

    def predict(self, context: TuningContext, schedules: Sequence[Schedule]) -> np.ndarray:
        return np.array([self.estimate(context, s) for s in schedules], dtype=np.float64)

    def update(self, context: TuningContext, schedules: Sequence[Schedule], results: Sequence[MeasureResult]) -> None:
        """Nothing to learn: the model is a function of the schedule and the hardware."""

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"format": FORMAT}))

    @classmethod
    def load(cls, path: str | Path) -> AnalyticalCostModel:
        try:
            fmt = json.loads(Path(path).read_text()).get("format")
        except (OSError, ValueError, AttributeError) as e:
            raise ValueError(f"{path} is not an analytical cost model ({e})") from None
        if fmt != FORMAT:
            raise ValueError(f"{path} is not an analytical cost model (format {fmt!r}, expected {FORMAT!r})")
        return cls()
