"""Halo boxes (``schedulers.halo``): the box a block stages of a window's input holds every position the
block's taps read, and no more (its first and last positions are read), over random windows and tiles."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from schedulers.halo import halo_shape, window_box
from smg import patterns


def _box_by_hand(k: int, s: int, p: int, tp: int, tq: int, p0: int, q0: int, ky0: int, step: int
                 ) -> tuple[tuple[int, int], tuple[int, int]]:
    """(first, last) image row and column a block at output (p0, q0) of tp x tq pixels reads over the taps
    ky0 .. ky0 + step - 1 (every kx): brute force over the window's definition."""
    rows = [s * pp + ky - p for pp in range(p0, p0 + tp) for ky in range(ky0, ky0 + step)]
    cols = [s * qq + kx - p for qq in range(q0, q0 + tq) for kx in range(k)]
    return (min(rows), max(rows)), (min(cols), max(cols))


@settings(max_examples=60, deadline=None)
@given(k=st.integers(1, 7), s=st.integers(1, 2), tp=st.integers(1, 8), tq=st.integers(1, 8),
       tc=st.sampled_from([1, 4, 8]), data=st.data())
def test_the_box_is_the_reads_of_a_block(k: int, s: int, tp: int, tq: int, tc: int, data) -> None:
    p = data.draw(st.integers(0, k // 2))
    g = patterns.depthwise_conv2d(2, 9, 10, 8, k, s, p, dtype="float16")
    box = window_box(g, "X")
    assert box is not None and window_box(g, "Wt") is None  # the filter is read plainly
    step = data.draw(st.integers(1, k))
    shape = halo_shape(g, "X", {"n": 1, "c": tc, "p": tp, "q": tq}, "ky", step)
    assert shape[0] == 1 and shape[3] == tc  # n and c: the block's own tiles
    p0 = data.draw(st.integers(0, g.dim_sizes["p"] - 1))
    q0 = data.draw(st.integers(0, g.dim_sizes["q"] - 1))
    ky0 = data.draw(st.integers(0, k - step))
    (r0, r1), (c0, c1) = _box_by_hand(k, s, p, tp, tq, p0, q0, ky0, step)
    assert (r1 - r0 + 1, c1 - c0 + 1) == shape[1:3]
    # the box's origin, as the lowering computes it: sum of coefficient x the block's first index, + b
    (_, (rows, rb), (cols, cb), _) = box
    start = {"p": p0, "q": q0, "ky": ky0, "kx": 0}
    assert sum(a * start[d] for d, a in rows) + rb == r0
    assert sum(a * start[d] for d, a in cols) + cb == c0


def test_only_windowed_reductions_stage_a_halo() -> None:
    """A pooling view (its own op) and an upsampling read (floor) keep their global reads."""
    assert window_box(patterns.max_pool2d(2, 16, 16, 8), "X") is None
    assert window_box(patterns.conv2d(2, 8, 8, 16, 16, upsample=2), "X") is None
    g = patterns.depthwise_conv2d(2, 8, 8, 4, 3, 1, 1)
    for tiles in ({"c": 4, "p": 2}, {"q": 8}):
        from schedulers.schedule import make_schedule

        s = make_schedule(g, tiles, serial="ky", step=3)
        assert s.level("X") == "shared"  # staged by default, a global read still offered
        assert make_schedule(g, tiles, serial="ky", step=3, levels={"X": "global"}).level("X") == "global"
    assert all(a >= 0 for coeffs, _ in window_box(g, "X") for _, a in coeffs)
    assert list(itertools.chain.from_iterable(c for c, _ in window_box(g, "X")))
