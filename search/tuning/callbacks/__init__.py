"""The measure callbacks, one file each; ``default_callbacks`` is what ``search.tuner.tune`` runs."""

from __future__ import annotations

from search.tuning.callback import MeasureCallback
from search.tuning.callbacks.commit import AddToDatabase
from search.tuning.callbacks.refit import UpdateCostModel
from search.tuning.callbacks.report import ReportProgress


def default_callbacks(progress: bool = True) -> list[MeasureCallback]:
    """Store the records, refit the cost model on them, report: the tuner's behaviour before it had parts."""
    return [AddToDatabase(), UpdateCostModel(), ReportProgress(progress)]


__all__ = ["AddToDatabase", "ReportProgress", "UpdateCostModel", "default_callbacks"]
