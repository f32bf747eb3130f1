"""A first pick's ranking estimates only the candidates that can reach what its callers read
(``search.cost.within_reach``), and picks what it picked when it estimated them all (issue 55, cold compiles)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from schedulers.hardware import H100
from search.cost import estimate_floor_us, estimate_us
from search.prior import PRIOR_CANDIDATES
from search.space import SearchSpace
from smg.ir import SMG
from smg.patterns import depthwise_conv2d, gemm_epilogue, group_norm, layernorm
from smg.serialize import smg_from_dict
from spacefusion.frontend import families, schedules

DATA = json.loads((Path(__file__).parent / "data" / "cold_picks.json").read_text())["graphs"]


@pytest.fixture(autouse=True)
def _fresh_rankings():
    schedules._RANKED.clear()  # each test ranks anew: a cached order would hide the path under test
    yield
    schedules._RANKED.clear()


@pytest.mark.parametrize("entry", DATA, ids=[e["label"] for e in DATA])
def test_first_picks_are_those_main_ranked_before_the_pruning(entry) -> None:
    """The first five of each representative graph's order (GEMM + GELU, causal attention, LayerNorms, Whisper's
    conv1d, ConvNeXt's depthwise 7x7, a GroupNorm), stored from main before ``within_reach``."""
    g = smg_from_dict(entry["smg"])
    order = schedules.ranked(g, H100, head=schedules.ATTEMPTS)
    assert [s.key for s in order[:schedules.ATTEMPTS]] == entry["head"]


def _graphs() -> list[SMG]:
    return [depthwise_conv2d(2, 14, 14, 32, kernel=7, pad=3, dtype="float16"),
            group_norm(2, 256, 8, 64, act="silu", dtype="float16"),
            layernorm(256, 384, dtype="float16"),
            gemm_epilogue(128, 256, 64, act="gelu", dtype="float16")]


@pytest.mark.parametrize("g", _graphs(), ids=lambda g: g.name)
def test_the_pruned_order_keeps_what_its_readers_read(g, monkeypatch) -> None:
    """Against the order of every candidate estimated (``within_reach`` made the identity): the same head, the
    same prefix the prior scores, the same family entry (``families.kept``)."""
    pruned = schedules.ranked(g, H100, head=schedules.ATTEMPTS)
    schedules._RANKED.clear()
    monkeypatch.setattr("search.cost.within_reach", lambda cands, *a, **k: cands)
    whole = schedules.ranked(g, H100, head=schedules.ATTEMPTS)
    n = min(PRIOR_CANDIDATES, len(whole))
    assert [s.key for s in pruned[:n]] == [s.key for s in whole[:n]]
    assert [s.key for s in families.kept(pruned)] == [s.key for s in families.kept(whole)]
    if g.name.startswith("depthwise"):  # where the pruning has work to do, it does it
        assert len(pruned) < len(whole) / 2


@pytest.mark.parametrize("g", _graphs(), ids=lambda g: g.name)
def test_the_floor_is_below_every_estimate(g) -> None:
    """``estimate_floor_us`` never exceeds ``estimate_us`` (CUDA-core and tensor-core candidates alike)."""
    cands = SearchSpace(g, H100).candidates()
    assert cands
    for s in cands:
        assert estimate_floor_us(s, H100) <= estimate_us(s, H100)
