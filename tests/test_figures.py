"""paper_figures/: every figure the README names exists, and its table says what the results files say."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
import make_figures as F  # noqa: E402

README = ROOT / "paper_figures" / "README.md"


def test_the_table_is_the_results_files() -> None:
    assert F.e2e_table() in README.read_text()


def test_every_named_figure_is_a_committed_png() -> None:
    names = set(re.findall(r"\(([\w.]+\.png)\)", README.read_text()))
    assert names == {"e2e_h100.png", "attention_unseen_h100.png"}
    for n in names:
        assert (ROOT / "paper_figures" / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", n


def test_speedups_are_over_eager() -> None:
    sp = F.e2e_speedups()
    assert all(v["eager"] == 1.0 for v in sp.values())
    assert sp["bert"]["spacefusion+graph"] > sp["bert"]["torch.compile"]  # launch-bound compile
    assert sp["bert"]["spacefusion+graph"] < sp["bert"]["eager+graph"]  # not the libraries' kernels yet
    assert len(F.unseen_ratios()) == 20
