"""The norm sweep (experiments/norm_sweep.py): what ``build`` lowers and what ``run`` reports, on the CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
import norm_sweep as N  # noqa: E402

from schedulers.hardware import H100  # noqa: E402
from spacefusion.frontend import builders  # noqa: E402
from spacefusion.frontend.schedules import ranked  # noqa: E402


def test_candidates_start_with_the_first_pick_and_hold_the_old_one() -> None:
    cands = N.candidates("bert_residual_layernorm")
    labels = [label for label, _ in cands]
    assert labels[0] == "first" and {"old", "probe", "first_scalar"} <= set(labels)
    assert len({s.key for _, s in cands}) == len(cands) >= 6
    assert cands[0][1].key == ranked(builders.norm(*N.SHAPES["bert_residual_layernorm"]), H100)[0].key
    old = dict(cands)["old"]
    assert dict(old.block) == {"m": 32} and old.lanes == 8 and old.num_blocks == 32


def test_every_shape_has_an_old_pick_and_the_cli_parses() -> None:
    assert set(N.OLD_PICKS) == set(N.SHAPES)
    with pytest.raises(SystemExit):
        N.main(["run", "--help"])


def test_the_report_names_each_system() -> None:
    shape = {"key": "k", "rows": 8, "width": 768}
    rows = [{"system": "spacefusion", "label": "first", "rank": 0, "estimate_us": 3.9, "blocks": 8, "threads": 32,
             "knobs": {}, "median_us": 4.0},
            {"system": "torch_eager", "median_us": 6.0},
            {"system": "spacefusion", "label": "old", "status": "error", "error": "Y: max abs error"}]
    text = N.format_shape(shape, rows)
    assert "first: rank 0" in text and "torch_eager" in text and "Y: max abs error" in text
