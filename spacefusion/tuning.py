"""Tuning, the public face: ``tune`` (the whole search with its default parts) and ``tune_with`` (the same loop
with any part swapped), the interfaces a research script implements, the implementations that ship, and what a
tune reads and writes: the database and its records, the measuring wire types, the runners and builders, the
offline batch, the first-round prior and the cost-model metrics.

    from spacefusion.tuning import TuningContext, SearchStrategy, tune_with, tuning_hardware
    ctx = TuningContext(g, tuning_hardware("llvm"), "llvm")
    summary = tune_with(ctx, LLVMRunner(), strategy=MyStrategy(), trials=32)

The parts live in ``search.tuning`` (one file per implementation); docs/tuning.md says how to swap one.
The names of ``_LAZY`` resolve on first use (the runners import torch, the frontend's tuning torch too).
"""

from __future__ import annotations

import importlib
from typing import Any

import search.tuning as _parts
from search.tuner import tune, tuning_hardware
from search.tuning import *  # noqa: F403  (every part: search.tuning.__all__)

_RUNNERS = ("MANIFEST_FILE", "MANIFEST_FORMAT", "RESULTS_FILE", "RESULTS_FORMAT", "LLVMRunner", "LocalGPURunner",
            "OfflineBatchRunner", "PoolRunner", "ProcessRunner", "RayRunner", "RunnerUnavailable", "TVMBuilder",
            "cpu_cores", "export_batch", "gpu_runner", "gpu_unavailable_reason", "import_batch", "import_offline",
            "visible_gpus")

#: public name -> (module, attribute)
_LAZY: dict[str, tuple[str, str]] = {
    # the database and its records (the measuring wire types)
    "TuningDatabase": ("search.database", "TuningDatabase"),
    "tuning_key": ("search.database", "tuning_key"),
    "tuning_flags": ("search.tuning.loop", "tuning_flags"),  # the flags a record's key holds for a builder
    "MeasureInput": ("search.records", "MeasureInput"),
    "MeasureResult": ("search.records", "MeasureResult"),
    # the space, the first-round prior, the learned model and its metrics
    "SearchSpace": ("search.space", "SearchSpace"),
    **{n: ("search.prior", n) for n in ("load_prior", "first_round_order", "prior_path", "read_records",
                                        "read_json", "train_prior")},
    "LearnedCostModel": ("search.learned", "LearnedCostModel"),
    "feature_matrix": ("search.features", "feature_matrix"),
    "spearman": ("search.metrics", "spearman"),
    "top1_slowdown": ("search.metrics", "top1_slowdown"),
    # builders, runners and the offline batch
    **{n: ("spacefusion.runners", n) for n in _RUNNERS},
    # tuning a torch model's partitions; a tuned build
    "captured_partitions": ("spacefusion.frontend.tune", "captured_partitions"),
    "tune_partitions": ("spacefusion.frontend.tune", "tune_partitions"),
    "tuned": ("spacefusion.frontend.dynamo", "tuned"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'spacefusion.tuning' has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


__all__ = [*_parts.__all__, "tune", "tuning_hardware", *_LAZY]
