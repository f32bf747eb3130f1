"""Cold and warm compile times of one model, spacefusion against torch.compile's default mode (issue 55).

    python experiments/compile_time.py --model bert_base_8x128 --out r.json   # on the GPU machine, TVM there

Each measurement is a fresh Python process (nothing imported, nothing cached in memory) timing its first call
of the compiled model, compile included, to the end of the GPU's work:

- spacefusion cold: an empty kernel cache (``SPACEFUSION_CACHE``), the distinct SMGs' first picks and builds
  exported by ``--workers`` processes (``frontend.parallel_build``), and with one (serial) for comparison;
- spacefusion warm: a new process over the kernel cache the cold run filled (the same SMGs);
- torch.compile cold and warm: an empty Inductor cache (``TORCHINDUCTOR_CACHE_DIR``), then that cache again.

The model is ``dynamo_gpu.MODELS[--model]`` (random weights of the real config, fp16); each output is checked
against eager fp16 within twice its distance from float32 (the rule of ``dynamo_gpu.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def one(model_name: str, system: str) -> dict[str, Any]:
    """In this process: build the model, compile it, time the first call (compile + run)."""
    import torch

    from experiments.dynamo_gpu import build, float_inputs

    model, x = build(model_name, "cuda")
    with torch.no_grad():
        exact = model.float()(**float_inputs(model_name, model, x))[0]
        model.half()
        eager = model(**x)[0]
        torch.cuda.synchronize()
        t = time.perf_counter()
        if system == "spacefusion":
            import spacefusion

            compiled = spacefusion.compile(model)
        else:
            compiled = torch.compile(model)
        got = compiled(**x)[0]
        torch.cuda.synchronize()
        took = time.perf_counter() - t
    err, base = (got.float() - exact).abs().max().item(), (eager.float() - exact).abs().max().item()
    row: dict[str, Any] = {"compile_and_first_call_s": took, "max_abs_err": err, "eager_fp16_err": base,
                           "ok": err <= 2 * base}
    row["dynamo_times_s"] = _dynamo_times()
    if system == "spacefusion":
        parts = compiled.spacefusion.partitions
        row["fused_subgraphs"] = sum(len(p.subgraphs) for p in parts)
        row["distinct_smgs"] = len({s.key for p in parts for s in p.subgraphs})
        row["exports"] = _exports(t)
    return row


def _dynamo_times() -> dict[str, float]:
    """Dynamo's own phase times in this process (tracing, the backend's call, guards), in seconds."""
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv", aggregate=True)
    return {n: round(float(v), 3) for n, v in zip(names, values)}


def _exports(since: float) -> list[dict[str, Any]]:
    """The kernels this process's compile exported (their ``timing.json``, newest run only), slowest first:
    what a cold compile's critical path is made of."""
    from spacefusion.api import device_hardware, kernel_cache

    start = time.time() - (time.perf_counter() - since)
    folder = kernel_cache(device_hardware())  # the GPU's own folder of the cache
    rows = [json.loads(f.read_text()) | {"key": f.parent.name} for f in folder.glob("*/timing.json")
            if f.stat().st_mtime >= start]
    return sorted(rows, key=lambda r: -(r["schedule_s"] + r["lower_s"] + r["save_s"]))


def _spawn(model_name: str, system: str, env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, "--one", system, "--model", model_name],
                         env={**os.environ, **env}, capture_output=True, text=True, check=False)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"error": (out.stderr or out.stdout)[-2000:]}
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bert_base_8x128")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--serial", action="store_true", help="also a cold spacefusion compile with one worker")
    ap.add_argument("--warm-repeats", type=int, default=1,
                    help="warm runs of each system (and of spacefusion without export workers: no pool started)")
    ap.add_argument("--systems", nargs="+", choices=("spacefusion", "torch.compile"),
                    default=["spacefusion", "torch.compile"], help="which systems to time")
    ap.add_argument("--out", type=Path, default=Path("compile_time.json"))
    ap.add_argument("--one", choices=("spacefusion", "torch.compile"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.model, args.one)), flush=True)
        return 0
    import torch

    rows: dict[str, Any] = {"model": args.model, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                            "cpus": os.cpu_count(), "workers": args.workers}
    with tempfile.TemporaryDirectory() as tmp:
        warm = {"SPACEFUSION_CACHE": f"{tmp}/sf", "SPACEFUSION_CUBIN_CACHE": f"{tmp}/cubins"}
        # cold means nvcc's cubins too (``SPACEFUSION_CUBIN_CACHE``, shared by every kernel cache of the machine),
        # as Inductor's cold run starts with an empty cache of its Triton kernels
        runs = [("spacefusion cold", "spacefusion", {"SPACEFUSION_CACHE": f"{tmp}/sf",
                                                     "SPACEFUSION_CUBIN_CACHE": f"{tmp}/cubins",
                                                     "SPACEFUSION_BUILD_WORKERS": str(args.workers)}),
                ("spacefusion warm", "spacefusion", warm),
                ("torch.compile cold", "torch.compile", {"TORCHINDUCTOR_CACHE_DIR": f"{tmp}/inductor"}),
                ("torch.compile warm", "torch.compile", {"TORCHINDUCTOR_CACHE_DIR": f"{tmp}/inductor"})]
        for i in range(1, args.warm_repeats):
            runs += [(f"spacefusion warm {i + 1}", "spacefusion", warm),
                     (f"torch.compile warm {i + 1}", "torch.compile", {"TORCHINDUCTOR_CACHE_DIR": f"{tmp}/inductor"})]
        if args.warm_repeats > 1:
            runs += [(f"spacefusion warm, no workers {i + 1}", "spacefusion",
                      {**warm, "SPACEFUSION_BUILD_WORKERS": "1"})
                     for i in range(args.warm_repeats)]
        if args.serial:
            runs.insert(1, ("spacefusion cold, serial", "spacefusion", {"SPACEFUSION_CACHE": f"{tmp}/sf1",
                                                                         "SPACEFUSION_CUBIN_CACHE": f"{tmp}/cubins1",
                                                                         "SPACEFUSION_BUILD_WORKERS": "1"}))
        for label, system, env in runs:
            if system not in args.systems:
                continue
            rows[label] = _spawn(args.model, system, env)
            print(label, json.dumps(rows[label])[:400], flush=True)
    args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
