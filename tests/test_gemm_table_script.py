"""Issue 57's GEMM table (experiments/gemm_table.py): what ``build`` ranks and lowers, and what ``run`` reports, on
the CPU (the timings are the GPU's)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
import gemm_table as G  # noqa: E402

from spacefusion.api import first_pick, hardware  # noqa: E402


def test_the_table_is_the_issues_shapes_in_the_linear_layout() -> None:
    assert list(G.SHAPES.values()) == [(1024, 256, 896), (1024, 768, 768), (1024, 896, 896), (6000, 512, 512),
                                       (1024, 2304, 768), (1024, 896, 4864), (1024, 9728, 896), (8192, 8192, 8192)]
    smg = G.smg_of("1024x896x4864")
    assert smg.inputs == ("A", "Bw") and smg.outputs == ("Y",)
    assert (smg.shape("A"), smg.shape("Bw"), smg.shape("Y")) == ((1024, 4864), (896, 4864), (1024, 896))  # W [n, k]


def test_candidates_start_with_the_h200s_first_pick_and_differ() -> None:
    h200 = hardware("h200")
    cands = G.candidates("1024x256x896", h200)
    assert [label for label, _ in cands] == ["first", "ranked1", "ranked2"]
    assert cands[0][1].key == first_pick(G.smg_of("1024x256x896"), h200).key
    assert len({s.key for _, s in cands}) == 3 and all(s.tensor_cores for _, s in cands)


def test_build_lowers_a_small_shape_with_its_manifest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(G.SHAPES, "128x64x64", (128, 64, 64))
    assert G.build(tmp_path, ["128x64x64"], "h200", count=1) == 0
    manifest = json.loads((tmp_path / "128x64x64" / "manifest.json").read_text())
    assert manifest["format"] == G.FORMAT and manifest["hardware"] == "H200"
    assert manifest["shape"] == {"key": "128x64x64", "m": 128, "n": 64, "k": 64, "dtype": "float16", "w_layout": "nk"}
    (row,) = manifest["candidates"]
    assert row["label"] == "first" and row["artefact"] == "first" and "error" not in row
    meta = json.loads((tmp_path / "128x64x64" / "first" / "kernel.json").read_text())
    params = {p["name"]: p["shape"] for p in meta["params"] if p.get("role") not in ("scratch", "tensormap")}
    assert params == {"A": [128, 64], "Bw": [64, 64], "Y": [128, 64]}


def test_the_report_gives_tflops_and_the_first_pick_against_cublas() -> None:
    shape = {"key": "1024x768x768", "m": 1024, "n": 768, "k": 768, "dtype": "float16"}
    assert G.tflops(shape, 10.0) == pytest.approx(2 * 1024 * 768 * 768 / 1e7)
    rows = [{"system": "spacefusion", "label": "first", "estimate_us": 5.8, "blocks": 96, "threads": 256,
             "knobs": {}, "median_us": 8.0, "tflops": 151.0},
            {"system": "spacefusion", "label": "ranked1", "status": "error", "error": "Y: max abs error"},
            {"system": G.CUBLAS, "label": G.CUBLAS, "median_us": 10.0, "tflops": 120.8}]
    assert G.speedup(rows) == 1.25 and G.speedup(rows, "ranked1") is None
    text = G.format_shape(shape, rows)
    assert "1.25x" in text and "Y: max abs error" in text and "151.0 TFLOP/s" in text
    with pytest.raises(SystemExit):
        G.main(["run", "--help"])
