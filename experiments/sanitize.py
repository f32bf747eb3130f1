#!/usr/bin/env python3
"""compute-sanitizer over every kernel of a whole-model compile (issue 59, item 11), on the GPU machine.

    python experiments/sanitize.py --models bert_base_8x128 resnet50_32x224 --tools memcheck racecheck --out r.json

For each model of ``dynamo_gpu.MODELS`` (random weights of the real config, fp16):

1. a plain process compiles it with ``spacefusion.compile`` into a kernel cache of its own (TVM on this
   machine) and checks the first call against eager (twice eager fp16's distance from float32, the rule of
   ``dynamo_gpu.py``): the kernels under test are the ones a user gets;
2. for each tool, a new process under ``compute-sanitizer --tool TOOL`` loads the same kernels from that cache
   (a warm compile: nothing is built under the sanitizer), runs the model once launch by launch and once more
   (the CUDA graph's capture and replay), and compute-sanitizer reports every bad access (memcheck) or shared
   memory hazard (racecheck) in every kernel launched, torch's own included.

With ``--per-kernel`` the tools run instead over each distinct kernel the compile built, one process per
kernel that loads its artefact from the cache and launches it once on random inputs (nothing of torch's own
is checked then): racecheck's cost grows with the blocks and shared-memory accesses it tracks, so a whole
model can run past any timeout (BERT-base, even at batch 1), while one launch per kernel finishes, and a
kernel that does not is named.

The record per model and tool: the sanitizer's ``ERROR SUMMARY`` count, the first reports it printed, the
fused subgraphs and distinct SMGs launched, the wall time and the exit status.  A tool that runs past
``--timeout`` is recorded as such, not as clean.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: memcheck, initcheck and synccheck end with ``ERROR SUMMARY: N errors``; racecheck with ``RACECHECK SUMMARY:
#: H hazards displayed (E errors, W warnings)``, whose errors are the count kept
SUMMARY = re.compile(r"(?:ERROR SUMMARY: (\d+) error|RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) error)")


def _errors(text: str) -> int | None:
    """The last summary's error count in a sanitizer's output; None where it printed none (not clean)."""
    found = SUMMARY.findall(text)
    return int(next(n for n in found[-1] if n)) if found else None


def one(model_name: str, calls: int, batch: int | None = None) -> dict[str, Any]:
    """In this process: compile the model (warm or cold, as the cache is), run it ``calls`` times, check it.
    ``batch`` replaces the model's batch size: racecheck's time grows with the blocks launched (BERT-base at
    batch 8 ran past 160 s); at batch 1 the same graphs' kernels are checked at their own first picks for
    that size (the tiles may differ from batch 8's)."""
    import torch

    import spacefusion
    from experiments.dynamo_gpu import MODELS, build, float_inputs

    if batch is not None:
        cfg, cls, kw, kind, _, seq = MODELS[model_name]
        MODELS[model_name] = (cfg, cls, kw, kind, batch, seq)

    model, x = build(model_name, "cuda")
    with torch.no_grad():
        exact = model.float()(**float_inputs(model_name, model, x))[0]
        model.half()
        eager = model(**x)[0]
        compiled = spacefusion.compile(model, measure=False)  # the kernels are what is checked
        for _ in range(calls):
            got = compiled(**x)[0]
        torch.cuda.synchronize()
    err, base = (got.float() - exact).abs().max().item(), (eager.float() - exact).abs().max().item()
    parts = compiled.spacefusion.partitions
    return {"max_abs_err": err, "eager_fp16_err": base, "ok": err <= 2 * base,
            "fused_subgraphs": sum(len(p.subgraphs) for p in parts),
            "distinct_smgs": len({s.key for p in parts for s in p.subgraphs})}


def launch_one(folder: Path) -> dict[str, Any]:
    """In this process: load the artefact in ``folder`` and launch it once on random inputs (normal values
    scaled by 0.5 for floating point, zeros for integers), then synchronize."""
    import torch

    from spacefusion.runtime import load_kernel, torch_dtype

    kernel = load_kernel(folder)
    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs = {}
    for p in kernel.artefact.inputs:
        dt = torch_dtype(p.dtype)
        inputs[p.name] = (0.5 * torch.randn(p.shape, generator=gen, device="cuda")).to(dt) \
            if dt.is_floating_point else torch.zeros(p.shape, dtype=dt, device="cuda")
    out = kernel(**inputs)
    torch.cuda.synchronize()
    finite = all(bool(torch.isfinite(t.float()).all()) for t in out.values())
    return {"kernel": json.loads((folder / "kernel.json").read_text())["kernel_name"], "finite": finite}


def per_kernel(prefix: list[str], cache: Path, timeout: float) -> dict[str, Any]:
    """Each artefact under ``cache`` (``kernels/<machine>/<key>``) launched once under ``prefix``."""
    rows: dict[str, Any] = {}
    for art in sorted(cache.glob("kernels/*/*/kernel.json")):
        cmd = [*prefix, sys.executable, __file__, "--kernel", str(art.parent)]
        t = time.perf_counter()
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            rows[art.parent.name] = {"timed_out_s": timeout}
            continue
        rows[art.parent.name] = {"wall_s": round(time.perf_counter() - t, 1), "returncode": out.returncode,
                                 "result": _last_json(out.stdout),
                                 "sanitizer_errors": _errors(out.stdout + out.stderr),
                                 "reports": [ln for ln in (out.stdout + out.stderr).splitlines()
                                             if ln.startswith("=========")][:20]}
    return rows


def _last_json(text: str) -> dict[str, Any] | None:
    lines = [ln for ln in text.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else None


def _spawn(prefix: list[str], model_name: str, calls: int, env: dict[str, str], timeout: float,
           batch: int | None = None) -> dict[str, Any]:
    cmd = [*prefix, sys.executable, __file__, "--one", model_name, "--calls", str(calls),
           *(("--batch", str(batch)) if batch is not None else ())]
    t = time.perf_counter()
    try:
        out = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout,
                             check=False)
    except subprocess.TimeoutExpired as exc:
        text = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return {"timed_out_s": timeout, "errors_seen": len(re.findall(r"^========= (Invalid|Race|Error)", text,
                                                                      re.M)), "head": text[:3000]}
    row: dict[str, Any] = {"wall_s": round(time.perf_counter() - t, 1), "returncode": out.returncode,
                           "result": _last_json(out.stdout)}
    if prefix:
        row["sanitizer_errors"] = _errors(out.stdout + out.stderr)
        reports = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.startswith("=========")]
        row["reports"] = reports[:60]
    if out.returncode != 0 and row["result"] is None:
        row["stderr"] = (out.stderr or out.stdout)[-3000:]
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["bert_base_8x128"])
    ap.add_argument("--tools", nargs="+", default=["memcheck", "racecheck"],
                    choices=("memcheck", "racecheck", "initcheck", "synccheck"))
    ap.add_argument("--calls", type=int, default=2, help="calls of the compiled model under each tool")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per sanitized process")
    ap.add_argument("--batch", type=int, default=None,
                    help="the models' batch size instead of their own (e.g. 1 for racecheck: fewer blocks to check)")
    ap.add_argument("--out", type=Path, default=Path("sanitize.json"))
    ap.add_argument("--per-kernel", action="store_true",
                    help="each distinct kernel launched once under each tool, instead of the whole model")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--kernel", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.batch is not None and args.batch < 1:
        ap.error(f"--batch {args.batch}: a batch size is 1 or more")
    if args.kernel:
        print(json.dumps(launch_one(args.kernel)), flush=True)
        return 0
    if args.one:
        print(json.dumps(one(args.one, args.calls, args.batch)), flush=True)
        return 0
    sanitizer = shutil.which("compute-sanitizer") or next(
        (str(p) for p in Path("/usr/local").glob("cuda*/bin/compute-sanitizer")), None)
    if sanitizer is None:
        print("compute-sanitizer not found on PATH or under /usr/local/cuda*/bin", file=sys.stderr)
        return 2
    import torch

    rows: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                            "sanitizer": subprocess.run([sanitizer, "--version"], capture_output=True,
                                                        text=True).stdout.strip().splitlines()[-1:],
                            "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            env = {"SPACEFUSION_CACHE": f"{tmp}/{name}"}
            rec: dict[str, Any] = {"batch": args.batch, "compile": _spawn([], name, 1, env, args.timeout * 2,
                                                                          args.batch)}
            print(name, "compile", json.dumps(rec["compile"])[:300], flush=True)
            for tool in args.tools:
                prefix = [sanitizer, "--tool", tool, "--print-limit", "50", "--target-processes", "all"]
                if args.per_kernel:
                    rec[tool] = per_kernel(prefix, Path(env["SPACEFUSION_CACHE"]), args.timeout)
                    counts = [r.get("sanitizer_errors") for r in rec[tool].values()]
                    print(name, tool, f"{len(counts)} kernels, errors {counts}", flush=True)
                    continue
                rec[tool] = _spawn(prefix, name, args.calls, env, args.timeout, args.batch)
                print(name, tool, json.dumps({k: v for k, v in rec[tool].items() if k != "reports"})[:400],
                      flush=True)
            rows["models"][name] = rec
            args.out.write_text(json.dumps(rows, indent=1))
    args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
