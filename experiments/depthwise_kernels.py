#!/usr/bin/env python3
"""Depthwise convolution kernels one by one against cuDNN's ``conv2d(groups=c)`` (issue 56).

    python experiments/depthwise_kernels.py build ART                 # where TVM is: candidates' CUDA artefacts
    python experiments/depthwise_kernels.py run ART --out r.json      # on the GPU (torch + cupy, no TVM)

``build`` ranks ``patterns.depthwise_conv2d`` at ConvNeXt-T's first 7x7 (32x96x56x56, fp16, channels-last)
and writes the first pick and the best-ranked candidate of each block shape in ``BLOCKS`` (channels x rows x
columns, the window's input staged as its halo box, threads on the channels).  ``run`` checks each against
float32 torch (``F.conv2d`` on the same fp16 values) and times it beside cuDNN's depthwise convolution on the
same tensors: CUDA events, 10 warm-up launches, the median of ``--iters``, L2 flushed by a 256 MB write
before each launch.  ``docs/convolutions.md`` has the table this gave.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPE = {"n": 32, "h": 56, "c": 96, "k": 7, "stride": 1, "pad": 3}
#: (channels, rows, columns) of a block
BLOCKS = ((32, 4, 8), (32, 8, 4), (32, 2, 8), (32, 4, 4), (96, 2, 4), (64, 2, 8), (16, 8, 8), (32, 1, 32))


def build(art: Path) -> int:
    from spacefusion.api import H100, candidates, estimate, patterns
    from spacefusion.api import build as build_kernel

    n, h, c, k, s, p = (SHAPE[x] for x in ("n", "h", "c", "k", "stride", "pad"))
    g = patterns.depthwise_conv2d(n, h, h, c, k, s, p, "none", True, False, "float16")
    order = candidates(g, H100)
    picked = {"first_pick": order[0]}
    for blk in BLOCKS:
        match = [x for x in order if (x.tiles.get("c"), x.tiles.get("p"), x.tiles.get("q")) == blk
                 and x.thread_dim == "c" and x.lanes == 1 and x.level("X") == "shared" and x.tiles.get("n") == 1]
        if match:
            picked["c{}p{}q{}".format(*blk)] = match[0]
    for tag, sch in picked.items():
        folder = build_kernel(sch, "cuda:sm_90a").save(art / tag)
        (folder / "shape.json").write_text(json.dumps(SHAPE | {"estimate_us": estimate(sch, H100),
                                                                "block": dict(sch.block)}))
        print(tag, dict(sch.block), f"{estimate(sch, H100):.1f} us estimated", flush=True)
    return 0


def _time(fn, iters: int) -> float:
    import torch

    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(10):
        fn()
    times = []
    for _ in range(iters):
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def _one(folder: Path, iters: int) -> dict:
    """One artefact: checked against float32 torch, then timed beside cuDNN on the same tensors."""
    import torch
    import torch.nn.functional as F

    from spacefusion.runtime import load_kernel

    meta = json.loads((folder / "shape.json").read_text())
    n, h, c, k, s, p = (meta[x] for x in ("n", "h", "c", "k", "stride", "pad"))
    x = torch.randn(n, h, h, c, device="cuda", dtype=torch.half)
    w = torch.randn(k, k, c, device="cuda", dtype=torch.half) * 0.2
    b = torch.randn(c, device="cuda", dtype=torch.half)
    xc, wc = x.permute(0, 3, 1, 2), w.permute(2, 0, 1)[:, None].contiguous()  # NCHW views, channels-last
    exact = F.conv2d(xc.float(), wc.float(), b.float(), stride=s, padding=p, groups=c).permute(0, 2, 3, 1)
    kernel = load_kernel(folder)
    y = kernel(X=x, Wt=w, bias=b)["Y"]
    cud = F.conv2d(xc, wc, b, stride=s, padding=p, groups=c).permute(0, 2, 3, 1)
    err, cerr = ((t.float() - exact).abs().max().item() for t in (y, cud))
    row = {"block": meta.get("block"), "estimate_us": meta.get("estimate_us"), "max_abs_err": err,
           "cudnn_max_abs_err": cerr, "ok": err <= 2 * cerr + 1e-3}
    if row["ok"]:
        buf = torch.empty_like(y)
        row["us"] = _time(lambda: kernel.launch({"X": x, "Wt": w, "bias": b}, {"Y": buf}), iters)
        row["cudnn_us"] = _time(lambda: F.conv2d(xc, wc, b, stride=s, padding=p, groups=c), iters)
    return row


def run(art: Path, out: Path, iters: int) -> int:
    import torch

    torch.manual_seed(0)
    rows: dict[str, dict] = {}
    for folder in sorted(p for p in art.iterdir() if (p / "shape.json").is_file()):
        rows[folder.name] = _one(folder, iters)
        print(folder.name, json.dumps(rows[folder.name]), flush=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "shape": SHAPE, "kernels": rows}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("phase", choices=("build", "run"))
    ap.add_argument("art", type=Path)
    ap.add_argument("--out", type=Path, default=Path("depthwise_kernels.json"))
    ap.add_argument("--iters", type=int, default=100)
    a = ap.parse_args(argv)
    a.art.mkdir(parents=True, exist_ok=True)
    return build(a.art) if a.phase == "build" else run(a.art, a.out, a.iters)


if __name__ == "__main__":
    sys.exit(main())
