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
"""

from __future__ import annotations

import logging
import math
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from schedulers.hardware import CPU_STAND_IN, HardwareModel, choose_hardware, local_device
from schedulers.schedule import Schedule
from search.cost import estimate_us, simt_veto
from search.database import TuningDatabase, cache_enabled, claim_owner, key_parts, tuning_key
from search.learned import LearnedCostModel
from search.metrics import spearman, top1_slowdown
from search.prior import first_round_order, prior_for
from search.records import Builder, MeasureInput, MeasureResult, Runner
from search.space import SearchSpace, SpaceReport
from smg.ir import SMG

MIN_RECORDS_TO_LEARN = 8


@dataclass
class TuneSummary:
    """What a tune found, how long it took, and how well the cost models ranked."""

    workload: str
    key: str
    best: Schedule | None
    best_result: MeasureResult | None
    from_cache: bool = False
    pending: str | None = None
    #: why candidates could not be measured on this runner at all (the environment, not the kernels)
    unmeasured: str | None = None
    space: SpaceReport | None = None
    built: int = 0
    measured: int = 0
    failed: int = 0
    wall_s: float = 0.0
    time_to_best_s: float = 0.0
    predicted_us: float | None = None
    analytical: dict[str, float] = field(default_factory=dict)
    learned: dict[str, float] = field(default_factory=dict)

    @property
    def best_us(self) -> float | None:
        return None if self.best_result is None else self.best_result.median_us

    def __str__(self) -> str:
        lines = [f"tune {self.workload}  key={self.key[:12]}"]
        if self.from_cache:
            lines.append("  cached best reused (set SPACEFUSION_NO_CACHE=1 to tune again)")
        if self.space is not None:
            lines.append(f"  {self.space}")
        lines.append(f"  built {self.built}, measured {self.measured} ({self.failed} failed), "
                     f"wall {self.wall_s:.1f} s, best found after {self.time_to_best_s:.1f} s")
        if self.pending:
            lines.append(f"  pending: {self.pending}")
        if self.unmeasured:
            lines.append(f"  not measured (nothing recorded for them): {self.unmeasured}")
        if self.best is not None and self.best_result is not None:
            lines.append(f"  best: {self.best_us:.1f} us  tiles {self.best.tiles} thread dim {self.best.thread_dim} "
                         f"serial {self.best.serial} step {self.best.step}")
            if self.predicted_us is not None:
                lines.append(f"  analytical model predicted {self.predicted_us:.1f} us for it "
                             f"({self.predicted_us / self.best_us:.2f}x)")
        for name, q in (("analytical", self.analytical), ("learned", self.learned)):
            if q:
                lines.append(f"  {name} model on unseen records: spearman {q['spearman']:.3f}, "
                             f"top-1 slowdown {q['top1_slowdown']:.2f}x over {int(q['n'])} records")
        return "\n".join(lines)


class _Progress:
    """A one-line progress bar on stderr (no dependency)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.done = max(total, 1), enabled, 0

    def update(self, n: int, best: float) -> None:
        self.done += n
        if not self.enabled:
            return
        width = 30
        fill = int(width * min(self.done, self.total) / self.total)
        best_s = f"{best:.1f} us" if math.isfinite(best) else "-"
        sys.stderr.write(f"\r  [{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} measured, best {best_s}")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def _quality(pred: list[float], measured: list[float]) -> dict[str, float]:
    ok = [(p, m) for p, m in zip(pred, measured) if math.isfinite(m)]
    if len(ok) < 2:
        return {}
    p, m = zip(*ok)
    return {"spearman": spearman(np.array(p), np.array(m)), "top1_slowdown": top1_slowdown(np.array(p), np.array(m)),
            "n": float(len(ok))}


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
    builder = builder if builder is not None else getattr(runner, "builder", None)
    if builder is None:
        raise TypeError(f"tune needs a builder: pass builder=..., or a runner with a .builder "
                        f"({type(runner).__name__} has none)")
    t_start = time.perf_counter()
    hw = tuning_hardware(target, hw)
    own_db = not isinstance(db, TuningDatabase)
    database = TuningDatabase(db if db is not None else Path(tempfile.mkdtemp()) / "tuning.db") if own_db else db
    try:
        return _tune(smg, runner, builder, hw, target, database, trials, batch, explore, seed, workers, progress,
                     recompute, max_step, t_start, fast_math, use_prior, inputs_from)
    finally:
        if own_db:
            database.close()


def _flags(builder: Builder, fast_math: bool) -> tuple[str, ...]:
    """What besides the schedule decides a tuning result: the builder's flags, and fast_math's numerics."""
    return (*builder.flags, *(("fast_math",) if fast_math else ()))


def _tune(smg: SMG, runner: Runner, builder: Builder, hw: HardwareModel, target: str, db: TuningDatabase,
          trials: int, batch: int, explore: float, seed: int, workers: int, progress: bool, recompute: bool,
          max_step: int | None, t_start: float, fast_math: bool = False, use_prior: bool = True,
          inputs_from: SMG | None = None) -> TuneSummary:
    flags = _flags(builder, fast_math)
    key = tuning_key(smg, hw, target, flags)
    parts = key_parts(smg, hw, target, flags)
    summary = TuneSummary(smg.name, key, None, None)
    if cache_enabled():
        cached, have = db.best(key), len(db.measured_keys(key))  # an environmental failure is no trial
        if cached is not None and have >= trials:
            summary.best, summary.best_result = cached
            summary.from_cache = True
            summary.wall_s = time.perf_counter() - t_start
            return summary
        trials -= have  # a tune cut short (killed, or asked for fewer before) resumes: its records count
    space = SearchSpace(smg, hw, recompute=recompute, max_step=max_step, cuda=not target.startswith("llvm"),
                        fast_math=fast_math)
    cands = space.candidates(skip_simt=simt_veto(hw))
    summary.space = space.report
    measured = db.measured_keys(key)
    remaining = {s.key: s for s in cands if s.key not in measured}
    est = {k: estimate_us(s, hw) for k, s in remaining.items()}
    model = LearnedCostModel(hw)
    prior = prior_for(hw).model if use_prior and target.startswith("cuda") else None  # learned from GPU kernels
    history = [(s, r) for s, r in db.records(key)]
    if sum(r.ok for _, r in history) >= MIN_RECORDS_TO_LEARN:
        model.fit([s for s, _ in history], [r for _, r in history], [key] * len(history))
    bar = _Progress(min(trials, len(remaining)), progress)
    held = {"analytical": ([], []), "learned": ([], [])}
    best_us = min((r.median_us for _, r in history), default=math.inf)
    done, owner = 0, claim_owner()  # a claim outlives an exception only as long as this process
    while done < trials and remaining:
        keys = list(remaining)
        if model.is_trained:
            score = dict(zip(keys, model.predict([remaining[k] for k in keys])))
            order = sorted(keys, key=lambda k: (score[k], k))
        else:  # the analytical model, its ties broken by the prior learned on other workloads
            order = first_round_order(remaining, est, prior)
        n = min(batch, trials - done, len(order))
        n_exploit = max(1, math.ceil(n * (1 - explore))) if model.is_trained or n < 4 else n - n // 4
        pick = order[:n_exploit]
        rest = order[n_exploit:]
        # exploration draws depend only on (seed, records so far): re-running a tune picks the same batch
        rng = np.random.default_rng([seed, len(db.measured_keys(key))])
        if n - len(pick) > 0 and rest:
            pick += list(rng.choice(rest, size=min(n - len(pick), len(rest)), replace=False))
        inputs = [MeasureInput(remaining[k], target, inputs_from) for k in pick]
        if not db.readonly:  # another tune on this database measures what it claimed: not here as well
            granted = set(db.claim(key, [i.key for i in inputs], owner))
            for i in inputs:
                if i.key not in granted:
                    remaining.pop(i.key, None)
            inputs = [i for i in inputs if i.key in granted]
            if not inputs:
                continue
        pred_learned = list(model.predict([i.schedule for i in inputs])) if model.is_trained else None
        summary.built += len(inputs)
        builder.prebuild(inputs, workers)
        results = runner.measure(inputs)
        pending = [r for r in results if dict(r.meta).get("pending")]
        if pending:
            summary.pending = pending[0].error
            break
        unusable = [r for r in results if r.environmental]  # the machine failed, not the kernel: not recorded
        if unusable:
            summary.unmeasured = unusable[0].error
            if not db.readonly:
                db.release(key, owner)  # their claims go too: another tune (or a rerun) may measure them
            if len(unusable) == len(results):
                break  # the next batch would meet the same machine
            for r in unusable:  # not again in this tune; a rerun tries them
                remaining.pop(r.schedule_key, None)
            keep = [not r.environmental for r in results]
            inputs = [i for i, k in zip(inputs, keep) if k]
            results = [r for r, k in zip(results, keep) if k]
            if pred_learned is not None:
                pred_learned = [p for p, k in zip(pred_learned, keep) if k]
        for inp, res in zip(inputs, results):
            db.add(key, inp.schedule, res, parts)
            remaining.pop(inp.key, None)
            summary.measured += 1
            summary.failed += 0 if res.ok else 1
            if res.median_us < best_us:
                best_us = res.median_us
                summary.time_to_best_s = time.perf_counter() - t_start
        meds = [r.median_us for r in results]
        held["analytical"][0].extend(est[i.key] for i in inputs)
        held["analytical"][1].extend(meds)
        if pred_learned is not None:
            held["learned"][0].extend(pred_learned)
            held["learned"][1].extend(meds)
        done += len(inputs)
        bar.update(len(inputs), best_us)
        history = db.records(key)
        if sum(r.ok for _, r in history) >= MIN_RECORDS_TO_LEARN:
            model.fit([s for s, _ in history], [r for _, r in history], [key] * len(history))
    bar.close()
    if not db.readonly:
        db.release(key, owner)
    best = db.best(key)
    if best is not None:
        summary.best, summary.best_result = best
        if not target.startswith("llvm"):  # the analytical model is a GPU's: it predicts nothing about a CPU
            summary.predicted_us = estimate_us(best[0], hw)
    summary.analytical = _quality(*held["analytical"])
    summary.learned = _quality(*held["learned"])
    summary.wall_s = time.perf_counter() - t_start
    return summary


def summary_dict(s: TuneSummary) -> dict[str, Any]:
    """Plain data for result files."""
    return {
        "workload": s.workload, "key": s.key, "from_cache": s.from_cache, "pending": s.pending,
        "unmeasured": s.unmeasured,
        "space": None if s.space is None else vars(s.space), "built": s.built, "measured": s.measured,
        "failed": s.failed, "wall_s": s.wall_s, "time_to_best_s": s.time_to_best_s, "best_us": s.best_us,
        "best_schedule": None if s.best is None else s.best.to_dict(), "predicted_us": s.predicted_us,
        "analytical": s.analytical, "learned": s.learned,
    }
