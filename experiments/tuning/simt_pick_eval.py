#!/usr/bin/env python3
"""How the analytical model picks among measured CUDA-core candidates, with and without a cost term.

Usage:
    python experiments/tuning/simt_pick_eval.py [--step-latency-us 0.45]

For every committed records file (``experiments/tuning/unet_*`` and ``*records*``), the CUDA-core
candidates measured for one SMG form a group; the model's pick is its lowest estimate (the first key on
a tie), scored as the pick's measured time over the group's best.  The script prints, for the model with
``search.cost.STEP_LATENCY_S`` at 0 and at the given value, each group whose pick moved and the geometric
mean over all groups (``docs/tuning.md``, 'A running reduction's steps').  CPU only: no kernel is built.
"""

from __future__ import annotations

import argparse
import json
import lzma
import math
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def groups() -> dict[tuple[str, str], list[tuple]]:
    """(file, SMG key) -> [(schedule, best measured us, hardware)] of the CUDA-core records."""
    from spacefusion.api import H100, H200, Schedule

    folder = ROOT / "experiments" / "tuning"
    files = sorted({*folder.glob("unet_*.json*"), *folder.glob("*records*.json*")})
    out: dict[tuple[str, str], list[tuple]] = defaultdict(list)
    for f in files:
        raw = lzma.open(f).read() if f.suffix == ".xz" else f.read_bytes()
        data = json.loads(raw)
        if not isinstance(data, dict) or "records" not in data:
            continue
        hw = H200 if "H200" in str(data.get("device")) else H100
        for r in data["records"]:
            lat = r["result"].get("latencies_us")
            if not lat:
                continue
            try:
                s = Schedule.from_json(json.dumps(r["schedule"]))
            except Exception:  # a record of a form this code no longer builds  # noqa: BLE001
                continue
            if s.warp_tile is None and not s.tensor_cores:
                out[(f.name, s.smg.key)].append((s, min(lat), hw))
    return {k: v for k, v in out.items() if len(v) > 1}


def picks(got: dict[tuple[str, str], list[tuple]], step_latency_s: float) -> dict[tuple[str, str], tuple]:
    """(pick's time / best, the pick's steps per block) per group, the model's step latency set as given."""
    import search.cost as cost

    saved, cost.STEP_LATENCY_S = cost.STEP_LATENCY_S, step_latency_s
    try:
        out = {}
        for k, v in got.items():
            est = [cost.estimate_us(s, hw) for s, _, hw in v]
            i = min(range(len(v)), key=lambda j: (est[j], v[j][0].key))
            out[k] = (v[i][1] / min(t for _, t, _ in v), v[i][0].steps_per_block)
        return out
    finally:
        cost.STEP_LATENCY_S = saved


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step-latency-us", type=float, default=0.45)
    a = ap.parse_args(argv)
    got = groups()
    old, new = picks(got, 0.0), picks(got, a.step_latency_us * 1e-6)
    better = worse = 0
    for k in sorted(old):
        (o, so), (n, sn) = old[k], new[k]
        if abs(o - n) > 1e-9:
            print(f"{k[0]} {k[1][:10]}: pick {o:.2f}x the best ({so} steps) -> {n:.2f}x ({sn} steps)")
            better, worse = better + (n < o), worse + (n > o)

    def geo(d: dict) -> float:
        return math.exp(sum(math.log(x[0]) for x in d.values()) / len(d))

    print(f"{len(old)} groups: the pick's time over the best, geometric mean {geo(old):.3f} without the step "
          f"latency, {geo(new):.3f} with {a.step_latency_us} us; {better} picks better, {worse} worse")
    return 0


if __name__ == "__main__":
    sys.exit(main())
