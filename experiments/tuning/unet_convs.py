#!/usr/bin/env python3
"""SD 1.5 UNet's convolutions on small grids: a wide candidate batch per conv, against cuDNN in one run.

Usage:
    python experiments/tuning/unet_convs.py export ART [--per 14] [--tiles N] [--set strided]  # here (TVM)
    python3 experiments/tuning/unet_convs.py run ART --out R.json       # on the GPU: the batch + cuDNN
    python experiments/tuning/unet_convs.py table ART R.json [--records OUT] [--db DB]

The UNet's convolutions at 32x32, 16x16 and 8x8 (batch 2) are GEMMs of 128 to 2048 rows over 5760 to
23040 steps of reduction: their row tiles leave most of the H100's 132 SMs idle, so the search offers
slices of the steps across blocks, and the tuner's first pick ran them at 120-300 TFLOP/s in the model
(`dynamo_unet_h100.json`).  ``export`` writes, per conv, the tuner's first ``--top`` picks and the
analytical model's best of each family it ranks lower (slices 1-16 x TMA or cp.async x a producer
warpgroup x ring depth), so one run shows which family the first round should have measured.  ``run``
checks and times the batch (``spacefusion.runtime.batch``) and times cuDNN's conv (channels-last fp16,
with the bias and residual add as torch adds them) on the same machine in the same process.  ``table``
prints first pick, best, best family and cuDNN per conv; ``--db`` adds every measurement to a tuning
database, which ``dynamo_gpu.py export --db`` then builds the model from.

``--set strided`` takes the strided convs instead (``STRIDED``: the UNet's three downsamplers and
ResNet-50's 3x3/2 and 1x1/2 convs), which TMA im2col loads by the map's traversal stride; ``--set large``
the UNet's 64x64 convs (``LARGE``); ``--set wide16 --wide N`` the 16x16 1280-channel ones with the model's best
128-row forms with fewer slices (``by_tile_slices``); ``--set wide_rest`` the other small-grid convs it lost;
``--set apart32`` the 32x32 plain form of the 16x16 -> 32x32 upsampled conv.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

#: (batch, h = w, c_in, c_out, kernel, residual, calls per UNet forward) of SD 1.5's convs on small grids
CONVS = [(2, 32, 640, 640, 3, True, 5), (2, 16, 1280, 1280, 3, True, 5), (2, 8, 1280, 1280, 3, True, 7),
         (2, 8, 1280, 1280, 3, False, 4), (2, 8, 2560, 1280, 3, False, 3), (2, 16, 2560, 1280, 3, False, 2),
         (2, 32, 1920, 640, 3, False, 1), (2, 16, 1920, 1280, 3, False, 1), (2, 32, 1280, 640, 3, False, 1),
         (2, 16, 1280, 1280, 1, True, 5)]
#: the strided convs, the same fields and the stride last: SD 1.5's downsamplers (batch 2) and torchvision
#: ResNet-50's (batch 32, 224x224: each stage's first 3x3 and its 1x1 downsampling, both stride 2)
STRIDED = [(2, 64, 320, 320, 3, False, 1, 2), (2, 32, 640, 640, 3, False, 1, 2), (2, 16, 1280, 1280, 3, False, 1, 2),
           (32, 56, 128, 128, 3, False, 1, 2), (32, 28, 256, 256, 3, False, 1, 2), (32, 14, 512, 512, 3, False, 1, 2),
           (32, 56, 256, 512, 1, False, 1, 2), (32, 28, 512, 1024, 1, False, 1, 2),
           (32, 14, 1024, 2048, 1, False, 1, 2)]
#: the UNet's 16x16 1280-channel convs, where torch.compile's in-graph cuDNN is furthest ahead
WIDE16 = [(2, 16, 1280, 1280, 3, True, 5), (2, 16, 1280, 1280, 3, False, 2), (2, 16, 2560, 1280, 3, False, 2)]
#: the other small-grid convs torch.compile's in-graph cuDNN ran faster (`model_profile_unet_h100.json`)
WIDE_REST = [(2, 8, 1280, 1280, 3, True, 7), (2, 8, 1280, 1280, 3, False, 4), (2, 8, 2560, 1280, 3, False, 3),
             (2, 16, 1920, 1280, 3, False, 1), (2, 32, 960, 640, 3, False, 1), (2, 32, 640, 640, 3, True, 5)]
#: the UNet's 64x64 convs (batch 2), the largest grids: measured only in the TMA im2col round before
LARGE = [(2, 64, 320, 320, 3, True, 5), (2, 64, 320, 320, 3, False, 2), (2, 64, 640, 320, 3, False, 2),
         (2, 64, 960, 320, 3, False, 1)]
#: the 2x1280x16x16 -> 32x32 upsampled conv's plain form (torch writing the upsampled image apart): its window
#: read took 129 us in the graph (`convs.APART_MAX_PIXELS` keeps it there), the plain form was not measured
APART32 = [(2, 32, 1280, 1280, 3, False, 1)]
SETS = {"small": CONVS, "apart32": APART32, "strided": STRIDED, "large": LARGE, "wide16": WIDE16,
        "wide_rest": WIDE_REST}


def _stride(c: tuple) -> int:
    return c[7] if len(c) > 7 else 1


def _key(c: tuple) -> list:
    """A conv's key in the labels and the cuDNN rows: the first six fields, and the stride where not 1."""
    return list(c[:6]) + ([_stride(c)] if _stride(c) > 1 else [])


def _label(c: tuple) -> str:
    b, hw, ci, co, k, res = c[:6]
    return f"{b}x{hw}x{hw}x{ci}->{co} {k}x{k}" + (f"/{_stride(c)}" if _stride(c) > 1 else "") + (" +res" if res else "")


def _smg(c: tuple):
    from spacefusion.api import patterns

    b, hw, ci, co, k, res = c[:6]
    return patterns.conv2d(b, hw, hw, ci, co, k, _stride(c), k // 2, residual=res, dtype="float16")


def _family(s) -> tuple:
    return (s.slices, bool(s.tma), bool(s.producer), s.stages >= 4)


def pick(smg, top: int, per: int) -> list[tuple[str, Any]]:
    """(why, schedule): the first ``top`` in the tuner's order, then the best-estimated of each family
    not yet held, in estimate order, up to ``per`` in all, then the first pick's deeper rings."""
    from batch_rounds import first_and_families

    from spacefusion.api import candidates

    got = first_and_families(smg, top, per, _family,
                             lambda fam: f"family slices {fam[0]} tma {fam[1]} producer {fam[2]} deep {fam[3]}")
    return got + deeper(candidates(smg)[0])


def by_tile(smg, held: list[tuple[str, Any]], limit: int) -> list[tuple[str, Any]]:
    """The analytical model's best of each tensor-core tile shape (rows x columns) not among ``held``, in
    estimate order, at most ``limit``.  Its estimates of the 16x16x1280 conv's tiles lie within 41-44 us
    (64x128 to 192x128), and the rounds measured 128x192, cuDNN's tile there, only on 16 slices: this puts
    each shape's best form in the batch."""
    from spacefusion.api import H100, candidates, estimate

    shapes = {tuple(s.block) for _, s in held}
    best: dict[tuple, Any] = {}
    for s in candidates(smg):
        if s.tensor_cores and tuple(s.block) not in shapes:
            best.setdefault(tuple(s.block), s)
    chosen = sorted(best.values(), key=lambda s: estimate(s, H100))[:limit]
    return [(f"tile {'x'.join(str(v) for _, v in s.block)}", s) for s in chosen]


def by_tile_slices(smg, held: list[tuple[str, Any]], limit: int, min_rows: int = 128) -> list[tuple[str, Any]]:
    """The analytical model's best of each (tile shape, slices, producer) with at least ``min_rows`` rows
    not among ``held``, in estimate order, at most ``limit``.  In torch.compile's graph cuDNN ran the 16x16
    1280-channel convs in 33.8 µs a call (`model_profile_unet_h100.json`) against our 44; the rounds
    measured its 128x192 tile only with 16 slices: this puts 128-row tiles' fewer-slice forms in a batch."""
    from spacefusion.api import H100, candidates, estimate

    have = {s.key for _, s in held}
    best: dict[tuple, Any] = {}
    for s in candidates(smg):
        if s.tensor_cores and s.tma and s.block[0][1] >= min_rows and s.key not in have:
            best.setdefault((tuple(s.block), s.slices, bool(s.producer)), s)
    chosen = sorted(best.values(), key=lambda s: estimate(s, H100))[:limit]
    return [(f"tile {'x'.join(str(v) for _, v in s.block)} slices {s.slices}", s) for s in chosen]


def deeper(s) -> list[tuple[str, Any]]:
    """The first pick with a deeper ring (4 and 6 stages), which the space offers a sliced block only up to
    3 of: a slice's few steps each wait for a load issued only ``stages - 1`` steps before."""
    from spacefusion.api import ScheduleError, make_schedule, non_defaults

    out = []
    for stages in (4, 6):
        if stages <= s.stages:
            continue
        knobs = {**non_defaults(s.warp), **non_defaults(s.hopper), "stages": stages}
        try:
            t = make_schedule(s.smg, tiles=dict(s.block), serial=s.serial, step=s.step, thread_dim=s.thread_dim,
                              tensor_cores=True, **knobs)
        except (ScheduleError, ValueError) as exc:
            print(f"  {stages} stages refused: {exc}")
            continue
        out.append((f"rank 0 with {stages} stages", t))
    return out


def export(art: Path, top: int, per: int, tiles: int = 0, convs: str = "small", wide: int = 0) -> None:
    from spacefusion.tuning import MeasureInput, export_batch

    inputs, labels = [], []
    for c in SETS[convs]:
        g = _smg(c)
        got = pick(g, top, per)
        extra = (by_tile(g, got, tiles) if tiles else []) + (by_tile_slices(g, got, wide) if wide else [])
        for why, s in got + extra:
            inputs.append(MeasureInput(s, "cuda:sm_90a"))
            labels.append({"conv": _key(c), "calls": c[6], "why": why, "workload_key": g.key,
                           "schedule_key": s.key, "slices": s.slices, "tma": bool(s.tma),
                           "producer": bool(s.producer), "stages": s.stages, "block": [list(t) for t in s.block]})
    export_batch(inputs, art)
    (art / "labels.json").write_text(json.dumps(labels, indent=1) + "\n")
    (art / "convs.json").write_text(json.dumps(SETS[convs]) + "\n")  # what ``run`` times cuDNN on
    print(f"{len(inputs)} candidates of {len(SETS[convs])} convs in {art}")


def cudnn_times(iters: int, convs: list[tuple]) -> list[dict[str, Any]]:
    """cuDNN's conv per shape (channels-last fp16, bias, then the residual add as torch does it), timed
    as the batch times our kernels (``runtime.timing.time_cuda``: CUDA events, L2 flushed, the launches held
    behind a sleep so the host's Python is not timed), median of ``iters``."""
    import torch
    import torch.nn.functional as F

    from spacefusion.runtime import time_cuda  # the GPU runtime: no TVM

    torch.backends.cudnn.benchmark = True
    out = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for c in convs:
        b, hw, ci, co, k, res = c[:6]
        st = _stride(c)
        x = torch.randn(b, ci, hw, hw, device="cuda", generator=g).half().to(memory_format=torch.channels_last)
        w = (torch.randn(co, ci, k, k, device="cuda", generator=g) / (ci * k * k) ** 0.5).half()
        w = w.to(memory_format=torch.channels_last)
        bias = torch.randn(co, device="cuda", generator=g).half()
        ho = (hw + 2 * (k // 2) - k) // st + 1
        r = torch.randn(b, co, ho, ho, device="cuda", generator=g).half().to(memory_format=torch.channels_last)

        def conv(x=x, w=w, bias=bias, r=r, res=res, k=k, st=st):
            y = F.conv2d(x, w, bias, stride=st, padding=k // 2)
            return y + r if res else y

        def alone(x=x, w=w, bias=bias, k=k, st=st):
            return F.conv2d(x, w, bias, stride=st, padding=k // 2)

        times = {name: round(time_cuda(fn, warmup=10, iters=iters).median_us, 2)
                 for name, fn in (("cudnn_conv_us", alone), ("cudnn_conv_add_us", conv))}
        out.append({"conv": _key(c), **times})
        print(_label(c), times, flush=True)
    return out


def run(art: Path, out: Path, iters: int) -> int:
    from batch_rounds import run_batch

    path = art / "convs.json"  # an export before ``--set`` wrote none: the small-grid set
    convs = [tuple(c) for c in json.loads(path.read_text())] if path.exists() else CONVS
    return run_batch(art, out, iters, "cudnn", lambda it: cudnn_times(it, convs))


def table(art: Path, results: Path, records: Path | None, db: Path | None) -> None:
    from batch_rounds import keep_round, load_round

    from spacefusion.tuning import MeasureResult

    labels, whole = load_round(art, results)
    res = [MeasureResult.from_dict(r) for r in whole["results"]]
    cudnn = {tuple(c["conv"]): c for c in whole.get("cudnn", [])}
    rows: dict[tuple, list] = {}
    for lab, r in zip(labels, res, strict=True):
        rows.setdefault(tuple(lab["conv"]), []).append((lab, r.median_us if r.ok else None, r.error))
    print("| conv (batch x h x w x c_in -> c_out) | calls | first pick | best | best's family | cuDNN conv (+ add) "
          "| first / cuDNN | best / cuDNN |")
    print("|---|---|---|---|---|---|---|---|")
    tot = {"first": 0.0, "best": 0.0, "cudnn": 0.0}
    for conv, got in rows.items():
        first = got[0][1]
        ok = [(u, lab) for lab, u, _ in got if u is not None]
        best, blab = min(ok, key=lambda t: t[0]) if ok else (None, None)
        cd = cudnn.get(conv, {})
        ref = cd.get("cudnn_conv_add_us" if conv[5] else "cudnn_conv_us")
        calls = got[0][0]["calls"]
        for k, v in (("first", first), ("best", best), ("cudnn", ref)):
            tot[k] += (v or 0.0) * calls
        fam = (f"{blab['block']} slices {blab['slices']} stages {blab['stages']} tma {blab['tma']} "
               f"producer {blab['producer']}") if blab else "-"
        f = lambda v: f"{v:.1f}" if v else "failed"  # noqa: E731
        r = lambda a, b: f"{b / a:.2f}x" if a and b else "-"  # noqa: E731
        label = _label((*conv[:6], calls, *conv[6:]))
        print(f"| {label} | {calls} | {f(first)} | {f(best)} | {fam} | {f(ref)} | {r(first, ref)} | {r(best, ref)} |")
    print(f"per UNet forward: first picks {tot['first']:.0f} us, bests {tot['best']:.0f}, cuDNN {tot['cudnn']:.0f}")
    keep_round(art, labels, whole, records, db, "cudnn")


def main() -> None:
    from batch_rounds import round_main

    def export_args(e: argparse.ArgumentParser) -> None:
        e.add_argument("--top", type=int, default=4)
        e.add_argument("--per", type=int, default=14)
        e.add_argument("--tiles", type=int, default=0, metavar="N",
                       help="also the model's best of up to N tile shapes the batch does not hold")
        e.add_argument("--wide", type=int, default=0, metavar="N",
                       help="also the model's best of up to N (tile, slices, producer) forms with 128+ rows")
        e.add_argument("--set", dest="convs", choices=sorted(SETS), default="small",
                       help="the small-grid convs (default), the strided, 64x64, 16x16 or other lost ones")

    round_main(__doc__, export_args, lambda a: export(a.art, a.top, a.per, a.tiles, a.convs, a.wide), run, table)


if __name__ == "__main__":
    main()
