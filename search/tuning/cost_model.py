"""The cost-model interface: what ranks the candidates a tune has not measured yet."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from schedulers.schedule import Schedule
from search.records import MeasureResult
from search.tuning.context import TuningContext


class CostModel(ABC):
    """Predicts a cost per candidate schedule, LOWER is better, comparable among one context's candidates only.

    ``update`` is handed every record of the tune's key measured so far, oldest first (the database's
    history, not only the newest batch): the database is the memory, so a tune that resumes or shares its
    database learns from all of it, and a model retrains on what it is given.  ``fitted`` says whether the
    model has learned from such records (the explore/exploit rule and the held-out report use it); a model
    that does not learn (the analytical one, a fixed prior) is never fitted.  ``save``/``load`` persist it
    (a model without state writes what names it)."""

    @abstractmethod
    def predict(self, context: TuningContext, schedules: Sequence[Schedule]) -> np.ndarray:
        """One cost per schedule, lower is better."""

    @abstractmethod
    def update(self, context: TuningContext, schedules: Sequence[Schedule], results: Sequence[MeasureResult]) -> None:
        """Learn from the measured records of ``context`` (all of them so far; see the class docstring)."""

    @abstractmethod
    def save(self, path: str | Path) -> None:
        """Write the model at ``path``."""

    @classmethod
    @abstractmethod
    def load(cls, path: str | Path) -> CostModel:
        """Read a model ``save`` wrote; ValueError if ``path`` holds something else."""

    @property
    def fitted(self) -> bool:
        """Whether ``update`` has fitted the model to measured records of the workload."""
        return False
