"""The auto-scheduler on the CPU: search space and pruning, the analytical model, and the whole
tune loop on TVM llvm (database reuse, interruption, corruption, the cache switch, the CLI)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from schedulers.codes import known
from schedulers.hardware import H100
from schedulers.resources import block_resources, shared_bytes
from schedulers.schedule import make_schedule
from search.cost import estimate
from search.database import DatabaseError, TuningDatabase, tuning_key
from search.records import MeasureResult
from search.space import SearchSpace
from search.tuner import tune
from smg import patterns as P
from smg.workloads import gemm, mha
from spacefusion.cli import main
from spacefusion.lower.build import COMPILE_FLAGS
from spacefusion.runners import LLVMRunner, TVMBuilder

# -- search space ----------------------------------------------------------------------------------


def test_space_counts_and_pruning_reasons() -> None:
    sp = SearchSpace(mha(4, 4, 256, 256, 64), H100)
    cands = sp.candidates()
    rep = sp.report
    assert rep.total >= rep.valid >= rep.fits == len(cands) > 0
    assert rep.fits < rep.total  # big steps/tiles overflow shared memory or registers
    assert {c.split(".")[0] for c in rep.pruned} <= {"resource", "threads", "warp_tile"}, rep.pruned
    assert all(known(c) for c in rep.pruned)  # every refusal counted by its code (schedulers.codes)
    assert "points" in sp.describe() and "tensor-core warp tiles" in sp.describe()
    tc = [s for s in cands if s.tensor_cores]  # fp16 attention: warp-tile variants are searched too
    assert tc and {s.stages for s in tc} == {1, 2, 3} and all(s.step % 16 == 0 for s in tc)
    for s in cands:  # everything kept fits the H100
        r = block_resources(s)
        assert r.threads <= H100.max_threads_per_block
        assert shared_bytes(s, align=128) <= H100.smem_per_block_bytes  # dynamic above 48 KB
    assert len({s.key for s in cands}) == len(cands)


def test_space_varies_every_knob() -> None:
    cands = SearchSpace(gemm(64, 64, 64), H100).candidates()
    assert len({tuple(sorted(s.tiles.items())) for s in cands}) > 5
    assert len({s.step for s in cands}) > 2
    assert len({s.thread_dim for s in cands}) == 2
    assert len({tuple(s.memory) for s in cands}) > 1  # staging on and off


def test_small_hardware_prunes_more() -> None:
    small = dataclasses.replace(H100, name="small", smem_static_per_block_bytes=4096, smem_per_block_bytes=8192,
                                smem_per_sm_bytes=8192)
    g = mha(2, 2, 128, 128, 64)
    assert len(SearchSpace(g, small).candidates()) < len(SearchSpace(g, H100).candidates())


# -- analytical model ------------------------------------------------------------------------------


def test_estimate_parts_and_orderings() -> None:
    g = gemm(1024, 1024, 256, dtype="float16")
    good = make_schedule(g, {"m": 16, "n": 64}, step=32)
    e = estimate(good, H100)
    assert e.us > 0 and e.flops >= 2 * 1024 * 1024 * 256 and e.bytes > 0 and e.occupancy > 0
    # one thread per block starves the machine; tile-1 rows re-read B from device memory
    assert estimate(make_schedule(g, {"m": 1, "n": 1}, step=32), H100).us > 10 * e.us
    assert estimate(make_schedule(g, {"m": 1, "n": 64}, step=32), H100).bytes > e.bytes


def test_estimate_charges_the_second_pass_and_recompute() -> None:
    g = P.residual_layernorm(1024, 4096, "float16")
    one = estimate(make_schedule(g, {"m": 64}, step=4096), H100)
    sliced = estimate(make_schedule(g, {"m": 64}, step=256), H100)
    assert sliced.bytes > one.bytes  # the second pass reads the row again
    m = P.mlp(256, 256, 256, 256, dtype="float16")
    cut = estimate(make_schedule(m, {"m": 4, "n": 64}, step=16, recompute=True,
                                 levels={"H": "register"}), H100)
    coop = estimate(make_schedule(m, {"m": 4, "n": 64}, step=16, recompute=True), H100)
    assert cut.flops > 10 * coop.flops  # per-thread recomputation of the hidden tile


# -- the tune loop on llvm -------------------------------------------------------------------------


def test_tune_finds_and_remembers_a_verified_best(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("SPACEFUSION_NO_CACHE", raising=False)
    g = P.layernorm(32, 256)
    db = tmp_path / "t.db"
    s = tune(g, LLVMRunner(repeats=2), target="llvm", db=db, trials=20, batch=5, progress=False)
    assert s.measured == 20 and s.failed == 0 and s.best is not None
    assert s.best_result.ok and s.best_result.max_abs_err is not None and s.best_result.max_abs_err < 1e-4
    with TuningDatabase(db) as d:
        key = tuning_key(g, H100, "llvm", COMPILE_FLAGS)
        assert d.count(key) == 20
        assert min(r.median_us for _, r in d.records(key)) == s.best_us
    assert s.learned and -1.0 <= s.learned["spearman"] <= 1.0  # held-out quality after the first batches
    again = tune(g, LLVMRunner(repeats=2), target="llvm", db=db, trials=20, progress=False)
    assert again.from_cache and again.measured == 0 and again.best.key == s.best.key and again.wall_s < 2.0
    monkeypatch.setenv("SPACEFUSION_NO_CACHE", "1")
    more = tune(g, LLVMRunner(repeats=2), target="llvm", db=db, trials=5, batch=5, progress=False)
    left = more.space.fits - 20
    assert not more.from_cache and more.measured == min(5, left) > 0  # only candidates not measured before
    with TuningDatabase(db) as d:
        assert d.count(tuning_key(g, H100, "llvm", COMPILE_FLAGS)) == 20 + more.measured


class _Interrupting(LLVMRunner):
    def __init__(self, after: int) -> None:
        super().__init__(repeats=1)
        self.after, self.calls = after, 0

    def measure(self, inputs):
        self.calls += 1
        if self.calls > self.after:
            raise KeyboardInterrupt
        return super().measure(inputs)


def test_interrupted_tune_keeps_what_it_measured(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SPACEFUSION_NO_CACHE", "1")
    g = gemm(64, 64, 32)
    db = tmp_path / "t.db"
    with pytest.raises(KeyboardInterrupt):
        tune(g, _Interrupting(after=2), target="llvm", db=db, trials=30, batch=4, progress=False)
    with TuningDatabase(db) as d:
        assert d.count(tuning_key(g, H100, "llvm", COMPILE_FLAGS)) == 8
    resumed = tune(g, LLVMRunner(repeats=1), target="llvm", db=db, trials=4, batch=4, progress=False)
    assert resumed.measured == 4  # the 8 already measured are not measured again
    with TuningDatabase(db) as d:
        assert d.count(tuning_key(g, H100, "llvm", COMPILE_FLAGS)) == 12


def test_corrupt_database_is_refused_and_kept(tmp_path) -> None:
    db = tmp_path / "t.db"
    db.write_bytes(b"not a database at all" * 10)
    before = db.read_bytes()
    with pytest.raises(DatabaseError):
        tune(gemm(8, 8, 8), LLVMRunner(repeats=1), target="llvm", db=db, trials=2, progress=False)
    assert db.read_bytes() == before


def test_failed_candidates_are_recorded_not_fatal(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SPACEFUSION_NO_CACHE", "1")

    class Flaky(LLVMRunner):
        def measure(self, inputs):
            out = super().measure(inputs)
            return [dataclasses.replace(r, error="run: injected failure", latencies_us=()) if i == 0 else r
                    for i, r in enumerate(out)]

    s = tune(gemm(16, 16, 8), Flaky(repeats=1), target="llvm", db=tmp_path / "t.db", trials=6, batch=3,
             progress=False)
    assert s.failed == 2 and s.best_result.ok and math.isfinite(s.best_us)


def test_cli_tune_on_llvm(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("SPACEFUSION_NO_CACHE", "1")
    out = tmp_path / "summary.json"
    rc = main(["tune", "softmax_gemm", "--shape", "32", "64", "8", "--target", "llvm", "--runner", "llvm",
               "--db", str(tmp_path / "t.db"), "--trials", "6", "--batch", "3", "--quiet", "--json", str(out)])
    assert rc == 0 and out.exists()
    text = capsys.readouterr().out
    assert "measured 6" in text and "best:" in text
    assert main(["tune", "softmax_gemm", "--shape", "32", "64", "8", "--target", "tpu"]) == 2
    assert "unknown target 'tpu'" in capsys.readouterr().err


def test_records_round_trip() -> None:
    r = MeasureResult("k" * 64, "llvm", (1.0, 3.0, 2.0), 1e-6, None, (("device", "cpu"),))
    assert MeasureResult.from_dict(r.to_dict()) == r and r.median_us == 2.0


def test_fast_math_is_a_separate_search_and_database_key(tmp_path) -> None:
    """``fast_math`` is a user's choice, never searched by default: with it every tensor-core candidate
    computes tanh/sigmoid on tanh.approx, and its results live under their own database key (an
    offline batch of such candidates is imported there), so approximate and exact bests never mix."""
    import json

    from search.database import key_parts
    from search.tuner import _flags
    from spacefusion.runners import MANIFEST_FORMAT, TVMBuilder, import_offline

    g = P.gemm_epilogue(1024, 1024, 256, "sigmoid", True, "float16")
    exact = SearchSpace(g, H100).candidates()
    fast = SearchSpace(g, H100, fast_math=True).candidates()
    assert not any(s.fast_math for s in exact)
    assert all(s.fast_math == (s.warp_tile is not None) for s in fast) and any(s.fast_math for s in fast)
    exact_flags, fast_flags = _flags(TVMBuilder(), False), _flags(TVMBuilder(), True)
    assert tuning_key(g, H100, "cuda:sm_90a", fast_flags) != tuning_key(g, H100, "cuda:sm_90a", exact_flags)
    s = next(x for x in fast if x.fast_math)
    folder = tmp_path / "batch"
    folder.mkdir()
    entry = {"schedule_key": s.key, "target": "cuda:sm_90a", "artefact": s.key, "workload": {}, "seed": 0,
             "schedule": s.to_dict()}
    (folder / "manifest.json").write_text(json.dumps({"format": MANIFEST_FORMAT, "candidates": [entry]}))
    rec = MeasureResult(s.key, "cuda:sm_90a", (12.5,), 1e-4)
    (folder / "results.json").write_text(json.dumps([rec.to_dict()]))
    db = TuningDatabase(tmp_path / "t.db")
    assert import_offline(db, folder, H100) == 1
    key = tuning_key(g, H100, "cuda:sm_90a", fast_flags)
    assert db.best(key) is not None and db.best(tuning_key(g, H100, "cuda:sm_90a", exact_flags)) is None
    assert key_parts(g, H100, "cuda:sm_90a", fast_flags) != key_parts(g, H100, "cuda:sm_90a", exact_flags)
    db.close()


def test_a_tune_cut_short_resumes_its_remaining_trials(tmp_path, monkeypatch) -> None:
    """A tune killed after its first batch left 4 records; run again with the same budget it measures the
    other 4 (not 8, and not none because a best exists), then reuses the best at once."""
    monkeypatch.delenv("SPACEFUSION_NO_CACHE", raising=False)
    g, db = P.layernorm(32, 256), tmp_path / "t.db"
    first = tune(g, LLVMRunner(repeats=1), target="llvm", db=db, trials=4, batch=4, progress=False)
    assert first.measured == 4
    rest = tune(g, LLVMRunner(repeats=1), target="llvm", db=db, trials=8, batch=4, progress=False)
    assert not rest.from_cache and rest.measured == 4
    with TuningDatabase(db) as d:
        assert d.count(tuning_key(g, H100, "llvm", COMPILE_FLAGS)) == 8
    again = tune(g, LLVMRunner(repeats=1), target="llvm", db=db, trials=8, batch=4, progress=False)
    assert again.from_cache and again.measured == 0


class _SlowRunner:
    """Measures nothing: a fixed latency per schedule after a pause, so that two tunes overlap in time."""

    name = "fake"
    builder = TVMBuilder()  # its flags key the database; nothing is built

    def measure(self, inputs: list) -> list[MeasureResult]:
        import time as _time

        _time.sleep(0.05)
        return [MeasureResult(i.key, i.target, (float(int(i.key[:6], 16) % 97 + 1),), 0.0) for i in inputs]


def test_claims_keep_concurrent_tuners_apart(tmp_path) -> None:
    """A candidate another live tuner claimed is not handed out again; a claim lapses with its process."""
    from search.database import claim_owner

    g = P.layernorm(32, 256)
    key = tuning_key(g, H100, "llvm", COMPILE_FLAGS)
    with TuningDatabase(tmp_path / "t.db") as db:
        a, b = claim_owner(), claim_owner()
        assert db.claim(key, ["s1", "s2", "s3"], a) == ["s1", "s2", "s3"]
        assert db.claim(key, ["s2", "s3", "s4"], b) == ["s4"]
        db.release(key, a)
        assert db.claim(key, ["s2"], b) == ["s2"]
        gone = claim_owner().split("/")[0] + "/999999999/dead"  # no such pid on this host
        assert db.claim(key, ["s5"], gone) == ["s5"] and db.claim(key, ["s5"], a) == ["s5"]


def test_two_tunes_on_one_database_measure_disjoint_candidates(tmp_path, monkeypatch) -> None:
    """Two tunes at once, 8 trials each: 16 distinct records (before claims, 2 x 16 measurements left 22)."""
    import threading

    monkeypatch.delenv("SPACEFUSION_NO_CACHE", raising=False)
    g, db = P.layernorm(32, 256), tmp_path / "t.db"
    TuningDatabase(db).close()
    out: list = []

    def run() -> None:
        out.append(tune(g, _SlowRunner(), target="llvm", db=db, trials=8, batch=4, progress=False))

    threads = [threading.Thread(target=run) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    with TuningDatabase(db) as d:
        assert d.count(tuning_key(g, H100, "llvm", COMPILE_FLAGS)) == sum(s.measured for s in out)
    assert all(s.measured > 0 for s in out), [s.measured for s in out]


def test_tuner_takes_its_builder_as_an_argument(tmp_path) -> None:
    """The tuner lowers only through the Builder it is handed: its flags key the database, its prebuild
    runs per batch; a runner without a builder and no builder= is refused with a sentence, not a crash."""

    class _Flagged(TVMBuilder):
        flags = ("-test-flag",)
        prebuilt: list[int] = []

        def prebuild(self, inputs, workers):
            self.prebuilt.append(len(inputs))
            return 0.0

    g = P.layernorm(32, 256)
    builder = _Flagged()
    with TuningDatabase(tmp_path / "t.db") as db:
        s = tune(g, _SlowRunner(), builder=builder, target="llvm", db=db, trials=4, batch=2, progress=False)
        assert s.measured == 4 and builder.prebuilt == [2, 2]
        assert s.key == tuning_key(g, H100, "llvm", ("-test-flag",)) != tuning_key(g, H100, "llvm", COMPILE_FLAGS)

    class _NoBuilder:
        name = "bare"

        def measure(self, inputs):
            return []

    with pytest.raises(TypeError, match="tune needs a builder.*_NoBuilder has none"):
        tune(g, _NoBuilder(), target="llvm", trials=1, progress=False)
