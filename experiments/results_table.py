#!/usr/bin/env python3
"""The README's results table, printed from a harness results file (no torch, no TVM).

Usage:  python experiments/results_table.py [experiments/results/harness_h100.json]

The README and docs/results.md hold this table verbatim; tests/test_docs.py regenerates it from the
committed file, so a new harness run cannot leave stale numbers in the docs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

#: the current harness run (experiments/results/README.md says what it is)
DEFAULT = Path(__file__).resolve().parent / "results" / "harness_h100.json"

#: systems shown as columns, in order; a workload without one shows "-"
COLUMNS = (("spacefusion", "spacefusion"), ("sdpa_flash", "SDPA flash"), ("sdpa_cudnn", "SDPA cuDNN"),
           ("torch.compile", "torch.compile"), ("eager", "eager"))


def _shape(shape: dict[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in shape.items())


def harness_table(path: Path = DEFAULT) -> str:
    """A markdown table of median microseconds per workload and system, plus spacefusion's roofline share.

    A workload that is only another's reference (the plain GEMM beside the sigmoid GEMM) is folded into
    that workload's row as "cuBLAS", since its eager row is one cuBLAS call.
    """
    data = json.loads(Path(path).read_text())
    rows = [r for r in data["rows"] if r["status"] == "ok"]
    us = {(r["workload"], r["system"]): r["median_us"] for r in rows}
    roof = {r["workload"]: r["roofline_fraction"] for r in rows if r["system"] == "spacefusion"}
    refs = {w["reference_for"]: w["key"] for w in data["workloads"] if w["reference_for"]}
    lines = ["| workload (fp16) | shape | " + " | ".join(h for _, h in COLUMNS) + " | cuBLAS A@B | roofline share |",
             "|---" * (len(COLUMNS) + 4) + "|"]
    for w in data["workloads"]:
        if w["reference_for"]:
            continue
        cells = [f"{us[w['key'], s]:.1f}" if (w["key"], s) in us else "-" for s, _ in COLUMNS]
        ref = refs.get(w["key"])
        cublas = f"{us[ref, 'eager']:.1f}" if ref and (ref, "eager") in us else "-"
        share = f"{roof[w['key']]:.0%}" if w["key"] in roof else "-"
        lines.append(f"| {w['label']} | {_shape(w['shape'])} | " + " | ".join(cells) + f" | {cublas} | {share} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="?", type=Path, default=DEFAULT)
    print(harness_table(ap.parse_args().results))


if __name__ == "__main__":
    main()
