#!/usr/bin/env python3
"""Lower schedule variants of the harness workloads to CUDA artefacts for a tile sweep (needs TVM).

Usage:  python experiments/make_sweep_artefacts.py OUT_DIR SPEC [SPEC ...]

A SPEC is ``workload:knob=value,...`` with the workload a key of ``make_harness_artefacts.SCHEDULES``
and knobs overriding its schedule: tiles (``m``, ``n``), ``step``, ``stages``, ``warps``, ``lanes``,
``vector``, ``slices``, ``split``, ``reload_a``, ``early_scores``, ``lazy_rescale``, ``mma_row_sums`` and
``wgmma``, ``tma``, ``producer``, ``pingpong``, ``fast_math`` (0/1), ``persistent`` (blocks), ``tc``
(tensor cores, 0/1) and ``global=A/B`` (read staged inputs A and B from global memory).
Each artefact lands in ``OUT_DIR/<workload>_<knobs>``;
then, on the GPU machine, ``python experiments/run_artefacts_gpu.py OUT_DIR/* --out sweep.json``
checks each against torch and times it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_harness_artefacts import SCHEDULES, lower_to  # noqa: E402

from spacefusion.api import make_schedule

TILE_DIMS = ("m", "n")
OPTIONS = ("stages", "warps", "lanes", "vector", "slices", "split", "reload_a", "early_scores", "lazy_rescale",
           "mma_row_sums", "wgmma", "tma", "producer", "persistent", "pingpong", "fast_math")


def parse_spec(spec: str) -> tuple[str, dict]:
    key, _, rest = spec.partition(":")
    if key not in SCHEDULES:
        raise SystemExit(f"unknown workload {key!r} in {spec!r}; known: {', '.join(SCHEDULES)}")
    knobs: dict = {}
    for item in filter(None, rest.split(",")):
        name, _, value = item.partition("=")
        if name == "global":
            knobs[name] = tuple(value.split("/"))
            continue
        if name not in (*TILE_DIMS, "step", "tc", *OPTIONS) or not value.isdigit():
            raise SystemExit(f"bad knob {item!r} in {spec!r}: want NAME=INT with NAME in "
                             f"{[*TILE_DIMS, 'step', 'tc', *OPTIONS]}")
        knobs[name] = int(value)
    return key, knobs


def variant(key: str, knobs: dict):
    """The harness schedule of ``key`` with ``knobs`` applied."""
    mk, tiles, serial, step, opts = SCHEDULES[key]
    tiles = {**tiles, **{d: knobs[d] for d in TILE_DIMS if d in knobs}}
    opts = {**opts, **{o: knobs[o] for o in OPTIONS if o in knobs}}
    if "tc" in knobs:
        opts["tensor_cores"] = bool(knobs["tc"])
        if not knobs["tc"]:
            opts = {k: v for k, v in opts.items() if k not in ("stages", "warps")}
    levels = {n: "global" for n in knobs.get("global", ())}
    return make_schedule(mk(), tiles, serial=serial, step=knobs.get("step", step), levels=levels, **opts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("specs", nargs="+")
    args = ap.parse_args(argv)
    for spec in args.specs:
        key, knobs = parse_spec(spec)
        t0 = time.perf_counter()
        s = variant(key, knobs)
        name = key + "".join(f"_{k}{''.join(v) if isinstance(v, tuple) else v}" for k, v in knobs.items())
        lower_to(s, args.out / name, t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
