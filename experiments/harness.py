#!/usr/bin/env python3
"""Comparison harness (issue 5): the benchmark workloads x systems on one GPU, to JSON and CSV.

Usage (from the repo root of a checkout on the GPU machine; needs torch + cupy, not TVM):
    python experiments/harness.py ARTEFACT_DIR [ARTEFACT_DIR ...] --out results.json [--csv results.csv]
        [--warmup 10] [--iters 100] [--workloads KEY ...] [--no-compile] [--sf-budget-s SECONDS]

Each ARTEFACT_DIR is a spacefusion kernel artefact (kernel.cu + kernel.json) or a folder of them; an
artefact is matched to a workload by its kernel.json ``workload`` name, shape and flags.  Workloads
(experiments/harness_workloads.py): MHA BERT / ViT / LLaMA, causal MHA, Softmax-GEMM, LayerNorm(x+r),
sigmoid(A@B+bias) and the plain GEMM A@B as its reference row, all fp16.

Systems per workload: ``spacefusion`` (the artefact's kernel; "no artefact" when none matches),
``eager`` (PyTorch written the HuggingFace way, unfused), ``torch.compile`` of it, and for attention
SDPA with each backend forced (``sdpa_flash``, ``sdpa_cudnn``, ``sdpa_efficient``) and ``flash_attn``
(``flash_attn_func``) when installed.  Every system is first checked against a float32 torch reference
computed from the same inputs (spacefusion's outputs NaN-filled first), and only if it matches timed
with the runtime's ``time_cuda`` (CUDA events, L2 flushed between runs by a read, median).  ``--sf-budget-s``
caps the timing of the (slow) spacefusion kernels: fewer runs, at least 5; baselines always get
``--iters`` runs.  Rows report TFLOP/s or GB/s per the workload's roofline, the fraction of that roof
(from the hardware model: tensor-core peak for the dtype, or DRAM bandwidth) and, in the spacefusion
row, its speedup against each baseline (baseline_us / spacefusion_us).  One failing system or workload
never loses the others; the JSON and CSV are rewritten after every workload.

torch is imported lazily, so ``--help`` works anywhere.  The runtime and the hardware model are loaded
by file path, so neither ``spacefusion`` nor ``schedulers`` (TVM, islpy, sympy) is imported.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gc
import importlib
import importlib.util
import json
import math
import platform
import shlex
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # experiments/: the shared loader
from gpu_runtime import compare_tensors, runtime_module, tolerance_module  # noqa: E402

if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import harness_workloads as hwl  # noqa: E402

#: Fewest timed runs of a spacefusion kernel under --sf-budget-s.
MIN_BUDGET_ITERS = 5
SDPA_BACKENDS = (("sdpa_flash", "FLASH_ATTENTION"), ("sdpa_cudnn", "CUDNN_ATTENTION"),
                 ("sdpa_efficient", "EFFICIENT_ATTENTION"))
SPACEFUSION = "spacefusion"

# ---- pure arithmetic (tested on CPU) -----------------------------------------------------------


def tflops(flops: float, us: float) -> float:
    """TFLOP/s of ``flops`` done in ``us`` microseconds."""
    return flops / us / 1e6


def gbps(nbytes: float, us: float) -> float:
    """GB/s (1e9 bytes) of ``nbytes`` moved in ``us`` microseconds."""
    return nbytes / us / 1e3


def roofline_fraction(roofline: str, flops: float, nbytes: float, us: float, peak_flops_per_s: float,
                      bandwidth_bytes_per_s: float) -> float:
    """Achieved fraction of the roof: FLOP/s over peak ("compute") or bytes/s over bandwidth ("memory")."""
    seconds = us * 1e-6
    if roofline == "compute":
        return flops / seconds / peak_flops_per_s
    if roofline == "memory":
        return nbytes / seconds / bandwidth_bytes_per_s
    raise ValueError(f"roofline must be one of {hwl.ROOFLINES}, got {roofline!r}")


def _timed(row: Mapping[str, Any]) -> bool:
    us = row.get("median_us")
    return row.get("status") == "ok" and isinstance(us, int | float) and us > 0


def speedups(rows: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """Per workload with a timed spacefusion row: {baseline: baseline_us / spacefusion_us}.

    Baselines are the workload's other timed rows, plus the timed rows of workloads that are its
    reference rows (``reference_for``), named ``<that workload>_<system>`` (e.g. ``gemm_eager``).
    """
    rows = list(rows)
    sf = {r["workload"]: float(r["median_us"]) for r in rows if r.get("system") == SPACEFUSION and _timed(r)}
    out: dict[str, dict[str, float]] = {k: {} for k in sf}
    for r in rows:
        if r.get("system") == SPACEFUSION or not _timed(r):
            continue
        if r["workload"] in sf:
            out[r["workload"]][r["system"]] = float(r["median_us"]) / sf[r["workload"]]
        target = r.get("reference_for")
        if target in sf:
            out[target][f"{r['workload']}_{r['system']}"] = float(r["median_us"]) / sf[target]
    return out


def attach_speedups(rows: list[dict[str, Any]]) -> None:
    """Put ``speedups`` (a dict, possibly empty) into every spacefusion row, in place."""
    table = speedups(rows)
    for r in rows:
        if r.get("system") == SPACEFUSION:
            r["speedups"] = table.get(r["workload"], {})


def add_metrics(row: dict[str, Any], w: hwl.Workload, peak_flops_per_s: float | None,
                bandwidth_bytes_per_s: float | None) -> dict[str, Any]:
    """Fill tflops / gbps / perf / roofline_fraction of a timed row (None where not timed or no peak)."""
    row.update(tflops=None, gbps=None, perf=None, perf_unit="TFLOP/s" if w.roofline == "compute" else "GB/s",
               roofline_fraction=None)
    if not _timed(row):
        return row
    us = float(row["median_us"])
    row["tflops"], row["gbps"] = tflops(w.flops, us), gbps(w.nbytes, us)
    row["perf"] = row["tflops"] if w.roofline == "compute" else row["gbps"]
    peak = peak_flops_per_s if w.roofline == "compute" else bandwidth_bytes_per_s
    if peak:
        row["roofline_fraction"] = roofline_fraction(w.roofline, w.flops, w.nbytes, us, peak_flops_per_s or 1.0,
                                                     bandwidth_bytes_per_s or 1.0)
    return row


def budget_iters(first_launch_s: float, warmup: int, iters: int, budget_s: float | None) -> tuple[int, int]:
    """(warmup, iters) so that a kernel taking ``first_launch_s`` a launch fits ``budget_s`` (at least 5 runs)."""
    if budget_s is None or first_launch_s * (warmup + iters) <= budget_s:
        return warmup, iters
    n = max(MIN_BUDGET_ITERS, min(iters, int(budget_s / max(first_launch_s, 1e-6))))
    return max(1, min(warmup, n // 3)), n


# ---- rows, CSV, JSON -------------------------------------------------------------------------------

CSV_COLUMNS = ("workload", "label", "shape", "dtype", "system", "status", "max_abs_err", "rtol", "atol",
               "median_us", "p10_us", "p90_us", "spread", "iters", "warmup", "roofline", "perf", "perf_unit",
               "tflops", "gbps", "roofline_fraction", "flops", "bytes", "first_call_s", "backend", "artefact", "error")


def new_row(w: hwl.Workload, system: str) -> dict[str, Any]:
    return {
        "workload": w.key, "label": w.label, "shape": dict(w.shape), "dtype": w.dtype, "system": system,
        "status": None, "error": None, "max_abs_err": None, "rtol": None, "atol": None, "median_us": None,
        "p10_us": None, "p90_us": None, "iters": None, "warmup": None, "roofline": w.roofline, "flops": w.flops,
        "bytes": w.nbytes, "reference_for": w.reference_for,
    }


def _cell(value: Any) -> Any:
    if isinstance(value, dict):
        return " ".join(f"{k}={v}" for k, v in value.items())
    if isinstance(value, str):
        return value.splitlines()[0] if value else value
    return "" if value is None else value


def csv_table(rows: list[dict[str, Any]]) -> tuple[list[str], list[dict[str, Any]]]:
    """CSV header and records: CSV_COLUMNS then one ``speedup_vs_<system>`` column per baseline seen."""
    extra: list[str] = []
    for r in rows:
        for name in r.get("speedups") or {}:
            if f"speedup_vs_{name}" not in extra:
                extra.append(f"speedup_vs_{name}")
    header = [*CSV_COLUMNS, *extra]
    out = []
    for r in rows:
        rec = {c: _cell(r.get(c)) for c in CSV_COLUMNS}
        for name, v in (r.get("speedups") or {}).items():
            rec[f"speedup_vs_{name}"] = v
        out.append({c: rec.get(c, "") for c in header})
    return header, out


def _clean(obj: Any) -> Any:
    """JSON-safe: non-finite floats become None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    return obj


def write_results(result: dict[str, Any], out: Path, csv_path: Path | None) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_clean(result), indent=2, allow_nan=False) + "\n")
    if csv_path is not None:
        csv_path.parent.mkdir(parents=True, exist_ok=True)
        header, records = csv_table(result["rows"])
        with csv_path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=header)
            writer.writeheader()
            writer.writerows(_clean(records))


def _fmt(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_table(rows: list[dict[str, Any]]) -> str:
    """A readable table: one line per workload x system, errors on the next line."""
    head = (f"{'workload':<13} {'system':<14} {'status':<13} {'max_err':>8} {'median_us':>11} "
            f"{'p10-p90_us':>19} {'perf':>14} {'roof%':>6}  speedups (baseline_us/spacefusion_us)")
    lines = [head, "-" * len(head)]
    for r in rows:
        spread = "-" if r.get("p10_us") is None else f"{r['p10_us']:.1f}-{r['p90_us']:.1f}"
        perf = "-" if r.get("perf") is None else f"{r['perf']:.1f} {r['perf_unit']}"
        frac = r.get("roofline_fraction")
        sp = ", ".join(f"{k} x{v:.3g}" for k, v in (r.get("speedups") or {}).items())
        lines.append(f"{r['workload']:<13} {r['system']:<14} {str(r.get('status'))[:13]:<13} "
                     f"{_fmt(r.get('max_abs_err'), '.1e'):>8} {_fmt(r.get('median_us'), '.1f'):>11} {spread:>19} "
                     f"{perf:>14} {_fmt(None if frac is None else 100 * frac, '.1f'):>6}  {sp}")
        if r.get("error") and r.get("status") not in ("ok",):
            lines.append(f"{'':<13}   {r['error'].splitlines()[0][:150]}")
    return "\n".join(lines)


# ---- the hardware model ----------------------------------------------------------------------------






def load_hardware_module() -> ModuleType:
    """``schedulers.hardware`` (stdlib only: it imports none of the schedulers' sympy or islpy)."""
    import importlib

    return importlib.import_module("schedulers.hardware")


def hardware_info(dtype: str = "float16") -> dict[str, Any]:
    """The hardware model: ``from_device()`` when it knows a peak for ``dtype``, else the H100 preset."""
    hw = load_hardware_module()
    info: dict[str, Any] = {}
    try:
        model = hw.from_device()
        model.peak_flops(dtype, tensor_core=True)
        info["from_device"] = True
    except Exception as exc:  # no device query, or no preset behind it (no FLOP peaks)
        model = hw.H100
        info.update(from_device=False, fallback_reason=f"{type(exc).__name__}: {exc}")
    info.update(name=model.name, arch=model.arch, num_sms=model.num_sms, dtype=dtype,
                peak_flops_per_s=model.peak_flops(dtype, tensor_core=True),
                dram_bandwidth_bytes_per_s=model.dram_bandwidth_bytes_per_s, source=model.source)
    return info


# ---- systems -----------------------------------------------------------------------------------------


class Unavailable(Exception):
    """A system that cannot run here, with the row status to report ("no artefact", "not installed", ...)."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class System:
    """``make()`` returns (fn, post, info): ``fn()`` launches and returns the output; ``post`` maps it to
    the reference layout (or None); ``info`` goes into the row.  ``budgeted``: --sf-budget-s applies."""

    name: str
    make: Callable[[], tuple[Callable[[], Any], Callable[[Any], Any] | None, dict[str, Any]]]
    budgeted: bool = False


def torch_function(w: hwl.Workload) -> Callable[..., Any]:
    """The workload as PyTorch eager writes it (HuggingFace style, unfused), on tensors in ``w.inputs`` order."""
    import torch
    import torch.nn.functional as F

    if w.kind == "attention":
        scale, causal = w.scale, w.causal
        m, l = w.shape["m"], w.shape["l"]  # noqa: E741
        mask = torch.ones(m, l, dtype=torch.bool, device="cuda").triu(1) if causal else None

        def attention(q: Any, k: Any, v: Any) -> Any:
            s = q @ k.transpose(-2, -1) * scale
            if mask is not None:
                s = s.masked_fill(mask, float("-inf"))
            return torch.softmax(s, dim=-1) @ v

        return attention
    if w.kind == "softmax_gemm":
        return lambda s, v: torch.softmax(s, dim=-1) @ v
    if w.kind == "residual_layernorm":
        n = w.shape["n"]
        return lambda x, r, wt, b: F.layer_norm(x + r, (n,), wt, b, eps=1e-5)
    if w.kind == "gemm_sigmoid":
        return lambda a, b, bias: torch.sigmoid(a @ b + bias)
    return lambda a, b: a @ b


def spacefusion_system(w: hwl.Workload, x: Mapping[str, Any], folder: Path | None) -> System:
    def make() -> tuple[Callable[[], Any], None, dict[str, Any]]:
        import torch

        if folder is None:
            raise Unavailable(hwl.NO_ARTEFACT, f"no artefact given matches {w.key} ({w.kind} {w.shape_str})")
        artefact_mod, gpu = runtime_module("artefact"), runtime_module("gpu")
        art = artefact_mod.KernelArtefact.load(folder)
        want = {**w.inputs, **w.outputs}
        got = {p.name: p.shape for p in (*art.inputs, *art.outputs)}  # scratch: the launcher's
        if got != want:
            raise ValueError(f"{folder}: params {got} are not the workload's {want}")
        kernel = gpu.CudaKernel(art)
        info = {"artefact": str(folder), "kernel_name": art.kernel_name, "grid": list(art.grid),
                "block": list(art.block), "backend": kernel.compile()}
        # NaN-filled outputs: any element the kernel never writes fails the check.
        outs = {p.name: torch.full(p.shape, math.nan, dtype=gpu.torch_dtype(p.dtype), device="cuda")
                for p in art.outputs}
        ins = {n: x[n] for n in w.inputs}
        out = outs[w.output]

        def fn() -> Any:
            kernel.launch(ins, outs)
            return out

        return fn, None, info

    return System(SPACEFUSION, make, budgeted=True)


def baseline_systems(w: hwl.Workload, x: Mapping[str, Any], use_compile: bool) -> list[System]:
    """eager, torch.compile, and for attention the SDPA backends and flash_attn."""
    import torch

    args = [x[n] for n in w.inputs]
    f = torch_function(w)

    def eager() -> Any:
        return f(*args)

    systems = [System("eager", lambda: (eager, None, {}))]

    def make_compiled() -> tuple[Callable[[], Any], None, dict[str, Any]]:
        if not use_compile:
            raise Unavailable("skipped", "--no-compile")
        return torch.compile(eager), None, {}

    systems.append(System("torch.compile", make_compiled))
    if w.kind != "attention":
        return systems

    q, k, v = args
    for name, backend_name in SDPA_BACKENDS:
        def make_sdpa(backend_name: str = backend_name) -> tuple[Callable[[], Any], None, dict[str, Any]]:
            import torch.nn.functional as F
            from torch.nn.attention import SDPBackend, sdpa_kernel

            backend = getattr(SDPBackend, backend_name)

            def sdpa() -> Any:
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=w.causal, scale=w.scale)

            return sdpa, None, {"backend": backend_name}

        systems.append(System(name, make_sdpa))

    def make_flash() -> tuple[Callable[[], Any], Callable[[Any], Any], dict[str, Any]]:
        try:
            import flash_attn
            from flash_attn import flash_attn_func
        except ImportError as exc:
            raise Unavailable("not installed", f"flash_attn is not importable ({exc})") from None
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # (b, seq, h, d), outside the timing

        def fa() -> Any:
            return flash_attn_func(qt, kt, vt, softmax_scale=w.scale, causal=w.causal)

        return fa, (lambda o: o.transpose(1, 2)), {"version": getattr(flash_attn, "__version__", None)}

    systems.append(System("flash_attn", make_flash))
    return systems


# ---- running ------------------------------------------------------------------------------------------


@dataclass
class Settings:
    warmup: int = 10
    iters: int = 100
    sf_budget_s: float | None = None
    seed: int = 0
    use_compile: bool = True
    flush: str = "read"
    repeats: int = 1


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def check_system(w: hwl.Workload, system: System, ref: Any, cfg: Settings) -> tuple[dict[str, Any],
                                                                                     Callable[[], Any] | None]:
    """Build ``system`` and check one run against the reference (smg/tolerance.py's rule, for the workload's
    dtype and reduction length; BASELINE_SLACK times it for systems other than spacefusion); its row, and the
    function to time only if it matched (None otherwise: the row says why).  Never raises."""
    import torch

    row = new_row(w, system.name)
    try:
        fn, post, info = system.make()
        row.update(info)
    except Unavailable as u:
        row.update(status=u.status, error=str(u))
        return row, None
    except Exception as exc:
        row.update(status="error", error=f"setup: {_error(exc)}", traceback=traceback.format_exc())
        return row, None
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()  # also compiles torch.compile, outside the timing
        torch.cuda.synchronize()
        row["first_call_s"] = time.perf_counter() - t0
        got = post(out) if post is not None else out
        check = compare_tensors(got.reshape(ref.shape), ref, w.dtype, w.reduction_length, name=w.output,
                                baseline=system.name != SPACEFUSION)
        del out, got
    except Exception as exc:
        row.update(status="error", error=f"run: {_error(exc)}", traceback=traceback.format_exc())
        return row, None
    row.update(max_abs_err=check.max_abs_err, rtol=check.tolerance.rtol, atol=check.atol)
    if not check.ok:
        row.update(status="failed", error=f"numerics: {check.problem}")
        return row, None
    row["warmup"], row["iters"] = cfg.warmup, cfg.iters
    if system.budgeted:
        row["warmup"], row["iters"] = budget_iters(row["first_call_s"], cfg.warmup, cfg.iters, cfg.sf_budget_s)
    return row, fn


def time_system(row: dict[str, Any], fn: Callable[[], Any], cfg: Settings) -> None:
    """One timing of a checked system (``row["warmup"]`` + ``row["iters"]`` runs) added to its row."""
    timing = runtime_module("timing")
    try:
        t = timing.time_cuda(fn, warmup=row["warmup"], iters=row["iters"], flush=cfg.flush)
    except Exception as exc:
        row.update(status="error", error=f"timing: {_error(exc)}", traceback=traceback.format_exc())
        return
    row.setdefault("repeats", []).append(t.as_dict())


def summarize_repeats(row: dict[str, Any]) -> None:
    """The row's time from its repeats: the median of their medians, with the 10th/90th
    percentiles of the middle repeat (a slow spell in another repeat stays out of them);
    ``spread`` is the slowest repeat's median over the fastest's."""
    reps = row.get("repeats")
    if row.get("status") not in (None, "ok") or not reps:
        return
    ranked = sorted(reps, key=lambda r: r["median_us"])
    n = len(ranked)
    mids = ranked[(n - 1) // 2: n // 2 + 1]  # one repeat, or the two middle ones
    median = sum(r["median_us"] for r in mids) / len(mids)
    middle = ranked[(n - 1) // 2]
    row.update(status="ok", median_us=median, p10_us=middle["p10_us"], p90_us=middle["p90_us"],
               spread=ranked[-1]["median_us"] / ranked[0]["median_us"])
    if n == 1:
        row.pop("repeats")
        row.pop("spread")


def run_workload(w: hwl.Workload, folder: Path | None, cfg: Settings, hw: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Inputs, fp32 reference and every system's row for one workload; a failure here becomes one row."""
    import torch

    torch._dynamo.reset()  # fresh compile caches: no recompiles or dynamic shapes carried between workloads
    rows: list[dict[str, Any]] = []
    try:
        gen = torch.Generator(device="cuda").manual_seed(cfg.seed)
        x = {n: torch.randn(s, generator=gen, device="cuda", dtype=torch.float32).to(getattr(torch, w.dtype))
             for n, s in w.inputs.items()}
        f = torch_function(w)
        with torch.no_grad():
            ref = f(*[x[n].float() for n in w.inputs]).reshape(w.outputs[w.output])
        torch.cuda.synchronize()
        systems = [] if not w.wants_artefact else [spacefusion_system(w, x, folder)]
        systems += baseline_systems(w, x, cfg.use_compile)
    except Exception as exc:
        row = new_row(w, "(setup)")
        row.update(status="error", error=f"setup: {_error(exc)}", traceback=traceback.format_exc())
        return [row]
    with torch.no_grad():
        checked = [check_system(w, system, ref, cfg) for system in systems]
        for _ in range(cfg.repeats):  # the systems take turns, so a slow spell hits one repeat of each
            for row, fn in checked:
                if fn is not None and row.get("status") != "error":
                    time_system(row, fn, cfg)
        for row, _ in checked:
            summarize_repeats(row)
            rows.append(add_metrics(row, w, hw.get("peak_flops_per_s"), hw.get("dram_bandwidth_bytes_per_s")))
            status = row["status"] if row["status"] == "ok" else f"{row['status']}: {row.get('error')}"
            us = "" if row.get("median_us") is None else f" {row['median_us']:.1f} us"
            print(f"  {w.key:<13} {row['system']:<14} {status}{us}", flush=True)
        del checked
    del x, ref
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def environment() -> dict[str, Any]:
    """Device and library versions."""
    import torch

    env: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "device_capability": list(torch.cuda.get_device_capability()),
        "device_memory_bytes": torch.cuda.get_device_properties(0).total_memory,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
    }
    for name in ("triton", "cupy", "flash_attn"):
        try:
            env[name] = importlib.import_module(name).__version__
        except Exception:
            env[name] = None
    try:
        import cupy

        env["cuda_driver"] = cupy.cuda.runtime.driverGetVersion()
    except Exception:
        env["cuda_driver"] = None
    return env


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artefacts", nargs="*", type=Path,
                        help="spacefusion artefact folders, or folders of them (matched to workloads by kernel.json)")
    parser.add_argument("--out", type=Path, default=Path("harness.json"), help="JSON results file")
    parser.add_argument("--csv", type=Path, default=None, help="CSV results file (default: --out with .csv)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=100, help="timed runs per system (median reported)")
    parser.add_argument("--workloads", nargs="+", default=None, choices=list(hwl.BY_KEY), metavar="KEY",
                        help=f"run only these workloads (default: all): {', '.join(hwl.BY_KEY)}")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile (slow to build)")
    parser.add_argument("--sf-budget-s", type=float, default=None,
                        help="seconds of timing per spacefusion kernel; slow kernels get fewer runs (at least "
                             f"{MIN_BUDGET_ITERS}); baselines always get --iters")
    parser.add_argument("--repeats", type=int, default=1,
                        help="time every system this many times, the systems of a workload taking turns; rows "
                             "report the median of the repeats' medians and their spread (slowest/fastest)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--flush", choices=("read", "write"), default="read",
                        help="L2 flush between timed runs: read a buffer twice the L2 (clean lines, default) "
                             "or zero it (dirty lines whose write-back the timed kernel pays for)")
    parser.add_argument("--note", default=None, help="free text for the JSON (where the artefacts came from, ...)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    csv_path = args.csv if args.csv is not None else args.out.with_suffix(".csv")
    workloads = hwl.select(args.workloads)
    chosen, unused = hwl.match_artefacts(workloads, hwl.artefact_folders(args.artefacts))

    import torch

    if not torch.cuda.is_available():
        print("no CUDA device visible to torch", file=sys.stderr)
        return 2
    # Full-precision fp32 matmuls for the references (fp16 systems are unaffected).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    cfg = Settings(warmup=args.warmup, iters=args.iters, sf_budget_s=args.sf_budget_s, seed=args.seed,
                   use_compile=not args.no_compile, flush=args.flush, repeats=args.repeats)
    hw = hardware_info("float16")
    env = environment()
    result: dict[str, Any] = {
        "format": "spacefusion-harness/1",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]) if argv is None else shlex.join(argv),
        **env,
        "hardware_model": hw,
        "timing": {"timer": "spacefusion.runtime.timing.time_cuda", "stat": "median of CUDA events",
                   "flush_l2": True, "flush": cfg.flush, "warmup": cfg.warmup, "iters": cfg.iters,
                   "sf_budget_s": cfg.sf_budget_s, "sf_min_iters": MIN_BUDGET_ITERS, "repeats": cfg.repeats},
        "seed": cfg.seed,
        "note": args.note,
        "check": {"reference": "float32 torch on the same inputs, TF32 off", "rule": tolerance_module().RULE,
                  "baseline_slack": tolerance_module().BASELINE_SLACK, "rule_source": "smg/tolerance.py"},
        "workloads": [w.describe() for w in workloads],
        "artefacts": {k: None if p is None else str(p) for k, p in chosen.items()},
        "unused_artefacts": unused,
        "complete": False,
        "rows": [],
    }
    print(f"device: {env['device']}  torch {env['torch']}  cuda {env['cuda']}  cudnn {env['cudnn']}  "
          f"triton {env['triton']}  cupy {env['cupy']}  flash_attn {env['flash_attn']}")
    print(f"hardware model: {hw['name']} (from_device={hw['from_device']}), peak fp16 "
          f"{hw['peak_flops_per_s'] / 1e12:.1f} TFLOP/s, DRAM {hw['dram_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s",
          flush=True)
    rows: list[dict[str, Any]] = result["rows"]
    for w in workloads:
        try:
            rows.extend(run_workload(w, chosen.get(w.key), cfg, hw))
        except Exception as exc:  # belt and braces: run_workload catches its own failures
            row = new_row(w, "(workload)")
            row.update(status="error", error=_error(exc), traceback=traceback.format_exc())
            rows.append(row)
        attach_speedups(rows)
        write_results(result, args.out, csv_path)
    result["complete"] = True
    write_results(result, args.out, csv_path)
    print()
    print(format_table(rows))
    print(f"wrote {args.out} and {csv_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
