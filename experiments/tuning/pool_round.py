#!/usr/bin/env python3
"""Max pools as SMGs (``patterns.max_pool2d``): the model's picks and one thread per output channel, against torch.

Usage:
    python experiments/tuning/pool_round.py export ART [--top 4]    # here (TVM): the batch
    python3 experiments/tuning/pool_round.py run ART --out R.json    # on the GPU: the batch + torch
    python experiments/tuning/pool_round.py table ART R.json [--records OUT] [--db DB]

ResNet-50's stem ends in ``BatchNorm -> ReLU -> MaxPool 3x3/2``: with the BatchNorm's scale folded into the
cuDNN conv (``frontend.bn_fold``), its shift, the ReLU and the pool are one SMG, a windowed max over the taps
per channel with the shift and ReLU after it.  ``export`` writes the tuner's first picks and block tiles of a
row of output pixels by 16-64 channels, one thread per output, the taps serial in the thread, so one run
shows whether the model picks among the best (``search.simt_memory.view_run_bytes`` and ``view_reuse``,
``search.cost.BLOCK_ISSUE_S`` were fitted on an earlier round of this script).  ``run`` checks and
times the batch and times torch's ``max_pool2d(relu(x))`` (eager: two kernels) and the same under
``torch.compile`` (one Triton kernel), channels-last fp16, in the same process.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

#: (batch, channels, h = w, kernel, stride, pad, calls per forward): ResNet-50's stem pool at batch 32
POOLS = [(32, 64, 112, 3, 2, 1, 1)]


def _label(p: tuple) -> str:
    b, c, hw, k, s, pad, _ = p
    return f"relu + max_pool {k}x{k}/s{s} pad {pad} {b}x{c}x{hw}x{hw}"


def _smg(p: tuple):
    from spacefusion.api import patterns

    b, c, hw, k, s, pad, _ = p
    return patterns.max_pool2d(b, hw, hw, c, k, s, pad, "relu", True, "float16")


def candidates(smg, top: int) -> list[tuple[str, Any]]:
    """(why, schedule): the tuner's first ``top``, then whole channel rows per block, one thread per output."""
    from spacefusion.api import ScheduleError, make_schedule
    from spacefusion.api import candidates as ranked

    out = [(f"rank {i}", s) for i, s in enumerate(ranked(smg)[:top])]
    c = smg.dim_sizes["c"]
    for pixels, chans in ((1, c), (2, c), (4, c), (8, c), (16, c), (8, c // 2), (16, c // 4), (2, c // 2)):
        try:  # a row of output pixels (q) per block, the channels over the threads, the taps serial
            s = make_schedule(smg, tiles={"n": 1, "p": 1, "q": pixels, "c": chans}, thread_dim="c", serial="ky",
                              step=smg.dim_sizes["ky"])
        except (ScheduleError, ValueError) as exc:
            print(f"  {pixels} pixels x {chans} channels refused: {exc}")
            continue
        out.append((f"{pixels} pixels x {chans} channels, a thread an output", s))
    return out


def export(art: Path, top: int) -> None:
    from spacefusion.tuning import MeasureInput, export_batch

    inputs, labels = [], []
    for p in POOLS:
        g = _smg(p)
        for why, s in candidates(g, top):
            inputs.append(MeasureInput(s, "cuda:sm_90a"))
            labels.append({"pool": list(p[:6]), "calls": p[6], "why": why, "workload_key": g.key,
                           "schedule_key": s.key, "block": [list(t) for t in s.block], "lanes": s.lanes,
                           "threads": s.threads})
    export_batch(inputs, art)
    (art / "labels.json").write_text(json.dumps(labels, indent=1) + "\n")
    print(f"{len(inputs)} candidates of {len(POOLS)} pools in {art}")


def torch_times(iters: int) -> list[dict[str, Any]]:
    """torch's ``max_pool2d(relu(x))``, eager and under ``torch.compile`` (channels-last fp16), timed as the
    batch times our kernels (``runtime.timing.time_cuda``: L2 flushed, launches held behind a sleep)."""
    import torch
    import torch.nn.functional as F

    from spacefusion.runtime import time_cuda  # the GPU runtime: no TVM

    out = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for p in POOLS:
        b, c, hw, k, s, pad, _ = p
        x = torch.randn(b, c, hw, hw, device="cuda", generator=g).half().to(memory_format=torch.channels_last)

        def eager(x=x, k=k, s=s, pad=pad):
            return F.max_pool2d(F.relu(x), k, s, pad)

        compiled = torch.compile(eager)
        compiled()
        times = {name: round(time_cuda(fn, warmup=10, iters=iters).median_us, 2)
                 for name, fn in (("torch_eager_us", eager), ("torch_compile_us", compiled))}
        out.append({"pool": list(p[:6]), **times})
        print(_label(p), times, flush=True)
    return out


def run(art: Path, out: Path, iters: int) -> int:
    from batch_rounds import run_batch

    return run_batch(art, out, iters, "torch", torch_times)


def table(art: Path, results: Path, records: Path | None, db: Path | None) -> None:
    from batch_rounds import keep_round, load_round

    from spacefusion.tuning import MeasureResult

    labels, whole = load_round(art, results)
    res = [MeasureResult.from_dict(r) for r in whole["results"]]
    base = {tuple(t["pool"]): t for t in whole.get("torch", [])}
    print("| pool | candidate | block | lanes | threads | us | vs torch eager | vs torch.compile |")
    print("|---|---|---|---|---|---|---|---|")
    for lab, r in zip(labels, res, strict=True):
        t = base.get(tuple(lab["pool"]), {})
        us = r.median_us if r.ok else None
        ratio = lambda ref, us=us: f"{ref / us:.2f}x" if us and ref else "-"  # noqa: E731
        print(f"| {_label((*lab['pool'], lab['calls']))} | {lab['why']} | {lab['block']} | {lab['lanes']} | "
              f"{lab['threads']} | {f'{us:.1f}' if us else 'failed: ' + str(r.error)[:60]} | "
              f"{ratio(t.get('torch_eager_us'))} | {ratio(t.get('torch_compile_us'))} |")
    keep_round(art, labels, whole, records, db, "torch")


def main() -> None:
    from batch_rounds import round_main

    def export_args(e: argparse.ArgumentParser) -> None:
        e.add_argument("--top", type=int, default=4)

    round_main(__doc__, export_args, lambda a: export(a.art, a.top), run, table)


if __name__ == "__main__":
    main()
