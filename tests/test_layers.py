"""Layers import only downward, read from the source (every import, lazy ones inside functions too).

smg < schedulers < search < spacefusion; only ``spacefusion/lower/`` imports TVM; the GPU runtime
imports nothing of the compiler (it runs where TVM, islpy and xgboost are absent).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAYERS = ("smg", "schedulers", "search", "spacefusion")
TVM = ("tvm", "tvm_ffi")
RUNTIME_MAY_IMPORT = ("spacefusion.runtime", "smg", "search.records")


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``path``; relative imports resolved against its package."""
    rel = path.relative_to(REPO).with_suffix("")
    package = list(rel.parts[:-1])  # a module's package; an __init__'s is its own folder, the same parts
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((node.lineno, mod))
            out += [(node.lineno, f"{mod}.{a.name}") for a in node.names]  # ``from . import gpu``: a module
    return out


def _sources(layer: str) -> list[Path]:
    return sorted((REPO / layer).rglob("*.py"))


def _violations(layer: str, allowed: tuple[str, ...]) -> list[str]:
    ours = set(LAYERS)
    bad = []
    for path in _sources(layer):
        for line, mod in _imports(path):
            top = mod.split(".")[0]
            if top in ours and top not in allowed:
                bad.append(f"{path.relative_to(REPO)}:{line} imports {mod}")
            if top in TVM and not path.relative_to(REPO).as_posix().startswith("spacefusion/lower/"):
                bad.append(f"{path.relative_to(REPO)}:{line} imports {mod} (only spacefusion/lower/ imports TVM)")
    return bad


@pytest.mark.parametrize("layer", LAYERS)
def test_layers_import_only_downward(layer: str) -> None:
    allowed = LAYERS[: LAYERS.index(layer) + 1]
    assert _violations(layer, allowed) == []


def test_the_gpu_runtime_imports_nothing_of_the_compiler() -> None:
    bad = []
    for path in _sources("spacefusion/runtime"):
        for line, mod in _imports(path):
            top = mod.split(".")[0]
            if top in LAYERS and not any(mod == m or mod.startswith(m + ".") for m in RUNTIME_MAY_IMPORT):
                bad.append(f"{path.relative_to(REPO)}:{line} imports {mod}")
            if top in (*TVM, "islpy", "xgboost"):
                bad.append(f"{path.relative_to(REPO)}:{line} imports {mod}")
    assert bad == []


def test_the_reader_sees_real_imports() -> None:
    """The checker itself: it finds lazy imports inside functions and resolves relative ones."""
    found = dict((m, n) for n, m in _imports(REPO / "spacefusion" / "runtime" / "batch.py"))
    assert "search.records" in found and "spacefusion.runtime.gpu" in found and "smg.reference" in found
    assert any(m.startswith("spacefusion.api") for _, m in _imports(REPO / "spacefusion" / "runners" / "builder.py"))
