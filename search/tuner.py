"""The tuner: recommend on the CPU, measure on a runner, remember in the database.

Loop: enumerate and prune the search space (``search.space``); rank the
candidates with the analytical model until the learned (XGBoost) model has
records to learn from, then with the learned model; measure a batch (mostly
the best-ranked, some at random so the learned model sees the whole space);
store every record as it arrives; retrain; repeat until the trial budget is
spent.  The trial budget counts the key's records already in the database: a
tune that holds ``trials`` of them reuses its best at once, and one cut short
(killed between batches) measures only the rest when run again; with
``SPACEFUSION_NO_CACHE`` set, ``trials`` new candidates are measured.  Before each measured batch the learned
model's predictions are recorded, so its ranking quality is always reported
on records it was not trained on.  A result that failed because of the machine,
not the kernel (``MeasureResult.environmental``: no GPU visible), is neither
stored nor counted as a trial; a batch of nothing else ends the tune with the
reason in ``TuneSummary.unmeasured``, so a rerun on a working runner measures
those candidates.

The tuner lowers and measures only through the ``Builder`` and ``Runner``
interfaces of ``search.records``; the implementations (TVM, the GPU runtime)
live in ``spacefusion.runners``, so this layer never imports them.

``tune`` is ``search.tuning.tune_with`` with the default parts (``DefaultCostModel``, ``ExploreExploit``,
``default_callbacks``): a research script that swaps one calls ``tune_with`` (docs/tuning.md).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from schedulers.hardware import CPU_STAND_IN, HardwareModel, choose_hardware, local_device
from search.database import TuningDatabase
from search.records import Builder, Runner
from search.tuning import (
    MIN_RECORDS_TO_LEARN,
    DefaultCostModel,
    ExploreExploit,
    TuneSummary,
    TuningContext,
    default_callbacks,
    summary_dict,
    tune_with,
)
from search.tuning.loop import builder_of
from search.tuning.loop import tuning_flags as _flags  # noqa: F401  (the key's flags: experiments and tests)
from smg.ir import SMG

__all__ = ["MIN_RECORDS_TO_LEARN", "TuneSummary", "summary_dict", "tune", "tuning_hardware"]

log = logging.getLogger("spacefusion")


def tuning_hardware(target: str, hw: HardwareModel | None = None) -> HardwareModel:
    """The model a tune of ``target`` searches with and files its records under: ``hw`` where given; for
    llvm, ``CPU_STAND_IN`` (the CPU has no model); for CUDA, the preset of the GPU in hand, else
    ``DEFAULT_GPU``, logged (a tune whose runner measures elsewhere, offline or on a cluster, should name
    the machine)."""
    if hw is not None:
        return hw
    if target.startswith("llvm"):
        return CPU_STAND_IN
    choice = choose_hardware(None, local_device())
    if choice.defaulted:
        log.warning("tuning %s for the %s: %s", target, choice.model.name, choice.why)
    return choice.model


def tune(smg: SMG, runner: Runner, *, hw: HardwareModel | None = None, target: str = "cuda:sm_90a",
         db: TuningDatabase | str | Path | None = None, trials: int = 64, batch: int = 16, explore: float = 0.25,
         seed: int = 0, workers: int = 2, progress: bool = True, recompute: bool = False,
         max_step: int | None = None, fast_math: bool = False, use_prior: bool = True,
         builder: Builder | None = None, inputs_from: SMG | None = None) -> TuneSummary:
    """Find a fast schedule of ``smg`` on ``runner``; see the module docstring.  ``fast_math`` lets
    tensor-core candidates compute tanh and logistics on tanh.approx (``Schedule.fast_math``); it is
    part of the database key, so approximate and exact results never stand in for each other.
    ``use_prior`` breaks the analytical model's ties in the first round with the ranker learned from
    the committed measurements of ``hw`` (``search.prior.prior_for``).  ``hw``: the machine the records are
    filed under and the search ranks for; None: ``tuning_hardware`` (the GPU in hand's preset, the llvm
    stand-in for llvm, else the logged default).  ``builder`` lowers the
    candidates (prebuilt in ``workers`` processes) and its flags key the database; by default the runner's
    own (``runner.builder``), as every runner of ``spacefusion.runners`` has one.  ``inputs_from``: the graph
    whose outputs ``smg`` reads (a split's partial for its ``stats`` kernel), so every candidate is checked on
    inputs it computes (``MeasureInput.inputs_from``)."""
    builder = builder_of(runner, builder)
    context = TuningContext(smg, tuning_hardware(target, hw), target, fast_math, inputs_from)
    own_db = not isinstance(db, TuningDatabase)
    database = TuningDatabase(db if db is not None else Path(tempfile.mkdtemp()) / "tuning.db") if own_db else db
    try:
        return tune_with(context, runner, builder=builder, database=database,
                         cost_model=DefaultCostModel(use_prior=use_prior), strategy=ExploreExploit(explore, seed),
                         callbacks=default_callbacks(progress), trials=trials, batch=batch, workers=workers,
                         recompute=recompute, max_step=max_step)
    finally:
        if own_db:
            database.close()
