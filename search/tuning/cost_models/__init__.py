"""The cost models a tune can rank with, one file each; ``DefaultCostModel`` is the tuner's own ranking."""

from search.tuning.cost_models.analytical import AnalyticalCostModel
from search.tuning.cost_models.default import DefaultCostModel
from search.tuning.cost_models.prior import PriorCostModel
from search.tuning.cost_models.xgboost_model import MIN_RECORDS_TO_LEARN, XGBoostCostModel

__all__ = ["MIN_RECORDS_TO_LEARN", "AnalyticalCostModel", "DefaultCostModel", "PriorCostModel", "XGBoostCostModel"]
