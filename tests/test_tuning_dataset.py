"""The committed H100 tuning records: the learned cost model is trained and evaluated on them on
the CPU.  Round 1 of each workload was chosen by the analytical model (plus exploration), round 2
by the learned model; training on one round and ranking the other is a held-out evaluation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from schedulers.hardware import H100
from schedulers.schedule import Schedule
from search.learned import LearnedCostModel
from search.metrics import spearman, top1_slowdown
from search.records import MeasureResult

DATA = Path(__file__).resolve().parents[1] / "experiments" / "tuning" / "h100_records.json"


def _records(workload: str) -> tuple[list[Schedule], list[MeasureResult]]:
    data = json.loads(DATA.read_text())
    rows = [r for r in data["records"] if r["workload"] == workload]
    return ([Schedule.from_json(json.dumps(r["schedule"])) for r in rows],
            [MeasureResult.from_dict(r["result"]) for r in rows])


def test_dataset_is_measured_and_verified() -> None:
    data = json.loads(DATA.read_text())
    assert data["device"].startswith("NVIDIA H100")
    for r in data["records"]:
        res = MeasureResult.from_dict(r["result"])
        assert res.ok and res.max_abs_err is not None and res.max_abs_err < 2e-2  # checked before timing
        assert Schedule.from_json(json.dumps(r["schedule"])).key == res.schedule_key


@pytest.mark.parametrize("workload,min_spearman", [("softmax_gemm", 0.9), ("mha", 0.2)])
def test_learned_model_ranks_the_other_round(workload: str, min_spearman: float) -> None:
    scheds, res = _records(workload)
    half = len(scheds) // 2
    model = LearnedCostModel(H100)
    model.fit(scheds[:half], res[:half], [workload] * half)
    pred = model.predict(scheds[half:])
    meas = np.array([r.median_us for r in res[half:]])
    assert spearman(pred, meas) > min_spearman
    assert top1_slowdown(pred, meas) < 1.1


def test_analytical_model_is_near_the_h100_harness_times() -> None:
    """The analytical estimates of the harness's tensor-core kernels stay within 3x of their
    measured H100 times (0.68-1.45x with the per-step model; Softmax-GEMM was 5.3x and causal MHA 2.9x off while device
    traffic counted K/V re-reads by every row block and cp.async tiles as uncoalesced reads)."""
    import sys

    from schedulers.schedule import make_schedule
    from search.cost import estimate_us

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "experiments"))
    from make_harness_artefacts import SCHEDULES

    rows = json.loads((root / "experiments" / "results" / "harness_h100.json").read_text())["rows"]
    measured = {r["workload"]: r["median_us"] for r in rows if r["system"] == "spacefusion" and r["status"] == "ok"}
    checked = 0
    for key, (mk, tiles, serial, step, opts) in SCHEDULES.items():
        if not opts.get("tensor_cores") or key not in measured:
            continue
        est = estimate_us(make_schedule(mk(), tiles, serial=serial, step=step, **opts), H100)
        assert measured[key] / 3 < est < measured[key] * 3, (key, est, measured[key])
        checked += 1
    assert checked >= 6


def test_analytical_model_ranks_the_llama_tuning_rounds() -> None:
    """72 measured schedules (three tuner rounds) of LLaMA-shaped attention (4, 32, 2048, 2048, 128),
    many of them spilling: the model charges what surely spills every step (it charged all local
    values once per block, so 18 spilling tilings that ran 1.1-15.6 ms were all estimated at about
    600 us). With the per-step model Spearman 0.87 (the roofline before it: 0.93) and its top pick
    runs 1.17x the best (was 1.33x); these kernels predate the row sums and wgmma.  With the register
    estimate fitted to nvcc (tests/test_warp_tile_registers.py) the top pick runs 1.15x the best and
    Spearman is 0.84: 8 kernels that nvcc gives 102-127 registers (2 blocks per SM; the estimate before
    said 132-144, 1 block) ran 1.0-2.1 ms and are now estimated 1.0-1.3 ms, the per-step model (its
    constants fitted with the old occupancies) crediting them a second block the H100 did not deliver."""
    from search.cost import estimate_us

    scheds, res = _records("attention")
    pairs = [(s, r) for s, r in zip(scheds, res, strict=True) if s.smg.dim_sizes["b"] == 4]
    assert len(pairs) == 72
    est = np.array([estimate_us(s, H100) for s, _ in pairs])
    meas = np.array([r.median_us for _, r in pairs])
    assert spearman(est, meas) > 0.83
    assert top1_slowdown(est, meas) < 1.2


CALIBRATION = DATA.parent / "warp_tile_calibration.json"


@pytest.mark.parametrize("workload", ["mha_bert", "mha_llama", "mha_vit", "gemm_sigmoid"])
def test_warp_tile_model_ranks_the_h100_sweeps(workload: str) -> None:
    """128 measured tensor-core kernels of the current lowering (knob grids of the harness's attention
    schedules, tuner rounds, the GEMM's tile sweeps; spilling GEMM tiles among them): the per-step
    model ranks each workload's kernels (Spearman 0.70-0.97; the roofline it replaced: -0.46 to 0.51 on
    the first 104, where BERT's best kernel was its 26th pick of 34) and a kernel within 5% of the
    fastest is among its first five picks."""
    from search.cost import estimate_us

    rows = [r for r in json.loads(CALIBRATION.read_text())["rows"] if r["workload"] == workload]
    assert len(rows) >= 20
    est = np.array([estimate_us(Schedule.from_json(json.dumps(r["schedule"])), H100) for r in rows])
    meas = np.array([r["median_us"] for r in rows])
    assert spearman(est, meas) > 0.6
    top5 = np.argsort(est)[:5]
    assert meas[top5].min() < 1.05 * meas.min()


def test_learned_model_carries_across_workloads_with_the_analytical_features() -> None:
    """Leave one workload out of the 128 calibration kernels, train on the other three, rank it: with
    the per-step model's estimate and unit shares among the features the mean Spearman is 0.50
    (GEMM 0.60, BERT 0.55, LLaMA 0.27, ViT 0.58; 0.52 before the model counted a wgmma group in flight
    against the ring, 0.55 earlier); without them 0.46 (LLaMA 0.08). The analytical model alone still
    ranks better (0.63-0.96), so the tuner starts from it."""
    rows = json.loads(CALIBRATION.read_text())["rows"]
    scheds = [Schedule.from_json(json.dumps(r["schedule"])) for r in rows]
    res = [MeasureResult(schedule_key=s.key, target="cuda:sm_90a", latencies_us=(r["median_us"],))
           for s, r in zip(scheds, rows, strict=True)]
    work = [r["workload"] for r in rows]
    rhos = []
    for held in sorted(set(work)):
        train = [i for i, w in enumerate(work) if w != held]
        test = [i for i, w in enumerate(work) if w == held]
        model = LearnedCostModel(H100)
        model.fit([scheds[i] for i in train], [res[i] for i in train], [work[i] for i in train])
        rhos.append(spearman(model.predict([scheds[i] for i in test]), np.array([rows[i]["median_us"] for i in test])))
    assert np.mean(rhos) > 0.48 and min(rhos) > 0.25


def test_warp_tile_model_ranks_the_producer_gemm_round() -> None:
    """A tuner round of the sigmoid GEMM with producer warpgroups, persistent blocks and pingpong in
    the space (12 model picks, 218-347 us): the model ranks them (Spearman 0.80; before counting the
    slot a wgmma group in flight holds, the 3-stage pingpong kernels, 294-347 us, were estimated with
    the 4-stage ones) and the fastest is among its first three picks."""
    from search.cost import estimate_us

    raw = json.loads((DATA.parent / "raw" / "gemm_sigmoid_round_ws1.json").read_text())
    by_key = {c["schedule_key"]: c["schedule"] for c in raw["manifest"]["candidates"]}
    rows = [(by_key[r["schedule_key"]], r) for r in raw["results"] if by_key[r["schedule_key"]].get("producer")]
    assert len(rows) >= 10 and all(r["error"] is None and r["max_abs_err"] < 2e-2 for _, r in rows)
    est = np.array([estimate_us(Schedule.from_json(json.dumps(s)), H100) for s, _ in rows])
    meas = np.array([r["latencies_us"][0] for _, r in rows])
    assert spearman(est, meas) > 0.6
    assert meas[np.argsort(est)[:3]].min() == meas.min()


def test_warp_tile_model_ranks_the_fa3_attention_round() -> None:
    """A tuner round of LLaMA-shaped attention once the search offers FlashAttention-3's structure (12
    model picks, 428-679 us): the model ranks them (Spearman 0.90) and its first four picks are the
    four step-128 warp-specialised kernels, the fastest among them (the round before: 496.9 us)."""
    from search.cost import estimate_us

    raw = json.loads((DATA.parent / "raw" / "attention_llama_round_fa3.json").read_text())
    by_key = {c["schedule_key"]: c["schedule"] for c in raw["manifest"]["candidates"]}
    rows = [(by_key[r["schedule_key"]], r) for r in raw["results"] if by_key[r["schedule_key"]].get("tensor_cores")]
    assert len(rows) == 12 and all(r["error"] is None and r["max_abs_err"] < 2e-2 for _, r in rows)
    scheds = [Schedule.from_json(json.dumps(s)) for s, _ in rows]
    est = np.array([estimate_us(s, H100) for s in scheds])
    meas = np.array([r["latencies_us"][0] for _, r in rows])
    assert spearman(est, meas) > 0.8
    first = np.argsort(est, kind="stable")[:4]
    assert meas[first].min() == meas.min() and all(scheds[i].producer and scheds[i].step == 128 for i in first)
