"""The numpy schedule interpreter against the unfused float64 reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, seed, settings
from hypothesis import strategies as st

from schedulers.interpreter import interpret
from schedulers.schedule import Schedule, make_schedule
from smg import SMG, evaluate, random_inputs
from smg.workloads import gemm, mha, softmax_gemm

RTOL = 1e-9


def check(s: Schedule, inputs: dict[str, np.ndarray]) -> None:
    got = interpret(s, inputs)
    want = evaluate(s.smg, inputs)
    assert set(got) == set(want) == set(s.smg.outputs)
    for name, ref in want.items():
        assert got[name].shape == ref.shape
        assert np.all(np.isfinite(got[name]))
        # relative to the output's scale: single GEMM entries may cancel to ~0
        np.testing.assert_allclose(got[name], ref, rtol=RTOL, atol=RTOL * float(np.abs(ref).max()),
                                   err_msg=f"{s.smg.name} {s.smg.dim_sizes} tiles={s.tiles} step={s.step}")


CASES: list[tuple[str, SMG, dict[str, int], int]] = [
    # non-divisible: 197 = 3*64 + 5 rows, 197 = 6*32 + 5 keys
    ("mha-197", mha(1, 2, 197, 197, 16), {"m": 64}, 32),
    ("mha-tiled-bh", mha(3, 5, 20, 23, 4), {"b": 2, "h": 3, "m": 7}, 6),
    ("mha-rect", mha(2, 2, 33, 70, 8), {"m": 16}, 70),  # one step
    ("mha-odd", mha(1, 1, 3, 5, 3), {"m": 2}, 2),
    ("mha-one", mha(1, 1, 1, 1, 1), {}, 1),
    ("mha-step1", mha(1, 1, 4, 9, 2), {"m": 3}, 1),
    ("softmax_gemm-197", softmax_gemm(197, 197, 24), {"m": 64}, 32),
    ("softmax_gemm-odd", softmax_gemm(7, 11, 5), {"m": 3}, 4),
    ("softmax_gemm-one", softmax_gemm(1, 1, 1), {}, 1),
    ("gemm-197", gemm(197, 37, 101), {"m": 64, "n": 16}, 32),
    ("gemm-odd", gemm(5, 3, 7), {"m": 2, "n": 2}, 3),
    ("gemm-whole", gemm(6, 4, 5), {"m": 6, "n": 4}, 5),
    ("gemm-one", gemm(1, 1, 1), {}, 1),
]


@pytest.mark.parametrize(("graph", "tiles", "step"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_interpreter_matches_reference(graph: SMG, tiles: dict[str, int], step: int) -> None:
    s = make_schedule(graph, tiles=tiles, step=step)
    check(s, random_inputs(graph, seed=7))


def test_large_logits_are_stable() -> None:
    """exp of the raw logits would overflow; the derived max-shift keeps it finite."""
    g = softmax_gemm(9, 50, 4)
    x = random_inputs(g, seed=1)
    x["S"] = x["S"].astype(np.float64) * 300.0
    check(make_schedule(g, tiles={"m": 4}, step=7), x)


def test_interpreting_a_json_round_tripped_schedule() -> None:
    g = mha(2, 1, 13, 19, 4)
    s = make_schedule(g, tiles={"b": 1, "m": 5}, step=6)
    back = Schedule.from_json(s.to_json())
    x = random_inputs(g, seed=3)
    a, b = interpret(s, x), interpret(back, x)
    np.testing.assert_array_equal(a["O"], b["O"])
    check(back, x)


def test_results_do_not_depend_on_tiling() -> None:
    g = softmax_gemm(10, 21, 3)
    x = random_inputs(g, seed=5)
    outs = [interpret(make_schedule(g, tiles={"m": m}, step=step), x)["O"]
            for m, step in [(10, 21), (1, 1), (3, 5), (4, 8)]]
    for o in outs[1:]:
        np.testing.assert_allclose(o, outs[0], rtol=1e-12, atol=1e-13)


@st.composite
def scheduled(draw) -> tuple[Schedule, int]:
    kind = draw(st.sampled_from(["mha", "softmax_gemm", "gemm"]))
    dim = st.integers(1, 9)
    if kind == "mha":
        b, h, m, l, d = (draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(dim), draw(dim),
                         draw(st.integers(1, 5)))
        g = mha(b, h, m, l, d)
        tiles = {"b": draw(st.integers(1, b)), "h": draw(st.integers(1, h)), "m": draw(st.integers(1, m))}
    elif kind == "softmax_gemm":
        m, l, n = draw(dim), draw(dim), draw(dim)
        g = softmax_gemm(m, l, n)
        tiles = {"m": draw(st.integers(1, m))}
    else:
        m, n, k = draw(dim), draw(dim), draw(dim)
        g = gemm(m, n, k)
        tiles = {"m": draw(st.integers(1, m)), "n": draw(st.integers(1, n))}
    serial = "k" if kind == "gemm" else "l"
    step = draw(st.integers(1, g.dim_sizes[serial]))
    return make_schedule(g, tiles=tiles, step=step), draw(st.integers(0, 2**16))


@seed(197)
@settings(max_examples=25, deadline=None)
@given(case=scheduled(), scale=st.sampled_from([0.5, 1.0, 4.0]))
def test_interpreter_property(case: tuple[Schedule, int], scale: float) -> None:
    s, data_seed = case
    assert s.serial == ("k" if s.smg.name == "gemm" else "l")
    check(s, random_inputs(s.smg, seed=data_seed, scale=scale))
