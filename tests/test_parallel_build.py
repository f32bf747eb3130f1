"""The distinct SMGs' CUDA artefacts exported in worker processes (``frontend.parallel_build``): the same
files as the serial export, and a worker count that is not one is named."""

from __future__ import annotations

import json
import re

import pytest

from smg import patterns
from spacefusion.frontend.backends import CudaBackend
from spacefusion.frontend.errors import FrontendError
from spacefusion.frontend.parallel_build import WORKERS_ENV, build_workers, export_many
from spacefusion.frontend.schedules import default_schedule


def _renumbered(source: str) -> str:
    return re.sub(r"_ptr_\d+", "_ptr_N", source)


def test_parallel_export_writes_what_the_serial_export_writes(tmp_path) -> None:
    smgs = [patterns.layernorm(64, 256, dtype="float16"), patterns.gemm_epilogue(64, 128, 64, "relu", True, "float16")]
    failed = export_many(tmp_path / "par", "sm_90a", default_schedule, False, smgs, workers=2)
    assert failed == {}
    serial = CudaBackend(tmp_path / "ser", schedule_for=default_schedule, build_missing=True, load=False)
    for smg in smgs:
        serial.export(smg)
        par, ser = tmp_path / "par" / smg.key[:16], tmp_path / "ser" / smg.key[:16]
        # the same launch record (schedule key, grid, block, shared memory, parameters, code fingerprint) and the
        # same source but for TVM's temporaries, which a process numbers by what it built before (``_ptr_8``)
        assert json.loads((par / "kernel.json").read_text()) == json.loads((ser / "kernel.json").read_text())
        assert _renumbered((par / "kernel.cu").read_text()) == _renumbered((ser / "kernel.cu").read_text())
        # what each export's time was made of, for compile-time studies
        for folder in (par, ser):
            timing = json.loads((folder / "timing.json").read_text())
            assert timing["name"] == smg.name and all(timing[k] >= 0 for k in ("schedule_s", "lower_s", "save_s"))


def test_a_backend_prefetches_only_what_it_lacks(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing to do for SMGs already exported (their split decided and recorded, their kernels built); a
    schedule function that cannot reach a worker (a closure) leaves the export to the serial path."""
    from spacefusion.frontend import parallel_build

    parallel_build.close_pool()
    smg = patterns.layernorm(64, 256, dtype="float16")
    be = CudaBackend(tmp_path, schedule_for=default_schedule, build_missing=True, load=False)
    be.export_all(smg)
    assert (tmp_path / smg.key[:16] / "split.json").is_file() and be._missing(smg) == []
    calls = []
    monkeypatch.setattr("spacefusion.frontend.parallel_build.subprocess.Popen",
                        lambda *a, **k: calls.append(a) or pytest.fail("no worker for exported SMGs"))
    assert be.prefetch([smg, smg]) == {}
    other = patterns.layernorm(64, 512, dtype="float16")
    assert export_many(tmp_path, "sm_90a", lambda g: default_schedule(g), False, [smg, other], workers=2) == {}
    assert not calls


@pytest.mark.parametrize("value", ["0", "two", "-3"])
def test_a_worker_count_that_is_not_one_is_named(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WORKERS_ENV, value)
    with pytest.raises(FrontendError, match=WORKERS_ENV):
        build_workers()


def test_the_workers_stay_warm_between_exports_and_end_with_the_pool(tmp_path) -> None:
    """A second export (a new set of sizes, another model) reaches the same worker processes, which imported
    TVM and torch for the first; a worker that died in between is replaced; closing the pool ends them all."""
    from spacefusion.frontend import parallel_build

    parallel_build.close_pool()
    first = [patterns.layernorm(32, 256, dtype="float16"), patterns.layernorm(32, 512, dtype="float16")]
    assert export_many(tmp_path, "sm_90a", default_schedule, False, first, workers=2) == {}
    procs = list(parallel_build._pool().procs)
    assert len(procs) == 2 and all(p.poll() is None for p in procs)
    second = [patterns.layernorm(48, 256, dtype="float16"), patterns.layernorm(48, 512, dtype="float16")]
    assert export_many(tmp_path, "sm_90a", default_schedule, False, second, workers=2) == {}
    assert parallel_build._pool().procs == procs  # the same processes, still alive
    procs[0].kill()
    procs[0].wait()
    third = [patterns.layernorm(64, 128, dtype="float16"), patterns.layernorm(16, 128, dtype="float16")]
    assert export_many(tmp_path, "sm_90a", default_schedule, False, third, workers=2) == {}
    assert all((tmp_path / s.key[:16] / "kernel.json").is_file() for s in first + second + third)
    live = parallel_build._pool().procs
    assert procs[0] not in live and procs[1] in live
    parallel_build.close_pool()
    assert all(p.poll() is not None for p in live) and parallel_build._pool().procs == []


def test_a_worker_decides_the_split_and_exports_its_kernels(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A norm whose rows leave the SMs idle is split: the decision (its update functions derived by sympy) is
    the worker's, recorded in ``split.json``, and so are its kernels; the caller then reads the record and
    derives nothing."""
    smg = patterns.group_norm(1, 512 * 512, 32, 128, "silu", dtype="float16")
    other = patterns.layernorm(64, 256, dtype="float16")
    be = CudaBackend(tmp_path, schedule_for=default_schedule, build_missing=True, load=False)
    monkeypatch.setenv(WORKERS_ENV, "2")
    assert be.prefetch([smg, other]) == {}
    monkeypatch.setattr("spacefusion.frontend.backends.decide_split",
                        lambda *a, **k: pytest.fail("the split was decided again"))
    again = CudaBackend(tmp_path, schedule_for=default_schedule, build_missing=True, load=False)
    split = again.split_of(smg)
    assert split is not None and len(split.kernels) >= 2 and again.split_of(other) is None
    assert again._missing(smg) == [] and again._missing(other) == []
