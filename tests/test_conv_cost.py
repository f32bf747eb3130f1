"""The analytical model's ranking of implicit-GEMM convolutions, judged on the committed H100 rounds of SD 1.5's
conv SMGs (experiments/tuning/conv_sd15_records_h100.json: 22 SMGs, 4-8 candidates each, every one checked
against the reference before it was timed, L2 flushed)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

import search.warp_tile_cost as wtc
from schedulers.hardware import H100
from schedulers.schedule import Schedule
from search.cost import estimate_us
from search.metrics import spearman, top1_slowdown
from search.prior import read_records
from smg import patterns

RECORDS = Path(__file__).resolve().parents[1] / "experiments" / "tuning" / "conv_sd15_records_h100.json"


@pytest.fixture(scope="module")
def rounds() -> list[list[tuple[Schedule, float]]]:
    groups: dict[str, list[tuple[Schedule, float]]] = defaultdict(list)
    for sched, res, group in zip(*read_records(RECORDS)):
        if res.ok:
            groups[group].append((sched, res.median_us))
    return [g for g in groups.values() if len(g) > 1]


def _quality(rounds: list[list[tuple[Schedule, float]]]) -> tuple[float, float, float]:
    """(geometric mean and worst of the measured time of the model's pick over the round's best, mean Spearman)."""
    picks, ranks = [], []
    for g in rounds:
        est, meas = [estimate_us(s, H100) for s, _ in g], [m for _, m in g]
        picks.append(top1_slowdown(est, meas))
        ranks.append(spearman(est, meas))
    return float(np.exp(np.mean(np.log(picks)))), max(picks), float(np.mean(ranks))


def test_the_model_picks_near_the_best_of_each_measured_conv_round(rounds) -> None:
    assert len(rounds) >= 20 and all(g[0][0].warp_tile.gathers for g in rounds)
    geo, worst, rho = _quality(rounds)
    # with a gathered tile's latency at a GEMM's (0.5 us) these were 1.20, 1.77 and 0.59
    assert geo < 1.08 and worst < 1.45 and rho > 0.7, (geo, worst, rho)


def test_the_gathered_latency_is_what_ranks_them(rounds, monkeypatch) -> None:
    monkeypatch.setattr(wtc, "GATHER_LATENCY_S", wtc.LOAD_LATENCY_S)
    geo, _, _ = _quality(rounds)
    assert geo > 1.15  # the fit is not vacuous: at a GEMM's latency the picks fall well behind


def test_the_gathered_latency_leaves_other_kernels_alone(monkeypatch) -> None:
    from search.space import SearchSpace

    smg = patterns.gemm_epilogue(512, 1024, 768, "gelu", dtype="float16")
    cands = [s for s in SearchSpace(smg, H100).candidates() if s.warp_tile is not None][:40]
    assert cands
    before = [estimate_us(s, H100) for s in cands]
    monkeypatch.setattr(wtc, "GATHER_LATENCY_S", 50e-6)
    assert [estimate_us(s, H100) for s in cands] == before
