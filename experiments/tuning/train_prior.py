#!/usr/bin/env python3
"""Rebuild the tuner's first-round prior (``search/prior.py``) from the committed H100 records.

Usage:  python experiments/tuning/train_prior.py [--out search/data/prior_h100.json]

Trains ``search.learned.LearnedCostModel`` (XGBoost, pairwise ranking within each workload) on every
measured kernel committed here and writes xgboost's JSON plus its sidecar.  Re-run it when records
are added, and commit both files.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

#: the committed measurements of the H100 the prior learns from
FILES = tuple(ROOT / "experiments" / "tuning" / f for f in
              ("warp_tile_calibration.json", "h100_records.json", "unseen_shapes_records.json"))


def main(argv: list[str] | None = None) -> int:
    from schedulers.hardware import H100
    from search.prior import prior_path, train_prior

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=prior_path(H100))
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    model = train_prior(H100, FILES)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    model.save(args.out)
    print(f"prior on {model.num_records} records written to {args.out} in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
