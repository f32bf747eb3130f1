#!/usr/bin/env python3
"""The warp-tile cost model's calibration data: knob grids of the harness's attention schedules.

Usage:
    python experiments/tuning/calibration_sweep.py build ART_DIR [--per 22]      # build machine (TVM)
    python experiments/run_artefacts_gpu.py ART_DIR/* --out cal.json --no-compile  # GPU machine
    python experiments/tuning/calibration_sweep.py collect ART_DIR cal.json DEST.json [--extra ROWS.json ...]

``build`` lowers a seeded random sample of each grid (rows, warps, step, stages, wgmma and one
more knob) with the schedule beside each artefact; ``collect`` joins the GPU run's times (every
kernel checked against torch first) with those schedules into the file that
``tests/test_tuning_dataset.py`` scores the analytical model on.  ``--extra`` adds already
measured rows (the GEMM's tuning round and tile sweeps) in the same format.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

GRIDS: dict[str, dict[str, list[int]]] = {
    "mha_bert": dict(m=[64, 128], warps=[4, 8], step=[64, 128], stages=[1, 2, 3], wgmma=[0, 1], lazy_rescale=[0, 1]),
    "mha_llama": dict(m=[64, 128], warps=[4, 8], step=[32, 64, 128], stages=[1, 2, 3], wgmma=[0, 1], reload_a=[0, 1]),
    "mha_vit": dict(m=[64, 128], warps=[4, 8], step=[32, 64], stages=[1, 2], wgmma=[0, 1]),
}


def build(out: Path, per: int, seed: int) -> None:
    from make_sweep_artefacts import variant

    from spacefusion.api import ScheduleError
    from spacefusion.api import build as build_kernel

    rng = random.Random(seed)
    for key, grid in GRIDS.items():
        combos = [dict(zip(grid, v, strict=True)) for v in itertools.product(*grid.values())]
        rng.shuffle(combos)
        made = 0
        for knobs in combos:
            if made == per:
                break
            name = key + "".join(f"_{k}{v}" for k, v in knobs.items())
            try:
                s = variant(key, knobs)
            except ScheduleError as e:  # e.g. 8 warps on 64 rows: not a warp-tile program
                print(f"skip {name}: {e}")
                continue
            build_kernel(s, "cuda").save(out / name)
            (out / name / "schedule.json").write_text(s.to_json())
            made += 1
            print(f"built {name}", flush=True)


def collect(art: Path, results: Path, dest: Path, extra: list[Path]) -> None:
    run = json.loads(results.read_text())
    rows = []
    for a in run["artefacts"]:
        if not a.get("ok"):
            continue
        folder = art / Path(a["path"]).name
        rows.append({"workload": folder.name.split("_m")[0], "name": folder.name,
                     "schedule": json.loads((folder / "schedule.json").read_text()),
                     "median_us": a["kernel"]["median_us"], "max_abs_err": a["max_abs_err"]})
    for path in extra:
        rows += json.loads(path.read_text())["rows"]
    dest.write_text(json.dumps({"device": run["device"], "torch": run["torch"], "timing": run["timing"],
                                "rows": rows}, indent=1) + "\n")
    print(f"wrote {len(rows)} rows to {dest}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("out", type=Path)
    b.add_argument("--per", type=int, default=22)
    b.add_argument("--seed", type=int, default=0)
    c = sub.add_parser("collect")
    c.add_argument("art", type=Path)
    c.add_argument("results", type=Path)
    c.add_argument("dest", type=Path)
    c.add_argument("--extra", type=Path, nargs="*", default=[])
    args = ap.parse_args(argv)
    if args.cmd == "build":
        build(args.out, args.per, args.seed)
    else:
        collect(args.art, args.results, args.dest, args.extra)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
