#!/usr/bin/env python3
"""The docs' results tables, printed from harness results files (no torch, no TVM).

Usage:  python experiments/results_table.py [HARNESS_JSON]      # the current table (README, docs/results.md)
        python experiments/results_table.py --history            # spacefusion's time per harness run

The README and docs/results.md hold these tables verbatim; tests/test_docs.py regenerates them from the
committed files, so a new harness run cannot leave stale numbers in the docs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

#: the current harness run (experiments/results/README.md says what it is)
DEFAULT = Path(__file__).resolve().parent / "results" / "harness_h100.json"

HISTORY = DEFAULT.parent / "history"

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


def history_table(paths: list[Path] | None = None) -> str:
    """spacefusion's median microseconds per workload in each full harness run, oldest first.

    Defaults to every harness-format file of ``results/history`` plus the current one; the extra-repeat
    files (a ``note`` and ``runs``, not ``rows``) are left out: their kernels are those of a run listed.
    """
    if paths is None:
        paths = [*sorted(HISTORY.glob("harness_*.json")), DEFAULT]
    runs = [(p, json.loads(p.read_text())) for p in paths]
    runs = sorted(((p, d) for p, d in runs if "rows" in d), key=lambda pd: pd[1]["date"])
    keys = [w["key"] for w in runs[-1][1]["workloads"] if not w["reference_for"]]
    labels = {w["key"]: w["label"] for _, d in runs for w in d["workloads"]}
    lines = ["| run (UTC) | file | " + " | ".join(labels[k] for k in keys) + " |", "|---" * (len(keys) + 2) + "|"]
    for p, d in runs:
        us = {r["workload"]: r["median_us"] for r in d["rows"] if r["system"] == "spacefusion" and r["status"] == "ok"}
        cells = [f"{us[k]:.1f}" if k in us else "-" for k in keys]
        name = p.relative_to(DEFAULT.parent).as_posix()
        lines.append(f"| {d['date'][:16].replace('T', ' ')} | `{name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="?", type=Path, default=DEFAULT)
    ap.add_argument("--history", action="store_true", help="one row per harness run instead")
    args = ap.parse_args()
    print(history_table() if args.history else harness_table(args.results))


if __name__ == "__main__":
    main()
