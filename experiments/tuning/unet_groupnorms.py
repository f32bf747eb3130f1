#!/usr/bin/env python3
"""SD 1.5 UNet's GroupNorms: each split kernel's candidates (partial, stats, apply) in one run, against torch.

Usage:
    python experiments/tuning/unet_groupnorms.py export ART [--top 3 --per 8]   # here (TVM): the batch
    python experiments/tuning/unet_groupnorms.py export ART --whole --max-hw 32   # the same, unsplit
    python experiments/tuning/unet_groupnorms.py export ART --steps --add-only    # the partials, every step
    python3 experiments/tuning/unet_groupnorms.py run ART --out R.json            # on the GPU: batch + torch
    python experiments/tuning/unet_groupnorms.py table ART R.json [--records OUT] [--db DB]

At batch 2 a GroupNorm's 64 (sample, group) reductions leave most of the H100's SMs idle, so
``schedulers.split`` runs each as three kernels: the partial sums over chunks of pixels, their totals
(``stats``: one tiny reduction per group) and the element-wise ``apply``.  The UNet runs 61 of them a
forward (22 distinct SMGs); their 183 kernels took 756 us of its 6570
(`history/dynamo_unet_h100_before_groupnorm_lanes.json`), the stats kernels alone 298 us for a few KB each.
``export`` writes, per kernel, the tuner's first ``--top`` picks, the previous space's first pick and the
analytical model's best of each CUDA-core family it ranks lower (lanes x vector x threads), up to
``--per``; ``run`` checks and times the batch (``spacefusion.runtime.batch``) and times torch's
``group_norm`` (+ SiLU, + the time embedding's add where the UNet has it; fp16 channels-last, eager) on the
same machine in the same process; ``table`` prints first pick and best per GroupNorm and per forward.
The batch flushes L2 before each kernel, which a model's graph does not: compare candidates of one kernel
here, not the split with one kernel (``docs/convolutions.md``, 'Small grids').
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

#: (channels, h = w, SiLU, the time embedding's add, eps, calls per forward) of SD 1.5's UNet GroupNorms at
#: batch 2 (32 groups): the ResNet blocks' (eps 1e-5, SiLU; the second with the add) and the transformer
#: blocks' (eps 1e-6, no SiLU), as ``spacefusion.compile`` partitioned them (``art/*.partition.txt``)
GNORMS = [(1280, 8, True, True, 1e-5, 7), (640, 32, False, False, 1e-6, 5), (320, 64, False, False, 1e-6, 5),
          (1280, 16, False, False, 1e-6, 5), (640, 32, True, True, 1e-5, 5), (320, 64, True, True, 1e-5, 5),
          (1280, 16, True, True, 1e-5, 5), (1280, 8, True, False, 1e-5, 4), (320, 64, True, False, 1e-5, 3),
          (2560, 8, True, False, 1e-5, 3), (640, 64, True, False, 1e-5, 2), (2560, 16, True, False, 1e-5, 2),
          (1280, 8, False, False, 1e-6, 1), (960, 64, True, False, 1e-5, 1), (960, 32, True, False, 1e-5, 1),
          (640, 32, True, False, 1e-5, 1), (640, 16, True, False, 1e-5, 1), (320, 32, True, False, 1e-5, 1),
          (1920, 32, True, False, 1e-5, 1), (1920, 16, True, False, 1e-5, 1), (1280, 32, True, False, 1e-5, 1),
          (1280, 16, True, False, 1e-5, 1)]
BATCH, GROUPS = 2, 32


def _label(g: tuple) -> str:
    c, hw, silu, add, eps, _ = g
    return f"{'add + ' if add else ''}GN{' + SiLU' if silu else ''} {BATCH}x{c}x{hw}x{hw} eps {eps:g}"


def _smg(g: tuple):
    from spacefusion.api import patterns

    c, hw, silu, add, eps, _ = g
    return patterns.group_norm(BATCH, hw * hw, GROUPS, c, "silu" if silu else "none", True, "float16", eps,
                               shift=add)


def _family(s) -> tuple:
    return (s.lanes, s.vector, s.threads)


def pick(smg, top: int, per: int) -> list[tuple[str, Any]]:
    """(why, schedule): the first ``top`` in the tuner's order; the first of the previous space (lanes at most
    a step's positions, before lanes could spread over the other reduced dims too); then the best-estimated
    of each (lanes, vector) not yet held, then of each (lanes, vector, threads), in estimate order, up to
    ``per`` in all."""
    from spacefusion.api import H100, candidates, estimate

    order = candidates(smg)
    out = [(f"rank {i}", s) for i, s in enumerate(order[:top])]
    prev = next((s for s in order if s.lanes <= s.step), None)
    if prev is not None and all(prev.key != s.key for _, s in out):
        out.append(("first pick of the previous space", prev))
    est = {s.key: estimate(s, H100) for s in order[top:]}
    for width in (2, 3):
        seen = {_family(s)[:width] for _, s in out}
        for s in sorted(order[top:], key=lambda s: est[s.key]):
            if len(out) >= per:
                break
            if _family(s)[:width] not in seen:
                seen.add(_family(s)[:width])
                out.append((f"family lanes {s.lanes} vector {s.vector}" + (f" threads {s.threads}" if width == 3
                                                                            else ""), s))
    return out


def by_step(smg, held: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """The tuner's first of each serial step not among ``held``.  Why: the analytical model ties a partial's
    steps (its reads are the same), while each step boundary runs the derived carries and the auxiliary
    accumulators again; the first pick of the ``X + E`` partial moved from 2 steps to 16 with the tile
    computed once (5.0 -> 7.7 us a call in the UNet's graph on the H200)."""
    from spacefusion.api import candidates

    seen = {s.step for _, s in held}
    out = []
    for s in candidates(smg):
        if s.step not in seen:
            seen.add(s.step)
            out.append((f"first of step {s.step}", s))
    return out


def kernels(g: tuple, whole: bool = False) -> list[tuple[str, Any]]:
    """(part, SMG) of ``g``'s split: partial, stats, apply; with ``whole`` (or where it is not split) the
    unsplit GroupNorm as one kernel."""
    from schedulers.split import decide_split
    from spacefusion.api import H100

    split = decide_split(_smg(g), H100)
    if whole or isinstance(split, str):
        return [("whole", _smg(g))]
    names = ("partial", "stats", "apply")
    return list(zip(names, split.kernels, strict=False))


def export(art: Path, top: int, per: int, whole: bool = False, max_hw: int = 64, steps: bool = False,
           add_only: bool = False) -> None:
    from spacefusion.api import H100, estimate
    from spacefusion.tuning import MeasureInput, export_batch

    if steps and whole:
        raise SystemExit("--steps measures the split's partial kernels, which --whole leaves out: pass one of them")
    chosen = [g for g in GNORMS if g[1] <= max_hw and (g[3] or not add_only)]
    if not chosen:
        raise SystemExit(f"--max-hw {max_hw}{' --add-only' if add_only else ''}: no GroupNorm of the UNet has an "
                         f"image side of at most that (its sides: {sorted({g[1] for g in GNORMS})})")
    inputs, labels = [], []
    for g in chosen:
        parts = kernels(g, whole)
        for part, k in parts:
            # a stats kernel is checked on the partial sums its partial computes, not on random ones
            producer = dict(parts)["partial"] if part == "stats" else None
            if steps and part != "partial":
                continue
            got = pick(k, top, per)
            for why, s in got + (by_step(k, got) if steps else []):
                inputs.append(MeasureInput(s, "cuda:sm_90a", producer))
                labels.append({"gn": list(g[:5]), "calls": g[5], "part": part, "why": why, "workload_key": k.key,
                               "schedule_key": s.key, "lanes": s.lanes, "vector": s.vector, "threads": s.threads,
                               "blocks": s.num_blocks, "step": s.step, "estimate_us": round(estimate(s, H100), 3)})
        print(_label(g), flush=True)
    export_batch(inputs, art)
    (art / "labels.json").write_text(json.dumps(labels, indent=1) + "\n")
    print(f"{len(inputs)} candidates of {len({json.dumps(lab['gn']) for lab in labels})} GroupNorms in {art}")


def torch_times(iters: int) -> list[dict[str, Any]]:
    """torch's eager GroupNorm per shape (fp16 channels-last; + SiLU, + the add before it where the UNet has
    them), timed as the batch times our kernels (``runtime.timing.time_cuda``: CUDA events, L2 flushed, the
    launches held behind a sleep so the host's Python is not timed), median of ``iters``."""
    import torch
    import torch.nn.functional as F

    from spacefusion.runtime import time_cuda  # the GPU runtime: no TVM

    gen = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for g in GNORMS:
        c, hw, silu, add, eps, _ = g
        x = torch.randn(BATCH, c, hw, hw, device="cuda", generator=gen).half().to(memory_format=torch.channels_last)
        e = torch.randn(BATCH, c, 1, 1, device="cuda", generator=gen).half()
        w = torch.randn(c, device="cuda", generator=gen).half()
        b = torch.randn(c, device="cuda", generator=gen).half()

        def fn(x=x, e=e, w=w, b=b, silu=silu, add=add, eps=eps):
            y = F.group_norm(x + e if add else x, GROUPS, w, b, eps)
            return F.silu(y) if silu else y

        us = time_cuda(fn, warmup=10, iters=iters).median_us
        out.append({"gn": list(g[:5]), "torch_eager_us": round(us, 2)})
        print(_label(g), out[-1]["torch_eager_us"], flush=True)
    return out


def run(art: Path, out: Path, iters: int) -> int:
    from batch_rounds import run_batch

    return run_batch(art, out, iters, "torch", torch_times)


def summarize(labels: list[dict], results: list[Any]) -> dict[tuple, dict[str, dict[str, Any]]]:
    """Per GroupNorm, per kernel part: the first pick's and the best's time (us), the best's label."""
    rows: dict[tuple, dict[str, list]] = {}
    for lab, r in zip(labels, results, strict=True):
        rows.setdefault(tuple(lab["gn"]), {}).setdefault(lab["part"], []).append((lab, r.median_us if r.ok else None))
    out: dict[tuple, dict[str, dict[str, Any]]] = {}
    for gn, parts in rows.items():
        for part, got in parts.items():
            ok = [(u, lab) for lab, u in got if u is not None]
            best, blab = min(ok, key=lambda t: t[0]) if ok else (None, None)
            out.setdefault(gn, {})[part] = {"first": got[0][1], "best": best, "best_label": blab,
                                            "calls": got[0][0]["calls"]}
    return out


def table(art: Path, results: Path, records: Path | None, db: Path | None) -> None:
    from batch_rounds import keep_round, load_round

    from spacefusion.tuning import MeasureResult

    labels, whole = load_round(art, results)
    res = [MeasureResult.from_dict(r) for r in whole["results"]]
    eager = {tuple(t["gn"]): t["torch_eager_us"] for t in whole.get("torch", [])}
    summary = summarize(labels, res)
    print("| GroupNorm | calls | partial first / best | stats first / best | apply first / best | one kernel first / "
          "best | sum first | sum best | torch eager |")
    print("|---|---|---|---|---|---|---|---|---|")
    tot = {"first": 0.0, "best": 0.0, "torch": 0.0}
    f = lambda v: f"{v:.1f}" if v is not None else "failed"  # noqa: E731
    for gn, parts in summary.items():
        calls = next(iter(parts.values()))["calls"]
        first = sum(p["first"] or 0.0 for p in parts.values())
        best = sum(p["best"] or 0.0 for p in parts.values())
        cells = [f"{f(parts[n]['first'])} / {f(parts[n]['best'])}" if n in parts else "-"
                 for n in ("partial", "stats", "apply", "whole")]
        ref = eager.get(gn)
        tot["first"] += first * calls
        tot["best"] += best * calls
        tot["torch"] += (ref or 0.0) * calls
        print(f"| {_label((*gn, calls))} | {calls} | {' | '.join(cells)} | {first:.1f} | {best:.1f} | {f(ref)} |")
    print(f"per UNet forward (kernel time, no launch gaps): first picks {tot['first']:.0f} us, bests "
          f"{tot['best']:.0f}, torch eager {tot['torch']:.0f}")
    keep_round(art, labels, whole, records, db, "torch")


def main() -> None:
    from batch_rounds import round_main

    def export_args(e: argparse.ArgumentParser) -> None:
        e.add_argument("--top", type=int, default=3)
        e.add_argument("--per", type=int, default=8)
        e.add_argument("--whole", action="store_true", help="the unsplit GroupNorms (one kernel each) instead")
        e.add_argument("--max-hw", type=int, default=64, help="only the GroupNorms of images up to this side")
        e.add_argument("--steps", action="store_true",
                       help="the partial kernels only, with the first pick of each serial step too")
        e.add_argument("--add-only", action="store_true", help="only the GroupNorms after the time embedding's add")

    round_main(__doc__, export_args, lambda a: export(a.art, a.top, a.per, a.whole, a.max_hw, a.steps, a.add_only),
               run, table)


if __name__ == "__main__":
    main()
