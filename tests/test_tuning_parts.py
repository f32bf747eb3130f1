"""The tuner as parts (issue 60): ``tune`` still measures, in the same order, the candidates it measured before it
was taken apart (golden runs recorded at ec6c3e1), and ``tune_with`` honours a swapped cost model, strategy,
database and callback list, and refuses a part of the wrong kind with a sentence naming the interface."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence, Set
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from schedulers.hardware import CPU_STAND_IN, H100
from schedulers.schedule import Schedule
from search.cost import estimate_us
from search.database import TuningDatabase
from search.prior import first_round_order, prior_for
from search.records import MeasureResult
from search.space import SearchSpace
from search.tuning import (
    AnalyticalCostModel,
    CostModel,
    Database,
    DefaultCostModel,
    ExploreExploit,
    MeasureCallback,
    MeasuredBatch,
    PriorCostModel,
    SearchStrategy,
    TuneState,
    TuningContext,
    XGBoostCostModel,
    default_callbacks,
    tune_with,
)
from smg import patterns as P
from tests.tuner_golden import BATCH, CASES, GOLDEN, SEED, TRIALS, KeyedRunner, NoBuilder, latency_of, run_case

LN = P.layernorm(32, 256)
CTX = TuningContext(LN, CPU_STAND_IN, "llvm")


@pytest.fixture(autouse=True)
def _cache_on(monkeypatch) -> None:
    monkeypatch.delenv("SPACEFUSION_NO_CACHE", raising=False)


# -- tune before and after -------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_tune_measures_what_it_measured_before_it_had_parts(case: str, tmp_path: Path) -> None:
    """Same batches, same order, same database records, same counts and best as the monolithic tuner of ec6c3e1
    (``tests/tuner_golden.py``); the XGBoost model is fitted in the second batch and picks the third, and the
    GPU case's first round has its ties broken by the prior, so each default part is on the path."""
    want = json.loads(GOLDEN.read_text())[case]
    got = run_case(case, tmp_path / "t.db")
    assert got["key"] == want["key"], "the tuning key changed: the space or keys changed, not only the tuner"
    assert got["batches"] == want["batches"]
    assert got == want
    assert want["learned_n"], "the golden run never scored a fitted learned model: it would not cover the refit"


def test_tune_with_the_default_parts_spelled_out_is_tune(tmp_path: Path) -> None:
    want = json.loads(GOLDEN.read_text())["layernorm_llvm"]
    runner = KeyedRunner()
    with TuningDatabase(tmp_path / "t.db") as db:
        s = tune_with(TuningContext(*CASES["layernorm_llvm"][:1], H100, "llvm"), runner, builder=NoBuilder(),
                      database=db, cost_model=DefaultCostModel(), strategy=ExploreExploit(0.25, SEED),
                      callbacks=default_callbacks(progress=False), trials=TRIALS, batch=BATCH)
        assert [[sch.key, res.median_us if res.ok else None, res.error] for sch, res in db.records(s.key)] \
            == want["records"]
    assert runner.batches == want["batches"] and s.measured == want["measured"]


# -- swapping a part -------------------------------------------------------------------------------


class _Worst(SearchStrategy):
    """Measures the worst-ranked candidates first, and remembers what it was handed."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, bool]] = []
        self.picked: list[list[str]] = []

    def pick(self, context: TuningContext, ranked: Sequence[str], n: int, measured: Set[str],
             cost_model: CostModel) -> list[str]:
        self.calls.append((len(ranked), len(measured), cost_model.fitted))
        self.picked.append(list(ranked[-n:][::-1]))
        return self.picked[-1]


def test_a_custom_strategy_picks_every_batch(tmp_path: Path) -> None:
    strategy, runner = _Worst(), KeyedRunner()
    s = tune_with(CTX, runner, builder=NoBuilder(), strategy=strategy,
                  callbacks=default_callbacks(progress=False), trials=12, batch=4)
    assert runner.batches == strategy.picked and len(runner.batches) == 3 and s.measured == 12
    cands = SearchSpace(LN, CPU_STAND_IN, cuda=False).candidates()
    last = sorted(cands, key=lambda c: (estimate_us(c, CPU_STAND_IN), c.key))[-4:][::-1]
    assert runner.batches[0] == [c.key for c in last]  # the analytical ranking's tail, worst first
    assert [c[1] for c in strategy.calls] == [0, 4, 8]  # what is measured, as the database says
    assert [c[0] for c in strategy.calls] == [len(cands), len(cands) - 4, len(cands) - 8]


class _Seen(MeasureCallback):
    def __init__(self) -> None:
        self.batches: list[MeasuredBatch] = []
        self.records_then: list[int] = []
        self.finished = 0

    def after_batch(self, state: TuneState, batch: MeasuredBatch) -> None:
        self.batches.append(batch)
        self.records_then.append(len(state.database.records(state.key)))

    def finish(self, state: TuneState) -> None:
        self.finished += 1


def test_custom_callbacks_run_in_order_and_replace_the_default_list(tmp_path: Path) -> None:
    """A list without ``AddToDatabase`` stores nothing (so no best); the callback sees each batch as measured."""
    seen, runner = _Seen(), KeyedRunner()
    with TuningDatabase(tmp_path / "t.db") as db:
        s = tune_with(CTX, runner, builder=NoBuilder(), database=db, callbacks=[seen], trials=8, batch=4)
        assert db.records(s.key) == [] and s.best is None
    assert [[i.key for i in b.inputs] for b in seen.batches] == runner.batches
    assert [r.median_us for b in seen.batches for r in b.results if r.ok] == \
        [latency_of(k) for b in runner.batches for k in b if k[-1] not in "07"]
    assert seen.records_then == [0, 0] and seen.finished == 1
    assert all(b.predicted is None for b in seen.batches)  # the cost model was never fitted

    seen2 = _Seen()
    with TuningDatabase(tmp_path / "u.db") as db:
        tune_with(CTX, KeyedRunner(), builder=NoBuilder(), database=db, trials=8, batch=4,
                  callbacks=[*default_callbacks(progress=False), seen2])
    assert seen2.records_then == [4, 8]  # after AddToDatabase, in list order


class _ByKey(CostModel):
    """Ranks by the schedule key's reverse (a stand-in for a research model); counts its updates."""

    def __init__(self) -> None:
        self.updates: list[int] = []

    def predict(self, context: TuningContext, schedules: Sequence[Schedule]) -> np.ndarray:
        return np.array([-int(s.key[:8], 16) for s in schedules], dtype=np.float64)

    def update(self, context: TuningContext, schedules: Sequence[Schedule],
               results: Sequence[MeasureResult]) -> None:
        self.updates.append(len(results))

    def save(self, path: str | Path) -> None:
        Path(path).write_text("{}")

    @classmethod
    def load(cls, path: str | Path) -> _ByKey:
        return cls()


def test_a_custom_cost_model_ranks_and_is_refit(tmp_path: Path) -> None:
    model, runner = _ByKey(), KeyedRunner()
    tune_with(CTX, runner, builder=NoBuilder(), cost_model=model, strategy=ExploreExploit(explore=0.0),
              callbacks=default_callbacks(progress=False), trials=8, batch=4)
    keys = sorted((c.key for c in SearchSpace(LN, CPU_STAND_IN, cuda=False).candidates()),
                  key=lambda k: int(k[:8], 16), reverse=True)
    assert runner.batches[0][:3] == keys[:3]  # an unfitted model: n - n // 4 exploit, one drawn
    assert model.updates == [4, 8]  # UpdateCostModel hands it the key's whole history after each batch


class _MemoryDatabase:
    """A database in a dict: what a script might swap in (nothing on disk, no claims)."""

    readonly = False

    def __init__(self) -> None:
        self.rows: dict[str, list[tuple[Schedule, MeasureResult]]] = {}

    def add(self, key: str, schedule: Schedule, result: MeasureResult, parts: dict[str, Any] | None = None) -> None:
        self.rows.setdefault(key, []).append((schedule, result))

    def records(self, key: str) -> list[tuple[Schedule, MeasureResult]]:
        return list(self.rows.get(key, []))

    def best(self, key: str) -> tuple[Schedule, MeasureResult] | None:
        ok = [(s, r) for s, r in self.records(key) if r.ok]
        return min(ok, key=lambda sr: sr[1].median_us) if ok else None

    def measured_keys(self, key: str) -> set[str]:
        return {s.key for s, _ in self.records(key)}

    def claim(self, key: str, schedule_keys: Iterable[str], owner: str, ttl_s: float = 0.0) -> list[str]:
        return list(schedule_keys)

    def release(self, key: str, owner: str) -> None:
        pass


def test_a_database_of_ones_own_holds_the_records_and_the_best() -> None:
    db = _MemoryDatabase()
    assert isinstance(db, Database)
    s = tune_with(CTX, KeyedRunner(), builder=NoBuilder(), database=db,  # type: ignore[arg-type]
                  callbacks=default_callbacks(progress=False), trials=8, batch=4)
    assert len(db.records(s.key)) == 8 and s.best_result is not None
    assert s.best_us == min(r.median_us for _, r in db.records(s.key))
    again = tune_with(CTX, KeyedRunner(), builder=NoBuilder(), database=db, trials=8)  # type: ignore[arg-type]
    assert again.from_cache and again.best.key == s.best.key


def test_tuning_database_implements_the_interface(tmp_path: Path) -> None:
    with TuningDatabase(tmp_path / "t.db") as db:
        assert isinstance(db, Database)


# -- wrong parts are refused -----------------------------------------------------------------------


class _Stray(SearchStrategy):
    def __init__(self, out: list[str]) -> None:
        self.out = out

    def pick(self, context: TuningContext, ranked: Sequence[str], n: int, measured: Set[str],
             cost_model: CostModel) -> list[str]:
        return [ranked[0] if k == "first" else k for k in self.out]


@pytest.mark.parametrize("kw, match", [
    ({"cost_model": object()}, r"cost_model must be a search\.tuning\.CostModel \(predict, update, save, load\)"),
    ({"strategy": lambda *a: []}, r"strategy must be a search\.tuning\.SearchStrategy \(pick\); got function"),
    ({"callbacks": [print]}, r"each callback must be a search\.tuning\.MeasureCallback"),
    ({"database": object()}, r"object is not a tuning database .*lacks readonly, add, records, best"),
])
def test_a_part_of_the_wrong_kind_is_a_type_error(kw: dict[str, Any], match: str) -> None:
    runner = KeyedRunner()
    with pytest.raises(TypeError, match=match):
        tune_with(CTX, runner, builder=NoBuilder(), trials=4, **kw)
    assert runner.batches == []


@pytest.mark.parametrize("out, match", [
    ([], "picked no candidate"),
    (["first", "first"], "picked a candidate twice"),
    (["first", "not-a-key"], "picked 1 key.*not among the unmeasured candidates"),
    (["first"] * 5, "picked 5 candidates; the batch holds at most 4"),
])
def test_a_strategy_that_picks_wrongly_is_named(out: list[str], match: str) -> None:
    runner = KeyedRunner()
    with pytest.raises(ValueError, match=f"search strategy _Stray {match}"):
        tune_with(CTX, runner, builder=NoBuilder(), strategy=_Stray(out), trials=4, batch=4)
    assert runner.batches == []


def test_a_context_and_a_cost_model_are_checked_when_made() -> None:
    with pytest.raises(TypeError, match="TuningContext.hw must be a HardwareModel, got str"):
        TuningContext(LN, "h100", "llvm")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="context must be a search.tuning.TuningContext"):
        tune_with(LN, KeyedRunner(), builder=NoBuilder())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="abstract method"):
        type("NoSave", (CostModel,), {"predict": lambda *a: None, "update": lambda *a: None})()
    with pytest.raises(ValueError, match="explore is the fraction"):
        ExploreExploit(explore=1.5)


# -- the cost models as implementations ------------------------------------------------------------


def test_the_default_cost_model_ranks_as_the_first_round_did_then_as_xgboost() -> None:
    g, _ = CASES["gemm_sigmoid_cuda"]
    ctx = TuningContext(g, H100, "cuda:sm_90a")
    cands = SearchSpace(g, H100).candidates()
    model = DefaultCostModel()
    score = model.predict(ctx, cands)
    order = [c.key for c in sorted(cands, key=lambda c: score[cands.index(c)])]
    est = {c.key: estimate_us(c, H100) for c in cands}
    assert order == first_round_order({c.key: c for c in cands}, est, prior_for(H100).model)
    assert order != first_round_order({c.key: c for c in cands}, est, None)  # the prior broke a tie
    results = [MeasureResult(c.key, "cuda:sm_90a", (latency_of(c.key),), 0.0) for c in cands[:12]]
    model.update(ctx, cands[:7], results[:7])
    assert not model.fitted  # fewer than MIN_RECORDS_TO_LEARN
    model.update(ctx, cands[:12], results)
    assert model.fitted and np.array_equal(model.predict(ctx, cands), model.learned.predict(ctx, cands))


def test_cost_models_save_and_load(tmp_path: Path) -> None:
    cands = SearchSpace(LN, CPU_STAND_IN, cuda=False).candidates()[:12]
    xgb = XGBoostCostModel()
    xgb.update(CTX, cands, [MeasureResult(c.key, "llvm", (latency_of(c.key),), 0.0) for c in cands])
    xgb.save(tmp_path / "m.json")
    back = XGBoostCostModel.load(tmp_path / "m.json")
    assert back.fitted and np.array_equal(back.predict(CTX, cands), xgb.predict(CTX, cands))
    assert np.array_equal(DefaultCostModel.load(tmp_path / "m.json").predict(CTX, cands), xgb.predict(CTX, cands))
    AnalyticalCostModel().save(tmp_path / "a.json")
    assert np.array_equal(AnalyticalCostModel.load(tmp_path / "a.json").predict(CTX, cands),
                          [estimate_us(c, CPU_STAND_IN) for c in cands])
    with pytest.raises(ValueError, match="is not an analytical cost model"):
        AnalyticalCostModel.load(tmp_path / "m.json")
    with pytest.raises(RuntimeError, match="not fitted"):
        XGBoostCostModel().predict(CTX, cands)
    PriorCostModel.load(tmp_path / "m.json").save(tmp_path / "p.json")
    assert (tmp_path / "p.meta.json").exists()


def test_the_prior_ranks_gpu_candidates_only() -> None:
    g, _ = CASES["gemm_sigmoid_cuda"]
    cands = SearchSpace(g, H100).candidates()[:5]
    prior = PriorCostModel()
    assert np.array_equal(prior.predict(TuningContext(g, H100, "cuda:sm_90a"), cands),
                          prior_for(H100).model.predict(cands))
    with pytest.raises(RuntimeError, match="no prior ranks llvm candidates"):
        prior.predict(TuningContext(g, H100, "llvm"), cands)


def test_the_face_offers_tuning() -> None:
    """``spacefusion.tuning`` is where a script finds the tuner and its parts (``__all__`` all importable)."""
    import search.tuning
    from spacefusion import tuning as face

    assert face.tune_with is tune_with and face.CostModel is CostModel and face.Database is Database
    assert set(search.tuning.__all__) <= set(face.__all__) and all(hasattr(face, n) for n in face.__all__)


def test_the_docs_example_swaps_a_strategy_and_adds_a_callback(capsys) -> None:
    """The block of docs/tuning.md runs as written (TVM llvm, 8 kernels) and does what it says."""
    from tests.mdblocks import ROOT, block_after

    code = block_after(ROOT / "docs" / "tuning.md", "To swap one part, pass it and keep the rest")
    scope: dict[str, Any] = {}
    exec(compile(code, "docs/tuning.md", "exec"), scope)
    assert capsys.readouterr().out.splitlines() == ["4 measured, 4 stored", "4 measured, 8 stored"]
    assert scope["summary"].measured == 8 and scope["summary"].best_result.ok
