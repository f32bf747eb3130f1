"""The docs say what the code and the committed results say: knobs, CLI command lines, the SMG picture,
the results tables, the results folder's index and every relative link."""

from __future__ import annotations

import argparse
import inspect
import re
import shlex
import sys
from pathlib import Path

import pytest

from schedulers.options import KNOB_FIELDS
from schedulers.schedule import make_schedule
from spacefusion.cli import make_parser
from tests.mdblocks import DOCS, ROOT, block_after, blocks

sys.path.insert(0, str(ROOT / "experiments"))
from results_table import harness_table, history_table  # noqa: E402

README = ROOT / "README.md"
RESULTS = ROOT / "experiments" / "results"


def _knob_rows() -> dict[str, tuple[str, str]]:
    """docs/knobs.md's reference table: knob -> (default as written, flag cell)."""
    rows = {}
    for line in (ROOT / "docs" / "knobs.md").read_text().splitlines():
        m = re.match(r"\| `(\w+)` \| `([^`]*)` \| ([^|]*) \|", line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3).strip())
    return rows


def _subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in make_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def test_knob_reference_matches_make_schedule() -> None:
    """Every make_schedule parameter but the graph and every knob of the option groups has a row, no row
    names a gone knob, defaults agree."""
    params = {k: v.default for k, v in inspect.signature(make_schedule).parameters.items()
              if k not in ("smg", "knobs")}
    params |= {f.name: f.default for f in KNOB_FIELDS}
    rows = _knob_rows()
    assert set(rows) == set(params), (set(params) - set(rows), set(rows) - set(params))
    for name, (default, _) in rows.items():
        assert default == repr(params[name]), (name, default, params[name])


def test_knob_flags_are_build_flags() -> None:
    """The flags named in the knob table exist on ``spacefusion build``, and each knob's flag is in the table."""
    flags = {s for a in _subparser("build")._actions for s in a.option_strings}
    named = {f: k for k, (_, cell) in _knob_rows().items() for f in re.findall(r"--[\w-]+", cell)}
    assert set(named) <= flags, set(named) - flags
    assert {"--" + f.name.replace("_", "-") for f in KNOB_FIELDS} <= set(named)


def _command_lines(path: Path) -> list[str]:
    """Shell commands of the file's ```bash blocks: continuations joined, comments dropped, && split."""
    out = []
    for body in blocks(path, "bash"):
        for line in body.replace("\\\n", " ").splitlines():
            out += [c.strip() for c in line.split("#")[0].split("&&") if c.strip()]
    return out


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_command_lines_parse(path: Path) -> None:
    """Each ``spacefusion ...`` line parses with the CLI's own parser; each script named exists."""
    for cmd in _command_lines(path):
        words = shlex.split(cmd)
        if words[0] == "spacefusion":
            try:
                make_parser().parse_args(words[1:])
            except SystemExit as e:
                raise AssertionError(f"{path.name}: {cmd!r} does not parse") from e
        elif words[0] == "python" and words[1].endswith(".py"):
            assert (ROOT / words[1]).is_file(), f"{path.name}: {words[1]} does not exist"


def test_readme_starts_with_the_ci_commands() -> None:
    """.ci/run runs exactly these two lines; the README shows them first."""
    assert blocks(README, "bash")[0] == 'pip install -e ".[tvm,test,ray]" && spacefusion demo\npython -m pytest tests\n'
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install -e ".[tvm,test,ray]" && spacefusion demo' in ci and "python -m pytest tests" in ci


def test_readme_is_short() -> None:
    assert len(README.read_text().splitlines()) <= 200


def test_smg_picture_is_what_the_demo_prints() -> None:
    """The README's picture is lines of the demo's ``print(g)`` and ``print(s)``, in their order."""
    from spacefusion.api import schedule
    from spacefusion.cli import _workload

    g = _workload("mha", [1, 2, 197, 197, 64], "float16")  # spacefusion demo's defaults
    printed = f"{g}\n\n{schedule(g, tiles={'m': 64}, step=32)}".splitlines()
    at = 0
    for line in block_after(README, "<!-- picture:").splitlines():
        assert line in printed[at:], f"not printed by the demo (or out of order): {line!r}"
        at = printed.index(line, at) + 1


@pytest.mark.parametrize("path", [README, ROOT / "docs" / "results.md"], ids=lambda p: p.name)
def test_results_table_is_the_committed_run(path: Path) -> None:
    assert harness_table() in path.read_text(), "regenerate with python experiments/results_table.py"


def test_history_table_is_the_committed_runs() -> None:
    text = (ROOT / "docs" / "results.md").read_text()
    assert history_table() in text, "regenerate with python experiments/results_table.py --history"


def test_results_index_names_every_file() -> None:
    """experiments/results/README.md lists every results file (current and history)."""
    index = (RESULTS / "README.md").read_text()
    files = [p for p in RESULTS.rglob("*") if p.is_file() and p.name != "README.md"]
    assert files
    missing = sorted(p.relative_to(RESULTS).as_posix() for p in files if p.name.split(".")[0] not in index)
    assert not missing, missing


@pytest.mark.parametrize("path", [*DOCS, RESULTS / "README.md"], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(path: Path) -> None:
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
        if "://" not in target:
            assert (path.parent / target).exists(), f"{path.name}: broken link {target}"


def _table_rows_off_their_header(text: str) -> list[str]:
    """Rows of the markdown tables in ``text`` whose cell count is not their header's (``\\|`` escapes)."""
    bad, width = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            width = None
            continue
        cells = len(re.findall(r"(?<!\\)\|", line)) - 1
        if width is None:
            width = cells
        elif cells != width:
            bad.append(line[:80])
    return bad


@pytest.mark.parametrize("path", [*DOCS, RESULTS / "README.md"], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_table_rows_have_their_headers_columns(path: Path) -> None:
    assert _table_rows_off_their_header(path.read_text()) == []


def test_a_row_off_its_header_is_found() -> None:
    text = "| a | b |\n|---|---|\n| 1 | 2 | 3 |\n\n| c |\n|---|\n| 4 |\n"
    assert _table_rows_off_their_header(text) == ["| 1 | 2 | 3 |"]
