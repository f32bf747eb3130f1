"""Kernel symbols emitted into CUDA are ASCII C identifiers whatever the graph's name ("größe", "注意"):
nvcc refuses universal characters in a device entity's name.  The user's name stays in the artefact."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from smg.errors import BadNameError
from smg.ops import Builder
from spacefusion.api import build, schedule
from spacefusion.lower.build import c_identifier, kernel_symbol

C_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z", re.ASCII)


def _graph(name: str):
    b = Builder(name, "float16")
    return b.build(b.unary("exp", b.input("X", {"m": 16, "n": 32})))


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60))
def test_any_name_gives_an_ascii_identifier(name: str) -> None:
    frag = c_identifier(name)
    assert C_IDENT.match("sf_" + frag + "_0") and len(frag) <= 40
    assert c_identifier(name) == frag  # deterministic
    if name.isascii():  # ASCII names keep the symbols (and cached cubins) they always had
        assert frag == re.sub(r"\W", "_", name)[:40]


def test_non_ascii_names_keep_distinct_symbols_and_the_display_name() -> None:
    names = ["größe", "grosse", "注意", "注意力", "gro_e"]
    syms = [kernel_symbol(schedule(_graph(n))) for n in names]
    assert syms[0].startswith("sf_groudfe_") and syms[2].startswith("sf_u6ce8u610f_")
    assert len(set(syms)) == len(names) and all(C_IDENT.match(s) for s in syms)
    art = build(schedule(_graph("größe")), "cuda:sm_90a")
    assert art.meta["workload"]["name"] == "größe" and art.meta["kernel_name"] == syms[0]
    assert art.source.isascii()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (compile only, no GPU)")
@pytest.mark.parametrize("name", ["größe", "注意"])
def test_non_ascii_graph_compiles_with_nvcc(name: str, tmp_path: Path) -> None:
    folder = build(schedule(_graph(name)), "cuda:sm_90a").save(tmp_path / "k", cache=None)
    assert (folder / "kernel.cubin").read_bytes()[:4] == b"\x7fELF"


@pytest.mark.parametrize("space", ["größe", "注意"])
def test_non_ascii_space_names_are_refused_by_name(space: str) -> None:
    """Space names become CUDA parameters and artefact params (bound by name): refused when declared."""
    b = Builder("g")
    with pytest.raises(BadNameError, match=f"space name '{space}' of graph 'g' must be an ASCII identifier"):
        b.input(space, {"m": 4})
    with pytest.raises(BadNameError, match="dimension name 'größe' is not an identifier of ASCII letters"):
        b.input("X", {"größe": 4})
