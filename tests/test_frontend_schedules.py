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
