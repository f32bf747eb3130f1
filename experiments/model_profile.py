#!/usr/bin/env python3
"""Where a model's time goes: spacefusion's convolutions against cuDNN's, conv by conv, and the idle time
between the kernels of each system's CUDA graph.

Usage (on the GPU machine, after ``dynamo_gpu.py export ART --models M`` here):
    python3 experiments/model_profile.py ART [ART2 ...] --model sd15_unet_2x64 --out R.json
    python3 experiments/model_profile.py --table R.json

A model run (``dynamo_gpu.py run``) gives totals by kernel family; it cannot say which convolution loses
to cuDNN, because torch's graph replays cuDNN's kernels without their shapes, nor where the wall time
beyond the kernels goes. This script answers both, from one forward of each system under the profiler:

- **convs**: eager torch runs each ``nn.Conv2d`` call inside a profiler range named by its shape (forward
  hooks), whose device time is cuDNN's kernels, the bias included, and eager's layout conversions where it
  makes them; torch.compile's (default mode) runs each of its cuDNN calls (``extern_kernels.convolution``)
  inside such a range, which is what reduce-overhead's graph replays (``inductor_convs``); each export's
  kernels are grouped by the workload recorded in their ``kernel.json``. All are keyed by (batch, c_in,
  c_out, kernel, output size, stride): an upsampling conv fused with its nearest 2x upsampling meets cuDNN's
  conv over the upsampled image.
- **gaps**: the kernels of one CUDA-graph replay in time order; idle time is the wall time from the first
  kernel's start to the last one's end that no kernel covers (overlapping kernels, as programmatic
  dependent launch makes them, count once). The largest gaps name the kernels on either side.

Every system's output is checked against float32 eager first (within twice eager fp16's own error).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
sys.path.insert(0, str(ROOT))

ConvKey = tuple[int, int, int, int, int, int]  # (n, c_in, c_out, kernel, out_hw, stride)


def _key_str(k: ConvKey) -> str:
    n, ci, co, ks, hw, s = k
    return f"{n}x{ci}->{co} {ks}x{ks}" + (f"/{s}" if s != 1 else "") + f" -> {hw}x{hw}"


def conv_key_of_workload(name: str, shape: dict[str, int]) -> ConvKey | None:
    """The conv an exported kernel computes, from its ``kernel.json`` workload (None: not a conv).  The
    patterns' shapes: ``conv2d_{k}x{k}...`` (n, h, w, c, m = output pixels, k, co) and ``upsample_conv2d``
    (n, h, w, c: the small image, co)."""
    m = re.match(r"(upsample_)?conv2d_(\d+)x\2", name)
    if m is None:
        return None
    ks = int(m.group(2))
    n, h, c, co = shape["n"], shape["h"], shape["c"], shape["co"]
    if m.group(1):  # by output parity: the upsampled image's conv
        return (n, c, co, ks, 2 * h, 1)
    out_hw = math.isqrt(shape["m"] // n)
    if out_hw > h:  # a nearest upsampling read through the window
        return (n, c, co, ks, out_hw, 1)
    return (n, c, co, ks, out_hw, h // out_hw)


def _conv_key_of_module(mod: Any, inp: Any) -> ConvKey:
    """An ``nn.Conv2d`` call's key from its input and attributes."""
    n, ci, h, _ = inp.shape
    ks, s = mod.kernel_size[0], mod.stride[0]
    pad = mod.padding[0] if isinstance(mod.padding, tuple) else (ks - 1) // 2  # "same"
    return (n, ci, mod.out_channels, ks, (h + 2 * pad - mod.dilation[0] * (ks - 1) - 1) // s + 1, s)


def _conv_key_of_call(args: tuple, kw: dict[str, Any]) -> list[int]:
    """An ``aten.convolution(input, weight, bias, stride, padding, dilation, ...)`` call's key, its arguments
    given by position or by name as Inductor's generated code passes them."""
    inp, w = args[0], args[1]
    get = lambda name, i: kw[name] if name in kw else args[i]  # noqa: E731
    s, pad, dil = get("stride", 3)[0], get("padding", 4)[0], get("dilation", 5)[0]
    ks, h = w.shape[-1], inp.shape[2]
    out_hw = (h + 2 * pad - dil * (ks - 1) - 1) // s + 1
    return [int(v) for v in (inp.shape[0], inp.shape[1], w.shape[0], ks, out_hw, s)]


def _events_time_us(e: Any) -> float:
    return float(getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0))


def cudnn_convs(model: Any, x: dict[str, Any]) -> dict[ConvKey, list[float]]:
    """Eager torch's convolutions: key -> [device µs of one forward, calls].  Each ``nn.Conv2d`` call runs
    inside a profiler range named by its key (forward hooks), whose kernels are cuDNN's (and the bias's)."""
    import torch

    ranges: list[Any] = []

    def pre(mod: Any, args: tuple) -> None:
        rf = torch.profiler.record_function("conv:" + json.dumps(_conv_key_of_module(mod, args[0])))
        rf.__enter__()
        ranges.append(rf)

    def post(mod: Any, args: tuple, out: Any) -> None:
        ranges.pop().__exit__(None, None, None)

    hooks = []
    for mod in model.modules():
        if isinstance(mod, torch.nn.Conv2d):
            hooks += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    try:
        prof = _profiled(model, x)
    finally:
        for h in hooks:
            h.remove()
    return _conv_ranges(prof)


def _profiled(fn: Any, x: dict[str, Any]) -> Any:
    """The profiler (CPU ranges and CUDA kernels) of one call of ``fn(**x)``, after one unprofiled call."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn(**x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn(**x)
        torch.cuda.synchronize()
    return prof


def _conv_ranges(prof: Any) -> dict[ConvKey, list[float]]:
    """key -> [device µs, calls] of the profiler ranges named ``conv:<key>``."""
    out: dict[ConvKey, list[float]] = {}
    for e in prof.events():
        if not e.name.startswith("conv:") or "CPU" not in str(getattr(e, "device_type", "CPU")):
            continue
        got = out.setdefault(tuple(json.loads(e.name[5:])), [0.0, 0])
        got[0] += _events_time_us(e)
        got[1] += 1
    return out


def inductor_convs(model: Any, x: dict[str, Any]) -> dict[ConvKey, list[float]]:
    """torch.compile's convolutions, conv by conv: key -> [device µs of one forward, calls].  Inductor's
    generated code calls cuDNN through ``extern_kernels.convolution`` (the bias and what follows are its own
    Triton kernels); reduce-overhead replays those calls' kernels in a CUDA graph, which hides their shapes,
    so this compiles the default mode with each call inside a profiler range named by its key."""
    import torch
    from torch._inductor.select_algorithm import extern_kernels

    orig = extern_kernels.convolution

    def conv(*args: Any, **kw: Any) -> Any:
        with torch.profiler.record_function("conv:" + json.dumps(_conv_key_of_call(args, kw))):
            return orig(*args, **kw)

    extern_kernels.convolution = conv
    try:
        prof = _profiled(torch.compile(model), x)
    finally:
        extern_kernels.convolution = orig
    return _conv_ranges(prof)


def exported_workloads(art: Path) -> dict[str, dict[str, Any]]:
    """kernel name -> its ``kernel.json`` (workload, grid, block)."""
    out = {}
    for f in glob.glob(str(art / "kernels" / "*" / "kernel.json")):
        j = json.loads(Path(f).read_text())
        out[j["kernel_name"]] = j
    return out


def kernel_timeline(fn: Any, x: dict[str, Any]) -> list[tuple[str, float, float]]:
    """(kernel name, start µs, end µs) of one forward under the profiler (after one unprofiled), in order."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn(**x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(**x)
        torch.cuda.synchronize()
    rows = []
    for e in prof.events():
        if getattr(e, "device_type", None) is None or "CUDA" not in str(e.device_type):
            continue
        if _events_time_us(e) <= 0 or e.name.startswith(("Memcpy", "Memset")):
            continue
        rows.append((e.name, float(e.time_range.start), float(e.time_range.end)))
    return sorted(rows, key=lambda r: r[1])


def gaps(timeline: list[tuple[str, float, float]], top: int = 15) -> dict[str, Any]:
    """Busy time (the union of the kernels' intervals), idle time between them, and the largest gaps."""
    if not timeline:
        return {"kernels": 0}
    busy, idle, end = 0.0, 0.0, timeline[0][1]
    largest = []
    prev = None
    for name, s, e in timeline:
        if s > end:
            idle += s - end
            largest.append((round(s - end, 2), prev, name))
        busy += max(0.0, e - max(s, end))
        end = max(end, e)
        prev = name
    largest.sort(key=lambda r: -r[0])
    hist = {"<1": 0, "1-2": 0, "2-5": 0, "5-20": 0, ">=20": 0}
    for g, _, _ in largest:
        hist["<1" if g < 1 else "1-2" if g < 2 else "2-5" if g < 5 else "5-20" if g < 20 else ">=20"] += 1
    return {"kernels": len(timeline), "span_us": round(end - timeline[0][1], 1), "busy_us": round(busy, 1),
            "idle_us": round(idle, 1), "gaps_by_us": hist,
            "largest": [(g, (a or "")[:70], b[:70]) for g, a, b in largest[:top]]}


def our_convs(timeline: list[tuple[str, float, float]], kernels: dict[str, dict[str, Any]]
              ) -> dict[ConvKey, list[Any]]:
    """Our conv kernels of one forward: key -> [µs, calls, {kernel name: [µs, calls]}] (a key's convs may be
    several kernels: with and without a residual, an upsampled read)."""
    out: dict[ConvKey, list[Any]] = {}
    for name, s, e in timeline:
        j = kernels.get(name)
        key = j and conv_key_of_workload(j["workload"]["name"], j["workload"]["shape"])
        if not key:
            continue
        got = out.setdefault(key, [0.0, 0, {}])
        got[0] += e - s
        got[1] += 1
        own = got[2].setdefault(name, [0.0, 0])
        own[0] += e - s
        own[1] += 1
    return out


def profile_model(arts: list[Path], name: str, out_path: Path, compile_torch: bool = True) -> int:
    import torch
    from dynamo_gpu import _last_hidden, build, float_inputs

    import spacefusion
    from spacefusion.api import CudaBackend, first_pick

    torch._dynamo.config.cache_size_limit = 64
    model, x = build(name, "cuda")
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": name,
                           "inputs": {k: list(v.shape) for k, v in x.items() if isinstance(v, torch.Tensor)}}
    with torch.no_grad():
        model.float()
        exact = _last_hidden(model(**float_inputs(name, model, x))).clone()
        model.half()
        systems: dict[str, Any] = {"eager": model}
        for art in arts:
            backend = CudaBackend(art / "kernels", schedule_for=first_pick)
            systems[f"spacefusion {art.name}"] = spacefusion.compile(model, target=backend, measure=False)
        if compile_torch:
            systems["torch.compile reduce-overhead"] = torch.compile(model, mode="reduce-overhead")
        errs = {k: (_last_hidden(fn(**x)).float() - exact).abs().max().item() for k, fn in systems.items()}
        res["check"] = {k: {"max_abs_err": round(v, 5), "ok": v <= 2 * errs["eager"]} for k, v in errs.items()}
        if not all(c["ok"] for c in res["check"].values()):
            print("output check failed:", res["check"], flush=True)
        cudnn = cudnn_convs(model, x)
        res["systems"] = {}
        convs: dict[str, dict[ConvKey, list[Any]]] = {"cuDNN (eager)": cudnn}
        if compile_torch:
            convs["cuDNN (torch.compile)"] = inductor_convs(model, x)
        for sys_name, fn in systems.items():
            if sys_name == "eager":
                continue
            tl = kernel_timeline(fn, x)
            res["systems"][sys_name] = gaps(tl)
            if sys_name.startswith("spacefusion"):
                art = arts[[f"spacefusion {a.name}" for a in arts].index(sys_name)]
                convs[sys_name] = our_convs(tl, exported_workloads(art))
    keys = sorted({k for c in convs.values() for k in c}, key=lambda k: -max(
        c.get(k, [0.0])[0] for c in convs.values()))
    res["convs"] = [{"conv": _key_str(k), "key": list(k),
                     **{s: ([round(c[k][0], 1), c[k][1]] if k in c else None) for s, c in convs.items()},
                     "kernels": {s: {n: [round(t, 1), calls] for n, (t, calls) in sorted(c[k][2].items())}
                                 for s, c in convs.items() if not s.startswith("cuDNN") and k in c}}
                    for k in keys]
    res["conv_totals_us"] = {s: round(sum(v[0] for v in c.values()), 1) for s, c in convs.items()}
    out_path.write_text(json.dumps(res, indent=1) + "\n")
    print(table(res), flush=True)
    return 0


def table(res: dict[str, Any]) -> str:
    systems = list(res["conv_totals_us"])
    lines = [f"{res['model']} on {res['device']} (µs in one forward; calls)",
             "| conv | " + " | ".join(systems) + " |", "|---|" + "---|" * len(systems)]
    for row in res["convs"]:
        cells = [f"{row[s][0]} ({row[s][1]})" if row.get(s) else "-" for s in systems]
        lines.append(f"| {row['conv']} | " + " | ".join(cells) + " |")
    lines.append("| all convs | " + " | ".join(str(res["conv_totals_us"][s]) for s in systems) + " |")
    lines.append("")
    for s, g in res["systems"].items():
        lines.append(f"{s}: {g.get('kernels')} kernels, span {g.get('span_us')} µs, busy {g.get('busy_us')}, "
                     f"idle {g.get('idle_us')}; gaps {g.get('gaps_by_us')}")
        for gap, a, b in g.get("largest", [])[:8]:
            lines.append(f"    {gap:7.2f} µs  after {a}  before {b}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("arts", type=Path, nargs="*", help="exports (dynamo_gpu.py export) to profile")
    ap.add_argument("--model", default="sd15_unet_2x64")
    ap.add_argument("--out", type=Path, default=Path("model_profile.json"))
    ap.add_argument("--no-torch-compile", action="store_true", help="skip torch.compile's graph")
    ap.add_argument("--table", type=Path, default=None, help="print a result file's tables")
    args = ap.parse_args(argv)
    if args.table is not None:
        print(table(json.loads(args.table.read_text())))
        return 0
    if not args.arts:
        ap.error("name at least one export (ART), or --table R.json")
    missing = [str(a) for a in args.arts if not (a / "kernels").is_dir()]
    if missing:
        ap.error(f"no kernels/ folder in {', '.join(missing)} (dynamo_gpu.py export ART first)")
    return profile_model(args.arts, args.model, args.out, not args.no_torch_compile)


if __name__ == "__main__":
    sys.exit(main())
