"""The CUDA seam of the frontend, on this machine (no GPU): artefacts are exported where TVM is; loading
one that was never exported is a clear error, not a crash in the runtime."""

from __future__ import annotations

import json

import pytest

from smg import patterns
from spacefusion.frontend import CudaBackend, FrontendError


def test_export_writes_an_artefact_per_smg_key(tmp_path) -> None:
    be = CudaBackend(tmp_path)
    g = patterns.gemm_epilogue(32, 64, 64, "gelu", True, dtype="float16")
    path = be.export(g, cubin=False)
    assert path == tmp_path / g.key[:16]
    meta = json.loads((path / "kernel.json").read_text())
    assert set(meta["param_order"]) == {"A", "Bw", "bias", "Y"}
    assert (path / "kernel.cu").read_text()


def test_an_artefact_built_by_other_code_is_rebuilt_where_the_backend_can_build(tmp_path) -> None:
    """A kernel folder keyed by the SMG records the code that built it (``kernel.json``'s ``code``); a backend
    that builds missing kernels rebuilds one from other code (or recording none) rather than serve it, and a
    backend that cannot build (a GPU machine without TVM) leaves it as it is."""
    from spacefusion.lower.fingerprint import code_fingerprint

    g = patterns.layernorm(8, 16, dtype="float16")
    path = CudaBackend(tmp_path).export(g, cubin=False)
    assert json.loads((path / "kernel.json").read_text())["code"] == code_fingerprint()
    for old in ("0" * 16, None):  # another version's, and an artefact from before fingerprints
        meta = json.loads((path / "kernel.json").read_text())
        meta.pop("code")
        (path / "kernel.json").write_text(json.dumps(meta | ({"code": old} if old else {})))
        (path / "kernel.cu").write_text("// stale")
        CudaBackend(tmp_path, load=False).compile(g)  # cannot build: served as it is
        assert (path / "kernel.cu").read_text() == "// stale"
        CudaBackend(tmp_path, build_missing=True, load=False).compile(g)
        assert (path / "kernel.cu").read_text() != "// stale"
        assert json.loads((path / "kernel.json").read_text())["code"] == code_fingerprint()


def test_compile_without_export_names_the_missing_artefact(tmp_path) -> None:
    g = patterns.layernorm(8, 16, dtype="float16")
    with pytest.raises(FrontendError, match="no CUDA artefact for layernorm"):
        CudaBackend(tmp_path).compile(g)


def test_gated_gemm_on_wgmma_shares_the_a_tile_and_refuses_with_a_schedule_error() -> None:
    """Regression: the wgmma check unpacked the one GEMM state of a plain GEMM, and two (LLaMA's gate and
    up projections over one X) raised ValueError out of the search space.  Now both states run on wgmma
    over one staged X, and what the lowering cannot do is a ScheduleError that says why."""
    from schedulers.errors import ScheduleError
    from schedulers.schedule import make_schedule
    from spacefusion.frontend.builders import gated_gemm

    g = gated_gemm(128, 128, 128, "silu", "float16")
    opts = {"serial": "k", "tensor_cores": True, "stages": 2, "warps": 4}
    p = make_schedule(g, {"m": 64, "n": 64}, step=64, wgmma=True, **opts).warp_tile
    assert p.wgmma_ss and [(s.update.state, s.x, s.factor) for s in p.gemm_states] == [("G", "Wg", "X"),
                                                                                      ("U", "Wu", "X")]
    with pytest.raises(ScheduleError, match=r"wgmma: the step 32 must be 64"):
        make_schedule(g, {"m": 64, "n": 64}, step=32, wgmma=True, **opts)
    assert make_schedule(g, {"m": 64, "n": 64}, step=64, **opts).warp_tile is not None


def test_gelu_tanh_epilogue_compiles_for_sm90a_on_the_first_pick(tmp_path) -> None:
    """GPT-2's and ALBERT's GELU (tanh form) in a tensor-core GEMM epilogue: the first pick builds, and
    nvcc compiles it for sm_90a where nvcc is (the GPU run is tests/test_dynamo.py's cuda test)."""
    import shutil

    from spacefusion.frontend.schedules import model_pick

    g = patterns.gemm_epilogue(256, 768, 768, "gelu_tanh", True, dtype="float16")
    be = CudaBackend(tmp_path, schedule_for=lambda s: model_pick(s)[0])
    path = be.export(g, cubin=shutil.which("nvcc") is not None)
    assert "tanh" in (path / "kernel.cu").read_text()
    if shutil.which("nvcc"):
        assert (path / "kernel.cubin").stat().st_size > 0
