#!/usr/bin/env python3
"""RMSNorm as the prologue of the next GEMM (``rmsnorm(x) @ W.T``, W [n, k] as ``nn.Linear`` stores it) against
torch's separate RMSNorm and cuBLAS GEMM.

Two steps, two machines:

    python experiments/norm_gemm.py build ART                 # where TVM runs: lower the candidates
    python experiments/norm_gemm.py run ART --out R.json      # on the GPU (torch + cupy, no TVM)

``build`` lowers, for each shape, the fused SMG the frontend builds (``patterns.gemm_epilogue(..., "nk",
norm="rmsnorm")``: the norm's weight folded into W once) as the analytical model's first pick and the next
distinct picks it ranks, and the same GEMM with the norm's weight kept apart (``norm_weight=True``: the form
the Builder API gives ``rmsnorm(x, g) @ W.T``), each into ``ART/<shape>/<label>`` with a cubin, and
``ART/<shape>/manifest.json``.  ``run`` checks every system against a float32 torch reference
(``smg/tolerance.py``'s rule), then times the ones that match with CUDA events (CUDA-graph replays, warm-up,
median, L2 flushed by a read between runs, the systems taking turns): the fused kernels, torch's
``F.rms_norm`` then ``F.linear`` (cuBLAS), LLaMA's RMSNorm written in ops then ``F.linear``, and cuBLAS's
GEMM alone (the floor the fusion approaches: it reads x once and writes nothing else).
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
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

FORMAT = "spacefusion-norm-gemm/1"
#: shape -> (rows, k, n, eps): Qwen2-0.5B's q (and o) and gate/up projections at 1024 tokens and decoding 8,
#: LLaMA-2-7B's q at 2048 tokens
SHAPES: dict[str, tuple[int, int, int, float]] = {
    "qwen2_q_1024": (1024, 896, 896, 1e-6),
    "qwen2_up_1024": (1024, 896, 4864, 1e-6),
    "qwen2_q_decode8": (8, 896, 896, 1e-6),
    "qwen2_up_decode8": (8, 896, 4864, 1e-6),
    "llama7b_q_2048": (2048, 4096, 4096, 1e-6),
}
DTYPE = "float16"
RANKED = 3  # distinct configurations from the top of the model's order (the first pick among them)
FLUSH = "read"


# ---- build (where TVM runs) -----------------------------------------------------------------------


def smg_of(key: str, weight: bool = False) -> Any:
    """The fused SMG of a shape: the norm's weight folded into W (the frontend's), or kept apart."""
    from spacefusion.api import patterns

    m, k, n, eps = SHAPES[key]
    return patterns.gemm_epilogue(m, n, k, "none", False, DTYPE, "nk", norm="rmsnorm", norm_weight=weight, eps=eps)


def distinct_picks(smg: Any, hw: Any, count: int, first: Any = None) -> list[tuple[str, Any]]:
    """(label, schedule): ``first`` (default: the top of the model's order for ``hw``) as "first", then the
    next configurations of that order that differ from every one before in a knob that changes the kernel
    (tiles, step, stages, warps, slices, wgmma, TMA, producer, persistence, lanes), as "ranked1", ..., up to
    ``count`` in all: candidates that are not the same kernel under another key."""
    from spacefusion.api import candidates as ranked

    def sig(s: Any) -> tuple:
        return s.block, s.step, s.stages, s.warps, s.slices, s.wgmma, s.tma, s.producer, s.persistent, s.lanes

    for head in (8 * count, None):  # the head of the order is quicker to rank, and usually holds them
        out: list[tuple[str, Any]] = [("first", first)] if first is not None else []
        seen = {sig(first)} if first is not None else set()
        for s in ranked(smg, hw, head=head):
            if len(out) >= count:
                break
            if sig(s) not in seen:
                seen.add(sig(s))
                out.append(("first" if not out else f"ranked{len(out)}", s))
        if len(out) >= count:
            break
    return out


def candidates(key: str) -> list[tuple[str, Any]]:
    """(label, schedule): the first distinct picks of the folded form, then the first pick of the other."""
    from spacefusion.api import H100
    from spacefusion.api import candidates as ranked

    return [*distinct_picks(smg_of(key), H100, RANKED),
            ("weight_apart", ranked(smg_of(key, weight=True), H100, head=1)[0])]


def build(art: Path, keys: list[str]) -> int:
    from unseen_shapes import _knobs

    from spacefusion.api import H100, estimate
    from spacefusion.api import build as lower

    for key in keys:
        t0 = time.perf_counter()
        folder = art / key
        rows = []
        for label, s in candidates(key):
            sched = json.loads(s.to_json())
            row: dict[str, Any] = {"label": label, "schedule_key": s.key, "estimate_us": round(estimate(s, H100), 2),
                                   "blocks": s.num_blocks, "threads": s.threads, "artefact": label,
                                   "weight_apart": label == "weight_apart", "knobs": _knobs(sched)}
            try:
                lower(s, "cuda:sm_90a").save(folder / label, compile_cubin=True)
            except Exception as exc:  # the others still get built; the run skips this one
                row.update(artefact=None, error=f"{type(exc).__name__}: {exc}"[:600])
            rows.append(row)
            print(f"{key}/{label}: {row['estimate_us']} us, {s.num_blocks} x {s.threads}, {row['knobs']}", flush=True)
        m, k, n, eps = SHAPES[key]
        manifest = {"format": FORMAT, "shape": {"key": key, "rows": m, "k": k, "n": n, "eps": eps, "dtype": DTYPE},
                    "build_s": round(time.perf_counter() - t0, 1), "candidates": rows}
        (folder / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return 0


# ---- run (GPU: torch + cupy, no TVM) ----------------------------------------------------------------


def _inputs(shape: dict[str, Any], seed: int) -> dict[str, Any]:
    """x, W [n, k] and the norm's weight g ~ 1 + 0.1 N(0, 1), in fp16 on the GPU."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    m, k, n = shape["rows"], shape["k"], shape["n"]
    return {"x": torch.randn(m, k, generator=gen, device="cuda").half(),
            "W": (torch.randn(n, k, generator=gen, device="cuda") / k ** 0.5).half(),
            "g": (1 + 0.1 * torch.randn(k, generator=gen, device="cuda")).half()}


def reference(x: dict[str, Any], eps: float) -> Any:
    """``rmsnorm(x) * g @ W.T`` in float32."""
    import torch

    h = x["x"].float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * x["g"].float()
    return h @ x["W"].float().t()


def _torch_systems(x: dict[str, Any], eps: float) -> dict[str, Any]:
    """The unfused baselines (cuBLAS's GEMM alone reads x as the fused kernel does, normalising nothing)."""
    import torch
    import torch.nn.functional as F

    k = x["x"].shape[-1]

    def llama() -> Any:  # transformers' LlamaRMSNorm: fp32 statistics, the weight applied in the input dtype
        h = x["x"].float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return F.linear(x["g"] * h.to(x["x"].dtype), x["W"])

    return {"torch_rms_norm+linear": lambda: F.linear(F.rms_norm(x["x"], (k,), x["g"], eps=eps), x["W"]),
            "llama_rmsnorm+linear": llama,
            "cublas_linear_alone": lambda: F.linear(x["x"], x["W"])}


def _kernel_fn(folder: Path, ins: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    """Launch closure of an artefact, its NaN-filled output, and its launch configuration."""
    import math

    import torch
    from gpu_runtime import runtime_module

    artefact_mod, gpu = runtime_module("artefact"), runtime_module("gpu")
    kernel = gpu.CudaKernel(artefact_mod.KernelArtefact.load(folder))
    info = {"backend": kernel.compile(), "grid": list(kernel.artefact.grid), "block": list(kernel.artefact.block)}
    args = {p.name: ins[p.name].view(p.shape) for p in kernel.artefact.inputs}
    outs = {p.name: torch.full(p.shape, math.nan, dtype=gpu.torch_dtype(p.dtype), device="cuda")
            for p in kernel.artefact.outputs}
    return (lambda: kernel.launch(args, outs)), outs["Y"], info


def _check(got: Any, ref: Any, k: int, baseline: bool = False) -> float:
    """Max abs error against the float32 reference; raises where ``smg/tolerance.py``'s rule fails."""
    from gpu_runtime import compare_tensors

    c = compare_tensors(got, ref, DTYPE, k, "Y", baseline)
    if not c.ok:
        raise ValueError(c.problem)
    return c.max_abs_err


def run(art: Path, out_path: Path, keys: list[str], warmup: int, iters: int, repeats: int) -> int:
    import torch

    result: dict[str, Any] = {"format": FORMAT, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "warmup": warmup, "iters": iters,
                              "repeats": repeats, "l2_flush": FLUSH, "shapes": []}
    for key in keys:
        manifest = json.loads((art / key / "manifest.json").read_text())
        shape = manifest["shape"]
        x = _inputs(shape, 0)
        ref, k = reference(x, shape["eps"]), shape["k"]
        folded = (x["W"].float() * x["g"].float()).half()  # the frontend's fold, once (not timed)
        rows: list[dict[str, Any]] = []
        for c in manifest["candidates"]:
            row = {"system": "spacefusion", **{f: c.get(f) for f in ("label", "estimate_us", "knobs", "schedule_key",
                                                                     "blocks", "threads")}}
            ins = {"A": x["x"], "Bw": x["W"], "Gn": x["g"]} if c.get("weight_apart") else {"A": x["x"], "Bw": folded}
            try:
                if not c.get("artefact"):
                    raise ValueError(c.get("error") or "no artefact")
                fn, out, info = _kernel_fn(art / key / c["artefact"], ins)
                fn()
                torch.cuda.synchronize()
                row.update(info, max_abs_err=_check(out, ref, k), fn=fn)
            except Exception as exc:
                row.update(status="error", error=f"{type(exc).__name__}: {exc}"[:600])
            rows.append(row)
        for name, fn in _torch_systems(x, shape["eps"]).items():
            row = {"system": name}
            try:
                got = fn()
                torch.cuda.synchronize()
                err = None if name == "cublas_linear_alone" else _check(got, ref, k, baseline=True)
                row.update(max_abs_err=err, fn=fn)
            except Exception as exc:
                row.update(status="error", error=f"{type(exc).__name__}: {exc}"[:600])
            rows.append(row)
        time_rows(rows, warmup, iters, repeats)
        result["shapes"].append({"shape": shape, "rows": rows})
        print(format_shape(shape, rows), flush=True)
        out_path.write_text(json.dumps(result, indent=1) + "\n")
    return 0


def time_rows(rows: list[dict[str, Any]], warmup: int, iters: int, repeats: int) -> None:
    """Time every row that holds a checked launch closure ``fn`` (popped): each captured into a CUDA graph (the
    runtime's Python launch would outlast these kernels), then ``repeats`` rounds in which the rows take
    turns, each round ``iters`` CUDA-event runs with L2 flushed by a read (``FLUSH``); a row gets
    ``medians_us`` (one per round), ``median_us`` (their median) and status "ok"."""
    import torch
    from e2e_gpu import _graphed
    from gpu_runtime import runtime_module

    timing = runtime_module("timing")
    with torch.no_grad():
        for row in rows:
            if "fn" in row:
                row["fn"] = _graphed(row["fn"], ())
        for _ in range(repeats):  # the systems take turns
            for row in rows:
                if "fn" in row:
                    t = timing.time_cuda(row["fn"], warmup=warmup, iters=iters, flush=FLUSH)
                    row.setdefault("medians_us", []).append(t.median_us)
    for row in rows:
        row.pop("fn", None)
        if row.get("medians_us"):
            row.update(status="ok", median_us=statistics.median(row["medians_us"]))


def format_shape(shape: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """One shape's systems, with the fused first pick's speed-up over torch's rms_norm + linear."""
    lines = [f"== {shape['key']} ({shape['rows']} x {shape['k']} -> {shape['n']})"]
    by = {r.get("label") or r["system"]: r.get("median_us") for r in rows}
    for r in rows:
        us = f"{r['median_us']:8.1f}" if r.get("median_us") else "       -"
        what = (f"{r.get('label')}: est {r.get('estimate_us')} us, {r.get('blocks')} x {r.get('threads')}, "
                f"{r.get('knobs')}" if r["system"] == "spacefusion" else "")
        lines.append(f"  {r['system']:<24} {us} us  {what}{'  ' + r['error'] if r.get('error') else ''}")
    if by.get("first") and by.get("torch_rms_norm+linear"):
        lines.append(f"  first pick vs torch rms_norm + linear: {by['torch_rms_norm+linear'] / by['first']:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from gpu_runtime import timing_args

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("art", type=Path)
    b.add_argument("--shapes", nargs="*", default=None, choices=list(SHAPES))
    r = sub.add_parser("run")
    r.add_argument("art", type=Path)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--shapes", nargs="*", default=None)
    timing_args(r)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "build":
            return build(a.art, a.shapes or list(SHAPES))
        keys = a.shapes or [k for k in SHAPES if (a.art / k / "manifest.json").is_file()]
        return run(a.art, a.out, keys, a.warmup, a.iters, a.repeats)
    except Exception:
        traceback.print_exc()
        return 2


if __name__ == "__main__":
    sys.exit(main())
