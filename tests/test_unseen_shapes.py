"""The unseen-shapes sweep (experiments/unseen_shapes.py): its arithmetic, and what the committed H100
results say about the auto-scheduler's first round on shapes nobody hand-tuned."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
import unseen_shapes as U  # noqa: E402

RESULTS = ROOT / "experiments" / "results" / "unseen_shapes_h100.json"
VALIDATION = RESULTS.with_name("unseen_shapes_validation_h100.json")
HARNESS = RESULTS.with_name("unseen_shapes_harness_h100.json")


def _entry(first: float, best: float, cudnn: float, flash: float) -> dict:
    rows = [{"system": "spacefusion", "rank": 0, "status": "ok", "median_us": first},
            {"system": "spacefusion", "rank": 1, "status": "ok", "median_us": best},
            {"system": "spacefusion", "rank": 2, "status": "error", "error": "max abs error 1 over tolerance 0.02"},
            {"system": "sdpa_flash", "status": "ok", "median_us": flash},
            {"system": "sdpa_cudnn", "status": "ok", "median_us": cudnn}]
    return {"shape": {"key": "x", "b": 1, "hq": 8, "hkv": 2, "m": 1, "l": 64, "d": 64, "causal": False}, "rows": rows}


def test_summary_ratios_name_the_first_pick_the_best_and_the_failures() -> None:
    m = U.summarize(_entry(first=12.0, best=10.0, cudnn=11.0, flash=15.0))
    assert (m["first_us"], m["best_us"], m["best_rank"], m["failed"]) == (12.0, 10.0, 1, 1)
    assert m["first_over_best"] == pytest.approx(1.2)
    assert m["best_vs_sdpa_cudnn"] == pytest.approx(1.1) and m["first_vs_sdpa_flash"] == pytest.approx(1.25)
    assert U.geomean([2.0, 8.0]) == pytest.approx(4.0) and U.geomean([]) is None


def test_shapes_are_broad_and_count_their_work() -> None:
    keys = {s.key for s in U.SHAPES}
    assert {"gqa_decode", "d80", "d96_causal", "clip77", "gqa_causal"} <= keys  # the five
    assert any(s.d == 256 for s in U.SHAPES) and any(s.m == 1 and s.hq == s.hkv for s in U.SHAPES)
    s = U.BY_KEY["gqa_causal"]
    assert s.flops == pytest.approx(4 * 2 * 32 * (4096 * 4096 - 4096 * 4095 / 2) * 128)
    assert U.BY_KEY["gqa_decode"].nbytes == 2 * (2 * 8 * 32 * 128 + 2 * 8 * 8 * 4096 * 128)
    g = U.smg_of(U.BY_KEY["gqa_decode"])
    assert g.shape("Q") == (8, 8, 4, 1, 128)  # the query group as its own dim, K/V broadcast along it


def _committed(path: Path = RESULTS) -> dict:
    if not path.is_file():
        pytest.fail(f"{path} is missing: run the sweep on the GPU (see experiments/unseen_shapes.py)")
    return json.loads(path.read_text())


def _sums(path: Path) -> dict[str, dict]:
    return {e["shape"]["key"]: U.summarize(e) for e in _committed(path)["shapes"]}


@pytest.mark.parametrize("path", [RESULTS, VALIDATION, HARNESS])
def test_every_committed_candidate_was_checked_before_it_was_timed(path: Path) -> None:
    data = _committed(path)
    assert data["format"] == U.FORMAT and "H100" in data["device"]
    for e in data["shapes"]:
        for r in e["rows"]:
            if r.get("status") == "ok":
                assert r["max_abs_err"] is not None and math.isfinite(r["median_us"]), (e["shape"]["key"], r)
        assert {r["system"] for r in e["rows"]} >= {"spacefusion", "sdpa_flash", "sdpa_cudnn"}


def test_committed_rounds_cover_the_sets_they_name() -> None:
    assert set(_sums(RESULTS)) == set(U.SETS["train"]) and set(_sums(VALIDATION)) == set(U.SETS["validation"])
    assert set(_sums(HARNESS)) == set(U.SETS["harness"])


def test_decoding_runs_on_tensor_cores_level_with_cudnn() -> None:
    """Issue 19's first finding: GQA decode's round held CUDA-core kernels only (first pick 8077 us, best
    6433 against cuDNN's 54.3).  With the group on tensor-core rows (smg.fold, padded row tiles) and
    slices of the KV steps every decoding shape's first pick is within 12% of cuDNN or faster (gqa_spec4,
    4 queries x groups of 4, is the slowest: 0.89), and the held-out GQA decoders (groups of 5 and 7,
    8 speculative queries) run 1.07-1.82x cuDNN's speed."""
    sums = {**_sums(RESULTS), **_sums(VALIDATION)}
    decoders = ("gqa_decode", "gqa_decode_long", "gqa8_decode", "mha_decode", "gqa_spec4",
                "v_gqa5_decode", "v_gqa7_decode", "v_spec8")
    for key in decoders:
        m = sums[key]
        assert m["failed"] == 0 and m["first_vs_sdpa_cudnn"] >= 0.88, (key, m)
    assert all(sums[k]["first_vs_sdpa_cudnn"] >= 1.0 for k in decoders[5:])


def test_first_pick_within_ten_percent_of_the_round_best() -> None:
    """The model's first pick against the best of its round (printed with -s), on all 24 shapes: the 8
    held-out shapes the prior never saw, the 12 it learned from and the harness's 4 attention shapes.
    Every first pick is within 10% of its round's best.  Before the register estimate was fitted to nvcc,
    v_d64_256's first pick (Q held in registers, 98 of them: 4 blocks an SM) was 1.11x the best; with it
    the reload_a picks (74-78 registers, 6 blocks) come first: 1.05x.  clip77 is at the edge: 1.10x in
    both of its rounds (16.9 / 15.3 us, then 17.3 / 15.8)."""
    for path in (VALIDATION, RESULTS, HARNESS):
        sums = _sums(path)
        for k, m in sums.items():
            print(f"{k:<16} first/best {m['first_over_best']:.3f}  cuDNN/best {m['best_vs_sdpa_cudnn']:.2f}  "
                  f"cuDNN/first {m['first_vs_sdpa_cudnn']:.2f}")
        assert all(m["first_over_best"] <= 1.10 for m in sums.values()), path.name
    assert _sums(VALIDATION)["v_d64_256"]["first_over_best"] < 1.06


def test_every_shape_within_ten_percent_of_cudnn_and_ahead_in_geomean() -> None:
    """Issue 19's goal on the 24 shapes (unseen, held out, harness): the best of each round within 10% of
    cuDNN or faster (the slowest: gqa_spec4 at 0.91), 1.12x cuDNN in geometric mean, the first picks 1.10x.
    Head dims of 80/96/112 were 0.43-0.79 of cuDNN while their second GEMM ran on mma.sync; with warpgroup
    MMA over a padded last band they are 0.94-1.15x (history/*_before_odd_wgmma.json has the rounds before;
    d96's re-run round measured cuDNN at 37.5 us where its first round had 40.8, ours 40.0 and 39.5)."""
    sums = {**_sums(RESULTS), **_sums(VALIDATION), **_sums(HARNESS)}
    assert len(sums) == 24
    assert all(m["best_vs_sdpa_cudnn"] >= 0.9 for m in sums.values()), sums
    assert U.geomean([m["best_vs_sdpa_cudnn"] for m in sums.values()]) > 1.1
    assert U.geomean([m["first_vs_sdpa_cudnn"] for m in sums.values()]) > 1.05
    odd = [k for k in sums if U.BY_KEY[k].d % 64]
    assert len(odd) == 5 and all(sums[k]["best_vs_sdpa_cudnn"] >= 0.93 for k in odd)


def test_the_cost_model_orders_each_committed_round_at_least_as_well_as_its_first_pick() -> None:
    """Each committed round ordered as the tuner orders a first batch today (the analytical estimate, its ties
    broken by the shipped prior: experiments/tuning/first_picks.py).  The pick it puts first is never slower
    than the round's committed first pick, and within 10% of the round's best on every unseen and harness
    shape.  (With the register estimate fitted to nvcc, v_d64_256's first round of before ordered this way put
    a reload_a pick first, 34.0 us against 37.0: the re-run round, committed now, measured its new first pick
    at 34.2 against a best of 32.4.)"""
    sys.path.insert(0, str(ROOT / "experiments" / "tuning"))
    import first_picks as FP

    picks = {p["round"]: p for p in FP.first_picks(art=None)}
    shapes = set(U.SETS["train"]) | set(U.SETS["validation"]) | set(U.SETS["harness"])
    assert shapes <= set(picks)
    for name, p in picks.items():
        assert p["first_us"] is not None, name
        if p["committed_us"] is not None:
            assert p["first_us"] <= p["committed_us"], (name, p["first_us"], p["committed_us"])
    ratio = {k: picks[k]["first_us"] / picks[k]["best_us"] for k in shapes}
    assert all(r <= 1.10 for r in ratio.values()), ratio
