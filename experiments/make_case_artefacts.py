#!/usr/bin/env python3
"""Lower the warp-tile test cases (``CASES`` of ``experiments/mma_cases.py``) to CUDA artefacts (needs TVM).

Usage:  python experiments/make_case_artefacts.py OUT_DIR [NAME ...]      (all cases when no NAME)

CI compiles every case with nvcc but has no GPU; copy OUT_DIR to the GPU machine and run
``experiments/run_artefacts_gpu.py OUT_DIR/*`` there, which checks each kernel against torch
(and relaunches it) before timing it.  Each case's graph is saved beside it (``smg.json``), the
reference of a workload the runner has no torch form of (the gated GEMM).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    from experiments.mma_cases import CASES, _schedule
    from spacefusion.api import build, save_smg

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("names", nargs="*", default=None)
    args = ap.parse_args(argv)
    unknown = sorted(set(args.names or ()) - set(CASES))
    if unknown:
        print(f"unknown cases {unknown}; known: {sorted(CASES)}", file=sys.stderr)
        return 2
    for name in args.names or sorted(CASES):
        s = _schedule(name)
        save_smg(build(s, "cuda").save(args.out / name), s.smg)  # the GPU runner's reference for any graph
        print(f"{name}: grid {s.num_blocks} x {s.threads} threads, step {s.step}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
