"""Every ```python block of the README and of docs/ runs (CPU path, in a scratch folder).

A file's blocks run in order in one namespace, as a reader would paste them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.mdblocks import DOCS, ROOT, blocks

WITH_PYTHON = [p for p in DOCS if blocks(p, "python")]


def test_the_readme_has_a_python_example() -> None:
    assert ROOT / "README.md" in WITH_PYTHON


@pytest.mark.parametrize("path", WITH_PYTHON, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_python_blocks_run(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the example writes out/mha
    namespace: dict[str, object] = {"__name__": "__main__"}
    for i, body in enumerate(blocks(path, "python")):
        exec(compile(body, f"{path.name} python block {i + 1}", "exec"), namespace)  # noqa: S102
