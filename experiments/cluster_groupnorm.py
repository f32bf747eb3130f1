#!/usr/bin/env python3
"""SD 1.5 UNet's long-row GroupNorms as one kernel over a thread-block cluster, against their split and torch.

Usage:
    python experiments/cluster_groupnorm.py export ART [--only 64] [--all]   # here (TVM): every variant's kernels
    python3 experiments/cluster_groupnorm.py run ART --out R.json      # on the GPU (torch, cupy; no TVM)

At batch 2 a GroupNorm has 64 rows for 132 SMs.  Rows over ``split.ONE_KERNEL_MAX_ROW`` elements run as three
kernels (``schedulers.split``: partial sums, their totals, the element-wise pass); one block a row lost to them
(a 20480-element row took 21.4 us a call in the model's graph against the split's 9.9).  With ``cluster`` blocks
a row (``lower.cluster``) the row is spread over a cluster's blocks and one launch reads it once from device
memory.  ``export`` builds, per GroupNorm, the split's first picks and the cluster variants (``VARIANTS``);
``run`` checks every variant's output against the unfused float64 reference, then times each as a CUDA graph
of ``REPEAT`` back-to-back GroupNorms (input warm in L2, as after the conv that wrote it: the median over
``--iters`` replays, per GroupNorm) and as a graph of one after an L2 flush (cold), beside torch's eager
``group_norm`` (+ SiLU, + the time embedding's add) on the same tensors.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments.tuning.unet_groupnorms import BATCH, GROUPS, _label, _smg  # noqa: E402
from experiments.tuning.unet_groupnorms import GNORMS as UNET_GNORMS  # noqa: E402
from schedulers.split import ONE_KERNEL_MAX_ROW  # noqa: E402

#: (channels, h = w, SiLU, the time embedding's add, eps, calls per forward): the UNet's GroupNorms whose rows
#: (h * w * channels / 32) are longer than the one-kernel rule's
GNORMS = [g for g in UNET_GNORMS if g[1] * g[1] * g[0] // GROUPS > ONE_KERNEL_MAX_ROW]
#: (cluster, lanes a block) of the one-kernel variants: 64 rows x cluster blocks (cluster 1: one block a row, the
#: form ``ONE_KERNEL_MAX_ROW`` keeps for shorter rows)
VARIANTS = [(1, 1024), (2, 1024), (4, 512), (4, 1024), (8, 256), (8, 512), (8, 1024)]
REPEAT = 20


def variants(g: tuple) -> list[tuple[str, list[Any]]]:
    """(name, schedules run in order) of ``g``: its split's first picks, and the cluster forms."""
    from schedulers.split import decide_split
    from spacefusion.api import H200, candidates, make_schedule

    smg = _smg(g)
    out = []
    split = decide_split(smg, H200, one_kernel_max_row=0)
    if not isinstance(split, str):
        out.append(("split", [candidates(k)[0] for k in split.kernels]))
    pixels = smg.dim_sizes["s"]
    for cluster, lanes in VARIANTS:
        s = make_schedule(smg, tiles={"n": 1, "g": 1}, serial="s", step=pixels, lanes=lanes, cluster=cluster)
        out.append((f"cluster {cluster} x {lanes} lanes" if cluster > 1 else f"one block x {lanes} lanes", [s]))
    return out


def export(art: Path, only: int | None, every: bool = False) -> None:
    from spacefusion.api import build

    art.mkdir(parents=True, exist_ok=True)
    manifest = []
    for g in UNET_GNORMS if every else GNORMS:
        if only is not None and g[1] != only:
            continue
        entry = {"gn": list(g), "label": _label(g), "variants": []}
        for name, scheds in variants(g):
            folders = []
            for s in scheds:
                folder = art / s.key[:16]
                if not (folder / "kernel.json").exists():
                    build(s, "cuda").save(folder)
                folders.append(folder.name)
            entry["variants"].append({"name": name, "kernels": folders})
        manifest.append(entry)
        print(_label(g), len(entry["variants"]), "variants", flush=True)
    (art / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


def _inputs(g: tuple, seed: int = 0) -> dict[str, Any]:
    import numpy as np

    from spacefusion.api import random_inputs

    xs = random_inputs(_smg(g), seed=seed)
    xs["X"] = (xs["X"].astype(np.float32) * 2 + 0.5).astype(np.float16)  # a mean away from 0
    return xs


def _chain(kernels: list[Any], tensors: dict[str, Any]):
    """A function launching ``kernels`` in order, each reading its inputs by name (a split's ``stats`` reads
    ``partial``'s outputs as ``<name>_p``, in its own folded shape) and leaving its outputs in ``tensors``."""
    import torch

    def run() -> None:
        for k in kernels:
            ins = {}
            for p in k.artefact.inputs:
                t = tensors.get(p.name, tensors.get(p.name.removesuffix("_p")))
                ins[p.name] = t.view(p.shape)
            outs = {p.name: tensors.setdefault(p.name, torch.empty(p.shape, dtype=getattr(torch, p.dtype),
                                                                    device="cuda")).view(p.shape)
                    for p in k.artefact.outputs}
            k.launch(ins, outs)
    return run


def _time_graph(fn, iters: int) -> float:
    """Median us per call of ``fn`` captured ``REPEAT`` times in one CUDA graph."""
    import torch

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEAT):
            fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / REPEAT)
    return sorted(times)[len(times) // 2]


def _time_cold(fn, iters: int, flush) -> float:
    """Median us of one call of ``fn``, a CUDA graph replayed after an L2 flush (a write of a buffer larger than
    L2).  A graph, not the launches themselves: a split's three ``CudaKernel.launch`` calls took ~100-330 us of
    host time against ~10 on the GPU, and the events timed the host."""
    import torch

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    times = []
    for _ in range(iters):
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times)[len(times) // 2]


def run(art: Path, out: Path, iters: int) -> int:
    import numpy as np
    import torch
    import torch.nn.functional as F

    from spacefusion.api import check_numerics, evaluate
    from spacefusion.runtime import CudaKernel

    manifest = json.loads((art / "manifest.json").read_text())
    flush = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    rows, failed = [], 0
    for entry in manifest:
        g = tuple(entry["gn"])
        c, hw, silu, add, eps, calls = g
        smg = _smg(g)
        xs = _inputs(g)
        ref = evaluate(smg, {n: v.astype(np.float64) for n, v in xs.items()})
        dev = {n: torch.from_numpy(v).cuda() for n, v in xs.items()}
        row = {"gn": entry["gn"], "label": entry["label"], "calls": calls, "variants": {}}
        for v in entry["variants"]:
            kernels = [CudaKernel(art / f) for f in v["kernels"]]
            tensors = dict(dev)
            fn = _chain(kernels, tensors)
            try:
                fn()
                torch.cuda.synchronize()
                got = {n: tensors[n].float().cpu().numpy().reshape(ref[n].shape) for n in smg.outputs}
                err, why = check_numerics(smg, ref, got)
            except Exception as e:  # noqa: BLE001 - a kernel that fails to load or launch is reported, not fatal
                row["variants"][v["name"]] = {"error": f"{type(e).__name__}: {e}"}
                failed += 1
                continue
            res = {"max_abs_err": float(err), "ok": why is None}
            if why is not None:
                res["why"] = why
                failed += 1
            else:
                res["us_warm"] = round(_time_graph(fn, iters), 2)
                res["us_cold"] = round(_time_cold(fn, iters, flush), 2)
            row["variants"][v["name"]] = res
        # torch: the same tensors channels-last (N, C, H, W) fp16
        x = dev["X"].view(BATCH, hw, hw, c).permute(0, 3, 1, 2)
        w, b = dev["W"].reshape(c), dev["B"].reshape(c)
        e = dev["E"].reshape(BATCH, c, 1, 1) if add else None

        def torch_gn(x=x, w=w, b=b, e=e, eps=eps, silu=silu):
            y = F.group_norm(x + e if e is not None else x, GROUPS, w, b, eps)
            return F.silu(y) if silu else y

        row["torch_us_warm"] = round(_time_graph(torch_gn, iters), 2)
        row["torch_us_cold"] = round(_time_cold(torch_gn, iters, flush), 2)
        rows.append(row)
        print(entry["label"], {k: (r.get("us_warm"), r.get("us_cold")) if "error" not in r else r["error"][:80]
                               for k, r in row["variants"].items()}, "torch", row["torch_us_warm"], flush=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "timing": {"warm": f"median of {iters} replays of a CUDA graph of {REPEAT} calls",
                                          "cold": f"median of {iters} replays of a graph of one call, each after "
                                                  f"a 512 MiB write"},
                               "rows": rows}, indent=1) + "\n")
    return 1 if failed else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export")
    e.add_argument("art", type=Path)
    e.add_argument("--only", type=int, default=None, help="only the GroupNorms of images of this side")
    e.add_argument("--all", action="store_true", help="every GroupNorm of the UNet, the short rows too")
    r = sub.add_parser("run")
    r.add_argument("art", type=Path)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--iters", type=int, default=50)
    a = ap.parse_args()
    if a.cmd == "export":
        export(a.art, a.only, a.all)
    else:
        raise SystemExit(run(a.art, a.out, a.iters))


if __name__ == "__main__":
    main()
