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

    from spacefusion.frontend.tune import captured_partitions

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
    """(why, schedule): the tuner's first ``top``, then the model's best of each family not yet held, in
    estimate order, up to ``per`` in all."""
    from schedulers.hardware import H100
    from search.cost import estimate_us
    from spacefusion.frontend.schedules import ranked

    order = ranked(smg)
    out = [(f"rank {i}", s) for i, s in enumerate(order[:top])]
    seen = {family(s) for _, s in out}
    best: dict[tuple, Any] = {}
    for s in order[top:]:
        best.setdefault(family(s), s)
    for fam, s in sorted(best.items(), key=lambda kv: estimate_us(kv[1], H100)):
        if len(out) >= per:
            break
        if fam not in seen:
            seen.add(fam)
            out.append((f"family {'x'.join(str(v) for _, v in fam[0])} slices {fam[1]} producer {fam[2]} "
                        f"deep {fam[3]}", s))
    return out


#: the knobs ``variants`` varies around the first pick: the serial step, the ring's depth, the row sums on
#: tensor cores, the accumulator's lazy rescale
VARY = {"step": (0.5, 1, 2), "stages": (2, 3, 4), "mma_row_sums": (False, True), "lazy_rescale": (False, True)}


def variants(s: Any, limit: int) -> list[tuple[str, Any]]:
    """The first pick with its knobs varied (``VARY``: every combination the schedule admits, in a fixed
    order), at most ``limit``.  Why: the SD 1.5 UNet's 4096-token attention (843 µs of a forward) had no
    better candidate among the tuner's order and the model's family bests, which differ from the first pick
    in several knobs at once."""
    import itertools

    from schedulers.errors import ScheduleError
    from schedulers.options import non_defaults
    from schedulers.schedule import make_schedule

    base = {**non_defaults(s.warp), **non_defaults(s.hopper)}
    out, seen = [], {s.key}
    for f, stages, sums, lazy in itertools.product(*VARY.values()):
        step = int(s.step * f)
        knobs = {**base, "stages": stages, "mma_row_sums": sums, "lazy_rescale": lazy}
        try:
            t = make_schedule(s.smg, tiles=dict(s.block), serial=s.serial, step=step, thread_dim=s.thread_dim,
                              tensor_cores=True, **knobs)
        except (ScheduleError, ValueError):
            continue
        if t.key not in seen:
            seen.add(t.key)
            out.append((f"rank 0 with step {step} stages {stages} row sums {sums} lazy {lazy}", t))
        if len(out) >= limit:
            break
    return out


def export(art: Path, groups: list[str], top: int, per: int, vary: int = 0, only: str = "") -> None:
    from schedulers.hardware import H100
    from search.cost import estimate_us
    from search.records import MeasureInput
    from spacefusion.runners.offline import export_batch

    inputs, labels = [], []
    for smg, calls, label in workloads(groups):
        if only and only not in label:
            continue
        got = candidates(smg, top, per)
        got += variants(got[0][1], vary) if vary and got[0][1].tensor_cores else []
        for why, s in got:
            inputs.append(MeasureInput(s, "cuda:sm_90a"))
            labels.append({"smg": label, "calls": calls, "why": why, "workload_key": smg.key,
                           "schedule_key": s.key, "estimate_us": round(estimate_us(s, H100), 2),
                           "block": [list(t) for t in s.block], "slices": s.slices, "stages": s.stages,
                           "producer": bool(s.producer), "tensor_cores": bool(s.tensor_cores)})
        print(f"{label}: {len(got)} candidates", flush=True)
    export_batch(inputs, art)
    (art / "labels.json").write_text(json.dumps(labels, indent=1) + "\n")
    print(f"{len(inputs)} candidates in {art}")


def run(art: Path, out: Path, iters: int) -> int:
    from batch_rounds import run_batch

    return run_batch(art, out, iters, "baseline", lambda _: [])


def table(art: Path, results: Path, records: Path | None, db: Path | None) -> None:
    from batch_rounds import keep_round, load_round

    from search.records import MeasureResult

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

    round_main(__doc__, export_args, lambda a: export(a.art, a.kinds, a.top, a.per, a.vary, a.only), run, table)


if __name__ == "__main__":
    main()
