"""``experiments/sanitize.py`` reads each compute-sanitizer tool's own summary line: a racecheck run that
printed its summary is counted (0 is clean), one that printed none is not taken for clean."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

import sanitize  # noqa: E402


@pytest.mark.parametrize("text, errors", [
    ("========= ERROR SUMMARY: 0 errors", 0),
    ("========= ERROR SUMMARY: 3 errors", 3),
    ("========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)", 0),
    ("========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)", 1),
    ("========= ERROR SUMMARY: 1 error\n========= ERROR SUMMARY: 4 errors", 4),
    ("the kernel printed nothing of the tool's", None),
])
def test_the_summary_count_of_each_tool(text: str, errors: int | None) -> None:
    assert sanitize._errors(text) == errors
