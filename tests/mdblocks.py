"""Fenced code blocks of the repository's markdown files, for the tests that keep the docs true."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: the markdown a newcomer reads: the README and docs/
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks(path: Path, lang: str) -> list[str]:
    """The bodies of the ```lang blocks of ``path``, in order."""
    return [body for kind, body in _FENCE.findall(path.read_text()) if kind == lang]


def block_after(path: Path, marker: str) -> str:
    """The body of the first fenced block after the line holding ``marker``."""
    text = path.read_text()
    at = text.index(marker)
    m = _FENCE.search(text, at)
    assert m is not None, f"no code block after {marker!r} in {path}"
    return m.group(2)
