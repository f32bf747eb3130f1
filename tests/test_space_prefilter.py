"""The search refuses tensor-core knob sets with no warp-tile program before building their Schedules
(``SearchSpace._no_program``): the candidates and every count of the report are those it finds building each."""

from __future__ import annotations

import pytest

from schedulers.hardware import H100
from search.space import SearchSpace
from smg import patterns

GRAPHS = {
    "gemm": lambda: patterns.gemm_epilogue(256, 256, 64, "relu", True, "float16"),
    "linear_nk": lambda: patterns.gemm_epilogue(96, 128, 64, "gelu", True, "float16", b_layout="nk"),
    "small_m": lambda: patterns.gemm_epilogue(8, 256, 128, "tanh", True, "float16"),
    "attention_causal": lambda: patterns.attention(1, 2, 128, 128, 64, causal=True),
    "attention_gqa": lambda: patterns.attention(1, 4, 64, 96, 32, kv_heads=2),
    "conv": lambda: patterns.conv2d(1, 8, 8, 16, 32, dtype="float16"),
    "layernorm": lambda: patterns.layernorm(64, 256, dtype="float16"),
}


@pytest.mark.parametrize("name", list(GRAPHS))
def test_the_prefilter_changes_nothing_the_search_finds(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    smg = GRAPHS[name]()
    found, skipped = [], []
    original = SearchSpace._no_program

    def counted(self: SearchSpace, k):  # noqa: ANN001, ANN202
        code = original(self, k)
        skipped.append(code is not None)
        return code

    monkeypatch.setattr(SearchSpace, "_no_program", counted)
    for on in (True, False):
        monkeypatch.setattr(SearchSpace, "prefilter", on)
        space = SearchSpace(smg, H100)
        keys = sorted(s.key for s in space.candidates())
        r = space.report
        found.append((keys, dict(sorted(r.pruned.items())), r.total, r.valid, r.fits))
    assert found[0] == found[1]
    assert found[0][0], name  # something to find: the comparison is not of two empty searches
    assert any(skipped), name  # and the prefilter refused some knob sets unbuilt
