"""make_schedule: block dims, serial dim, memory levels, printing, JSON and errors."""

from __future__ import annotations

import dataclasses
import json
import re
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedulers.errors import ScheduleError, TemporalSliceError
from schedulers.hardware import PRESETS, HardwareError, get_hardware
from schedulers.schedule import FORMAT, LEVELS, Schedule, make_schedule
from smg.workloads import gemm, mha, softmax_gemm

HEX64 = re.compile(r"[0-9a-f]{64}")


@cache
def mha_schedule(step: int = 32) -> Schedule:
    return make_schedule(mha(2, 4, 256, 512, 64), tiles={"m": 64}, step=step)


# -- make_schedule for mha ------------------------------------------------------------------------


def test_mha_block_dims_and_tiles() -> None:
    s = mha_schedule()
    assert s.block == (("b", 1), ("h", 1), ("m", 64))
    assert s.tiles == {"b": 1, "h": 1, "m": 64}
    assert s.thread_dim == "m"
    assert s.threads == 64
    assert s.grid() == {"b": 2, "h": 4, "m": 4}
    assert s.num_blocks == 32


def test_mha_serial_dim_is_picked_automatically() -> None:
    s = mha_schedule()
    assert s.serial == "l"  # not d: slicing l removes K, V, S, P from on-chip memory
    assert s.step == 32
    assert s.num_steps == 16
    assert s.plan.serial == "l"
    assert [u.state for u in s.plan.states] == ["P_max", "P_sum", "O"]


def test_mha_memory_levels() -> None:
    s = mha_schedule()
    assert [n for n, _ in s.memory] == [sp.name for sp in s.smg.spaces]
    assert all(lvl in LEVELS for _, lvl in s.memory)
    assert s.level("K") == "shared"
    assert s.level("V") == "shared"
    assert s.level("Q") == "global"
    assert s.level("S") == "register"
    assert s.level("Ss") == "register"
    assert s.level("P") == "inlined"
    assert s.level("P_exp") == "inlined"
    assert s.level("P_sub") == "inlined"
    assert s.level("P_max") == "register"
    assert s.level("P_sum") == "register"
    assert s.level("O") == "register"  # the output is accumulated in registers


def test_default_tiles() -> None:
    s = make_schedule(mha(2, 3, 40, 50, 8))
    assert s.tiles == {"b": 1, "h": 1, "m": 40}  # thread dim gets min(64, size), others 1
    s = make_schedule(mha(2, 3, 100, 50, 8), step=7)
    assert s.tiles["m"] == 64 and s.grid()["m"] == 2 and s.num_steps == 8


def test_gemm_and_softmax_gemm_schedules() -> None:
    g = make_schedule(gemm(128, 96, 64), tiles={"m": 32, "n": 16}, step=16)
    assert g.block == (("m", 32), ("n", 16))
    assert g.thread_dim == "n"  # innermost cut output dim
    assert g.serial == "k" and g.num_steps == 4
    assert [u.state for u in g.plan.states] == ["C"]
    assert g.plan.states[0].correction == "1"
    sg = make_schedule(softmax_gemm(100, 70, 16), tiles={"m": 32}, step=10)
    assert sg.block == (("m", 32),) and sg.serial == "l" and sg.grid() == {"m": 4}
    # V is read by every thread of the block each step; each thread reads its own row of S
    assert sg.level("V") == "shared" and sg.level("S") == "global"


def test_thread_dim_can_be_chosen() -> None:
    s = make_schedule(gemm(64, 64, 16), thread_dim="m", tiles={"m": 32, "n": 8}, step=8)
    assert s.thread_dim == "m" and s.threads == 32 * 8  # one thread per element of the block tile
    # both inputs lack a cut dim with tile > 1: each is shared by several threads, staged per step
    assert s.level("A") == "shared" and s.level("B") == "shared"


def test_block_tile_larger_than_a_thread_block_is_refused() -> None:
    with pytest.raises(ScheduleError, match="at most 1024"):
        make_schedule(gemm(64, 64, 16), tiles={"m": 64, "n": 32}, step=8)


def test_str_shows_update_functions_and_reasons() -> None:
    s = mha_schedule()
    text = str(s)
    names = tuple(u.state for u in s.plan.states)
    for u in s.plan.states:
        assert u.describe("l", names) in text
    assert "P_max' = max(P_max, max_l Ss)" in text
    assert "P_sum' = P_sum * exp(" in text
    assert "O' = O * exp(" in text
    assert "broadcast postposition: factor 1/P_sum" in text
    assert "finalize: O = O/P_sum" in text
    for d in s.spatial:
        assert d.reason in text
    assert "serial dim l, step 32 (16 steps)" in text
    assert "cut, tile 64 (4 blocks)" in text
    assert s.key[:12] in text
    assert "K:shared" in text and "P:inlined" in text and "O:register" in text


# -- JSON round trip and keys ---------------------------------------------------------------------


@pytest.mark.parametrize("factory", [
    lambda: mha_schedule(),
    lambda: make_schedule(softmax_gemm(33, 17, 5), tiles={"m": 8}, step=4),
    lambda: make_schedule(gemm(9, 7, 5), tiles={"m": 2, "n": 3}, step=2),
])
def test_json_round_trip(factory) -> None:
    s = factory()
    text = s.to_json()
    back = Schedule.from_json(text)
    assert back == s
    assert back.key == s.key
    assert HEX64.fullmatch(s.key)
    assert back.to_json() == text
    assert json.loads(text)["format"] == FORMAT
    assert str(back) == str(s)


def test_key_is_deterministic_and_tracks_decisions() -> None:
    a = make_schedule(gemm(16, 16, 16), step=4)
    b = make_schedule(gemm(16, 16, 16), step=4)
    assert a is not b and a.key == b.key
    assert make_schedule(gemm(16, 16, 16), step=8).key != a.key
    assert make_schedule(gemm(16, 16, 16), step=4, tiles={"n": 8}).key != a.key
    assert dataclasses.replace(a, step=2).key != a.key
    assert make_schedule(gemm(16, 16, 32), step=4).key != a.key
    assert mha_schedule(16).key != mha_schedule(32).key


def test_edited_json_changes_the_key() -> None:
    s = make_schedule(gemm(16, 16, 16), step=4)
    d = json.loads(s.to_json())
    d["step"] = 8
    t = Schedule.from_json(json.dumps(d))
    assert t.step == 8 and t.key != s.key and t != s


@pytest.mark.parametrize("text", ["", "{", "not json", '{"format": ', "{'format': 1}"])
def test_corrupt_json_raises_schedule_error(text: str) -> None:
    with pytest.raises(ScheduleError, match="not valid JSON"):
        Schedule.from_json(text)


def test_truncated_schedule_json_raises_schedule_error() -> None:
    text = make_schedule(gemm(8, 8, 8), step=2).to_json()
    with pytest.raises(ScheduleError, match="not valid JSON"):
        Schedule.from_json(text[: len(text) // 2])


@pytest.mark.parametrize("tag", ["spacefusion-schedule/0", "spacefusion-schedule/2", "", None])
def test_wrong_format_tag_raises_schedule_error(tag) -> None:
    d = json.loads(make_schedule(gemm(8, 8, 8), step=2).to_json())
    d["format"] = tag
    with pytest.raises(ScheduleError, match="not a spacefusion schedule") as exc:
        Schedule.from_json(json.dumps(d))
    assert repr(tag) in str(exc.value)


def test_missing_format_tag_raises_schedule_error() -> None:
    d = json.loads(make_schedule(gemm(8, 8, 8), step=2).to_json())
    del d["format"]
    with pytest.raises(ScheduleError, match="format tag None"):
        Schedule.from_json(json.dumps(d))


@pytest.mark.parametrize("text", ["[]", "null", '"schedule"', "3", '{"format": "spacefusion-schedule/1"}'])
def test_non_object_or_incomplete_json_raises_schedule_error(text: str) -> None:
    with pytest.raises(ScheduleError):
        Schedule.from_json(text)


# -- errors ---------------------------------------------------------------------------------------


def test_tile_larger_than_dim() -> None:
    with pytest.raises(ScheduleError) as exc:
        make_schedule(gemm(8, 6, 4), tiles={"n": 7}, step=2)
    msg = str(exc.value)
    assert "'n'" in msg and "7" in msg and "(6)" in msg and "larger than the dim" in msg


@pytest.mark.parametrize("tile", [0, -4])
def test_non_positive_tile(tile: int) -> None:
    with pytest.raises(ScheduleError, match=rf"tile {tile} for dim 'm'.*not positive"):
        make_schedule(gemm(8, 8, 8), tiles={"m": tile}, step=2)


def test_tile_for_reduced_dim_gives_the_reason() -> None:
    with pytest.raises(ScheduleError) as exc:
        make_schedule(gemm(8, 8, 8), tiles={"k": 4}, step=2)
    msg = str(exc.value)
    assert "dim 'k' cannot be cut spatially" in msg
    assert "All-to-One along k in C" in msg


def test_tile_for_broadcast_dim_gives_the_reason() -> None:
    with pytest.raises(ScheduleError) as exc:
        make_schedule(mha(1, 1, 16, 16, 8), tiles={"n": 4}, step=4)
    msg = str(exc.value)
    assert "dim 'n' cannot be cut spatially" in msg
    assert "One-to-All along n from intermediate P" in msg


def test_tile_for_unknown_dim() -> None:
    with pytest.raises(ScheduleError, match="unknown dim 'z'"):
        make_schedule(gemm(8, 8, 8), tiles={"z": 2}, step=2)


def test_unknown_serial_dim() -> None:
    with pytest.raises(ScheduleError, match="serial dim 'z' is not a dim of 'gemm'"):
        make_schedule(gemm(8, 8, 8), serial="z", step=2)


def test_serial_dim_that_nothing_reduces() -> None:
    with pytest.raises(TemporalSliceError, match="nothing to slice"):
        make_schedule(gemm(8, 8, 8), serial="m", step=2)


def test_step_larger_than_dim() -> None:
    with pytest.raises(ScheduleError) as exc:
        make_schedule(gemm(8, 8, 5), step=6)
    msg = str(exc.value)
    assert "step 6" in msg and "'k'" in msg and "(5)" in msg
    with pytest.raises(ScheduleError, match="step 40 for serial dim 'l'"):
        make_schedule(mha(1, 1, 8, 33, 4), step=40)


@pytest.mark.parametrize("step", [0, -1])
def test_non_positive_step(step: int) -> None:
    with pytest.raises(ScheduleError, match=f"step {step}"):
        make_schedule(gemm(8, 8, 8), step=step)


def test_thread_dim_must_be_cut() -> None:
    with pytest.raises(ScheduleError, match="thread dim 'k' is not a spatially cut dim"):
        make_schedule(gemm(8, 8, 8), thread_dim="k", step=2)


def test_unplannable_graph_is_refused_by_make_schedule() -> None:
    from smg import Builder

    g = Builder("inverse_deviation")
    x = g.input("X", {"m": 4, "l": 16})
    inv = g.map("1/(X - Xsum)", x, g.reduce(x, "l", "sum", name="Xsum"), name="inv")
    with pytest.raises(TemporalSliceError, match="not closed under differentiation"):
        make_schedule(g.build(g.reduce(inv, "l", "sum", name="acc")), step=4)


def test_automatic_serial_dim_is_one_the_temporal_slicer_accepts() -> None:
    from smg import Builder

    g = Builder("wide_head")
    q = g.input("Q", {"m": 16, "d": 64})
    k = g.input("K", {"l": 2, "d": 64})
    v = g.input("V", {"l": 2, "n": 1})
    s = g.matmul(q, k, "d", name="S")
    o = g.matmul(g.softmax(s, "l", name="P"), v, "l", name="O")
    smg = g.build(o)
    assert make_schedule(smg, serial="l", step=1).serial == "l"  # l is a valid choice
    assert make_schedule(smg, step=1).serial == "l"


def test_the_spliced_key_is_the_content_key_of_the_schedule() -> None:
    """``Schedule.key`` splices the cached canonical texts of the SMG, the plan and the spatial decisions
    (shared by a search's candidates) into the rest: the digest is the sha256 of ``to_dict``'s canonical form,
    as a database written before the splice keyed it."""
    from schedulers.hardware import H100
    from search.space import SearchSpace
    from smg.hashing import content_key
    from smg.patterns import gemm_epilogue

    for g in (gemm_epilogue(64, 64, 64, "gelu", True, "float16", stack=3), mha(1, 2, 64, 64, 32)):
        cands = SearchSpace(g, H100).candidates()
        assert len(cands) > 50
        for s in cands[:: max(1, len(cands) // 40)]:
            assert s.key == content_key(s.to_dict())


def test_ring_depth_up_to_eight_and_a_clear_error_past_it() -> None:
    """Deep-K GEMMs want 6-8 ring slots (BERT's FFN output GEMM: 16.0 us at 8 against 24.1 in slices of 3);
    past 8 the schedule is refused by name, before any lowering."""
    from smg import patterns

    g = patterns.gemm_epilogue(256, 256, 1024, "none", True, "float16")
    s = make_schedule(g, {"m": 128, "n": 64}, serial="k", step=64, tensor_cores=True, stages=8, warps=8,
                      wgmma=True, tma=True, producer=True)
    assert s.stages == 8 and s.producer
    with pytest.raises(ScheduleError, match="stages 9 must be 1..8"):
        make_schedule(g, {"m": 128, "n": 64}, serial="k", step=64, tensor_cores=True, stages=9, wgmma=True)


@settings(max_examples=60, deadline=None)
@given(st.one_of(st.floats(allow_nan=True), st.booleans(), st.text(max_size=3), st.none(),
                 st.fractions(), st.decimals(allow_nan=False)))
def test_a_tile_that_is_not_an_int_is_refused_naming_dim_and_value(tile: object) -> None:
    """``int()`` used to truncate ``{'m': 2.5}`` to 2 (and read True as 1): the schedule built was not the
    one asked for.  Any non-int tile is now a ScheduleError with the dim and the value."""
    with pytest.raises(ScheduleError, match=r"tile .* for dim 'm' must be a whole number") as info:
        make_schedule(gemm(8, 8, 8), tiles={"m": tile}, step=2)
    assert info.value.code == "tile.type" and repr(tile) in str(info.value)


def test_reported_tile_cases_through_the_api() -> None:
    import numpy as np

    from spacefusion.api import schedule

    g = mha(1, 2, 32, 32, 16)
    with pytest.raises(ScheduleError, match=r"^tile 2.5 for dim 'm' must be a whole number \(an int\), not float$"):
        schedule(g, tiles={"m": 2.5})
    with pytest.raises(ScheduleError, match=r"^tile True for dim 'm' must be a whole number \(an int\), not bool$"):
        schedule(g, tiles={"m": True})
    assert dict(schedule(g, tiles={"m": np.int64(16)}).block)["m"] == 16  # numpy ints are ints


GPUS = [n for n, m in PRESETS.items() if m.kind == "gpu"]


@pytest.mark.parametrize("name", [*GPUS, *(n.upper() for n in GPUS), "H100-SXM", " nvidia h200 "])
def test_hw_may_be_a_preset_name(name: str) -> None:
    from spacefusion.api import schedule

    g = gemm(8, 8, 8)
    assert schedule(g, step=2, hw=name) == schedule(g, step=2, hw=get_hardware(name))


def test_the_named_preset_is_the_one_used() -> None:
    """The NPU preset allows one thread per block (a placeholder): named by string, its limit applies."""
    with pytest.raises(ScheduleError, match="at most 1 on NPU"):
        make_schedule(gemm(8, 8, 8), step=2, hw="NPU")


def test_unknown_hw_name_lists_the_known_ones() -> None:
    from spacefusion.api import schedule

    with pytest.raises(HardwareError, match=r"unknown hardware 'b200'; known: v100, a100, h100, h200, npu"):
        schedule(gemm(8, 8, 8), step=2, hw="b200")
    with pytest.raises(HardwareError, match=r"hw must be a HardwareModel or a preset name .*; got int 100"):
        schedule(gemm(8, 8, 8), step=2, hw=100)
