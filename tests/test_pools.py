"""Measuring on several workers at once without Ray (``runners.ProcessRunner``: a subprocess per GPU of this
host, the fallback of ``gpu_runner``) and what every pool shares (``runners/pool.py``): candidates spread over
the workers, one GPU each; a worker killed mid-batch replaced, its candidate measured once, on another; a
candidate that kills every worker it meets recorded as failed; no worker left: nothing recorded, claims
released; a seeded tune reaching the golden run's records on 1 and on 3 workers; a model's SMGs tuned side
by side; the tuner's build processes kept warm.  The Ray cluster's side: tests/test_ray_cluster.py."""

from __future__ import annotations

import functools
import sqlite3
import threading
from pathlib import Path

import pytest

from schedulers.hardware import H100
from schedulers.schedule import make_schedule
from search.database import TuningDatabase
from search.records import MeasureInput
from search.tuner import tune
from smg import patterns as P
from smg.workloads import gemm
from spacefusion.runners import LocalGPURunner, ProcessRunner, RunnerUnavailable, gpu_runner
from tests.fault_runners import DyingRunner, ShippedKeyedRunner, SlowKeyedRunner, back_to, kill_first_busy
from tests.tuner_golden import BATCH, CASES, GOLDEN, SEED, TRIALS, KeyedRunner, NoBuilder


def claims(db: Path) -> list[tuple]:
    with sqlite3.connect(db) as c:
        return c.execute("SELECT * FROM claims").fetchall()


def test_each_worker_has_its_gpu_and_the_results_come_back_in_order() -> None:
    """One worker per GPU named, each seeing only its own (CUDA_VISIBLE_DEVICES); a batch is spread over them
    and comes back in input order, each result saying which worker measured it.  (The workers' runner is the
    golden runs' keyed one; tests/test_ray_cluster.py measures llvm kernels on a pool.)"""
    ss = [make_schedule(gemm(32, 32, 16), tiles={"n": n}, step=k) for n, k in ((8, 4), (16, 8), (4, 4), (8, 8))]
    inputs = [MeasureInput(s, "cuda:sm_90a") for s in ss]
    with ProcessRunner(gpus=["0", "1"], inner=functools.partial(SlowKeyedRunner, delay_s=0.2),
                       builder=NoBuilder()) as runner:
        results = runner.measure(inputs)
        assert runner.name == "processes[slow-keyed]" and runner.parallelism == 2 and not runner.ship
        assert sorted(h["cuda_visible_devices"] for h in runner.pool.hellos.values()) == ["0", "1"]
    assert [r.schedule_key for r in results] == [i.key for i in inputs]
    assert [r.median_us if r.ok else None for r in results] == [r.median_us if r.ok else None
                                                                 for r in KeyedRunner().measure(inputs)]
    workers = [dict(r.meta)["worker"] for r in results]
    assert set(workers) == {"worker 0 (GPU 0)", "worker 1 (GPU 1)"}  # both took candidates
    assert all(dict(r.meta)["via"] == "processes" for r in results)


def test_a_worker_killed_mid_tune_is_replaced_and_nothing_is_lost_or_measured_twice(tmp_path) -> None:
    """SIGKILL one of two workers while it measures: its candidate is measured on the other, the worker is
    started again, and the tune records every candidate once; no claim is left behind.  (The workers take 0.3 s
    a candidate and build nothing; tests/test_ray_cluster.py kills an llvm worker of a Ray cluster.)"""
    g, db = P.layernorm(32, 256), tmp_path / "t.db"
    killed: list[int] = []
    with ProcessRunner(workers=2, inner=functools.partial(SlowKeyedRunner, delay_s=0.3), builder=NoBuilder()) as runner:
        runner.connect()
        assert runner.pool is not None
        killer = kill_first_busy(runner.pool, killed)
        s = tune(g, runner, target="llvm", db=db, trials=6, batch=6, progress=False)
        killer.join()
        assert back_to(runner, 2) == 2  # started again
        assert killed and killed[0] not in {h["pid"] for h in runner.pool.hellos.values()}
    assert s.measured == 6 and not s.unmeasured
    with TuningDatabase(db) as d:
        records = d.records(s.key)
    assert len(records) == 6 and sum(r.ok for _, r in records) == 6 - s.failed
    assert sorted(runner.answered.values()) == [1] * 6  # each measured once: the killed worker answered nothing
    retried = [r for _, r in records if dict(r.meta).get("lost_workers")]
    assert len(retried) == 1 and "killed by signal 9" in dict(retried[0].meta)["lost_workers"][0]
    assert dict(retried[0].meta)["worker"] != dict(retried[0].meta)["lost_workers"][0].split(":")[0]  # elsewhere
    assert claims(db) == []


def test_a_candidate_that_kills_every_worker_it_meets_is_recorded_failed(tmp_path) -> None:
    """A candidate that takes down two workers is what failed (a rerun would crash them again): recorded with
    the reason, the rest of the batch measured, the workers started again."""
    g = P.layernorm(32, 256)
    probe = tune(g, KeyedRunner(), builder=NoBuilder(), target="llvm", trials=4, batch=4, progress=False,
                 db=tmp_path / "probe.db")
    with TuningDatabase(tmp_path / "probe.db") as d:
        victim = d.records(probe.key)[1][0].key
    inner = functools.partial(DyingRunner, die_on=victim[:12])
    with ProcessRunner(workers=2, inner=inner, builder=NoBuilder()) as runner:
        s = tune(g, runner, target="llvm", db=tmp_path / "t.db", trials=4, batch=4, progress=False)
        assert back_to(runner, 2) == 2
    with TuningDatabase(tmp_path / "t.db") as d:
        by_key = {sch.key: r for sch, r in d.records(s.key)}
    assert len(by_key) == 4 and s.measured == 4
    assert by_key[victim].error.startswith("worker: it took down 2 workers: worker ")
    assert "exit status 3" in by_key[victim].error and not by_key[victim].environmental


def test_with_no_worker_left_nothing_is_recorded_and_the_claims_are_released(tmp_path) -> None:
    """The only worker dies on every candidate and is not started again (restarts=0): the tune stops with the
    reason, records nothing and leaves no claim, so a rerun measures every candidate."""
    g, db = P.layernorm(32, 256), tmp_path / "t.db"
    with ProcessRunner(workers=1, inner=functools.partial(DyingRunner, die_on=""), builder=NoBuilder(),
                       restarts=0) as runner:
        s = tune(g, runner, target="llvm", db=db, trials=4, batch=4, progress=False)
    assert s.measured == 0 and s.unmeasured.startswith("processes[dying]: no worker left (worker 0: lost 1 job(s)")
    with TuningDatabase(db) as d:
        assert d.records(s.key) == []
    assert claims(db) == []


def test_no_worker_that_can_start_is_a_clear_error() -> None:
    """A GPU worker where torch sees no GPU refuses to start, and the pool says so at once: nothing is measured
    (and recorded as the kernels' failures) on a machine that cannot run them."""
    runner = ProcessRunner(gpus=["0"], inner=LocalGPURunner)
    with pytest.raises(RunnerUnavailable, match=r"no worker started: worker 0 \(GPU 0\): cannot work: "
                                                r"RunnerUnavailable: no GPU: "):
        runner.connect()
    runner.close()


def test_the_same_seeded_tune_on_three_workers_is_the_golden_run(tmp_path) -> None:
    """The golden run's runner (latency a function of the key) on 3 worker processes: the same records in the
    same order, so the same best, as the tuner measuring in its own process (recorded at ec6c3e1).  On 1 and 3
    Ray workers: tests/test_ray_cluster.py."""
    import json

    want = json.loads(GOLDEN.read_text())["layernorm_llvm"]
    smg, target = CASES["layernorm_llvm"]
    with ProcessRunner(workers=3, inner=KeyedRunner, builder=NoBuilder()) as runner:
        s = tune(smg, runner, hw=H100, target=target, db=tmp_path / "t.db", trials=TRIALS, batch=BATCH, seed=SEED,
                 progress=False)
        assert runner.parallelism == 3
    with TuningDatabase(tmp_path / "t.db") as d:
        got = [[sch.key, r.median_us if r.ok else None, r.error] for sch, r in d.records(s.key)]
    assert got == want["records"] and s.best.key == want["best"]


def test_a_models_smgs_are_tuned_side_by_side_with_the_same_bests(tmp_path) -> None:
    """``tune_partitions`` on a pool of 3 tunes 3 SMGs at once (candidates of several SMGs in flight together)
    and reaches, SMG by SMG, the records of tuning them one after another (each tune's picks depend on its own
    records only)."""
    from spacefusion.frontend.records import Partition, Subgraph
    from spacefusion.frontend.tune import tune_partitions

    smgs = [P.layernorm(32, 256), P.layernorm(64, 128), gemm(32, 32, 16)]
    part = Partition(tuple(Subgraph("norm", f"s{i}", (), g, (), ()) for i, g in enumerate(smgs)), ())

    class Watch:  # the pool, counting the tunes measuring at once
        def __init__(self, inner) -> None:
            self.inner, self.builder, self.name = inner, inner.builder, inner.name
            self.now = self.most = 0
            self.lock = threading.Lock()

        def measure(self, inputs):
            with self.lock:
                self.now += 1
                self.most = max(self.most, self.now)
            try:
                return self.inner.measure(inputs)
            finally:
                with self.lock:
                    self.now -= 1

    reports = {}
    with ProcessRunner(workers=3, inner=functools.partial(SlowKeyedRunner, delay_s=0.4), builder=NoBuilder()) as pool:
        pool.connect()
        for jobs in (1, 3):
            watch = Watch(pool)
            reports[jobs] = tune_partitions(part, watch, tmp_path / f"{jobs}.db", hw=H100, target="llvm", trials=4,
                                            batch=1, progress=False, jobs=jobs)
            # one at a time, or several at once (all three, unless a tune's ranking on a loaded CPU outlasts another)
            assert watch.most == 1 if jobs == 1 else watch.most >= 2, (jobs, watch.most)
    for one, three in zip(reports[1].tuned, reports[3].tuned):
        assert one.label == three.label and one.summary.best.key == three.summary.best.key
        with TuningDatabase(tmp_path / "1.db") as a, TuningDatabase(tmp_path / "3.db") as b:
            assert [s.key for s, _ in a.records(one.summary.key)] == [s.key for s, _ in b.records(three.summary.key)]


def test_gpu_runner_asks_for_no_more_gpus_than_are_visible(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    with pytest.raises(RunnerUnavailable, match=r"4 GPUs asked for, 2 visible here \(3, 5\)"):
        gpu_runner(gpus=4)
    runner = gpu_runner(engine="processes")
    assert isinstance(runner, ProcessRunner) and runner.gpus == ["3", "5"]
    assert isinstance(gpu_runner(gpus=1), LocalGPURunner)  # one GPU: measured in this process, as before
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert isinstance(gpu_runner(), LocalGPURunner)  # none: its check() says why
    with pytest.raises(ValueError, match="unknown engine 'mpi'"):
        gpu_runner(engine="mpi")


def test_cuda_candidates_are_built_on_the_tuning_host_and_shipped_to_workers_without_tvm(tmp_path, monkeypatch) -> None:
    """A pool whose workers can measure a built artefact (``measure_built``, as ``LocalGPURunner``) gets every
    CUDA candidate built ahead in the tuning host's build processes (warm from batch to batch; cubins in the
    cache) and shipped: the workers never import TVM.  A candidate that does not build is its failure, said
    without a worker; the kept artefacts go once measured."""
    import shutil

    from spacefusion.runners import TVMBuilder
    from spacefusion.runners.processes import build_pool, close_build_pools

    close_build_pools()
    monkeypatch.setenv("SPACEFUSION_CUBIN_CACHE", str(tmp_path / "cubins"))  # the build processes' environment
    assert TVMBuilder().prebuild([MeasureInput(make_schedule(gemm(32, 32, 16)), "cuda:sm_90a")], 1) == 0.0
    g = gemm(32, 32, 16)
    try:
        with ProcessRunner(workers=2, inner=ShippedKeyedRunner) as runner:
            assert runner.ship and runner.spec["builds"] is False
            s = tune(g, runner, hw=H100, target="cuda:sm_90a", db=tmp_path / "t.db", trials=1, batch=1, workers=2,
                     progress=False)
            pids = sorted(h["pid"] for h in build_pool(2).hellos.values())
            (bad,) = runner.measure([MeasureInput(make_schedule(g), "cuda:sm_1")])
            assert runner.builder._kept() == {}  # type: ignore[attr-defined]
        assert len(pids) == 2 and sorted(h["pid"] for h in build_pool(2).hellos.values()) == pids  # still up
    finally:
        close_build_pools()
    with TuningDatabase(tmp_path / "t.db") as d:
        records = d.records(s.key)
    assert s.measured == 1 and len(records) == 1
    for sch, r in records:
        meta = dict(r.meta)
        assert {"kernel.cu", "kernel.json"} <= set(meta["files"]) == set(meta["shipped"])
        assert meta["kernel_of"] == sch.key
        assert meta["tvm_here"] is False and meta["via"] == "processes"
        assert ("kernel.cubin" in meta["files"]) == bool(shutil.which("nvcc"))
    if shutil.which("nvcc"):
        assert len(list((tmp_path / "cubins").rglob("*.cubin"))) == 1
    assert bad.error.startswith("build: ") and "sm_1" in bad.error and dict(bad.meta)["built"] == "here"


def test_a_candidate_that_never_answers_stops_its_workers_and_is_recorded_failed(tmp_path) -> None:
    """A worker that does not answer within the candidate's time limit (a kernel that never ends) is stopped
    and started again; the candidate goes to another, and after two it is recorded as failed, saying so."""
    g = P.layernorm(32, 256)
    with ProcessRunner(workers=2, inner=functools.partial(SlowKeyedRunner, delay_s=30), builder=NoBuilder(),
                       candidate_timeout_s=1) as runner:
        s = tune(g, runner, target="llvm", db=tmp_path / "t.db", trials=1, batch=1, progress=False)
    with TuningDatabase(tmp_path / "t.db") as d:
        ((_, r),) = d.records(s.key)
    assert r.error.startswith("worker: it took down 2 workers: worker ")
    assert r.error.count("gave no answer within 1 s (stopped)") == 2
