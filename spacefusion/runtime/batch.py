"""The GPU side of measuring: the offline batch's wire format and the check-then-time loop.

Runs where torch and cupy are, with no TVM, islpy or xgboost: it imports only this runtime, ``smg``
(numpy + sympy: the workload and its float64 reference) and ``search.records`` (the record format).
``spacefusion.runners`` exports a batch where TVM runs and reads the results back; the local GPU
runner calls ``measure_artefact`` in-process, so both time a candidate the same way.

On the GPU machine (``pip install -e ".[gpu]"`` in a checkout, no TVM needed; offline: docs/architecture.md,
"Installing on the GPU machine")::

    spacefusion-measure BATCH_DIR --out BATCH_DIR/results.json

A batch folder holds ``manifest.json`` (format ``MANIFEST_FORMAT``: one entry per candidate with its
schedule key, target, artefact folder, workload SMG as data, and seed, or the error that stopped its
build; ``inputs_from``, where present, the SMG whose outputs the check's inputs are) and one kernel
artefact folder per candidate.  The results file (``RESULTS_FORMAT``) holds one
``search.records.MeasureResult`` dict per entry, in manifest order, rewritten after every candidate.
Exit status: 0 when the results file was written, 2 when there is no GPU or the manifest is unreadable.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from search.records import MeasureResult

MANIFEST_FORMAT = "spacefusion-batch/1"
RESULTS_FORMAT = "spacefusion-batch-results/1"
MANIFEST_FILE = "manifest.json"
RESULTS_FILE = "results.json"
COMMAND = "spacefusion-measure"
RUNNER = "measure_batch"


def describe(exc: BaseException) -> str:
    """An exception as one bounded line of text for a record's ``error``."""
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) <= 2000 else text[:2000] + " ..."


# ---- wire format ---------------------------------------------------------------------------------


def load_manifest(folder: str | Path) -> dict[str, Any]:
    """Read and shape-check ``folder/manifest.json``; ValueError naming the file on any problem."""
    path = Path(folder) / MANIFEST_FILE
    if not path.is_file():
        raise ValueError(f"{path}: no manifest (export the batch with spacefusion.runners.export_batch)")
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


def read_results(results_json: str | Path) -> list[MeasureResult]:
    """The records of a results file (or a bare list of records), each validated.

    A malformed file raises ValueError naming the file and, for a bad record, its position; a missing
    file raises FileNotFoundError.
    """
    path = Path(results_json)
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if isinstance(data, dict):
        if data.get("format") != RESULTS_FORMAT or not isinstance(data.get("results"), list):
            raise ValueError(f"{path}: not a batch results file (expected format {RESULTS_FORMAT!r} "
                             f"and a 'results' list, got format {data.get('format')!r})")
        records = data["results"]
    elif isinstance(data, list):
        records = data
    else:
        raise ValueError(f"{path}: expected a results object or a list of records, got {type(data).__name__}")
    out = []
    for i, rec in enumerate(records):
        try:
            out.append(MeasureResult.from_dict(rec))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: record {i} is malformed: {describe(exc)}") from None
    return out


# ---- numerics, then timing -----------------------------------------------------------------------


class References:
    """Seeded inputs and float64 reference outputs, computed once per workload (SMG key) and seed."""

    def __init__(self) -> None:
        self._cache: dict[tuple[str, int, str | None], tuple[Any, dict[str, Any], dict[str, Any]]] = {}

    def get(self, smg: Any, seed: int, inputs_from: Any = None) -> tuple[Any, dict[str, Any], dict[str, Any]]:
        """(smg, inputs, reference) for an ``smg.ir.SMG`` or its ``smg_to_dict`` form; with ``inputs_from``
        (an SMG or its dict: the graph whose outputs ``smg`` reads), inputs that graph computes
        (``smg.reference.produced_inputs``)."""
        from smg.reference import evaluate, produced_inputs, random_inputs
        from smg.serialize import smg_from_dict

        if isinstance(smg, Mapping):
            smg = smg_from_dict(dict(smg))
        if isinstance(inputs_from, Mapping):
            inputs_from = smg_from_dict(dict(inputs_from))
        key = (smg.key, int(seed), inputs_from.key if inputs_from is not None else None)
        if key not in self._cache:
            x = random_inputs(smg, int(seed)) if inputs_from is None else produced_inputs(smg, inputs_from, int(seed))
            self._cache[key] = (smg, x, evaluate(smg, x))
        return self._cache[key]


@dataclass(frozen=True)
class Measured:
    """What ``measure_artefact`` saw: ``error`` None means checked and timed (``latency_us`` set)."""

    latency_us: float | None
    max_abs_err: float | None
    error: str | None
    meta: dict[str, Any]


def as_torch(a: Any, dtype: Any) -> Any:
    """Numpy array ``a`` as a CPU tensor of torch dtype ``dtype``.  A dtype torch cannot take from numpy
    (``ml_dtypes.bfloat16``, the reference's bf16 inputs) goes through float32, which holds it exactly."""
    import numpy as np
    import torch

    a = np.ascontiguousarray(a)
    try:
        t = torch.from_numpy(a)
    except TypeError:
        t = torch.from_numpy(a.astype(np.float32))
    return t.to(dtype)


def measure_artefact(folder: str | Path, smg: Any, inputs: Mapping[str, Any], reference: Mapping[str, Any], *,
                     warmup: int = 10, iters: int = 100, flush_l2: bool = True, budget_s: float | None = None,
                     schedule_key: str | None = None) -> Measured:
    """Load and compile the artefact in ``folder``, launch it once on NaN-filled outputs, check it against
    ``reference`` (``smg.reference.check_numerics``), and only if it matches time it with
    ``timing.time_cuda`` (CUDA events, L2 flushed, median).  Never raises for a bad candidate.

    ``budget_s`` caps the timing of a slow candidate (fewer runs, at least 3, recorded in ``meta``);
    ``schedule_key``, when given, must match the one the artefact was built for.
    """
    import torch

    from smg.reference import check_numerics

    from . import artefact as art_mod
    from . import gpu, timing

    meta: dict[str, Any] = {"warmup": warmup, "iters": iters, "flush_l2": flush_l2}
    t0 = time.perf_counter()
    try:
        folder = Path(folder)
        written = json.loads((folder / "kernel.json").read_text()).get("schedule_key")
        if schedule_key is not None and written not in (None, schedule_key):
            raise ValueError(f"{folder} holds schedule {written}, the manifest says {schedule_key}")
        kernel = gpu.CudaKernel(art_mod.KernelArtefact.load(folder))
        meta["backend"] = kernel.compile()
    except Exception as exc:
        return Measured(None, None, f"build: {describe(exc)}", meta)
    meta["load_s"] = round(time.perf_counter() - t0, 4)
    try:
        art = kernel.artefact
        dev_in = {p.name: as_torch(inputs[p.name], gpu.torch_dtype(p.dtype)).to("cuda") for p in art.inputs}
        # NaN-filled outputs: an element the kernel never writes fails the check.
        outs = {p.name: torch.full(p.shape, math.nan, dtype=gpu.torch_dtype(p.dtype), device="cuda")
                for p in art.outputs}
        torch.cuda.synchronize()
        t_launch = time.perf_counter()
        kernel.launch(dev_in, outs)
        torch.cuda.synchronize()
        t_launch = time.perf_counter() - t_launch
        got = {n: t.double().cpu().numpy() for n, t in outs.items()}
    except Exception as exc:
        return Measured(None, None, f"run: {describe(exc)}", meta)
    err, problem = check_numerics(smg, reference, got)
    if problem is not None:
        return Measured(None, err, problem, meta)
    if budget_s is not None and t_launch * (warmup + iters) > budget_s:
        iters = max(3, min(iters, int(budget_s / max(t_launch, 1e-6))))
        warmup = max(1, min(warmup, iters // 3))
        meta.update(iters=iters, warmup=warmup, first_launch_s=round(t_launch, 4))
    try:
        t = timing.time_cuda(lambda: kernel.launch(dev_in, outs), warmup=warmup, iters=iters, flush_l2=flush_l2)
    except Exception as exc:
        return Measured(None, err, f"timing: {describe(exc)}", meta)
    meta.update(p10_us=t.p10_us, p90_us=t.p90_us)
    return Measured(t.median_us, err, None, meta)


def measure_entry(entry: Mapping[str, Any], folder: Path, refs: References, *, warmup: int, iters: int,
                  flush_l2: bool, device: str, budget_s: float | None = None) -> MeasureResult:
    """Check then time one manifest candidate; every failure becomes a record with ``error``."""
    meta: dict[str, Any] = {"runner": RUNNER, "device": device, "warmup": warmup, "iters": iters,
                            "flush_l2": flush_l2, "seed": entry["seed"], "artefact": entry["artefact"]}

    def result(m: Measured | None = None, error: str | None = None) -> MeasureResult:
        lat = () if m is None or m.latency_us is None else (m.latency_us,)
        full = {**meta, **(m.meta if m else {})}
        return MeasureResult(str(entry["schedule_key"]), str(entry["target"]), lat, m.max_abs_err if m else None,
                             error if m is None else m.error, tuple(sorted(full.items())))

    if entry.get("error"):
        return result(error=str(entry["error"]))
    if not entry["artefact"]:
        return result(error="build: the manifest names no artefact for this candidate")
    try:
        smg, x, ref = refs.get(entry["workload"], entry["seed"], entry.get("inputs_from"))
    except Exception as exc:
        return result(error=f"reference: {describe(exc)}")
    return result(measure_artefact(folder / entry["artefact"], smg, x, ref, warmup=warmup, iters=iters,
                                   flush_l2=flush_l2, budget_s=budget_s, schedule_key=str(entry["schedule_key"])))


def main(argv: list[str] | None = None) -> int:
    """``spacefusion-measure``: measure every candidate of a batch folder, writing the results file."""
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("manifest_dir", type=Path, help="folder holding manifest.json and the artefact folders")
    parser.add_argument("--out", type=Path, default=None, help=f"results file (default MANIFEST_DIR/{RESULTS_FILE})")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--no-flush-l2", action="store_true", help="time with a warm L2 (default: flushed)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds of timing per candidate; slow candidates get fewer runs (at least 3)")
    args = parser.parse_args(argv)
    out = args.out or args.manifest_dir / RESULTS_FILE
    if args.warmup < 0 or args.iters < 1:
        print(f"error: --warmup must be >= 0 and --iters >= 1, got {args.warmup} and {args.iters}", file=sys.stderr)
        return 2
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
    from . import timing

    def write(rows: list[MeasureResult]) -> None:
        """Rewritten after every candidate: a session cut short still leaves what it measured."""
        try:
            import cupy

            cupy_version = cupy.__version__
        except ImportError:
            cupy_version = None
        result = {"format": RESULTS_FORMAT, "manifest": str(args.manifest_dir / MANIFEST_FILE), "device": device,
                  "torch": torch.__version__, "torch_cuda": torch.version.cuda, "cupy": cupy_version,
                  "timing": {"warmup": args.warmup, "iters": args.iters, "flush_l2": not args.no_flush_l2,
                             "flush": timing.DEFAULT_FLUSH, "stat": "median of CUDA events"},
                  "results": [r.to_dict() for r in rows]}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")

    refs = References()
    rows: list[MeasureResult] = []
    cands = manifest["candidates"]
    for i, entry in enumerate(cands):
        try:
            row = measure_entry(entry, args.manifest_dir, refs, warmup=args.warmup, iters=args.iters,
                                flush_l2=not args.no_flush_l2, device=device, budget_s=args.budget_s)
        except Exception as exc:  # belt and braces: one candidate must never lose the others' numbers
            row = MeasureResult(str(entry["schedule_key"]), str(entry["target"]), (), None,
                                f"internal: {describe(exc)}",
                                (("runner", RUNNER), ("traceback", traceback.format_exc()[-4000:])))
        rows.append(row)
        lat = f"{row.latencies_us[0]:9.2f} us" if row.latencies_us else "        - "
        err = "-" if row.max_abs_err is None else f"{row.max_abs_err:.2e}"
        status = "ok" if row.error is None else row.error.splitlines()[0][:100]
        print(f"[{i + 1}/{len(cands)}] {row.schedule_key[:12]} {row.target:<13} {lat}  err {err:>8}  {status}",
              flush=True)
        write(rows)
    write(rows)
    print(f"{sum(r.error is None for r in rows)}/{len(rows)} candidates ok on {device}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
