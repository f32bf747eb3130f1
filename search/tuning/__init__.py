"""The tuner as parts, one interface per concern (as TVM MetaSchedule's ``tune_tasks`` takes its builder,
runner, database, cost model, measure callbacks and task scheduler), one file per implementation:

- ``TuningContext``: the graph, the hardware model, the target (``context.py``);
- ``CostModel`` (``cost_model.py``): ``predict``, ``update``, ``save``, ``load``; ``cost_models/``: the
  analytical model, the XGBoost model, the prior, and ``DefaultCostModel`` (today's ranking of the three);
- ``SearchStrategy`` (``strategy.py``): which candidates to measure next; ``strategies/``: ``ExploreExploit``;
- ``Database`` (``database.py``): what the tuner reads and writes; ``search.database.TuningDatabase``;
- ``MeasureCallback`` (``callback.py``): after each batch; ``callbacks/``: ``AddToDatabase``,
  ``UpdateCostModel``, ``ReportProgress`` (``default_callbacks()``);
- ``tune_with`` (``loop.py``) composes them; ``search.tuner.tune`` is ``tune_with`` with the defaults.
"""

from search.tuning.callback import MeasureCallback, MeasuredBatch, TuneState
from search.tuning.callbacks import AddToDatabase, ReportProgress, UpdateCostModel, default_callbacks
from search.tuning.context import TuningContext
from search.tuning.cost_model import CostModel
from search.tuning.cost_models import (
    MIN_RECORDS_TO_LEARN,
    AnalyticalCostModel,
    DefaultCostModel,
    PriorCostModel,
    XGBoostCostModel,
)
from search.tuning.database import Database
from search.tuning.loop import tune_with
from search.tuning.strategies import ExploreExploit
from search.tuning.strategy import SearchStrategy
from search.tuning.summary import TuneSummary, summary_dict

__all__ = [
    "MIN_RECORDS_TO_LEARN", "AddToDatabase", "AnalyticalCostModel", "CostModel", "Database", "DefaultCostModel",
    "ExploreExploit", "MeasureCallback", "MeasuredBatch", "PriorCostModel", "ReportProgress", "SearchStrategy",
    "TuneState", "TuneSummary", "TuningContext", "UpdateCostModel", "XGBoostCostModel", "default_callbacks",
    "summary_dict", "tune_with",
]
