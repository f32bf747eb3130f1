"""``experiments/training_gpu.py`` at CPU-test sizes: the export captures a training step's forward and backward
on meta tensors and writes their fused SMGs' artefacts (``export_cuda_training``), whose keys are the ones the
run's graphs read; the run phase checks each system's loss and gradients against float32 eager before timing
it, and fails a wrong one.  The GPU run itself (``cuda``) at the same sizes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
import training_gpu as tg  # noqa: E402

MODEL = "bert_base_8x128"


@pytest.fixture(scope="module")
def art(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("training_gpu")
    assert tg.export(folder, [MODEL], "H200", small=True) == 0
    return folder


def test_the_export_captures_both_stages(art: Path) -> None:
    manifest = json.loads((art / "training_manifest.json").read_text())
    keys = manifest["models"][MODEL]["keys"]
    assert len(keys) >= 6 and all((art / "kernels" / k / "kernel.cu").is_file() for k in keys)
    report = (art / f"{MODEL}.partition.txt").read_text()
    assert "forward (" in report and "backward (" in report and "not compiled yet" not in report, report


def test_the_run_checks_then_times_and_reads_the_export(art: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    results = tg.run(art, out, [MODEL], small=True, device="cpu", modes=(), hw="H200", warmup=0, iters=1,
                     repeats=1)
    row = json.loads(out.read_text())["models"][MODEL]
    assert row == json.loads(json.dumps(results["models"][MODEL]))
    assert row["check"]["eager"]["ok"] and row["check"]["spacefusion"]["ok"], row["check"]
    assert row["ms"]["eager"] > 0 and row["ms"]["spacefusion"] > 0
    # every GEMM the CPU run fused has the artefact the meta export wrote (the attention differs by device)
    for stage in ("forward", "backward"):
        found, missing = row["coverage"][stage]["found"], row["coverage"][stage]["missing"]
        assert found and not [m for m in missing if "gemm" in m], row["coverage"]


def test_grad_error_is_relative_over_all_parameters() -> None:
    ref = {"w": torch.tensor([3.0, 4.0]), "b": torch.tensor([0.0, 1e-9])}
    assert tg.grad_error({"w": torch.tensor([3.0, 4.0]), "b": torch.tensor([1e-6, 0.0])}, ref)[0] < 1e-6
    err, where, missing = tg.grad_error({"w": torch.tensor([3.0, 3.0])}, ref)
    assert abs(err - 0.2) < 1e-9 and where == "w" and missing == ["b"]


@pytest.mark.cuda
def test_the_gpu_run_at_small_sizes(art: Path, tmp_path: Path) -> None:
    """The run phase on the GPU: ours through CudaBackend(ART/kernels) (the runtime launching the exported
    kernels), eager and torch.compile default, each checked against float32 eager and timed."""
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    results = tg.run(art, tmp_path / "r.json", [MODEL], small=True, device="cuda", modes=("default",), hw="H200",
                     warmup=1, iters=2, repeats=1)
    row = results["models"][MODEL]
    assert all(row["check"][s]["ok"] for s in ("eager", "torch.compile default", "spacefusion")), row["check"]
    assert row["coverage"]["forward"]["found"], row["coverage"]
