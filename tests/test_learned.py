"""The learned cost model: ranking metrics, schedule features, and the XGBoost ranker's machinery."""

from __future__ import annotations

import json
import math
from functools import lru_cache
from unittest import mock

import numpy as np
import pytest

import schedulers.schedule as schedule_mod
from schedulers.hardware import H100
from schedulers.schedule import Schedule, make_schedule, pick_serial
from schedulers.spatial import analyse_spatial, cuttable
from schedulers.temporal import plan_temporal
from schedulers.traffic import traffic
from search.features import FEATURE_NAMES, feature_matrix, features
from search.learned import LearnedCostModel
from search.metrics import rankdata, spearman, top1_slowdown, top_k_recall
from search.records import MeasureResult
from smg.patterns import layernorm
from smg.workloads import gemm, softmax_gemm

# -- metrics ------------------------------------------------------------------------------------


def test_spearman_orders_and_ties():
    a = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert spearman(a, [10, 20, 30, 40, 50]) == pytest.approx(1.0)
    assert spearman(a, [5, 4, 3, 2, 1]) == pytest.approx(-1.0)
    # ties: b ranks (1.5, 1.5, 3, 4); a ranks (1, 2, 3, 4).  Pearson of the centred ranks
    # (-1.5, -.5, .5, 1.5) and (-1, -1, .5, 1.5): 4.5 / sqrt(5 * 4.5) = sqrt(0.9)
    assert list(rankdata([7, 7, 8, 9])) == [1.5, 1.5, 3.0, 4.0]
    assert spearman([1, 2, 3, 4], [7, 7, 8, 9]) == pytest.approx(math.sqrt(0.9))
    assert spearman([1, 2, 3], [4, 4, 4]) == 0.0  # constant: no information, not NaN
    assert spearman([1.0], [2.0]) == 0.0
    assert spearman([1, 2, float("nan"), 3], [1, 2, 0, 3]) == pytest.approx(1.0)  # NaN pairs dropped
    assert spearman([1, 2, 3], [1, 2, math.inf]) == pytest.approx(1.0)  # a failure ranks last


def test_top1_slowdown_and_recall():
    measured = [30.0, 10.0, 20.0, 40.0]
    assert top1_slowdown([3, 1, 2, 4], measured) == 1.0  # predicted best is the true best
    assert top1_slowdown([0.5, 1, 2, 4], measured) == pytest.approx(3.0)  # picks the 30 us one
    assert top1_slowdown([1, 0, 2, 3], [10.0, math.inf, 20.0, 30.0]) == math.inf  # picks a failure
    assert top_k_recall([3, 1, 2, 4], measured, 2) == 1.0
    assert top_k_recall([1, 2, 3, 4], measured, 2) == 0.5  # {0, 1} vs true {1, 2}
    assert top_k_recall([4, 3, 2, 1], measured, 1) == 0.0
    assert top_k_recall([1, 2], [1.0, 2.0], 5) == 1.0  # k clipped


# -- features -----------------------------------------------------------------------------------


def test_features_fixed_length_finite_deterministic():
    g = gemm(64, 64, 32)
    a = make_schedule(g, tiles={"m": 4, "n": 32}, step=16)
    b = make_schedule(g, tiles={"m": 1, "n": 64}, step=8, thread_dim="n")
    fa, fb = features(a, H100), features(b, H100)
    assert fa.shape == (len(FEATURE_NAMES),) and fa.dtype == np.float64
    assert len(set(FEATURE_NAMES)) == len(FEATURE_NAMES)
    assert np.isfinite(fa).all() and np.isfinite(fb).all()
    assert np.array_equal(fa, features(a, H100))
    assert np.array_equal(fa, features(Schedule.from_json(a.to_json()), H100))
    assert not np.array_equal(fa, fb)
    f = dict(zip(FEATURE_NAMES, fa))
    assert f["threads"] == 128 and f["num_steps"] == 2 and f["num_cut_dims"] == 2
    assert f["log2_num_blocks"] == pytest.approx(math.log2(1 + 16 * 2))
    assert f["fused_bytes"] == traffic(a).fused_bytes
    m = feature_matrix([a, b], H100)
    assert m.shape == (2, len(FEATURE_NAMES)) and np.array_equal(m[1], fb)
    assert feature_matrix([], H100).shape == (0, len(FEATURE_NAMES))


def test_features_of_other_workloads_are_finite():
    for g in (softmax_gemm(64, 128, 64), layernorm(32, 128)):
        f = dict(zip(FEATURE_NAMES, features(make_schedule(g, step=32), H100)))
        assert all(math.isfinite(v) for v in f.values())
        assert f["num_states"] >= 2
    f = dict(zip(FEATURE_NAMES, features(make_schedule(layernorm(32, 128), step=32), H100)))
    assert f["second_pass"] == 1.0


# -- the learned model on synthetic labels ------------------------------------------------------

FAIL_ON_CHIP_BYTES = 64 * 1024


def _pow2(limit: int) -> list[int]:
    return [1 << i for i in range(int(math.log2(limit)) + 1)]


def hidden_latency_us(s: Schedule, rng: np.random.Generator) -> float | None:
    """A made-up, roofline-like latency the model has to learn; None means "failed to build".

    Launch overhead, plus device bytes over a bandwidth that needs enough threads in flight and a
    wide thread tile (coalescing), plus FLOPs over a peak that needs enough blocks, plus a
    synchronisation per step and wave; times 5% log-normal noise.
    """
    tr = traffic(s)
    if tr.on_chip_bytes_per_block > FAIL_ON_CHIP_BYTES:
        return None
    threads, blocks = s.threads, s.num_blocks
    in_flight = min(1.0, blocks * threads / (132 * 1024))
    coalesce = min(1.0, s.tiles[s.thread_dim] / 32)
    if s.thread_dim != s.smg.space(s.smg.outputs[0]).dims[-1]:
        coalesce *= 0.6
    flops = 2.0 * sum(math.prod(s.smg.dim_sizes[d] for d in op.iter_dims) for op in s.smg.ops)
    mem_us = tr.fused_bytes / (3e6 * max(in_flight, 1 / 64) * (0.2 + 0.8 * coalesce))
    flop_us = flops / (60e6 * max(min(1.0, blocks / 132), 1 / 132))
    waves = math.ceil(blocks / (132 * max(1, 2048 // (32 * math.ceil(threads / 32)))))
    sync_us = 0.05 * s.num_steps * waves
    return (3.0 + mem_us + flop_us + sync_us) * float(np.exp(rng.normal(0.0, 0.05)))


def _candidates(g, n: int, rng: np.random.Generator) -> list[Schedule]:
    """Distinct schedules of ``g``: power-of-two tiles on the cuttable dims (at most 1024 threads),
    steps, and every cut dim as the thread dim; a seeded sample of ``n`` of them."""
    sizes = g.dim_sizes
    cut = cuttable(g)
    serial = pick_serial(g, analyse_spatial(g))
    combos = [{}]
    for d in cut:
        combos = [{**c, d: t} for c in combos for t in _pow2(sizes[d]) if math.prod([*c.values(), t]) <= 1024]
    opts = [(c, step, td) for c in combos for step in _pow2(sizes[serial]) if step >= 8 for td in cut]
    pick = rng.choice(len(opts), size=min(n, len(opts)), replace=False)
    return [make_schedule(g, tiles=opts[i][0], step=opts[i][1], thread_dim=opts[i][2], serial=serial)
            for i in sorted(pick)]


@pytest.fixture(scope="module")
def dataset():
    """Schedules of three workloads with *synthetic* latencies from ``hidden_latency_us``.

    These labels are NOT measurements: they exist to test the learning machinery (features,
    grouping, labels, training, evaluation) against a known, learnable ground truth.
    ``plan_temporal`` is memoised while building (it is a pure function of (smg, serial) that
    re-checks its derivation numerically on every call, which dominates the time).
    """
    rng = np.random.default_rng(0)
    cached = lru_cache(maxsize=None)(plan_temporal)
    out = []
    with mock.patch.object(schedule_mod, "plan_temporal", cached):
        for g in (gemm(256, 256, 128), softmax_gemm(512, 256, 64), layernorm(128, 512)):
            for s in _candidates(g, 60, rng):
                lat = hidden_latency_us(s, rng)
                res = (MeasureResult(s.key, "synthetic", error="on-chip footprint too large") if lat is None
                       else MeasureResult(s.key, "synthetic", latencies_us=(lat,)))
                out.append((s, res, g.key))
    X = feature_matrix([s for s, _, _ in out], H100)
    return out, X


def _split(data, X, frac: float = 0.6, seed: int = 1):
    rng = np.random.default_rng(seed)
    train = rng.random(len(data)) < frac

    def take(mask):
        idx = np.flatnonzero(mask)
        return ([data[i][0] for i in idx], [data[i][1] for i in idx], [data[i][2] for i in idx], X[idx])
    return take(train), take(~train)


def test_dataset_is_varied(dataset):
    data, X = dataset
    assert len(data) >= 150
    assert len({s.key for s, _, _ in data}) == len(data)  # distinct schedules
    assert len({g for _, _, g in data}) == 3
    assert any(not r.ok for _, r, _ in data) and sum(r.ok for _, r, _ in data) > 100
    assert np.isfinite(X).all()


def test_learns_held_out_ranking(dataset):
    """Train on 60% of each workload's candidates; rank the other 40% (synthetic labels)."""
    data, X = dataset
    (s_tr, r_tr, g_tr, _), (s_te, r_te, g_te, _) = _split(data, X)
    model = LearnedCostModel(H100)
    assert not model.is_trained
    with pytest.raises(RuntimeError):
        model.predict(s_te[:1])
    model.fit(s_tr, r_tr, g_tr)
    assert model.is_trained
    ev = model.evaluate(s_te, r_te, g_te)
    assert ev["num_seen"] == 0 and ev["num_records"] == len(s_te)
    assert len(ev["groups"]) == 3
    for name, g in ev["groups"].items():
        assert g["spearman"] > 0.6, (name, g)
        assert g["top1_slowdown"] < 1.5, (name, g)
    assert ev["mean_spearman"] > 0.6 and ev["mean_top1_slowdown"] < 1.5
    # a model that has learned nothing useful would not clear these bars
    rng = np.random.default_rng(3)
    noise = [spearman(rng.random(len(s_te)), [r.median_us for r in r_te]) for _ in range(5)]
    assert max(noise) < 0.6


def test_predict_accepts_features_and_update_retrains(dataset):
    data, X = dataset
    (s_tr, r_tr, g_tr, X_tr), (s_te, r_te, g_te, X_te) = _split(data, X)
    half = len(s_tr) // 2
    model = LearnedCostModel(H100)
    model.fit(s_tr[:half], r_tr[:half], g_tr[:half])
    before = model.predict(X_te)
    assert np.array_equal(before, model.predict(s_te))
    model.update(X_tr[half:], r_tr[half:], g_tr[half:])
    assert model.is_trained and model.num_records == len(s_tr)
    after = model.predict(X_te)
    assert after.shape == (len(s_te),) and not np.array_equal(before, after)
    # retraining on all records equals fitting them in one go (order of arrival does not matter)
    full = LearnedCostModel(H100)
    full.fit(X_tr, r_tr, g_tr)
    assert np.allclose(after, full.predict(X_te))
    with pytest.raises(ValueError, match="misaligned"):
        model.update(s_tr[:2], r_tr[1:3], g_tr[:2])
    with pytest.raises(ValueError, match="one result"):
        model.fit(s_tr[:3], r_tr[:2], g_tr[:3])


def test_save_load_round_trip(dataset, tmp_path):
    data, X = dataset
    (s_tr, r_tr, g_tr, X_tr), (_, _, _, X_te) = _split(data, X)
    model = LearnedCostModel(H100)
    model.fit(X_tr, r_tr, g_tr)
    path = tmp_path / "cost.json"
    model.save(path)
    side = tmp_path / "cost.meta.json"
    assert json.loads(path.read_text())["learner"]  # xgboost's own JSON
    loaded = LearnedCostModel.load(path)
    assert loaded.is_trained and loaded.hw == H100
    assert np.array_equal(model.predict(X_te), loaded.predict(X_te))
    with pytest.raises(ValueError, match=".json"):
        model.save(tmp_path / "cost.ubj")

    meta = json.loads(side.read_text())
    meta["feature_names"] = [*meta["feature_names"][:-1], "log2_bogus"]
    side.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="log2_bogus"):
        LearnedCostModel.load(path)
    meta["feature_names"] = list(reversed(FEATURE_NAMES))
    side.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="sidecar's feature names"):
        LearnedCostModel.load(path)
    side.unlink()
    with pytest.raises(ValueError, match="sidecar"):
        LearnedCostModel.load(path)


def test_a_model_saved_in_an_older_feature_layout_predicts_the_same(dataset, tmp_path):
    """A model saved before a knob's column was added, or with the columns in another order, is re-pointed
    at this version's columns on load and predicts exactly what it did (the shipped prior predates the
    generated knob columns)."""
    data, X = dataset
    (_, r_tr, g_tr, X_tr), (_, _, _, X_te) = _split(data, X)
    model = LearnedCostModel(H100)
    model.fit(X_tr, r_tr, g_tr)
    path = tmp_path / "cost.json"
    model.save(path)
    unused = FEATURE_NAMES.index("unroll")  # constant in the records: never split on
    old = [n for n in reversed(FEATURE_NAMES) if n != "unroll"]  # an "older" layout: reordered, one column fewer
    at = {n: i for i, n in enumerate(old)}
    doc = json.loads(path.read_text())
    learner = doc["learner"]
    for tree in learner["gradient_booster"]["model"]["trees"]:
        assert unused not in [i for i, left in zip(tree["split_indices"], tree["left_children"]) if left != -1]
        tree["split_indices"] = [at.get(FEATURE_NAMES[i], 0) for i in tree["split_indices"]]
        tree["tree_param"]["num_feature"] = str(len(old))
    learner["learner_model_param"]["num_feature"] = str(len(old))
    learner["feature_names"] = old
    learner["feature_types"] = ["float"] * len(old)
    path.write_text(json.dumps(doc))
    side = tmp_path / "cost.meta.json"
    meta = json.loads(side.read_text())
    meta["feature_names"] = old
    side.write_text(json.dumps(meta))
    assert np.array_equal(LearnedCostModel.load(path).predict(X_te), model.predict(X_te))
