#!/usr/bin/env python3
"""SD 1.5 UNet's GEMMs, attention and LayerNorms: a candidate batch per distinct SMG, measured in one run.

Usage:
    python experiments/tuning/unet_gemms.py export ART [--kinds gemm attention norm] [--top 3] [--per 6]
    python3 experiments/tuning/unet_gemms.py run ART --out R.json      # on the GPU (no TVM there)
    python experiments/tuning/unet_gemms.py table ART R.json [--records OUT] [--db DB]

The UNet's tuned export had measured schedules for its convolutions and GroupNorms only: its 135 GEMM
kernels (1779 µs a forward in `dynamo_unet_h100.json`), 32 attentions (1098) and 48 LayerNorms (297)
ran the analytical model's first pick.  ``export`` captures the UNet on meta tensors as
``spacefusion.compile`` partitions it (``captured_partitions``: the same SMGs, so the same tuning keys)
and writes, per distinct SMG of the asked kinds, the tuner's first ``--top`` and the model's best of each
family it ranks lower (tile shape x slices x producer x ring depth), up to ``--per``.  ``run`` checks
each candidate against the numpy reference and times it (``spacefusion.runtime.batch``: CUDA events,
L2 flushed, median).  ``table`` prints first pick, best and the time a forward saves at its calls;
``--db`` adds every measurement to a tuning database under the hardware it was measured on, which
``dynamo_gpu.py export --db`` then builds from.  This round has no baseline of its own: the model run
compares the whole forward against torch.compile in one process.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

#: the round's kind groups, as the partition names a subgraph's kind
KINDS = {"gemm": ("gemm", "stacked_gemm", "gated_gemm"), "attention": ("attention",),
         "norm": ("norm", "residual_norm")}
MODEL = "sd15_unet_2x64"


def workloads(groups: list[str]) -> list[tuple[Any, int, str]]:
    """(SMG, calls a forward, label) of each distinct subgraph of ``groups``' kinds in the UNet, in the
    order the partition first meets them."""
    import torch
    from dynamo_gpu import build

    from spacefusion.tuning import captured_partitions

    kinds = [k for g in groups for k in KINDS[g]]
    torch._dynamo.reset()
    model, x = build(MODEL, "meta")
    out: dict[str, list] = {}
    for p in captured_partitions(model, kinds=kinds, **x):
        for key, subs in p.distinct.items():
            got = out.setdefault(key, [subs[0].smg, 0, subs[0].label])
            got[1] += len(subs)
    return [tuple(v) for v in out.values()]


def family(s: Any) -> tuple:
    """What one candidate of a family shares: tile shape, slices, a producer warpgroup, a deep ring."""
    return (tuple(s.block), s.slices, bool(s.producer), s.stages >= 4)


def candidates(smg: Any, top: int, per: int) -> list[tuple[str, Any]]:
    """(why, schedule): the tuner's first ``top``, then the model's best of each ``family`` not yet held, in
    estimate order, up to ``per`` in all."""
    from batch_rounds import first_and_families

    return first_and_families(smg, top, per, family, lambda fam: f"family {'x'.join(str(v) for _, v in fam[0])} "
                              f"slices {fam[1]} producer {fam[2]} deep {fam[3]}")


#: the knobs ``variants`` varies around the first pick: the serial step, the ring's depth, the row sums on
#: tensor cores, the accumulator's lazy rescale
VARY = {"step": (0.5, 1.0, 2.0), "stages": (2, 3, 4), "mma_row_sums": (False, True), "lazy_rescale": (False, True)}
#: ``--set conv``'s: the step, the ring (to 6) and the slices across blocks (halved or doubled)
VARY_CONV = {"step": (0.5, 1.0, 2.0), "stages": (2, 3, 4, 6), "slices": (0.5, 1.0, 2.0)}
KINDS["conv"] = ("conv",)
_SAID = {"mma_row_sums": "row sums", "lazy_rescale": "lazy"}


def variants(s: Any, limit: int, vary: dict[str, tuple] | None = None, nearest: bool = False,
             name: str = "rank 0") -> list[tuple[str, Any]]:
    """``s`` with its knobs varied (``vary``, default ``VARY``: every combination the schedule admits, in
    product order, or with ``nearest`` those that change fewest knobs first), at most ``limit``.  A factor
    (a float) scales the knob's value; anything else replaces it.  Why: the SD 1.5 UNet's 4096-token
    attention (843 µs of a forward) had no better candidate among the tuner's order and the model's family
    bests, which differ from the first pick in several knobs at once."""
    import itertools

    from spacefusion.api import ScheduleError, make_schedule, non_defaults

    vary = VARY if vary is None else vary
    base = {**non_defaults(s.warp), **non_defaults(s.hopper)}
    now = {"step": s.step, **{k: getattr(s, k) for k in vary if k != "step"}}
    combos = [dict(zip(vary, c, strict=True)) for c in itertools.product(*vary.values())]
    values = [{k: (int(now[k] * v) if isinstance(v, float) else v) for k, v in c.items()} for c in combos]
    if nearest:
        values.sort(key=lambda v: sum(v[k] != now[k] for k in v))
    out, seen = [], {s.key}
    for v in values:
        knobs = {**base, **{k: x for k, x in v.items() if k != "step"}}
        try:
            t = make_schedule(s.smg, tiles=dict(s.block), serial=s.serial, step=v["step"], thread_dim=s.thread_dim,
                              tensor_cores=True, **knobs)
        except (ScheduleError, ValueError):
            continue
        if t.key not in seen:
            seen.add(t.key)
            said = " ".join(f"{_SAID.get(k, k)} {x}" for k, x in v.items())
            out.append((f"{name} with {said}", t))
        if len(out) >= limit:
            break
    return out


def export(art: Path, groups: list[str], top: int, per: int, vary: int = 0, only: str = "",
           around: Path | None = None, hardware: tuple[str, ...] = ("H200", "H100")) -> None:
    """The batch: per SMG ``candidates``, then up to ``vary`` knob variants of its first pick, or with
    ``around`` (a tuning database) of its best record there (``hardware`` in order), nearest first."""
    from spacefusion.api import H100, estimate
    from spacefusion.tuning import MeasureInput, export_batch, tuned

    best_of = tuned(around, "cuda:sm_90a", lambda _: None, hardware) if around is not None else None
    inputs, labels = [], []
    for smg, calls, label in workloads(groups):
        if only and only not in label:
            continue
        got = candidates(smg, top, per)
        base, name = got[0][1], "rank 0"
        if around is not None:
            best = best_of(smg)
            base, name = (best, "best") if best is not None else (base, name)
            if best is not None and best.key not in {s.key for _, s in got}:
                got.append(("best", best))
        if vary and base.tensor_cores:
            got += variants(base, vary, VARY_CONV if "conv" in groups else None, nearest=around is not None,
                            name=name)
        for why, s in got:
            inputs.append(MeasureInput(s, "cuda:sm_90a"))
            labels.append({"smg": label, "calls": calls, "why": why, "workload_key": smg.key,
                           "schedule_key": s.key, "estimate_us": round(estimate(s, H100), 2),
                           "block": [list(t) for t in s.block], "slices": s.slices, "stages": s.stages,
                           "producer": bool(s.producer), "tensor_cores": bool(s.tensor_cores)})
        print(f"{label}: {len(got)} candidates", flush=True)
    if not inputs:
        raise SystemExit(f"no SMG of kinds {', '.join(groups)} in the UNet"
                         + (f" has a label holding {only!r}" if only else ""))
    export_batch(inputs, art)
    (art / "labels.json").write_text(json.dumps(labels, indent=1) + "\n")
    print(f"{len(inputs)} candidates in {art}")


def run(art: Path, out: Path, iters: int) -> int:
    from batch_rounds import run_batch

    return run_batch(art, out, iters, "baseline", lambda _: [])


def table(art: Path, results: Path, records: Path | None, db: Path | None) -> None:
    from batch_rounds import keep_round, load_round

    from spacefusion.tuning import MeasureResult

    labels, whole = load_round(art, results)
    res = [MeasureResult.from_dict(r) for r in whole["results"]]
    rows: dict[str, list] = {}
    for lab, r in zip(labels, res, strict=True):
        rows.setdefault(lab["workload_key"], []).append((lab, r.median_us if r.ok else None))
    print(f"measured on {whole.get('device', '?')}")
    print("| SMG | calls | first pick (µs) | best | best's form | saved a forward (µs) |")
    print("|---|---|---|---|---|---|")
    first_total = best_total = 0.0
    for got in rows.values():
        lab0, first = got[0]
        ok = [(u, lab) for lab, u in got if u is not None]
        if not ok or first is None:
            print(f"| {lab0['smg']} | {lab0['calls']} | {first or 'failed'} | - | - | - |")
            continue
        best, blab = min(ok, key=lambda t: t[0])
        calls = lab0["calls"]
        first_total += first * calls
        best_total += best * calls
        form = f"{'x'.join(str(v) for _, v in blab['block'])} slices {blab['slices']} stages {blab['stages']}"
        print(f"| {lab0['smg']} | {calls} | {first:.1f} | {best:.1f} | {form} | {(first - best) * calls:.1f} |")
    print(f"per UNet forward: first picks {first_total:.0f} µs, bests {best_total:.0f}")
    keep_round(art, labels, whole, records, db, "baseline")


def main() -> None:
    from batch_rounds import round_main

    def export_args(e: argparse.ArgumentParser) -> None:
        e.add_argument("--kinds", nargs="+", choices=sorted(KINDS), default=sorted(KINDS))
        e.add_argument("--top", type=int, default=3)
        e.add_argument("--per", type=int, default=6)
        e.add_argument("--vary", type=int, default=0, metavar="N",
                       help="also up to N variants of each first pick's knobs (VARY)")
        e.add_argument("--only", default="", help="only the SMGs whose label holds this text")
        e.add_argument("--around", type=Path, default=None, metavar="DB",
                       help="vary each SMG's best record in this tuning database (else its first pick)")
        e.add_argument("--hw", nargs="+", default=["H200", "H100"], help="--around: whose records, in order")

    round_main(__doc__, export_args,
               lambda a: export(a.art, a.kinds, a.top, a.per, a.vary, a.only, a.around, tuple(a.hw)), run, table)


if __name__ == "__main__":
    main()
