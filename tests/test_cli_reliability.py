"""The command line's reliability reports (issue 59): each problem stops with a message naming it (exit 2 for
usage, 1 for a tune whose runner stopped working), never a traceback, silence or a wrong answer, and nothing in
a tuning database is lost.  One test (or group) per report, each on this CPU and tiny shapes."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from schedulers.hardware import H100
from search.database import DatabaseLockedError, TuningDatabase, tuning_key
from search.records import MeasureInput, MeasureResult
from search.tuner import tune
from smg import patterns as P
from spacefusion import runners
from spacefusion.api import schedule
from spacefusion.cli import main
from spacefusion.lower.build import COMPILE_FLAGS
from spacefusion.runners import TVMBuilder
from spacefusion.runners.common import unavailable

LN = ["tune", "layernorm", "--shape", "32", "256", "--dtype", "float32"]


class _Fake:
    """Measures nothing: a fixed latency per schedule, or, while ``broken``, the environment's failure (what
    ``LocalGPURunner`` gives without a GPU).  Builds nothing either (the tuner's prebuild is skipped for llvm)."""

    name = "fake"
    builder = TVMBuilder()  # its flags key the database

    def __init__(self, broken: bool = False) -> None:
        self.broken, self.seen, self.inputs = broken, [], []

    def measure(self, inputs: list[MeasureInput]) -> list[MeasureResult]:
        self.seen += [i.key for i in inputs]
        self.inputs += inputs
        if self.broken:
            return [unavailable(i, "no GPU: torch sees no CUDA device", {"runner": self.name}) for i in inputs]
        return [MeasureResult(i.key, i.target, (float(int(i.key[:6], 16) % 97 + 1),), 0.0) for i in inputs]


# -- 1: a runner that cannot run here ---------------------------------------------------------------


def test_the_default_gpu_runner_without_a_gpu_stops_before_tuning(tmp_path, capsys, monkeypatch) -> None:
    """It exited 0 with "measured 2 (2 failed)"; now it stops before any candidate, saying what to use instead."""
    monkeypatch.setattr(runners.local_gpu, "gpu_unavailable_reason", lambda: "torch sees no CUDA device")
    db = tmp_path / "t.db"
    assert main([*LN, "--trials", "2", "--db", str(db), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--runner gpu (the default) cannot measure on this machine: no GPU: torch sees no CUDA device" in err
    assert "--runner llvm --target llvm" in err and "--runner offline --batch-dir DIR" in err
    assert "Traceback" not in err and not db.exists()  # refused before the database was even made


def test_environment_failures_are_not_recorded_and_a_rerun_measures_them(tmp_path, monkeypatch) -> None:
    """Failures of the machine (no GPU) used up the trials: the rerun measured nothing.  Now they are not
    stored, the tune says why it stopped, and a rerun on a working runner measures those very candidates."""
    monkeypatch.delenv("SPACEFUSION_NO_CACHE", raising=False)
    g, db = P.layernorm(32, 256), tmp_path / "t.db"
    key = tuning_key(g, H100, "llvm", COMPILE_FLAGS)
    broken = _Fake(broken=True)
    s = tune(g, broken, target="llvm", db=db, trials=4, batch=2, progress=False, workers=1)
    assert s.measured == 0 and s.best is None and s.unmeasured.startswith("no GPU")
    assert "not measured (nothing recorded for them): no GPU" in str(s)
    with TuningDatabase(db) as d:
        assert d.count(key) == 0
    fixed = _Fake()
    again = tune(g, fixed, target="llvm", db=db, trials=4, batch=2, progress=False, workers=1)
    assert again.measured == 4 and again.unmeasured is None and again.best is not None
    assert broken.seen[:2] == fixed.seen[:2]  # the same first batch, measured this time


def test_a_database_with_older_no_gpu_records_measures_them_and_keeps_kernel_failures(tmp_path) -> None:
    """Databases written before the fix hold "no GPU: ..." failures (no flag): they do not count as measured,
    so they are measured (their rows replaced by the real results); a kernel's own failure still counts."""
    g, db = P.layernorm(32, 256), tmp_path / "t.db"
    key = tuning_key(g, H100, "llvm", COMPILE_FLAGS)
    first = _Fake(broken=True)
    tune(g, first, target="llvm", db=db, trials=2, batch=2, progress=False, workers=1)
    old, bad = first.inputs[:2]  # the tuner's first picks, as an older tune recorded them without a GPU
    with TuningDatabase(db) as d:
        d.add(key, old.schedule, MeasureResult(old.key, "llvm", error="no GPU: torch sees no CUDA device; "
                                               "cuda-local runner needs torch + cupy with a CUDA device"))
        d.add(key, bad.schedule, MeasureResult(bad.key, "llvm", error="run: illegal memory access"))
        assert d.measured_keys(key) == {bad.key} and d.count(key) == 2
        assert d.claim(key, [old.key, bad.key], "someone") == [old.key]
        d.release(key, "someone")
    fixed = _Fake()
    s = tune(g, fixed, target="llvm", db=db, trials=3, batch=3, progress=False, workers=1)
    assert s.measured == 2 and old.key in fixed.seen and bad.key not in fixed.seen  # the failure was a trial
    with TuningDatabase(db) as d:
        by_key = {sc.key: r for sc, r in d.records(key)}
        assert by_key[bad.key].error == "run: illegal memory access"  # kept
        assert by_key[old.key].ok  # measured now


def test_a_runner_that_stops_working_mid_tune_fails_the_command(tmp_path, capsys, monkeypatch) -> None:
    """The check before tuning passed, then the GPU was gone: exit 1 with the reason, nothing recorded."""
    monkeypatch.setattr(runners.LocalGPURunner, "check", lambda self: None)
    monkeypatch.setattr(runners.local_gpu, "gpu_unavailable_reason", lambda: "torch sees no CUDA device")
    db = tmp_path / "t.db"
    assert main([*LN, "--trials", "2", "--workers", "1", "--db", str(db), "--quiet"]) == 1
    out = capsys.readouterr()
    assert "gpu runner could not measure candidates here: no GPU: torch sees no CUDA device" in out.err
    assert "measured 0 (0 failed)" in out.out
    with TuningDatabase(db) as d:
        assert sum(d.count(k) for k in d.workloads()) == 0


# -- 2: a runner and a target that do not go together ----------------------------------------------


@pytest.mark.parametrize(("argv", "match"), [
    (["--runner", "gpu", "--target", "llvm"], "--runner gpu measures CUDA kernels on this machine's GPU, and "
                                              "--target llvm builds for this CPU"),
    (["--runner", "offline", "--batch-dir", "b", "--target", "llvm"], "--runner offline measures CUDA kernels"),
    (["--runner", "llvm", "--target", "h100"], "--runner llvm measures on this CPU, so it tunes --target llvm, "
                                               "not --target h100"),
], ids=["gpu+llvm", "offline+llvm", "llvm+h100"])
def test_a_runner_that_cannot_measure_the_target_is_refused(tmp_path, capsys, argv, match) -> None:
    """--runner gpu/ray with --target llvm quietly measured on the local llvm runner."""
    assert main([*LN, *argv, "--trials", "1", "--db", str(tmp_path / "t.db")]) == 2
    assert match in capsys.readouterr().err
    assert not (tmp_path / "t.db").exists()


@pytest.mark.parametrize(("target", "inner", "gpus"), [("llvm", "LLVMRunner", 0), ("h100", "LocalGPURunner", 1)])
def test_the_ray_runner_is_honoured_for_each_target(monkeypatch, target, inner, gpus) -> None:
    """--runner ray measures on the cluster: llvm actors for --target llvm, one GPU per actor otherwise (from the
    CLI its actors ran the llvm runner, so every CUDA candidate failed as 'llvm runner measures llvm only')."""
    pytest.importorskip("ray")
    from spacefusion.cli import make_parser, tune_runner

    connected = []
    monkeypatch.setattr(runners.RayRunner, "connect", lambda self: connected.append(self.address))
    args = make_parser().parse_args(["tune", "gemm", "--shape", "8", "8", "8", "--runner", "ray", "--target", target,
                                     "--ray-address", "10.0.0.1:6379"])
    r = tune_runner(args, "llvm" if target == "llvm" else "cuda:sm_90a")
    assert isinstance(r, runners.RayRunner) and r.inner.func.__name__ == inner and r.num_gpus == gpus
    assert connected == ["10.0.0.1:6379"]  # checked before the tune, not in it


# -- 3: a Ray address where nothing listens ---------------------------------------------------------


def test_a_ray_address_with_nothing_listening_fails_within_the_timeout(tmp_path, capsys) -> None:
    """It retried for 300 s and more; now a few seconds at most, and the address is named."""
    pytest.importorskip("ray")
    with socket.socket() as s:  # a port nothing listens on (bound, then closed)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    assert main([*LN, "--runner", "ray", "--target", "llvm", "--ray-address", f"127.0.0.1:{port}",
                 "--ray-timeout", "2", "--db", str(tmp_path / "t.db")]) == 2
    assert time.perf_counter() - t0 < 4
    err = capsys.readouterr().err
    assert f"no Ray cluster at 127.0.0.1:{port}: connecting to 127.0.0.1:{port} failed within 2 s" in err


def test_ray_addresses_are_parsed_or_refused() -> None:
    from spacefusion.runners.ray import _host_port, probe

    assert _host_port("10.1.2.3:6379") == ("10.1.2.3", 6379)
    assert _host_port("ray://head:10001") == ("head", 10001)
    assert _host_port("[::1]:6379") == ("::1", 6379)
    assert _host_port("auto") is None
    probe("auto")  # Ray finds the cluster itself
    with pytest.raises(runners.RunnerUnavailable, match="Ray address 'head' is not HOST:PORT"):
        probe("head")


@pytest.mark.parametrize(("argv", "match"), [
    (["--runner", "llvm", "--gpus", "2"], "--gpus is for --runner gpu, not --runner llvm"),
    (["--runner", "llvm", "--ray-address", "10.0.0.1:6379"], "--ray-address is for --runner ray, not --runner llvm"),
], ids=["gpus", "ray-address"])
def test_a_flag_of_another_runner_is_refused(tmp_path, capsys, argv, match) -> None:
    assert main([*LN, *argv, "--target", "llvm", "--db", str(tmp_path / "t.db")]) == 2
    assert match in capsys.readouterr().err and not (tmp_path / "t.db").exists()


def test_more_gpus_than_are_visible_is_refused(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert main([*LN, "--gpus", "3", "--target", "h100", "--db", str(tmp_path / "t.db")]) == 2
    assert "--runner gpu (the default) cannot measure on this machine: 3 GPUs asked for, 2 visible here (0, 1)" \
        in capsys.readouterr().err


def test_the_ray_timeout_must_be_positive(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main([*LN, "--runner", "ray", "--ray-timeout", "0"])
    assert e.value.code == 2 and "give a positive finite number" in capsys.readouterr().err


# -- 4: a locked database is a lock, not corruption ------------------------------------------------

_HOLD = "import sqlite3, sys, time\nc = sqlite3.connect(sys.argv[1], isolation_level=None)\n" \
        "c.execute('BEGIN EXCLUSIVE')\nprint('locked', flush=True)\ntime.sleep(60)\n"


def _hold(db) -> subprocess.Popen:
    h = subprocess.Popen([sys.executable, "-c", _HOLD, str(db)], stdout=subprocess.PIPE, text=True)
    assert h.stdout.readline().strip() == "locked"
    return h


def test_a_locked_database_is_reported_as_a_lock_and_nothing_is_lost(tmp_path, capsys, monkeypatch) -> None:
    g, db = P.layernorm(32, 256), tmp_path / "t.db"
    key = tuning_key(g, H100, "llvm", COMPILE_FLAGS)
    s = schedule(g)
    with TuningDatabase(db) as d:
        d.add(key, s, MeasureResult(s.key, "llvm", (3.0,), 0.0))
    before = db.read_bytes()
    held = TuningDatabase(db, lock_wait_s=0.1)  # opened before the other writer came
    h = _hold(db)
    try:
        with pytest.raises(DatabaseLockedError) as e:
            TuningDatabase(db, lock_wait_s=0.1)
        msg = str(e.value)
        assert "is locked, not damaged (opening it" in msg and "corrupt" not in msg
        assert f"held by pid {h.pid}" in msg and "wait for that process to finish" in msg and str(db) in msg
        with pytest.raises(DatabaseLockedError, match="is locked, not damaged \\(write failed"):
            held.add(key, s, MeasureResult(s.key, "llvm", (2.0,), 0.0))
        monkeypatch.setattr("search.database.LOCK_WAIT_S", 0.1)
        assert main([*LN, "--runner", "llvm", "--trials", "1", "--db", str(db), "--quiet"]) == 2
        err = capsys.readouterr().err
        assert "is locked, not damaged" in err and "corrupt" not in err
    finally:
        h.kill()
        h.wait()
        held.close()
    assert db.read_bytes() == before
    with TuningDatabase(db) as d:
        assert d.best(key)[1].median_us == 3.0


# -- 5: a schedule file of another workload --------------------------------------------------------


def test_build_refuses_a_schedule_saved_for_another_workload(tmp_path, capsys) -> None:
    """``build mha --schedule gemm.json`` built the gemm."""
    s = schedule(P.gemm_epilogue(16, 16, 16))
    f = tmp_path / "gemm.json"
    f.write_text(s.to_json())
    out = tmp_path / "o"
    assert main(["build", "mha", "--shape", "1", "1", "16", "16", "16", "--schedule", str(f), "--target", "llvm",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--schedule {f} is a schedule of {s.smg.name} (A[16x16] float32" in err
    assert "not of the workload asked for, mha --shape 1 1 16 16 16: mha (Q[1x1x16x16] float32" in err
    assert main(["build", "gemm_epilogue", "--shape", "16", "16", "8", "--schedule", str(f), "--target", "llvm",
                 "--out", str(out)]) == 2
    assert "A[16x8] float32" in capsys.readouterr().err  # another shape of the same workload
    assert main(["build", "gemm_epilogue", "--schedule", str(f), "--out", str(out)]) == 2
    assert "give the workload's --shape too" in capsys.readouterr().err
    assert main(["build", "gemm_epilogue", "--shape", "16", "16", "16", "--schedule", str(f), "--target", "llvm",
                 "--out", str(out)]) == 0  # its own workload (the dtype taken from the schedule)
    assert "(OK)" in capsys.readouterr().out


# -- 6: the demo's step on any shape ---------------------------------------------------------------


def test_the_demo_fits_its_step_to_a_short_key_dim(tmp_path, capsys) -> None:
    """``demo --shape 1 2 64 7 64`` failed on its own default step (32 > 7)."""
    assert main(["demo", "--shape", "1", "1", "8", "7", "8", "--dtype", "float32", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "serial dim l, step 7" in out and "(OK)" in out
    assert main(["demo", "--shape", "1", "1", "8", "7", "8", "--step", "8", "--out", str(tmp_path)]) == 2
    assert "--step 8 is longer than SKV (7)" in capsys.readouterr().err


# -- 7: bfloat16 -------------------------------------------------------------------------------------


def test_bfloat16_builds_for_cuda_and_is_checked_on_llvm(tmp_path, capsys) -> None:
    att = ["build", "attention", "--shape", "1", "1", "16", "16", "16", "--dtype", "bfloat16"]
    assert main([*att, "--target", "llvm", "--out", str(tmp_path / "l")]) == 0
    assert "(OK)" in capsys.readouterr().out
    assert main([*att, "--target", "cuda", "--out", str(tmp_path / "c")]) == 0
    assert "bfloat16" in (tmp_path / "c" / "kernel.cu").read_text()


def test_bfloat16_on_llvm_without_ml_dtypes_is_refused(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # as where ml_dtypes is not installed
    assert main(["build", "attention", "--shape", "1", "1", "16", "16", "16", "--dtype", "bfloat16", "--target",
                 "llvm", "--out", str(tmp_path)]) == 2
    assert "bfloat16 cannot run on llvm here: numpy has no bfloat16 and ml_dtypes" in capsys.readouterr().err
    assert main([*LN[:5], "--dtype", "bfloat16", "--runner", "llvm", "--db", str(tmp_path / "t.db")]) == 2
    assert "bfloat16 cannot run on llvm here" in capsys.readouterr().err


# -- 8: no GPU prediction for a CPU tune -----------------------------------------------------------


def test_a_cpu_tune_prints_no_gpu_prediction(tmp_path) -> None:
    """tune --target llvm printed "analytical model predicted 11.1 us for it (0.00x)" from the H100 model."""
    g = P.layernorm(32, 256)
    cpu = tune(g, _Fake(), target="llvm", db=tmp_path / "c.db", trials=2, batch=2, progress=False, workers=1)
    assert cpu.best is not None and cpu.predicted_us is None and "predicted" not in str(cpu)
    gpu = tune(g, _Fake(), target="cuda:sm_90a", db=tmp_path / "g.db", trials=2, batch=2, progress=False, workers=1)
    assert gpu.predicted_us is not None and "analytical model predicted" in str(gpu)
