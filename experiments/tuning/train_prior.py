#!/usr/bin/env python3
"""Rebuild the tuner's first-round prior (``search/prior.py``) of a machine from its committed records.

Usage:  python experiments/tuning/train_prior.py [--hw h100|h200] [--out search/data/prior_<hw>.json]
                                                 [--evaluate experiments/tuning/prior_<hw>_heldout.json]

Trains ``search.learned.LearnedCostModel`` (XGBoost, pairwise ranking within each workload) on every
measured kernel of that machine committed here (``FILES``) and writes xgboost's JSON plus its sidecar.  Re-run
it when records are added, and commit both files.

``--evaluate`` first judges the prior held out, one shape (a records group: workload and SMG key) at a time:
a prior trained on every other record of the machine ranks that shape's measured candidates, beside the
H100's shipped prior (what a machine without a prior of its own falls back to) and the analytical model
alone.  Per shape: the Spearman correlation of each ranking with the measured times, and how far the first
pick of the first round's order (``search.prior.first_round_order``: the estimate, ties within 1% broken by
the prior) is from the shape's measured best.  The summary goes into the sidecar (``training``), the rows to
the file named.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

TUNING = ROOT / "experiments" / "tuning"
#: the committed measurements of each machine that its prior learns from
FILES = {
    "h100": tuple(TUNING / f for f in ("warp_tile_calibration.json", "h100_records.json",
                                       "unseen_shapes_records.json")),
    # every spacefusion-records/1 file measured on the H200 (the UNet's rounds) and the H200 rounds of the
    # models' tuning (e2e_rounds2_h100.json holds both machines': ``read_records`` keeps the H200's)
    "h200": (*sorted(TUNING.glob("*_h200.json.xz")), TUNING / "raw" / "unet_convs_strided_h200.json",
             TUNING / "e2e_rounds2_h100.json"),
}
#: a held-out shape is judged where at least this many of its candidates ran
MIN_GROUP = 4


def _load(hw: Any, files: tuple[Path, ...]) -> tuple[list[Any], list[Any], list[str]]:
    from spacefusion.tuning import read_records

    scheds, res, groups = [], [], []
    for f in files:
        s, r, g = read_records(f, hw.name)
        scheds += s
        res += r
        groups += g
    return scheds, res, groups


class _Rows:
    """A trained model scoring precomputed feature rows (``first_round_order`` passes the candidates)."""

    is_trained = True

    def __init__(self, model: Any) -> None:
        self.model = model

    def predict(self, rows: list[np.ndarray]) -> np.ndarray:
        return self.model.predict(np.vstack(rows))


def _kind(group: str) -> str:
    """A records group's workload kind: its workload's name without the shape (``conv2d_3x3_none``,
    ``e2e_gemm_gelu``)."""
    name = group.split(":")[0]
    return name.split("_m")[0] if name.startswith("e2e_") else name


def evaluate(hw: Any, files: tuple[Path, ...]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Leave-one-out: the summary and one row per judged shape (see the module docstring), held out one shape
    at a time and, stricter, one workload kind at a time (every shape of it)."""
    from spacefusion.api import H100, estimate
    from spacefusion.tuning import LearnedCostModel, feature_matrix, first_round_order, load_prior, spearman

    scheds, res, groups = _load(hw, files)
    med = np.array([r.median_us if r.ok else np.inf for r in res])
    X = feature_matrix(scheds, hw)  # what the machine's own prior scores
    X_h100 = feature_matrix(scheds, H100)  # what the H100's prior scores where it stands in (its own numbers)
    est = np.array([estimate(s, hw) for s in scheds])
    h100 = load_prior(H100)
    rows = []
    models: dict[tuple[str, str], Any] = {}

    def left_out(unit: str, key: str) -> Any:
        """A prior trained on every record but those of ``key`` (a group, or a kind: ``unit``)."""
        if (unit, key) not in models:
            train = [i for i, gi in enumerate(groups) if (gi if unit == "shape" else _kind(gi)) != key]
            models[(unit, key)] = model = LearnedCostModel(hw)
            model.fit(X[train], [res[i] for i in train], [groups[i] for i in train])
        return models[(unit, key)]

    for g, unit in ((g, u) for u in ("shape", "kind") for g in sorted(set(groups))):
        idx = [i for i, gi in enumerate(groups) if gi == g and np.isfinite(med[i])]
        if len(idx) < MIN_GROUP:
            continue
        model = left_out(unit, g if unit == "shape" else _kind(g))
        m, best = med[idx], med[idx].min()
        row: dict[str, Any] = {"group": g, "held_out": unit, "n": len(idx), "best_us": round(float(best), 2)}
        for name, prior, feats in (("own", _Rows(model), X), ("h100", _Rows(h100), X_h100), ("none", None, X)):
            cands = {str(i): feats[i] for i in idx}
            first = int(first_round_order(cands, {str(i): float(est[i]) for i in idx}, prior)[0])  # type: ignore[arg-type]
            row[f"first_{name}"] = round(float(med[first] / best), 4)
            if prior is not None:
                row[f"spearman_{name}"] = round(float(spearman(prior.predict([feats[i] for i in idx]), m)), 4)
        row["spearman_analytical"] = round(float(spearman(est[idx], m)), 4)
        rows.append(row)

    def judged(unit: str) -> dict[str, Any]:
        part = [r for r in rows if r["held_out"] == unit]

        def mean(key: str) -> float:
            return round(float(np.mean([r[key] for r in part])), 4)

        return {
            "shapes": len(part),
            "mean_spearman": {k: mean(f"spearman_{k}") for k in ("own", "h100", "analytical")},
            "first_pick_within_10pct_of_best": {k: sum(r[f"first_{k}"] <= 1.10 for r in part)
                                                for k in ("own", "h100", "none")},
            "mean_first_pick_over_best": {k: mean(f"first_{k}") for k in ("own", "h100", "none")},
        }

    summary = {
        "held_out": ("each shape (a records group: workload and SMG key) with at least "
                     f"{MIN_GROUP} candidates that ran, ranked by a prior trained on every other record "
                     "(per_shape) or on every record of other workload kinds (per_kind); 'own' is that prior, "
                     "'h100' the shipped H100 prior, 'none'/'analytical' the analytical model alone"),
        "per_shape": judged("shape"),
        "per_kind": judged("kind"),
    }
    return summary, rows


def main(argv: list[str] | None = None) -> int:
    from spacefusion.api import get_hardware
    from spacefusion.tuning import prior_path, train_prior

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hw", choices=sorted(FILES), default="h100")
    ap.add_argument("--out", type=Path, default=None, help="default: search/data/prior_<hw>.json")
    ap.add_argument("--evaluate", type=Path, default=None, help="judge it held out first; rows to this file")
    args = ap.parse_args(argv)
    hw, files = get_hardware(args.hw), FILES[args.hw]
    out = args.out or prior_path(hw)
    training: dict[str, Any] = {"files": [str(f.relative_to(ROOT)) for f in files]}
    if args.evaluate is not None:
        t0 = time.perf_counter()
        summary, rows = evaluate(hw, files)
        training |= summary
        args.evaluate.parent.mkdir(parents=True, exist_ok=True)
        args.evaluate.write_text(json.dumps({"hardware": hw.name, "summary": summary, "shapes": rows}, indent=1))
        print(json.dumps(summary, indent=1))
        print(f"held-out rows written to {args.evaluate} in {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    model = train_prior(hw, files)
    training |= {"num_records": model.num_records, "num_groups": len(set(_load(hw, files)[2]))}
    out.parent.mkdir(parents=True, exist_ok=True)
    model.save(out, training if args.evaluate is not None or args.hw != "h100" else None)
    print(f"prior on {model.num_records} records written to {out} in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
