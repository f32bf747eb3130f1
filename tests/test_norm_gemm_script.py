"""The norm-prologue benchmark (experiments/norm_gemm.py): what ``build`` lowers and what ``run`` reports, on
the CPU (the timings are the GPU's)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
import norm_gemm as N  # noqa: E402

from schedulers.hardware import H100  # noqa: E402
from spacefusion.frontend.schedules import ranked  # noqa: E402


def test_candidates_start_with_the_frontends_first_pick() -> None:
    cands = N.candidates("qwen2_q_1024")
    labels = [label for label, _ in cands]
    assert labels[0] == "first" and labels[-1] == "weight_apart" and len(set(labels)) == len(labels)
    first = cands[0][1]
    assert first.key == ranked(N.smg_of("qwen2_q_1024"), H100)[0].key
    assert first.tensor_cores and first.warp_tile.gemm_states[0].k_major and "Gn" not in first.smg.inputs
    assert "Gn" in dict(cands)["weight_apart"].smg.inputs


def test_the_cli_parses_and_the_report_names_each_system() -> None:
    with pytest.raises(SystemExit):
        N.main(["run", "--help"])
    shape = {"key": "k", "rows": 8, "k": 896, "n": 896}
    rows = [{"system": "spacefusion", "label": "first", "estimate_us": 3.9, "blocks": 8, "threads": 32,
             "knobs": {}, "median_us": 4.0},
            {"system": "torch_rms_norm+linear", "median_us": 6.0},
            {"system": "spacefusion", "label": "ranked1", "status": "error", "error": "Y: max abs error"}]
    text = N.format_shape(shape, rows)
    assert "first: est 3.9" in text and "Y: max abs error" in text and "1.50x" in text
