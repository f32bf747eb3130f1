#!/usr/bin/env python3
"""A whole model fused on the GPU: eager PyTorch, torch.compile and spacefusion (with and without a CUDA graph).

Two steps, two machines:

    python experiments/e2e_gpu.py build ART --model bert --batch 8 --seq 128   # where TVM runs
    python experiments/e2e_gpu.py run ART --out e2e.json                       # on the GPU (torch + cupy)

``build`` captures the model (on the meta device: shapes only), partitions it, and for each distinct
fused subgraph takes the tuner's first pick without measuring anything (the analytical model, its ties
broken by the prior: ``spacefusion.frontend.schedules.model_pick``), and exports its CUDA artefact; the
manifest records the search time per subgraph.  ``run`` builds the same model with the same seed on the
GPU, fuses it on those artefacts (``CudaBackend``: no TVM there), checks the fused forward against eager,
and times eager, ``torch.compile``, the fused model launch by launch, and the fused model replayed as one
CUDA graph, with CUDA events (warm-up, median of many runs), the systems taking turns.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

FORMAT = "spacefusion-e2e/1"
#: LLaMA-2-7B's prefill over --seq tokens, and decode of one token per sequence with a KV cache of seq - 1
LLAMAS = ("llama", "llama_gqa", "llama_decode", "llama_gqa_decode")


def make_model(name: str, layers: int | None) -> tuple[Any, Any]:
    """(model, example-input function) of one of the issue's models, real configs."""
    from dataclasses import replace

    from spacefusion.models import BertConfig, BertModel, LlamaConfig, LlamaModel, ViTConfig, ViTModel

    def n(c: Any) -> Any:
        return replace(c, num_hidden_layers=layers) if layers else c

    if name == "bert":
        return BertModel(n(BertConfig())), lambda m, b, s: m.example_inputs(b, s)
    if name == "vit":
        return ViTModel(n(ViTConfig())), lambda m, b, s: m.example_inputs(b)
    if name in LLAMAS:
        c = n(LlamaConfig())
        model = LlamaModel(c.gqa(8) if "gqa" in name else c)
        if name.endswith("decode"):  # one new token per sequence against a KV cache of seq - 1 tokens
            return model, lambda m, b, s: m.example_inputs(b, 1, past=s - 1)
        return model, lambda m, b, s: m.example_inputs(b, s)
    raise SystemExit(f"unknown model {name!r}; known: bert, vit, {', '.join(LLAMAS)}")


def _half(x: tuple, device: str) -> tuple:
    import torch

    return tuple((t.half() if t.is_floating_point() else t).to(device) if isinstance(t, torch.Tensor) else t for t in x)


# ---- build (where TVM runs) -----------------------------------------------------------------------


def build(art: Path, model_name: str, batch: int, seq: int, layers: int | None, db_path: Path | None = None) -> int:
    """``db_path``: a tuning database (``experiments/e2e_tune.py``) whose measured best is taken for the
    subgraphs it has; the others get the model's first pick."""
    import torch

    from spacefusion.api import COMPILE_FLAGS, H100, CudaBackend, capture, model_pick, partition
    from spacefusion.tuning import TuningDatabase, tuning_key

    t0 = time.perf_counter()
    with torch.device("meta"):
        model, inputs = make_model(model_name, layers)
        model = model.half()
        x = _half(inputs(model, batch, seq), "meta")
        part = partition(capture(model, *x).module)
    capture_s = time.perf_counter() - t0
    print(part)
    picks: dict[str, Any] = {}
    backend = CudaBackend(art / "kernels", schedule_for=lambda g: picks[g.key])
    rows = []
    db = TuningDatabase(db_path) if db_path is not None else None
    for key, subs in part.distinct.items():
        smg = subs[0].smg
        t1 = time.perf_counter()
        row: dict[str, Any] = {"key": key, "label": subs[0].label, "kind": subs[0].kind, "uses": len(subs)}
        try:
            best = db.best(tuning_key(smg, H100, "cuda:sm_90a", COMPILE_FLAGS)) if db is not None else None
            if best is not None:
                chosen, tried = best[0], 0
                _export(backend, picks, smg, chosen)
                row.update(source="measured", measured_us=round(best[1].median_us, 2))
            else:
                chosen, tried = model_pick(smg, H100, build=lambda s, g=smg: _export(backend, picks, g, s))
                row.update(source="model")
            row.update(schedule=chosen.to_dict(), tried=tried, summary=str(chosen).splitlines()[0],
                       traffic=_traffic(chosen))
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:600]
        row["search_s"] = round(time.perf_counter() - t1, 2)
        rows.append(row)
        print(f"{row['uses']:3d} x {row['label']}: {row.get('error') or 'picked'} in {row['search_s']} s", flush=True)
    manifest = {"format": FORMAT, "model": model_name, "batch": batch, "seq": seq, "layers": layers,
                "capture_s": round(capture_s, 2), "search_s": round(sum(r["search_s"] for r in rows), 2),
                "subgraphs": dict(part.counts()), "left": dict(part.left_reasons()), "kernels": rows}
    (art / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"{len(rows)} distinct kernels, search + build {manifest['search_s']} s, capture {manifest['capture_s']} s")
    return 0


def _traffic(s: Any) -> dict[str, int]:
    """The traffic model's device-memory bytes (``schedulers.traffic``, islpy footprints): the unfused chain
    (one kernel per operator), the fused schedule (each block's distinct elements; a warp-tile kernel's
    re-read K/V tiles counted per block, as L2 serves them), and each input and output once."""
    import math

    import numpy as np

    from spacefusion.api import traffic

    t, g = traffic(s), s.smg
    once = sum(math.prod(g.shape(n)) * np.dtype(g.space(n).dtype).itemsize for n in (*g.inputs, *g.outputs))
    return {"unfused_bytes": int(t.unfused_bytes), "fused_bytes": int(t.fused_bytes), "compulsory_bytes": int(once)}


def _export(backend: Any, picks: dict[str, Any], smg: Any, s: Any) -> None:
    picks[smg.key] = s
    backend.export(smg)


# ---- run (on the GPU machine) ---------------------------------------------------------------------


def _graphed(fn: Any, args: tuple) -> Any:
    """``fn(*args)`` captured once into a CUDA graph (after warm-up on a side stream); returns the replay."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn(*args)
    torch.cuda.current_stream().wait_stream(s)
    from gpu_runtime import runtime_module

    g = torch.cuda.CUDAGraph()
    with runtime_module("tensormap").deferred_copies(), torch.cuda.graph(g):  # maps filled once, not per replay
        out = fn(*args)

    def replay() -> Any:
        g.replay()
        return out

    # a replay reads by address what ``fn`` owns (a fused module's re-laid weights, its kernels' loaded
    # modules, their tensor maps) and ``args``: dropped, they would be freed and reused under the graph
    replay.keep_alive = (fn, args)  # type: ignore[attr-defined]
    return replay


def _first(out: Any) -> Any:
    return out[0] if isinstance(out, (tuple, list)) else out


def run(art: Path, out_path: Path, warmup: int, iters: int, repeats: int, use_compile: bool) -> int:
    import torch
    from gpu_runtime import runtime_module

    from spacefusion.api import CudaBackend, fuse

    timing = runtime_module("timing")
    if not (art / "manifest.json").is_file():
        raise SystemExit(f"{art}: no manifest.json; build it where TVM runs: experiments/e2e_gpu.py build {art} ...")
    man = json.loads((art / "manifest.json").read_text())
    if man.get("format") != FORMAT:
        raise SystemExit(f"{art / 'manifest.json'}: format {man.get('format')!r}, expected {FORMAT!r}")
    model, inputs = make_model(man["model"], man["layers"])  # seeded weights, drawn on the CPU
    model = model.half().eval().cuda()
    x = _half(inputs(model, man["batch"], man["seq"]), "cuda")
    result: dict[str, Any] = {"format": FORMAT, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "manifest": man, "systems": {}}
    systems: dict[str, Any] = {}
    with torch.no_grad():
        ref = _first(model(*x)).float()
        systems["eager"] = lambda: model(*x)
        t0 = time.perf_counter()
        fused = fuse(model, *x, backend=CudaBackend(art / "kernels"))
        result["fuse_s"] = round(time.perf_counter() - t0, 2)
        part = fused.partition
        result["partition"] = {"subgraphs": dict(part.counts()), "left": dict(part.left_reasons())}
        systems["spacefusion"] = lambda: fused(*x)
        try:
            systems["spacefusion+graph"] = _graphed(fused, x)
        except Exception as exc:
            result["systems"]["spacefusion+graph"] = {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:600],
                                                      "traceback": traceback.format_exc()}
        try:
            systems["eager+graph"] = _graphed(model, x)
        except Exception as exc:
            result["systems"]["eager+graph"] = {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:600]}
        if use_compile:
            compiled = torch.compile(model)
            systems["torch.compile"] = lambda: compiled(*x)
            graphed = torch.compile(model, mode="reduce-overhead")  # inductor's kernels in CUDA graphs
            systems["torch.compile(reduce-overhead)"] = lambda: graphed(*x)
        rows: dict[str, dict[str, Any]] = {}
        for name, fn in systems.items():
            row = rows[name] = {}
            try:
                got = _first(fn()).float()
                torch.cuda.synchronize()
                err = float((got - ref).abs().max())
                row.update(max_abs_err=err, ref_absmax=float(ref.abs().max()))
                tol = 5e-2 * max(1.0, float(ref.abs().max()))
                if not err <= tol:
                    raise ValueError(f"max abs error {err:.3g} against eager over {tol:.3g}")
                row["fn"] = fn
            except Exception as exc:
                row.update(status="error", error=f"{type(exc).__name__}: {exc}"[:600], traceback=traceback.format_exc())
        for _ in range(repeats):
            for _name, row in rows.items():
                if "fn" in row:
                    t = timing.time_cuda(row["fn"], warmup=warmup, iters=iters, hold=False)
                    row.setdefault("medians_us", []).append(t.median_us)
        for name, row in rows.items():
            row.pop("fn", None)
            if row.get("medians_us"):
                row.update(status="ok", median_us=statistics.median(row["medians_us"]))
            result["systems"][name] = {**result["systems"].get(name, {}), **row}
            print(f"{name:<28} {row.get('status')} {row.get('median_us', float('nan')):10.1f} us  "
                  f"err {row.get('max_abs_err', float('nan')):.3g} {row.get('error', '')[:200]}", flush=True)
        for name in ("spacefusion+graph", "eager+graph"):
            if name in systems and rows[name].get("status") == "ok":
                result["systems"][name]["kernels"] = _profile(systems[name])
    out_path.write_text(json.dumps(result, indent=1) + "\n")
    return 0


def _profile(fn: Any, top: int = 40) -> list[dict[str, Any]]:
    """GPU time per kernel (name, grid, block) over 5 runs of ``fn`` (torch.profiler's trace), the
    largest first: spacefusion's kernels all bear one name, their launch shapes tell them apart."""
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    path = Path(tempfile.mkdtemp()) / "trace.json"
    prof.export_chrome_trace(str(path))
    sums: dict[tuple, list[float]] = {}
    for e in json.loads(path.read_text()).get("traceEvents", []):
        if e.get("cat") == "kernel":
            a = e.get("args", {})
            key = (e["name"][:100], str(a.get("grid")), str(a.get("block")))
            sums.setdefault(key, []).append(float(e.get("dur", 0.0)))
    rows = [{"kernel": k[0], "grid": k[1], "block": k[2], "calls": len(v) // 5, "us": round(sum(v) / 5, 1)}
            for k, v in sums.items()]
    rows.sort(key=lambda r: -r["us"])
    for r in rows[:top]:
        print(f"    {r['us']:9.1f} us  {r['calls']:4d} x  {r['kernel'][:60]} {r['grid']} {r['block']}")
    return rows[:top]


def main(argv: list[str] | None = None) -> int:
    from gpu_runtime import timing_args

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("art", type=Path)
    b.add_argument("--model", default="bert")
    b.add_argument("--batch", type=int, default=8)
    b.add_argument("--seq", type=int, default=128)
    b.add_argument("--layers", type=int, default=None)
    b.add_argument("--db", type=Path, default=None, help="a tuning database: its measured bests where it has them")
    r = sub.add_parser("run")
    r.add_argument("art", type=Path)
    r.add_argument("--out", type=Path, required=True)
    timing_args(r, warmup=5, iters=30)
    r.add_argument("--no-compile", action="store_true")
    a = ap.parse_args(argv)
    if a.cmd == "build":
        return build(a.art, a.model, a.batch, a.seq, a.layers, a.db)
    return run(a.art, a.out, a.warmup, a.iters, a.repeats, not a.no_compile)


if __name__ == "__main__":
    sys.exit(main())
