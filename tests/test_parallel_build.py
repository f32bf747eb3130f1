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


def test_a_backend_prefetches_only_what_it_lacks(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing to do for SMGs already exported; a schedule function that cannot reach a worker (a closure)
    leaves the export to the serial path."""
    smg = patterns.layernorm(64, 256, dtype="float16")
    be = CudaBackend(tmp_path, schedule_for=default_schedule, build_missing=True, load=False)
    be.export(smg, cubin=False)
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
