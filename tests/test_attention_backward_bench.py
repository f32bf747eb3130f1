"""``experiments/attention_backward.py`` at CPU-test sizes: the export writes what the run phase reads (every
kernel's artefact and graph, the manifest's wiring), and the run phase checks each system before it times it
(ours evaluated from the exported graphs, SDPA on the CPU; a wrong system is failed, not timed).  The GPU run
itself (``cuda``) at the same small shapes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
import attention_backward as ab  # noqa: E402

CASES = ["d64_causal", "bias_d128"]  # a plain causal one and one whose passes read the statistics apart


@pytest.fixture(scope="module")
def art(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("attention_backward")
    assert ab.export(folder, CASES, "H200", small=True, cubin=False) == 0
    return folder


def test_the_export_writes_every_kernel_the_run_reads(art: Path) -> None:
    manifest = ab.read_manifest(art)
    assert manifest["small"] and manifest["hardware_model"] == "H200"
    for name in CASES:
        entry = manifest["cases"][name]
        assert "error" not in entry, entry.get("error")
        assert [k["name"] for k in entry["kernels"]] == ["forward", "Delta", "dQ", "dK_dV"]
        assert entry["seed"] == "dO" and entry["grads"] == {"Q": "dQ", "K": "dK", "V": "dV"}
        produced = set(ab.make_inputs(ab.Case.from_dict(entry["case"]), "cpu", torch.float32))
        for k in entry["kernels"]:
            folder = art / k["folder"]
            assert {"kernel.cu", "kernel.json", "smg.json"} <= {p.name for p in folder.iterdir()}
            assert set(k["inputs"]) <= produced, (k["name"], k["inputs"])  # each read was produced before
            produced |= set(k["outputs"])
        assert {"O", "dQ", "dK", "dV"} <= produced
    assert "LSE_max" in manifest["cases"]["bias_d128"]["kernels"][0]["outputs"]  # masked: the two parts


def test_the_run_checks_then_times(art: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    results = ab.run(art, out, CASES, "cpu", warmup=0, iters=1, repeats=1)
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    for name in CASES:
        rows = {r["system"]: r for r in results["cases"][name]["rows"]}
        for system in ("spacefusion", "sdpa default"):
            assert rows[system]["status"] == "checked", rows[system]
            assert set(rows[system]["check"]) == {"O", "dQ", "dK", "dV"}
            assert rows[system]["forward_us"] > 0 and rows[system]["backward_us"] > 0
        assert rows["sdpa cudnn"]["status"] == "refused" and "forward_us" not in rows["sdpa cudnn"]
    bias = ab.Case.from_dict(results["cases"]["bias_d128"]["case"])
    assert results["cases"]["bias_d128"]["backward_flops"] == 2.5 * bias.forward_flops()


def test_a_case_in_a_child_process_gives_the_same_rows(art: Path, tmp_path: Path) -> None:
    """``run_child`` (the GPU's default: a faulting kernel costs only its case) reads back what the child wrote."""
    results = ab.run(art, tmp_path / "r.json", ["d64_causal"], "cpu", warmup=0, iters=1, repeats=1, isolate=True)
    rows = {r["system"]: r["status"] for r in results["cases"]["d64_causal"]["rows"]}
    assert rows["spacefusion"] == rows["sdpa default"] == "checked" and "error" not in results["cases"]["d64_causal"]


def test_a_wrong_gradient_fails_the_check() -> None:
    case = ab.CASES["d64_causal"].shrunk()
    x = ab.make_inputs(case, "cpu", torch.float32)
    ref = ab.reference(case, x)
    good = ab.sdpa_system("sdpa default", case, x)

    def wrong() -> ab.Runner:
        r = good.make()
        results = r.results
        r.results = lambda: {**results(), "dK": torch.zeros_like(x["K"])}  # type: ignore[method-assign]
        return r

    row, runner = ab.check(case, ab.System("wrong dK", wrong), ref)
    assert runner is None and row["status"] == "failed" and "dK" in row["error"]
    assert ab.check(case, good, ref)[0]["status"] == "checked"


def test_flops_count_kept_pairs() -> None:
    full = ab.Case("f", 1, 1, 1, 8, 4, False)
    assert full.forward_flops() == 4 * 64 * 4
    assert ab.Case("c", 1, 1, 1, 8, 4, True).kept_pairs() == 36
    assert ab.Case("w", 1, 1, 1, 8, 4, True, "window", 3).kept_pairs() == 1 + 2 + 3 * 6


@pytest.mark.cuda
def test_the_gpu_run_at_small_shapes(art: Path, tmp_path: Path) -> None:
    """The run phase on the GPU (the runtime launching the exported kernels; needs nvcc there, the export
    wrote no cubin): ours and SDPA's default dispatch checked against float32 and timed."""
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    results = ab.run(art, tmp_path / "r.json", CASES, "cuda", warmup=1, iters=3, repeats=1)
    for name in CASES:
        rows = {r["system"]: r for r in results["cases"][name]["rows"]}
        for system in ("spacefusion", "sdpa default"):
            assert rows[system]["status"] == "checked", rows[system]
            assert rows[system]["backward_us"] > 0
