#!/usr/bin/env python3
"""Ranking quality of the analytical and the learned cost model on the committed H100 records.

Usage:  python experiments/tuning/evaluate_models.py [--db experiments/tuning/h100.db] [--export records.json]

For each tuned workload the records are in measurement order: round 1 was chosen by the
analytical model (plus random exploration), round 2 by the learned model.  The learned model is
trained on one round and scored on the other (records it was not trained on); the analytical
model needs no training and is scored on all records.  ``--export`` writes the records as plain
JSON (schedule + measurement), the dataset the CPU tests train on.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from spacefusion.api import H100, estimate
from spacefusion.tuning import LearnedCostModel, TuningDatabase, spearman, top1_slowdown


def quality(pred, meas) -> dict[str, float]:
    pred, meas = np.asarray(pred, float), np.asarray(meas, float)
    ok = np.isfinite(meas)
    return {"spearman": round(spearman(pred[ok], meas[ok]), 3), "top1_slowdown": round(top1_slowdown(pred, meas), 3),
            "n": int(ok.sum())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", default=str(Path(__file__).with_name("h100.db")))
    ap.add_argument("--export", default=None)
    args = ap.parse_args(argv)
    out, dataset = {}, []
    with TuningDatabase(args.db, readonly=True) as db:
        for key in db.workloads():
            recs = db.records(key)
            name = recs[0][0].smg.name
            scheds, res = [s for s, _ in recs], [r for _, r in recs]
            meas = [r.median_us for r in res]
            half = len(recs) // 2
            row = {"records": len(recs), "ok": sum(r.ok for r in res), "best_us": min(meas),
                   "analytical_all": quality([estimate(s, H100) for s in scheds], meas)}
            for train, test, label in ((slice(0, half), slice(half, None), "learned_r1_to_r2"),
                                       (slice(half, None), slice(0, half), "learned_r2_to_r1")):
                m = LearnedCostModel(H100)
                m.fit(scheds[train], res[train], [key] * len(scheds[train]))
                row[label] = quality(m.predict(scheds[test]), meas[test])
            out[name] = row
            dataset += [{"workload": name, "tuning_key": key, "schedule": s.to_dict(), "result": r.to_dict()}
                        for s, r in recs]
    print(json.dumps(out, indent=1))
    if args.export:
        Path(args.export).write_text(json.dumps({"format": "spacefusion-records/1", "device": "NVIDIA H100 80GB HBM3",
                                                 "records": dataset}, indent=0) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
