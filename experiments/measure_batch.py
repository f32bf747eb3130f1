#!/usr/bin/env python3
"""Measure an offline tuning batch on a GPU machine that has torch + cupy but no TVM.

Usage (from the repo root of a checkout on the GPU machine; needs numpy, sympy, torch, cupy):
    python experiments/measure_batch.py MANIFEST_DIR --out results.json [--warmup 10] [--iters 100] [--no-flush-l2]

MANIFEST_DIR is a folder written by ``search.runners.export_batch`` (or ``OfflineBatchRunner.export``)
where TVM runs: ``manifest.json`` plus one kernel artefact folder per candidate.  For each candidate, in
manifest order: rebuild its workload SMG from the manifest, make the seeded inputs
(``smg.reference.random_inputs``), compute the float64 numpy reference once per workload, load and
compile the artefact (its cubin if present, else nvcc/NVRTC), launch once on NaN-filled outputs, check
against the reference, and only if it matches time it with ``timing.time_cuda`` (CUDA events, L2
flushed).  A failing candidate is recorded with its error and the script goes on.

Back where TVM runs, ``search.runners.import_batch("results.json")`` (or ``OfflineBatchRunner.collect``)
reads the records: ``search.records.MeasureResult`` dicts (format ``spacefusion-record/1``), with
``latencies_us`` = [median of the timed runs] and p10/p90 in ``meta``.

The runtime is loaded from its file path as a private package (as in run_artefacts_gpu.py), and
neither ``spacefusion`` nor ``search`` is imported: they pull in TVM / the schedulers.  Only the light
``smg`` package (numpy + sympy) is imported.  Exit status: 0 when the results file was written, 2 when
there is no GPU or the manifest is unreadable.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # experiments/: the shared loader
from gpu_runtime import runtime_module  # noqa: E402

MANIFEST_FORMAT = "spacefusion-batch/1"
RESULTS_FORMAT = "spacefusion-batch-results/1"
RECORD_FORMAT = "spacefusion-record/1"
RUNNER = "measure_batch"

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))






# ---- manifest and records ------------------------------------------------------------------------


def load_manifest(folder: Path) -> dict[str, Any]:
    """Read and shape-check ``folder/manifest.json``; ValueError naming the file on any problem."""
    path = folder / "manifest.json"
    if not path.is_file():
        raise ValueError(f"{path}: no manifest (export the batch with search.runners.export_batch)")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        tag = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{path}: format is {tag!r}, expected {MANIFEST_FORMAT!r}")
    cands = data.get("candidates")
    if not isinstance(cands, list):
        raise ValueError(f"{path}: 'candidates' must be a list")
    for i, c in enumerate(cands):
        missing = [k for k in ("schedule_key", "target", "artefact", "workload", "seed") if k not in c]
        if missing:
            raise ValueError(f"{path}: candidate {i} lacks {missing}")
    return data


def record(entry: Mapping[str, Any], latencies_us: list[float] | None = None, max_abs_err: float | None = None,
           error: str | None = None, meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One result in ``search.records.MeasureResult.to_dict`` form (same keys, same format tag)."""
    return {
        "format": RECORD_FORMAT,
        "schedule_key": str(entry["schedule_key"]),
        "target": str(entry["target"]),
        "latencies_us": [float(x) for x in latencies_us or []],
        "max_abs_err": max_abs_err,
        "error": error,
        "meta": dict(meta or {}),
    }


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) <= 2000 else text[:2000] + " ..."


class References:
    """Seeded inputs and float64 reference outputs, once per workload (SMG key) and seed."""

    def __init__(self) -> None:
        self._cache: dict[tuple[str, int], tuple[Any, dict[str, Any], dict[str, Any]]] = {}

    def get(self, workload: dict[str, Any], seed: int) -> tuple[Any, dict[str, Any], dict[str, Any]]:
        from smg.reference import evaluate, random_inputs
        from smg.serialize import smg_from_dict

        smg = smg_from_dict(workload)
        key = (smg.key, int(seed))
        if key not in self._cache:
            x = random_inputs(smg, int(seed))
            self._cache[key] = (smg, x, evaluate(smg, x))
        return self._cache[key]


def measure_entry(entry: Mapping[str, Any], folder: Path, refs: References, *, warmup: int, iters: int,
                  flush_l2: bool, device: str, budget_s: float | None = None) -> dict[str, Any]:
    """Check then time one manifest candidate; every failure becomes a record with ``error``."""
    import numpy as np
    import torch

    artefact_mod, gpu, timing = runtime_module("artefact"), runtime_module("gpu"), runtime_module("timing")
    meta: dict[str, Any] = {"runner": RUNNER, "device": device, "warmup": warmup, "iters": iters,
                            "flush_l2": flush_l2, "seed": entry["seed"], "artefact": entry["artefact"]}
    if entry.get("error"):
        return record(entry, error=str(entry["error"]), meta=meta)
    if not entry["artefact"]:
        return record(entry, error="build: the manifest names no artefact for this candidate", meta=meta)
    try:
        smg, x, ref = refs.get(entry["workload"], entry["seed"])
    except Exception as exc:
        return record(entry, error=f"reference: {_describe(exc)}", meta=meta)
    t0 = time.perf_counter()
    try:
        art_dir = folder / entry["artefact"]
        written = json.loads((art_dir / "kernel.json").read_text()).get("schedule_key")
        if written not in (None, entry["schedule_key"]):
            raise ValueError(f"{art_dir} holds schedule {written}, the manifest says {entry['schedule_key']}")
        kernel = gpu.CudaKernel(artefact_mod.KernelArtefact.load(art_dir))
        meta["backend"] = kernel.compile()
    except Exception as exc:
        return record(entry, error=f"build: {_describe(exc)}", meta=meta)
    meta["load_s"] = round(time.perf_counter() - t0, 4)
    try:
        art = kernel.artefact
        inputs = {p.name: torch.from_numpy(np.ascontiguousarray(x[p.name])).to("cuda") for p in art.inputs}
        # NaN-filled outputs: an element the kernel never writes fails the check.
        outputs = {p.name: torch.full(p.shape, math.nan, dtype=gpu.torch_dtype(p.dtype), device="cuda")
                   for p in art.outputs}
        torch.cuda.synchronize()
        t_launch = time.perf_counter()
        kernel.launch(inputs, outputs)
        torch.cuda.synchronize()
        t_launch = time.perf_counter() - t_launch
        got = {n: t.double().cpu().numpy() for n, t in outputs.items()}
    except Exception as exc:
        return record(entry, error=f"run: {_describe(exc)}", meta=meta)
    from smg.reference import check_numerics  # the same check the CPU runners use (numpy only)

    err, problem = check_numerics(smg, ref, got)
    if problem is not None:
        return record(entry, max_abs_err=err, error=problem, meta=meta)
    if budget_s is not None and t_launch * (warmup + iters) > budget_s:
        # slow candidates: fewer runs, so a batch of them fits the GPU session (recorded in meta)
        iters = max(3, min(iters, int(budget_s / max(t_launch, 1e-6))))
        warmup = max(1, min(warmup, iters // 3))
        meta.update(iters=iters, warmup=warmup, first_launch_s=round(t_launch, 4))
    try:
        t = timing.time_cuda(lambda: kernel.launch(inputs, outputs), warmup=warmup, iters=iters, flush_l2=flush_l2)
    except Exception as exc:
        return record(entry, max_abs_err=err, error=f"timing: {_describe(exc)}", meta=meta)
    meta.update(p10_us=t.p10_us, p90_us=t.p90_us)
    return record(entry, [t.median_us], err, None, meta)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("manifest_dir", type=Path, help="folder holding manifest.json and the artefact folders")
    parser.add_argument("--out", type=Path, default=None, help="results file (default MANIFEST_DIR/results.json)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--no-flush-l2", action="store_true", help="time with a warm L2 (default: flushed)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds of timing per candidate; slow candidates get fewer runs (at least 3)")
    args = parser.parse_args(argv)
    out = args.out or args.manifest_dir / "results.json"

    try:
        manifest = load_manifest(args.manifest_dir)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        import torch
    except ImportError:
        print("error: torch is not installed", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: no CUDA device visible to torch", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.cuda.get_device_name()

    def write(rows: list[dict[str, Any]]) -> None:
        """Rewritten after every candidate: a session cut short still leaves what it measured."""
        try:
            import cupy

            cupy_version = cupy.__version__
        except ImportError:
            cupy_version = None
        result = {
            "format": RESULTS_FORMAT,
            "manifest": str(args.manifest_dir / "manifest.json"),
            "device": device,
            "torch": torch.__version__,
            "torch_cuda": torch.version.cuda,
            "cupy": cupy_version,
            "timing": {"warmup": args.warmup, "iters": args.iters, "flush_l2": not args.no_flush_l2,
                       "flush": runtime_module("timing").DEFAULT_FLUSH,
                       "stat": "median of CUDA events"},
            "results": rows,
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")

    refs = References()
    rows: list[dict[str, Any]] = []
    cands = manifest["candidates"]
    for i, entry in enumerate(cands):
        try:
            row = measure_entry(entry, args.manifest_dir, refs, warmup=args.warmup, iters=args.iters,
                                flush_l2=not args.no_flush_l2, device=device, budget_s=args.budget_s)
        except Exception as exc:  # belt and braces: one candidate must never lose the others' numbers
            row = record(entry, error=f"internal: {_describe(exc)}",
                         meta={"runner": RUNNER, "traceback": traceback.format_exc()[-4000:]})
        rows.append(row)
        lat = f"{row['latencies_us'][0]:9.2f} us" if row["latencies_us"] else "        - "
        err = "-" if row["max_abs_err"] is None else f"{row['max_abs_err']:.2e}"
        status = "ok" if row["error"] is None else row["error"].splitlines()[0][:100]
        key, target = entry["schedule_key"][:12], entry["target"]
        print(f"[{i + 1}/{len(cands)}] {key} {target:<13} {lat}  err {err:>8}  {status}", flush=True)
        write(rows)
    write(rows)

    n_ok = sum(r["error"] is None for r in rows)
    print(f"{n_ok}/{len(rows)} candidates ok on {device}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
