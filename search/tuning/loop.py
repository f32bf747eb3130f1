"""The tune loop as a composition of parts: ``tune_with(context, runner, builder=, database=, cost_model=,
strategy=, callbacks=)``.

Each batch: the cost model ranks the unmeasured candidates (ties by key), the strategy picks from the
ranking, the database grants the picks no concurrent tune claimed, the builder prebuilds and the runner
measures them, and the callbacks run in order (by default: store the records, refit the cost model on the
key's history, report).  What stays here is the bookkeeping every tune needs: the trial budget (which counts
the key's records already in the database), the claims, and results the machine, not the kernel, failed
(``MeasureResult.environmental``: neither stored nor counted).  ``search.tuner.tune`` is this loop with the
default parts.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from search.cost import estimate_us, simt_veto
from search.database import TuningDatabase, cache_enabled, claim_owner, key_parts, tuning_key
from search.records import Builder, MeasureInput, MeasureResult, Runner
from search.space import SearchSpace
from search.tuning.callback import MeasureCallback, MeasuredBatch, TuneState
from search.tuning.callbacks import default_callbacks
from search.tuning.context import TuningContext
from search.tuning.cost_model import CostModel
from search.tuning.cost_models import DefaultCostModel
from search.tuning.database import Database, check_database
from search.tuning.strategies import ExploreExploit
from search.tuning.strategy import SearchStrategy, checked_pick
from search.tuning.summary import TuneSummary


def tuning_flags(builder: Builder, fast_math: bool) -> tuple[str, ...]:
    """What besides the schedule decides a tuning result: the builder's flags, and fast_math's numerics."""
    return (*builder.flags, *(("fast_math",) if fast_math else ()))


def builder_of(runner: Runner, builder: Builder | None) -> Builder:
    """``builder``, else the runner's own (every runner of ``spacefusion.runners`` has one); TypeError if neither."""
    builder = builder if builder is not None else getattr(runner, "builder", None)
    if builder is None:
        raise TypeError(f"tune needs a builder: pass builder=..., or a runner with a .builder "
                        f"({type(runner).__name__} has none)")
    return builder


def _part(obj: object, kind: type, role: str, what: str) -> object:
    if not isinstance(obj, kind):
        raise TypeError(f"{role} must be a {kind.__module__.rsplit('.', 1)[0]}.{kind.__name__} ({what}); got "
                        f"{type(obj).__name__}")
    return obj


def tune_with(context: TuningContext, runner: Runner, *, builder: Builder | None = None,
              database: Database | None = None, cost_model: CostModel | None = None,
              strategy: SearchStrategy | None = None, callbacks: Sequence[MeasureCallback] | None = None,
              trials: int = 64, batch: int = 16, workers: int = 2, recompute: bool = False,
              max_step: int | None = None) -> TuneSummary:
    """Tune ``context`` on ``runner`` with the parts given, the defaults for the rest: the runner's builder,
    a database in a temporary directory (closed again), ``DefaultCostModel()``, ``ExploreExploit()``,
    ``default_callbacks()``.  ``trials`` counts the key's records already in the database (see
    ``search.tuner``); ``batch`` candidates are measured at a time, prebuilt in ``workers`` processes;
    ``recompute`` and ``max_step`` shape the space (``search.space.SearchSpace``).  A part of the wrong kind is
    a TypeError naming the interface, before anything is measured."""
    if not isinstance(context, TuningContext):
        raise TypeError(f"context must be a search.tuning.TuningContext, got {type(context).__name__}")
    if batch < 1 or trials < 0:
        raise ValueError(f"a tune measures batches of at least 1 of at most trials >= 0 candidates; got "
                         f"batch={batch}, trials={trials}")
    t_start = time.perf_counter()
    builder = builder_of(runner, builder)
    cost_model = DefaultCostModel() if cost_model is None else cost_model
    _part(cost_model, CostModel, "cost_model", "predict, update, save, load")
    strategy = ExploreExploit() if strategy is None else strategy
    _part(strategy, SearchStrategy, "strategy", "pick")
    callbacks = default_callbacks() if callbacks is None else list(callbacks)
    for cb in callbacks:
        _part(cb, MeasureCallback, "each callback", "after_batch, finish")
    own = database is None
    db = TuningDatabase(Path(tempfile.mkdtemp()) / "tuning.db") if own else check_database(database)
    try:
        return _run(context, runner, builder, db, cost_model, strategy, callbacks, trials, batch, workers,
                    recompute, max_step, t_start)
    finally:
        if own:
            db.close()  # type: ignore[union-attr]


def _run(ctx: TuningContext, runner: Runner, builder: Builder, db: Database, cost_model: CostModel,
         strategy: SearchStrategy, callbacks: list[MeasureCallback], trials: int, batch: int, workers: int,
         recompute: bool, max_step: int | None, t_start: float) -> TuneSummary:
    flags = tuning_flags(builder, ctx.fast_math)
    key = tuning_key(ctx.smg, ctx.hw, ctx.target, flags)
    summary = TuneSummary(ctx.smg.name, key, None, None)
    if cache_enabled():
        cached, have = db.best(key), len(db.measured_keys(key))  # an environmental failure is no trial
        if cached is not None and have >= trials:
            summary.best, summary.best_result = cached
            summary.from_cache = True
            summary.wall_s = time.perf_counter() - t_start
            return summary
        trials -= have  # a tune cut short (killed, or asked for fewer before) resumes: its records count
    space = SearchSpace(ctx.smg, ctx.hw, recompute=recompute, max_step=max_step, cuda=ctx.cuda,
                        fast_math=ctx.fast_math)
    cands = space.candidates(skip_simt=simt_veto(ctx.hw))
    summary.space = space.report
    measured = db.measured_keys(key)
    remaining = {s.key: s for s in cands if s.key not in measured}
    history = db.records(key)
    if history:
        cost_model.update(ctx, [s for s, _ in history], [r for _, r in history])
    state = TuneState(ctx, key, key_parts(ctx.smg, ctx.hw, ctx.target, flags), db, cost_model, summary, t_start,
                      min((r.median_us for _, r in history), default=math.inf), min(trials, len(remaining)))
    done, owner = 0, claim_owner()  # a claim outlives an exception only as long as this process
    while done < trials and remaining:
        inputs = _next_batch(state, strategy, remaining, min(batch, trials - done), owner)
        if not inputs:
            continue
        predicted = tuple(cost_model.predict(ctx, [i.schedule for i in inputs])) if cost_model.fitted else None
        summary.built += len(inputs)
        builder.prebuild(inputs, workers)
        measured_batch = _measured(state, inputs, runner.measure(inputs), predicted, remaining, owner)
        if measured_batch is None:
            break
        done += len(measured_batch.inputs)
        for cb in callbacks:
            cb.after_batch(state, measured_batch)
    for cb in callbacks:
        cb.finish(state)
    if not db.readonly:
        db.release(key, owner)
    best = db.best(key)
    if best is not None:
        summary.best, summary.best_result = best
        if ctx.cuda:  # the analytical model is a GPU's: it predicts nothing about a CPU
            summary.predicted_us = estimate_us(best[0], ctx.hw)
    summary.wall_s = time.perf_counter() - t_start
    return summary


def _next_batch(state: TuneState, strategy: SearchStrategy, remaining: dict, n: int, owner: str) -> list[MeasureInput]:
    """Rank the unmeasured candidates with the cost model (ties by key), let the strategy pick up to ``n``,
    and keep the picks the database grants this tune (all of a read-only one's); the rest of ``remaining``
    another tune claimed is dropped from it."""
    ctx, db = state.context, state.database
    keys = list(remaining)
    score = dict(zip(keys, state.cost_model.predict(ctx, [remaining[k] for k in keys])))
    order = sorted(keys, key=lambda k: (score[k], k))
    n = min(n, len(order))
    pick = checked_pick(strategy, strategy.pick(ctx, order, n, db.measured_keys(state.key), state.cost_model),
                        order, n)
    inputs = [MeasureInput(remaining[k], ctx.target, ctx.inputs_from) for k in pick]
    if db.readonly:
        return inputs
    granted = set(db.claim(state.key, [i.key for i in inputs], owner))  # another tune measures what it claimed
    for i in inputs:
        if i.key not in granted:
            remaining.pop(i.key, None)
    return [i for i in inputs if i.key in granted]


def _measured(state: TuneState, inputs: list[MeasureInput], results: list[MeasureResult],
              predicted: tuple[float, ...] | None, remaining: dict, owner: str) -> MeasuredBatch | None:
    """The batch as the callbacks see it, its environmental failures left out (and out of ``remaining``: a
    rerun tries them); None where the tune must stop (a result pending elsewhere, or nothing but the machine
    failing).  Counts the batch in the summary and keeps the best median."""
    summary, db = state.summary, state.database
    pending = [r for r in results if dict(r.meta).get("pending")]
    if pending:
        summary.pending = pending[0].error
        return None
    unusable = [r for r in results if r.environmental]  # the machine failed, not the kernel: not recorded
    if unusable:
        summary.unmeasured = unusable[0].error
        if not db.readonly:
            db.release(state.key, owner)  # their claims go too: another tune (or a rerun) may measure them
        if len(unusable) == len(results):
            return None  # the next batch would meet the same machine
        for r in unusable:
            remaining.pop(r.schedule_key, None)
        keep = [not r.environmental for r in results]
        inputs = [i for i, k in zip(inputs, keep) if k]
        results = [r for r, k in zip(results, keep) if k]
        if predicted is not None:
            predicted = tuple(p for p, k in zip(predicted, keep) if k)
    for inp, res in zip(inputs, results):
        remaining.pop(inp.key, None)
        summary.measured += 1
        summary.failed += 0 if res.ok else 1
        if res.median_us < state.best_us:
            state.best_us = res.median_us
            summary.time_to_best_s = time.perf_counter() - state.t_start
    return MeasuredBatch(tuple(inputs), tuple(results), predicted)
