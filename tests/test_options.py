"""Typed option groups: the knobs check themselves with structured rejections, everything else about
them is derived from the groups, and every committed schedule still loads with the same key."""

from __future__ import annotations

import dataclasses
import glob
import json
from pathlib import Path

import numpy as np
import pytest

from schedulers.codes import known
from schedulers.errors import ScheduleError
from schedulers.hardware import H100
from schedulers.options import GROUPS, KNOB_FIELDS, KNOB_GROUP, HopperOptions, WarpTileOptions, split_knobs
from schedulers.schedule import Schedule, make_schedule
from search.space import DROPPABLE, Knobs, SearchSpace
from smg import patterns as P
from smg.hashing import canonical_text, text_key
from smg.workloads import gemm

REPO = Path(__file__).resolve().parents[1]


def _committed_schedules() -> list[dict]:
    found = []

    def walk(o: object) -> None:
        if isinstance(o, dict):
            if o.get("format") == "spacefusion-schedule/1" and "smg" in o:
                found.append(o)
            for v in o.values():
                walk(v)
        elif isinstance(o, list):
            for v in o:
                walk(v)

    for f in sorted(glob.glob(str(REPO / "experiments" / "**" / "*.json"), recursive=True)):
        walk(json.loads(Path(f).read_text()))
    return found


def test_every_committed_schedule_loads_with_its_key_unchanged() -> None:
    """The groups serialise as the flat knobs did (non-defaults only), so a record written before them
    reads back to the same content, and so to the same key: no migration of keys was needed."""
    records = _committed_schedules()
    assert len(records) > 1000
    groups_used = set()
    for d in records:
        s = Schedule._from_dict(d)
        assert s.key == text_key(canonical_text(d)), d.get("block")
        groups_used |= {g for g in GROUPS if getattr(s, g) != GROUPS[g]()}
    assert groups_used == set(GROUPS)  # the corpus exercises every group


def test_a_knob_is_read_through_its_group() -> None:
    s = make_schedule(P.attention(1, 2, 128, 128, 64, dtype="float16"), tiles={"m": 64}, step=64,
                      tensor_cores=True, stages=2, wgmma=True)
    assert s.stages == s.warp.stages == 2 and s.wgmma is s.hopper.wgmma is True and s.lanes == s.simt.lanes == 1
    with pytest.raises(AttributeError, match="no attribute 'stagez'"):
        _ = s.stagez


@pytest.mark.parametrize("knobs,code,knob", [
    ({"stages": 0}, "stages.range", "stages"),
    ({"split": 3}, "split.range", "split"),
    ({"lanes": 3}, "lanes.range", "lanes"),
    ({"stages": 2.5}, "stages.type", "stages"),
    ({"reload_a": "yes"}, "reload_a.type", "reload_a"),
    ({"wgmma": True}, "options.need_tensor_cores", None),
    ({"vector": 8}, "vector.width", "vector"),  # 8 float32 are 32 bytes, one load moves 16
])
def test_refusals_carry_a_code_and_the_knob_to_blame(knobs, code, knob) -> None:
    g = P.layernorm(4, 64)  # float32 rows of 64
    with pytest.raises(ScheduleError) as info:
        make_schedule(g, **knobs)
    assert info.value.code == code and info.value.knob == knob and str(info.value)


def test_an_unknown_option_lists_the_known_ones() -> None:
    with pytest.raises(ScheduleError, match="unknown schedule option 'stagess'; options are") as info:
        make_schedule(gemm(16, 16, 16), stagess=2)
    assert info.value.code == "option.unknown"


def test_search_counts_rejections_by_code() -> None:
    space = SearchSpace(gemm(256, 256, 64, dtype="float16"), H100)
    space.candidates()
    codes = set(space.report.pruned)
    assert codes and all("." in c and known(c) for c in codes), codes  # of the table (schedulers.codes)
    assert not any(" " in c for c in codes)  # codes, never sentences


def test_knobs_the_search_and_the_cli_are_derived_from_the_groups() -> None:
    from spacefusion.cli import make_parser

    names = [f.name for f in KNOB_FIELDS]
    assert set(names) == set(KNOB_GROUP)
    assert [f.name for f in dataclasses.fields(Knobs)][-len(names):] == names
    assert set(DROPPABLE) <= set(names)
    help_text = make_parser()._subparsers._group_actions[0].choices["build"].format_help()
    for n in names:
        assert f"--{n.replace('_', '-')}" in help_text, n
    assert split_knobs({"stages": 2, "tma": True}) == {"simt": GROUPS["simt"](), "warp": WarpTileOptions(stages=2),
                                                       "hopper": HopperOptions(tma=True)}


def test_every_knob_is_seen_by_a_feature_and_owns_its_column() -> None:
    """Every knob names the feature that sees it; a knob with an encoding gets its own column, generated
    from the group (a new knob reaches the learned model without editing search/features.py), and its
    column moves with its value."""
    from search.features import FEATURE_NAMES, KNOB_COLUMNS, features

    for f in KNOB_FIELDS:
        assert f.metadata["feature"] in FEATURE_NAMES, f.name
    owned = [name for name, _, _ in KNOB_COLUMNS]
    assert len(owned) == len(set(owned)) and "unroll" in owned and "stages" in owned
    g = P.layernorm(4, 96)
    base, on = make_schedule(g, step=32), make_schedule(g, step=32, unroll=True)
    a, b = features(base, H100), features(on, H100)
    i = FEATURE_NAMES.index("unroll")
    assert (a[i], b[i]) == (0.0, 1.0)
    assert np.array_equal(np.delete(a, i), np.delete(b, i))


def test_unroll_the_knob_added_through_its_group_only() -> None:
    """``unroll`` was added as one field and one check in SimtOptions and one line of the lowering; its
    JSON, CLI flag and search Knobs field came from the group.  It changes the loop, not the result."""
    import numpy as np

    from smg.reference import check_numerics, evaluate, random_inputs
    from spacefusion.api import build
    from spacefusion.lower.tir import build_primfunc

    g = P.layernorm(4, 96)
    plain, unrolled = make_schedule(g, step=32), make_schedule(g, step=32, unroll=True)
    assert unrolled.key != plain.key and Schedule.from_json(unrolled.to_json()) == unrolled
    assert '"unroll": true' in unrolled.to_json() and "unroll" not in plain.to_json()
    assert "unroll" in [f.name for f in dataclasses.fields(Knobs)]
    assert "T.unroll(" in build_primfunc(unrolled, "llvm").script()
    assert "T.unroll(" not in build_primfunc(plain, "llvm").script()
    loops = [build(x, "cuda:sm_90a").source.count("for (") for x in (plain, unrolled)]
    assert loops[1] < loops[0], loops  # TVM unrolls the lane's loop in the CUDA it writes
    x = random_inputs(g, 0)
    err, problem = check_numerics(g, evaluate(g, x), build(unrolled, "llvm")(x))
    assert problem is None and np.isfinite(err)
    with pytest.raises(ScheduleError) as info:
        make_schedule(g, step=96, lanes=1, unroll=True, tiles={"m": 1})
    assert info.value.code == "unroll.too_long" and info.value.knob == "unroll"
    with pytest.raises(ScheduleError) as info:
        make_schedule(g, step=32, vector=4, unroll=True)
    assert info.value.code == "unroll.not_simt_scalar"



@pytest.mark.parametrize("bad,code", [({"lanes": True}, "lanes.type"), ({"stages": np.int64(2)}, None),
                                      ({"reload_a": 1}, None), ({"reload_a": 2}, "reload_a.type"),
                                      ({"wgmma": 1.0}, "wgmma.type")])
def test_the_checks_cache_tells_true_from_one(bad, code) -> None:
    """``split_knobs`` and ``check_values`` are cached by each value with its type, so a value equal to an
    accepted one but of another type (``True`` for lanes 1, ``1.0`` for a flag) is still refused, in either
    order, and numpy integers and 0/1 flags are still coerced as before."""
    from schedulers.knobs import check_values

    name, value = next(iter(bad.items()))
    good = {name: 1 if KNOB_GROUP[name] == "simt" or name == "stages" else True}
    for order in ((good, bad), (bad, good)):
        for knobs in order:
            groups = split_knobs(knobs)
            got = check_values(groups[KNOB_GROUP[name]])
            want = code if knobs is bad else None
            assert (got.code if got else None) == want, (knobs, got)


def test_a_search_ranks_the_same_schedules_whatever_was_cached_before() -> None:
    """The caches of the options and memory levels are pure: a space enumerated twice, and after another
    graph's, gives the same schedules with the same keys, each equal to the digest of its own JSON."""
    from smg.hashing import content_key

    g = P.attention(1, 2, 64, 64, 32, dtype="float16")
    first = [s.key for s in SearchSpace(g, H100).candidates()]
    SearchSpace(gemm(128, 64, 64, dtype="float16"), H100).candidates()
    again = SearchSpace(g, H100).candidates()
    assert [s.key for s in again] == first and len(first) > 100
    for s in again[::37]:
        assert s.key == content_key(s.to_dict())
