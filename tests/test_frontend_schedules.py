"""The first pick with nothing measured (frontend.schedules.model_pick), which the GPU path builds from."""

from __future__ import annotations

import pytest

from schedulers.errors import ScheduleError
from schedulers.hardware import H100
from smg import patterns
from spacefusion.frontend.schedules import model_pick, ranked


def test_model_pick_moves_past_schedules_the_lowering_refuses() -> None:
    g = patterns.gemm_epilogue(64, 64, 64, "relu", True, "float16")
    order = ranked(g, H100)
    assert len(order) > 3
    seen: list[str] = []

    def build(s) -> None:
        seen.append(s.key)
        if len(seen) < 3:
            raise ScheduleError("refused by the lowering")

    s, tried = model_pick(g, H100, build=build)
    assert tried == 3 and s.key == order[2].key and seen == [o.key for o in order[:3]]
    assert model_pick(g, H100)[0].key == order[0].key


def test_model_pick_names_the_last_error_when_nothing_builds() -> None:
    g = patterns.gemm_epilogue(64, 64, 64, "relu", True, "float16")

    def refuse(s) -> None:
        raise ScheduleError("no such kernel")

    with pytest.raises(RuntimeError, match="none of the 2 best schedules .* no such kernel"):
        model_pick(g, H100, build=refuse, attempts=2)


@pytest.mark.parametrize("graph", [
    lambda: patterns.attention(8, 12, 128, 128, 64, dtype="float16"),  # BERT's: the CUDA-core candidates skipped
    lambda: patterns.gemm_epilogue(8, 256, 256, "tanh", True, "float16"),  # a GEMV's: kept, they may lead
    lambda: patterns.layernorm(64, 512, dtype="float16"),  # no tensor-core form
], ids=["attention", "gemv", "layernorm"])
def test_a_first_picks_head_is_the_whole_orders_head(graph, monkeypatch: pytest.MonkeyPatch) -> None:
    """``ranked(head=k)`` leaves out only candidates that cannot reach the first ``k``: those ``k`` are the
    whole order's, in its order (``head_veto``'s argument), and a whole order cached serves a head."""
    from spacefusion.frontend import schedules

    g = graph()
    monkeypatch.setattr(schedules, "_RANKED", type(schedules._RANKED)())
    head = ranked(g, H100, head=5)
    monkeypatch.setattr(schedules, "_RANKED", type(schedules._RANKED)())
    whole = ranked(g, H100)
    assert [s.key for s in head[:5]] == [s.key for s in whole[:5]]
    assert len(head) <= len(whole)
    if g.name == "attention":  # the veto fired: only the tensor-core candidates were enumerated
        assert len(head) < len(whole) and all(s.tensor_cores for s in head)
    assert ranked(g, H100, head=5) == whole  # the whole order, now cached, serves the head


def test_a_head_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="head 0 must be 1 or more"):
        ranked(patterns.layernorm(64, 512, dtype="float16"), H100, head=0)
