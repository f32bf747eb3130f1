"""What the search offers comes from the knobs' declarations (``knob(offer=...)``, ``schedulers.options``): the
walk over them (``search.walk``) nests the offers in ``SEARCH_ORDER``, applies variants, and refuses a value its
knob's declaration refuses; the search's value sets are subsets of the declared ones; a knob's own refusal
codes are declared with it."""

from __future__ import annotations

import dataclasses

import pytest

from schedulers import codes
from schedulers.hardware import A100, H100
from schedulers.knobs import value_refusal
from schedulers.options import (
    DEEP_PRODUCER_STAGES,
    GEMM_STAGES,
    KNOB_FIELDS,
    LANES,
    MORE_SLICES,
    PRODUCER_STAGES,
    SEARCH_LANES,
    SEARCH_ORDER,
    SEARCH_SLICES,
    SEARCH_SPLITS,
    SEARCH_STAGES,
    SEARCH_WARPS,
    SPLITS,
    WIDE_LANES,
)
from search.space import DROPPABLE, SearchSpace
from search.walk import DEFAULTS, NAMES, walk
from smg import patterns, workloads

FIELDS = {f.name: f for f in KNOB_FIELDS}


def _point(values: tuple) -> dict:
    return dict(zip(NAMES, values, strict=True))


def test_the_search_value_sets_are_subsets_of_the_declared_ones() -> None:
    """Before, ``search/space.py`` declared ``SPLITS = (1, 4)`` and ``LANES`` (4 values) under the names of
    ``options.py``'s ``(1, 2, 4, 8)`` and 11 values; now each offered set is named apart and valid."""
    assert set(SEARCH_LANES + WIDE_LANES) <= set(LANES) and set(SEARCH_SPLITS) <= set(SPLITS)
    for name, values in (("stages", SEARCH_STAGES + GEMM_STAGES + PRODUCER_STAGES + DEEP_PRODUCER_STAGES),
                         ("warps", SEARCH_WARPS), ("slices", SEARCH_SLICES + MORE_SLICES),
                         ("lanes", SEARCH_LANES + WIDE_LANES), ("split", SEARCH_SPLITS)):
        assert all(value_refusal(FIELDS[name], v) is None for v in values), name


def test_every_offered_knob_is_walked_once_and_the_droppable_ones_are_declared() -> None:
    offered = [f.name for f in KNOB_FIELDS if f.metadata["offer"] is not None]
    assert sorted(SEARCH_ORDER) == sorted(offered) and len(set(SEARCH_ORDER)) == len(SEARCH_ORDER)
    assert {"unroll", "cluster"}.isdisjoint(SEARCH_ORDER)  # user's knobs: not searched
    assert set(DROPPABLE) == {"mma_row_sums", "wgmma", "tma", "producer", "persistent", "pingpong", "fast_math"}


def test_the_walk_nests_the_offers_in_order_with_each_seeing_those_before_it() -> None:
    offers = {"stages": lambda w: (1, 2), "split": lambda w: (1, 4) if w.stages == 1 else (1,),
              "early_scores": lambda w: (False, True) if w.stages > 1 and w.split == 1 else (False,)}
    got = [(p["stages"], p["split"], p["early_scores"])
           for p in map(_point, walk(("stages", "split", "early_scores"), {}, offers))]
    assert got == [(1, 1, False), (1, 4, False), (2, 1, False), (2, 1, True)]
    assert all(p[k] == DEFAULTS[k] for p in map(_point, walk(("stages",), {}, offers)) for k in NAMES if k != "stages")


def test_a_variant_sets_its_knobs_together_and_they_are_not_offered_again_inside_it() -> None:
    offers = {"producer": lambda w: (False, {"producer": True, "stages": 4}),
              "stages": lambda w: (1, 2), "persistent": lambda w: (0, 7) if w.producer else (0,)}
    got = [(p["producer"], p["stages"], p["persistent"])
           for p in map(_point, walk(("producer", "stages", "persistent"), {}, offers))]
    assert got == [(False, 1, 0), (False, 2, 0), (True, 4, 0), (True, 4, 7)]


def test_the_walk_reads_the_facts_and_refuses_a_value_the_declaration_refuses() -> None:
    offers = {"lanes": lambda w: (w.widest,)}
    assert [_point(p)["lanes"] for p in walk(("lanes",), {"widest": 32}, offers)] == [32]
    with pytest.raises(ValueError, match="lanes=3"):
        list(walk(("lanes",), {"widest": 3}, offers))
    with pytest.raises(ValueError, match="stages=9"):
        list(walk(("producer",), {}, {"producer": lambda w: ({"producer": True, "stages": 9},)}))
    with pytest.raises(AttributeError, match="neither a knob nor a fact"):
        list(walk(("lanes",), {}, offers))
    with pytest.raises(ValueError, match="named like knobs"):
        list(walk(("lanes",), {"stages": 2}, offers))


@pytest.mark.parametrize("hw", [H100, A100], ids=["h100", "a100"])
def test_every_point_the_search_enumerates_holds_values_its_knobs_declare(hw) -> None:
    """The walk checks each offered value; here every point's knobs pass their groups' value checks too."""
    graphs = [workloads.softmax_gemm(256, 512, 64, dtype="float16"), patterns.layernorm(64, 1024, "float16"),
              patterns.gemm_epilogue(256, 256, 128, "relu", True, "float16"),
              patterns.attention(1, 2, 128, 1024, 64, dtype="float16")]
    for g in graphs:
        for k in SearchSpace(g, hw).knobs():
            for f in KNOB_FIELDS:
                assert value_refusal(f, getattr(k, f.name)) is None, (g.name, f.name, getattr(k, f.name))


def test_a_knobs_own_refusal_codes_are_declared_with_it() -> None:
    declared = codes.knob_refusals()
    assert declared["reload_a.no_gemm"] == FIELDS["reload_a"].metadata["refusals"]["no_gemm"]
    assert codes.known("producer.slices") and codes.meaning("producer.slices") == "producer with slices"
    assert not (set(declared) & set(codes.REFUSALS))  # one place each
    assert all(c.split(".")[0] in FIELDS for c in declared)


def test_the_knobs_dataclass_is_the_slicing_choices_then_every_knob() -> None:
    from search.space import Knobs

    names = [f.name for f in dataclasses.fields(Knobs)]
    assert names[7:] == list(NAMES)


def test_the_tensor_core_knobs_refusal_names_what_was_set_and_every_such_knob() -> None:
    from schedulers.errors import ScheduleError
    from schedulers.schedule import make_schedule

    with pytest.raises(ScheduleError) as info:
        make_schedule(patterns.layernorm(64, 256, "float16"), {"m": 1}, stages=2, pingpong=True)
    assert info.value.code == "options.need_tensor_cores" and str(info.value).startswith("stages, pingpong set: ")
    assert all(f.name in str(info.value) for f in KNOB_FIELDS if f.name not in ("lanes", "vector", "unroll",
                                                                                 "cluster"))
