"""The search leaves out, unbuilt, tensor-core knob sets that make_schedule would refuse, and finds the same:

- the prefilter (``SearchSpace._no_program``) refuses a knob set with no warp-tile program before building its
  Schedule: the candidates and every count of the report are those it finds building each;
- the forms analysis (``SearchSpace.analyse_forms``: the graph's tensor-core forms derived once per serial dim,
  and wgmma left without a split) enumerates fewer knob sets: the candidates are the same, in the same order
  (what the tuner ranks, and its first pick), the valid and fitting counts too."""

from __future__ import annotations

import pytest

from schedulers.hardware import A100, H100, HardwareModel
from search.space import SearchSpace
from smg import patterns, workloads

GRAPHS = {
    "gemm": lambda: patterns.gemm_epilogue(256, 256, 64, "relu", True, "float16"),
    "linear_nk": lambda: patterns.gemm_epilogue(96, 128, 64, "gelu", True, "float16", b_layout="nk"),
    "small_m": lambda: patterns.gemm_epilogue(8, 256, 128, "tanh", True, "float16"),
    "attention_causal": lambda: patterns.attention(1, 2, 128, 128, 64, causal=True),
    "attention_gqa": lambda: patterns.attention(1, 4, 64, 96, 32, kv_heads=2),
    "mha": lambda: workloads.mha(2, 4, 128, 128, 64),
    "softmax_gemm": lambda: workloads.softmax_gemm(256, 512, 64),
    "conv": lambda: patterns.conv2d(1, 8, 8, 16, 32, dtype="float16"),
    "layernorm": lambda: patterns.layernorm(64, 256, dtype="float16"),
}


def _search(smg, hw: HardwareModel) -> tuple[list[str], dict[str, int], int, int, int]:
    space = SearchSpace(smg, hw)
    keys = [s.key for s in space.candidates()]  # in the order found: the tuner ranks them, ties by this order
    r = space.report
    return keys, dict(sorted(r.pruned.items())), r.total, r.valid, r.fits


#: every graph on the H100 (sm_90a: wgmma on), and the four the issue names on the A100 (sm_80: none)
CASES = [(n, H100) for n in GRAPHS] + [(n, A100) for n in ("mha", "softmax_gemm", "gemm", "layernorm")]


@pytest.mark.parametrize("name,hw", CASES, ids=[f"{n}-{hw.name}" for n, hw in CASES])
def test_the_prefilter_and_the_forms_change_nothing_the_search_finds(name: str, hw: HardwareModel,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    smg = GRAPHS[name]()
    skipped = []
    original = SearchSpace._no_program

    def counted(self: SearchSpace, k):  # noqa: ANN001, ANN202
        code = original(self, k)
        skipped.append(code is not None)
        return code

    monkeypatch.setattr(SearchSpace, "_no_program", counted)
    found = {}
    for forms, prefilter in ((True, True), (True, False), (False, True)):
        monkeypatch.setattr(SearchSpace, "analyse_forms", forms)
        monkeypatch.setattr(SearchSpace, "prefilter", prefilter)
        skipped.clear()
        found[forms, prefilter] = _search(smg, hw), any(skipped)
    (plain, _), (built, _), (before, prefiltered) = found[True, True], found[True, False], found[False, True]
    assert plain == built  # the prefilter: candidates, their order and every count of the report
    assert plain[0] == before[0] and plain[3:] == before[3:]  # the forms: candidates, their order, valid, fits
    assert plain[2] <= before[2] and all(n <= before[1].get(c, 0) for c, n in plain[1].items())  # fewer refused
    assert plain[0], name  # something to find: the comparison is not of two empty searches
    assert prefiltered, name  # and the prefilter refused some knob sets unbuilt (without the forms analysis)
