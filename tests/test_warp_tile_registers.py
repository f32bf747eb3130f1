"""The warp-tile register estimate (``schedulers.warp_tile.warp_tile_registers``) against what nvcc allocates,
on the committed corpus of tensor-core kernels (``experiments/tuning/register_corpus.json``: every warp-tile
schedule of the committed records and rounds plus search-space samples, lowered and compiled by
``experiments/tuning/register_corpus.py``), and the occupancy it gives the cost model."""

from __future__ import annotations

import sys
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from schedulers.hardware import H100
from schedulers.resources import MAX_REGISTERS, block_resources
from schedulers.warp_tile import CONSUMER_REGS, moves_registers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments" / "tuning"))
import register_corpus as C  # noqa: E402

#: at or above this nvcc count a kernel sits at the 255 ceiling: an estimate above it is not an error
CEILING = 248


@lru_cache(maxsize=1)
def _corpus() -> list[tuple]:
    """(schedule, row, estimate, block resources) of every corpus kernel."""
    if not C.OUT.is_file():
        pytest.fail(f"{C.OUT} is missing: run experiments/tuning/register_corpus.py")
    out = []
    for s, row in C.load():
        r = block_resources(s)
        out.append((s, row, r.registers_estimate, r))
    return out


def _fitted() -> list[tuple]:
    """Kernels nvcc neither spilled nor launched with ``setmaxnreg`` (there ptxas reports the launch's 168)."""
    return [x for x in _corpus() if x[1]["spill_bytes"] == 0 and not moves_registers(x[0].warp_tile)]


def _errors(rows: list[tuple]) -> np.ndarray:
    """Estimate less nvcc's count; 0 where nvcc is at the ceiling and the estimate above it."""
    e = np.array([est - row["registers"] for _, row, est, _ in rows], float)
    ceiling = np.array([row["registers"] >= CEILING for _, row, _, _ in rows])
    return np.where(ceiling & (e > 0), 0.0, e)


def test_the_corpus_covers_the_forms_the_search_offers() -> None:
    rows = _corpus()
    assert len(rows) >= 700 and len(_fitted()) >= 500
    progs = [s.warp_tile for s, *_ in rows]
    assert sum(p.hopper.wgmma for p in progs) >= 300 and sum(not p.hopper.wgmma for p in progs) >= 300
    attention = [(s, p) for (s, *_), p in zip(rows, progs) if p.gemm is not None]
    for wgmma in (True, False):
        for reload in (True, False):
            got = sum(p.hopper.wgmma == wgmma and p.warp.reload_a == reload for _, p in attention)
            assert got >= 50, (wgmma, reload)
    assert {s.smg.dim_sizes[p.gemm.k] for s, p in attention} >= {64, 80, 96, 112, 128, 256}
    assert sum(p.hopper.producer for p in progs) >= 50 and sum(p.wgmma_ss for p in progs) >= 60
    assert sum(not p.hopper.wgmma and p.gemm is None and not p.row_states for p in progs) >= 40  # GEMMs on mma.sync
    assert sum(bool(p.tiles_in) and bool(p.row_states) for p in progs) >= 10  # softmax @ V
    assert all(row["registers"] <= MAX_REGISTERS and row["threads"] == s.threads for s, row, *_ in rows)


def test_the_estimate_is_within_its_stated_bounds_of_nvcc() -> None:
    """On the kernels nvcc compiles without spills or ``setmaxnreg``: 10.4 registers off on average (the
    estimate before this corpus: 26.2, 23 above on average), 90% within 23, none more than 39 above; the
    worst below is a plain GEMM on mma.sync with 256 columns of B fragments (98).  On the
    warpgroup-MMA forms (the tuner's picks for attention and GEMMs) 6.0 and 7.9 on average; there the worst are
    blocks slicing the serial steps (``slices``, 16 kernels 16 below on average, one of 256 rows 82)."""
    rows = _fitted()
    e = _errors(rows)
    print(f"\n{len(e)} kernels: mean |err| {np.abs(e).mean():.1f}, mean {e.mean():.1f}, p90 "
          f"{np.percentile(np.abs(e), 90):.0f}, max {e.max():.0f}, min {e.min():.0f}")
    assert np.abs(e).mean() <= 11.0 and abs(e.mean()) <= 4.0
    assert np.percentile(np.abs(e), 90) <= 24.0
    assert e.max() <= 40.0 and e.min() >= -100.0
    forms = (("wgmma attention", lambda p: p.hopper.wgmma and not p.wgmma_ss, 7.0),
             ("wgmma GEMM", lambda p: p.wgmma_ss, 9.0))
    for name, pick, bound in forms:
        sub = _errors([x for x in rows if pick(x[0].warp_tile)])
        print(f"{name}: {len(sub)} kernels, mean |err| {np.abs(sub).mean():.1f}, worst {sub.min():.0f} / "
              f"{sub.max():.0f}")
        assert len(sub) >= 60 and np.abs(sub).mean() <= bound, (name, np.abs(sub).mean())
        assert np.abs(sub).max() <= 85.0, (name, sub.min(), sub.max())


def test_the_estimate_gives_the_occupancy_nvcc_gives() -> None:
    """Blocks per SM from the estimate against those from nvcc's count (same threads and shared memory):
    equal on 487 of the 534 kernels (399 before); what decides between candidates of one shape."""
    rows = _fitted()
    same = [H100.occupancy_blocks_per_sm(r.shared_bytes, r.threads, min(est, MAX_REGISTERS))
            == H100.occupancy_blocks_per_sm(r.shared_bytes, r.threads, row["registers"]) for _, row, est, r in rows]
    assert np.mean(same) >= 0.88, np.mean(same)


def test_spills_are_predicted_where_nvcc_spills() -> None:
    """The estimate passes the register cap (255, or ``setmaxnreg``'s 232) on every kernel but one that nvcc
    spills 256 B or more, and on under 2% of those it compiles without spilling (10 of 534; 57 before)."""
    rows = _corpus()
    cap = {id(s): CONSUMER_REGS if moves_registers(s.warp_tile) else MAX_REGISTERS for s, *_ in rows}
    heavy = [est > cap[id(s)] for s, row, est, _ in rows if row["spill_bytes"] >= 256]
    clean = [est > cap[id(s)] for s, row, est, _ in rows if row["spill_bytes"] == 0]
    assert len(heavy) >= 100 and sum(heavy) >= len(heavy) - 1
    assert sum(clean) <= 0.02 * len(clean)
    # what the cost model charges as spilled (beyond the cap plus WARP_TILE_SPILL_SLACK) where nvcc spills
    # nothing: 3 kernels, at most 21 floats a thread; and it charges 135 of the 143 that spill
    charged = [r.likely_spilled_floats for s, row, _, r in rows if row["spill_bytes"] == 0]
    assert sum(f > 0 for f in charged) <= 3 and max(charged) <= 24
    assert sum(r.likely_spilled_floats > 0 for s, row, _, r in rows if row["spill_bytes"] > 0) >= 130


def test_q_read_from_shared_memory_frees_registers_on_wgmma() -> None:
    """Issue 19's short-row attention (clip77, v_d64_256): 64-row warpgroup tiles, steps of 32.  nvcc gives
    90-98 registers with Q's fragments held and 74-78 with ``reload_a`` (wgmma reads Q from shared
    memory: no fragments at all): 4-5 blocks per SM against 6.  The estimate tells them apart (92, 76)
    where the one before gave 122 and 114, 4 blocks per SM for all."""
    shapes = ({"b": 32, "h": 16, "m": 256, "d": 64, "l": 256, "n": 64},
              {"b": 64, "h": 12, "m": 77, "d": 64, "l": 77, "n": 64})
    picks = [x for x in _corpus() if x[0].smg.dim_sizes in shapes and x[0].wgmma and x[0].step == 32]
    assert len(picks) >= 10
    for s, row, est, r in picks:
        nvcc = H100.occupancy_blocks_per_sm(r.shared_bytes, r.threads, row["registers"])
        ours = H100.occupancy_blocks_per_sm(r.shared_bytes, r.threads, r.registers_per_thread)
        assert (ours, nvcc) in ((6, 6), (5, 5), (5, 4)) and (ours == 6) == s.reload_a, (s.key, est, row["registers"])
        assert abs(est - row["registers"]) <= 8


def test_warp_specialised_kernels_need_what_the_estimate_says() -> None:
    """A producer warpgroup beside two MMA warpgroups: ptxas reports the launch's 168 for the whole kernel,
    so the corpus holds the least ``setmaxnreg`` raise with which it spills nothing (``consumer_registers``,
    168 meaning at most that).  The estimate is 5.4 off on average (the one before: 8.5), and above the
    232 of the raise exactly where ptxas spills even there."""
    rows = [x for x in _corpus() if moves_registers(x[0].warp_tile)]
    assert len(rows) >= 70 and all("consumer_registers" in row and row["registers"] <= 168 for _, row, _, _ in rows)
    err = []
    for _, row, est, r in rows:
        need = row["consumer_registers"]
        assert (need is None) == (est > CONSUMER_REGS) == r.spills, (need, est)
        if need is not None:
            err.append(0 if need == 168 and est <= 168 else est - need)
    assert np.abs(err).mean() <= 7.0 and np.max(np.abs(err)) <= 32, (np.abs(err).mean(), min(err), max(err))


@pytest.mark.parametrize(("regs", "blocks"), [(64, 6), (74, 6), (78, 6), (80, 6), (81, 5), (90, 5), (96, 5),
                                              (98, 4), (128, 4), (129, 3), (168, 3), (169, 2), (255, 2)])
def test_registers_are_allocated_per_warp_in_units_of_256(regs: int, blocks: int) -> None:
    """A warp's registers are rounded up to 256 (a thread's to 8), the SM's 65536 shared by whole warps:
    128 threads with 36 KB of shared memory (6 blocks by shared memory) fit 6 blocks up to 80 registers,
    5 up to 96, 4 up to 128."""
    assert H100.occupancy_blocks_per_sm(36 * 1024, 128, regs) == blocks
