"""CUDA emission: source and launch metadata, and nvcc compiling it (where nvcc exists)."""

from __future__ import annotations

import json
import shutil

import pytest

from schedulers.errors import ScheduleError
from smg.workloads import mha, softmax_gemm
from spacefusion.api import build, schedule
from spacefusion.runtime.artefact import KernelArtefact


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_cuda_source_and_metadata(arch, dtype) -> None:
    s = schedule(mha(2, 3, 197, 197, 64, dtype=dtype), tiles={"m": 64}, step=32)
    art = build(s, f"cuda:{arch}")
    m = art.meta
    assert "__global__" in art.source and m["kernel_name"] in art.source
    assert m["grid"] == [2 * 3 * 4, 1, 1] and m["block"] == [64, 1, 1]
    assert sorted(m["param_order"]) == ["K", "O", "Q", "V"]
    assert {p["name"]: p["shape"] for p in m["params"]}["O"] == [2, 3, 197, 64]
    assert all(p["dtype"] == dtype for p in m["params"])
    assert m["static_smem_bytes"] == 2 * 32 * 64 * (2 if dtype == "float16" else 4)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_nvcc_compiles_generated_cuda(tmp_path, arch) -> None:
    for g in (mha(1, 2, 197, 197, 64), softmax_gemm(300, 197, 64)):
        s = schedule(g, tiles={"m": 64}, step=32)
        folder = build(s, f"cuda:{arch}").save(tmp_path / f"{g.name}_{arch}")
        assert (folder / "kernel.cubin").stat().st_size > 0
        meta = json.loads((folder / "kernel.json").read_text())
        assert meta["cubin"] == "kernel.cubin"
        KernelArtefact.load(folder)  # the TVM-free runner accepts it


def test_shared_memory_over_limit_is_refused() -> None:
    s = schedule(mha(1, 1, 1024, 1024, 128, dtype="float32"), tiles={"m": 64}, step=128)
    with pytest.raises(ScheduleError, match="shared memory"):
        build(s, "cuda:sm_90a")
