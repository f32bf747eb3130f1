"""The public API (spacefusion.api) is a thin face: each function returns what the implementation it names
returns, so a script moved onto it sees the same schedules, estimates and artefacts."""

from __future__ import annotations

from pathlib import Path

import pytest

from spacefusion import api


@pytest.fixture(scope="module")
def graph():
    return api.patterns.layernorm(32, 128)


def test_hardware_by_name_is_the_preset() -> None:
    from schedulers.hardware import H100, H200

    assert api.hardware("h100") is H100 and api.hardware("H200") is H200 and api.hardware(H100) is H100
    assert api.H100 is H100
    with pytest.raises(api.HardwareError):
        api.hardware("no-such-gpu")


def test_candidates_and_estimate_are_the_rankings(graph) -> None:
    from search.cost import estimate_us
    from spacefusion.frontend.schedules import ranked

    order = api.candidates(graph, api.H100)
    assert [s.key for s in order] == [s.key for s in ranked(graph, api.H100)]
    assert [s.key for s in api.candidates(graph, api.H100, head=2)] == [s.key for s in order[:2]]
    assert api.estimate(order[0], api.H100) == estimate_us(order[0], api.H100)
    assert api.first_pick(graph, api.H100).key == order[0].key


def test_schedule_save_and_load_keep_the_key(graph, tmp_path: Path) -> None:
    s = api.schedule(graph)
    path = api.save_schedule(s, tmp_path / "deep" / "s.json")
    assert api.load_schedule(path).key == s.key


def test_export_refuses_a_cpu_target(graph, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not cuda"):
        api.export(api.schedule(graph), tmp_path, "llvm")


def test_unknown_names_are_attribute_errors() -> None:
    with pytest.raises(AttributeError):
        api.no_such_name  # noqa: B018
    assert {"candidates", "estimate", "export", "load", "hardware", "first_pick"} <= set(dir(api))
