"""Tuning, the public face: ``tune`` (the whole search with its default parts) and ``tune_with`` (the same loop
with any part swapped), the interfaces a research script implements, and the implementations that ship.

    from spacefusion.tuning import TuningContext, SearchStrategy, tune_with, tuning_hardware
    ctx = TuningContext(g, tuning_hardware("llvm"), "llvm")
    summary = tune_with(ctx, LLVMRunner(), strategy=MyStrategy(), trials=32)

The parts live in ``search.tuning`` (one file per implementation); docs/tuning.md says how to swap one.
"""

from __future__ import annotations

from search.tuner import tune, tuning_hardware
from search.tuning import (
    MIN_RECORDS_TO_LEARN,
    AddToDatabase,
    AnalyticalCostModel,
    CostModel,
    Database,
    DefaultCostModel,
    ExploreExploit,
    MeasureCallback,
    MeasuredBatch,
    PriorCostModel,
    ReportProgress,
    SearchStrategy,
    TuneState,
    TuneSummary,
    TuningContext,
    UpdateCostModel,
    XGBoostCostModel,
    default_callbacks,
    summary_dict,
    tune_with,
)

__all__ = [
    "MIN_RECORDS_TO_LEARN", "AddToDatabase", "AnalyticalCostModel", "CostModel", "Database", "DefaultCostModel",
    "ExploreExploit", "MeasureCallback", "MeasuredBatch", "PriorCostModel", "ReportProgress", "SearchStrategy",
    "TuneState", "TuneSummary", "TuningContext", "UpdateCostModel", "XGBoostCostModel", "default_callbacks",
    "summary_dict", "tune", "tune_with", "tuning_hardware",
]
