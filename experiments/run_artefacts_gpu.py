#!/usr/bin/env python3
"""Check and time kernel artefacts on a GPU machine that has torch + cupy but no TVM.

Usage (from the repo root):
    python experiments/run_artefacts_gpu.py ARTEFACT_DIR [ARTEFACT_DIR ...] --out results.json

For each artefact: seeded random inputs, a float32 torch reference, one launch checked against it
(smg/tolerance.py's rule), and, only if it matches, timings of the kernel and of torch
baselines measured in the same process; after the timed launches, one more launch on fresh inputs is checked
too (state kept between launches).

The runtime is imported as the package ``spacefusion.runtime``, which needs no TVM, islpy or xgboost.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # experiments/: the shared loader
from gpu_runtime import compare_tensors, runtime_module, tolerance_module  # noqa: E402

if str(REPO_ROOT) not in sys.path:  # smg (numpy + sympy, no TVM): the graph saved beside an artefact
    sys.path.insert(1, str(REPO_ROOT))


@dataclass
class Case:
    """What a workload needs checked: inputs, the fp32 reference of output ``output``, baselines."""

    inputs: dict[str, Any]
    output: str
    reference: Any
    baselines: dict[str, Callable[[], Any]] = field(default_factory=dict)


def _require(art: Any, inputs: tuple[str, ...], output: str) -> None:
    roles = {p.name: p.role for p in art.params}
    for name in inputs:
        if roles.get(name) != "input":
            raise ValueError(f"workload {art.workload.get('name')!r} needs an input param {name!r}; got {roles}")
    if roles.get(output) != "output":
        raise ValueError(f"workload {art.workload.get('name')!r} needs an output param {output!r}; got {roles}")


def _random_inputs(art: Any, names: tuple[str, ...], seed: int) -> dict[str, Any]:
    import torch

    gpu = runtime_module("gpu")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    out = {}
    for name in names:
        p = art.param(name)
        dtype = gpu.torch_dtype(p.dtype)
        if not dtype.is_floating_point:
            raise ValueError(f"param {name!r}: random inputs only for float dtypes, got {p.dtype}")
        out[name] = torch.randn(p.shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)
    return out


def build_mha(art: Any, seed: int, use_compile: bool) -> Case:
    """O = softmax(Q @ K^T * scale) @ V, scale from the workload or 1/sqrt(d)."""
    import torch
    import torch.nn.functional as F

    _require(art, ("Q", "K", "V"), "O")
    x = _random_inputs(art, ("Q", "K", "V"), seed)
    q, k, v = x["Q"], x["K"], x["V"]
    scale = float(art.workload.get("scale", 1.0 / math.sqrt(q.shape[-1])))
    qf, kf, vf = q.float(), k.float(), v.float()
    ref = torch.softmax(qf @ kf.transpose(-2, -1) * scale, dim=-1) @ vf

    def eager() -> Any:
        return torch.softmax(q @ k.transpose(-2, -1) * scale, dim=-1) @ v

    baselines: dict[str, Callable[[], Any]] = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, scale=scale),
        "eager": eager,
    }
    if use_compile:
        baselines["torch.compile"] = torch.compile(eager)
    return Case(inputs=x, output="O", reference=ref, baselines=baselines)


def build_softmax_gemm(art: Any, seed: int, use_compile: bool) -> Case:
    """O = softmax(S, dim=-1) @ V."""
    import torch

    _require(art, ("S", "V"), "O")
    x = _random_inputs(art, ("S", "V"), seed)
    s, v = x["S"], x["V"]
    ref = torch.softmax(s.float(), dim=-1) @ v.float()

    def eager() -> Any:
        return torch.softmax(s, -1) @ v

    baselines: dict[str, Callable[[], Any]] = {"eager": eager}
    if use_compile:
        baselines["torch.compile"] = torch.compile(eager)
    return Case(inputs=x, output="O", reference=ref, baselines=baselines)


def _case(art: Any, seed: int, use_compile: bool, names: tuple[str, ...], output: str,
          fn: Callable[..., Any]) -> Case:
    """A pattern whose torch form is ``fn(*inputs)`` (run in fp32 for the reference)."""
    import torch

    _require(art, names, output)
    x = _random_inputs(art, names, seed)
    args = [x[n] for n in names]
    ref = fn(*[a.float() for a in args]).reshape(art.param(output).shape)

    def eager() -> Any:
        return fn(*args)

    baselines: dict[str, Callable[[], Any]] = {"eager": eager}
    if use_compile:
        baselines["torch.compile"] = torch.compile(eager)
    return Case(inputs=x, output=output, reference=ref, baselines=baselines)


def _params(art: Any) -> tuple[str, ...]:
    return tuple(p.name for p in art.params if p.role == "input")


def build_norm(art: Any, seed: int, use_compile: bool) -> Case:
    """LayerNorm / residual LayerNorm / RMSNorm / softmax over the last dim, as torch writes them."""
    import torch
    import torch.nn.functional as F

    name = art.workload["name"]
    n = art.param("Y").shape[-1]
    fns: dict[str, tuple[tuple[str, ...], Callable[..., Any]]] = {
        "layernorm": (("X", "W", "B"), lambda x, w, b: F.layer_norm(x, (n,), w, b, eps=1e-5)),
        "residual_layernorm": (("X", "R", "W", "B"), lambda x, r, w, b: F.layer_norm(x + r, (n,), w, b, eps=1e-5)),
        "rmsnorm": (("X", "W"), lambda x, w: F.rms_norm(x, (n,), w, eps=1e-6)),
        "softmax": (("X",), lambda x: torch.softmax(x, dim=-1)),
    }
    names, fn = fns[name]
    return _case(art, seed, use_compile, names, "Y", fn)


_ACTS = {"sigmoid": "sigmoid", "relu": "relu", "gelu": "gelu", "silu": "silu", "tanh": "tanh"}


def build_gemm_epilogue(art: Any, seed: int, use_compile: bool) -> Case:
    """``act(A @ Bw [+ bias])`` with torch's own GEMM and activation."""
    import torch.nn.functional as F

    name = art.workload["name"].removeprefix("gemm_")
    act = (lambda x: x) if name == "none" else getattr(F, _ACTS[name])
    if "bias" in _params(art):
        return _case(art, seed, use_compile, ("A", "Bw", "bias"), "Y", lambda a, b, c: act(a @ b + c))
    return _case(art, seed, use_compile, ("A", "Bw"), "Y", lambda a, b: act(a @ b))


def build_gemm_layernorm(art: Any, seed: int, use_compile: bool) -> Case:
    import torch.nn.functional as F

    n = art.param("Y").shape[-1]
    return _case(art, seed, use_compile, ("A", "Bw", "W", "Bn"), "Y",
                 lambda a, b, w, c: F.layer_norm(a @ b, (n,), w, c, eps=1e-5))


def build_mlp(art: Any, seed: int, use_compile: bool) -> Case:
    import torch.nn.functional as F

    return _case(art, seed, use_compile, ("X", "W1", "W2"), "Y", lambda x, w1, w2: F.gelu(x @ w1) @ w2)


def build_attention(art: Any, seed: int, use_compile: bool) -> Case:
    """Causal and/or grouped-query attention; SDPA gets the same mask and GQA layout.  The artefact's
    workload says the operands' layout (``layout``: bhsd unless recorded): a bshd kernel takes
    Q [b, m, kv_heads, (group), d], K/V [b, l, kv_heads, d] and writes O [b, m, kv_heads, (group), d],
    so the reference and SDPA see them through transposes, as HF's split_heads / merge_heads do."""
    import torch
    import torch.nn.functional as F

    meta = art.workload
    causal = meta.get("causal") == "True"
    scale = float(meta["scale"])
    bshd = meta.get("layout") == "bshd"
    qs, ks = art.param("Q").shape, art.param("K").shape
    if bshd:
        b, m, d, hq, hk = qs[0], qs[1], qs[-1], math.prod(qs[2:-1]), ks[2]
    else:
        b, m, d, hq, hk = qs[0], qs[-2], qs[-1], math.prod(qs[1:-2]), ks[1]

    def heads_first(q: Any, k: Any, v: Any) -> tuple[Any, Any, Any]:
        """Q [b, hq, m, d] and K/V [b, hk, l, d] (views)."""
        if bshd:
            return q.reshape(b, m, hq, d).transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        return q.reshape(b, hq, m, d), k, v

    def back(o: Any) -> Any:
        """[b, hq, m, d] in the kernel's O order (a view; the reference reshapes it to O's shape)."""
        return o.transpose(1, 2) if bshd else o

    def eager(q: Any, k: Any, v: Any) -> Any:
        q4, k4, v4 = heads_first(q, k, v)
        rep = hq // hk
        k4, v4 = k4.repeat_interleave(rep, dim=1), v4.repeat_interleave(rep, dim=1)
        s = q4 @ k4.transpose(-2, -1) * scale
        if causal:
            keep = torch.ones(m, k4.shape[2], dtype=torch.bool, device=q.device).tril()
            s = s.masked_fill(~keep, float("-inf"))
        return back(torch.softmax(s, dim=-1) @ v4)

    case = _case(art, seed, use_compile, ("Q", "K", "V"), "O", eager)
    q, k, v = (case.inputs[n] for n in ("Q", "K", "V"))
    case.baselines["sdpa"] = lambda: back(F.scaled_dot_product_attention(
        *heads_first(q, k, v), is_causal=causal, scale=scale, enable_gqa=hk != hq))
    return case


def build_vae_block(art: Any, seed: int, use_compile: bool) -> Case:
    """Upsample(2x nearest) -> Conv2d 3x3 pad 1 -> GroupNorm -> SiLU, as torch writes it."""
    import torch.nn.functional as F

    groups, cg, c_in = art.param("Wc").shape[:3]

    def chain(x: Any, wc: Any, gw: Any, gb: Any) -> Any:
        up = F.interpolate(x, scale_factor=2, mode="nearest")
        conv = F.conv2d(up, wc.reshape(groups * cg, c_in, 3, 3), padding=1)
        return F.silu(F.group_norm(conv, groups, gw.reshape(-1), gb.reshape(-1), eps=1e-6))

    return _case(art, seed, use_compile, ("In", "Wc", "gw", "gb"), "Out", chain)


def build_from_smg(art: Any, seed: int, use_compile: bool) -> Case:
    """A workload with no torch form here, checked against its own graph (``smg.json`` beside the
    artefact, ``smg.reference_torch``): every op unfused in fp32 for the reference, and in the inputs'
    dtype as the eager baseline (a gated GEMM's two GEMMs on cuBLAS, then the element-wise ops).  The
    inputs are scaled by ``input_scales`` so that long sums keep a 16-bit output finite (LLaMA's gated
    GEMM over k = 4096 of unit inputs reaches 1e5)."""
    import torch

    from spacefusion.api import SMG_FILE, evaluate_torch, input_scales, load_smg

    smg = load_smg(art.folder)
    if smg is None:
        raise ValueError(f"unsupported workload {art.workload.get('name')!r} and no {SMG_FILE} beside the "
                         f"artefact; known: {sorted(WORKLOADS)}")
    out, names, scales = smg.outputs[0], tuple(smg.inputs), input_scales(smg)
    _require(art, names, out)
    x = {n: (v.float() * scales[n]).to(v.dtype) for n, v in _random_inputs(art, names, seed).items()}

    def eager() -> Any:
        return evaluate_torch(smg, x)[out]

    ref = evaluate_torch(smg, {n: v.float() for n, v in x.items()})[out].reshape(art.param(out).shape)
    baselines: dict[str, Callable[[], Any]] = {"eager": eager}
    if use_compile:
        baselines["torch.compile"] = torch.compile(eager)
    return Case(inputs=x, output=out, reference=ref, baselines=baselines)


WORKLOADS: dict[str, Callable[[Any, int, bool], Case]] = {
    "vae_decoder_block": build_vae_block,
    "mha": build_mha,
    "softmax_gemm": build_softmax_gemm,
    "layernorm": build_norm,
    "residual_layernorm": build_norm,
    "rmsnorm": build_norm,
    "softmax": build_norm,
    "gemm_sigmoid": build_gemm_epilogue,
    "gemm_relu": build_gemm_epilogue,
    "gemm_none": build_gemm_epilogue,
    "gemm_tanh": build_gemm_epilogue,
    "gemm_gelu": build_gemm_epilogue,
    "gemm_silu": build_gemm_epilogue,
    "gemm_layernorm": build_gemm_layernorm,
    "mlp": build_mlp,
    "attention": build_attention,
}


def max_abs_err(out: Any, ref: Any) -> float:
    """Max |out - ref| in float32; NaN if any element is non-finite (e.g. never written)."""
    import torch

    diff = (out.float().reshape(ref.shape) - ref).abs()
    if not bool(torch.isfinite(diff).all()):
        return math.nan
    return float(diff.max())


def reduction_bound(art: Any) -> int:
    """An upper bound on the longest reduction of an artefact's workload: its inputs' largest dim (the
    ``K`` of the output check, smg/tolerance.py; it matters for fp32 outputs only)."""
    return max((n for p in art.inputs for n in p.shape), default=1)


def check(art: Any, out: Any, case: Case) -> Any:
    """``out`` (the kernel's output tensor) against ``case.reference`` under smg/tolerance.py's rule."""
    return compare_tensors(out, case.reference, art.param(case.output).dtype, reduction_bound(art), case.output)


def run_one(folder: Path, *, seed: int, warmup: int, iters: int, use_compile: bool,
            flush: str = "read") -> dict[str, Any]:
    """Check one artefact and, if it matches the reference, time it and its baselines."""
    import torch

    artefact_mod, gpu, timing = runtime_module("artefact"), runtime_module("gpu"), runtime_module("timing")
    art = artefact_mod.KernelArtefact.load(folder)
    name = art.workload.get("name")
    out_dtype = art.param("O").dtype if any(p.name == "O" for p in art.params) else art.outputs[0].dtype
    row: dict[str, Any] = {
        "path": str(folder),
        "kernel_name": art.kernel_name,
        "workload": name,
        "workload_shape": art.workload.get("shape"),
        "workload_meta": dict(art.workload),
        "shapes": {p.name: list(p.shape) for p in art.params},
        "dtypes": {p.name: p.dtype for p in art.params},
        "dtype": out_dtype,
        "grid": list(art.grid),
        "block": list(art.block),
        "dynamic_smem_bytes": art.dynamic_smem_bytes,
        "ok": False,
        "kernel": None,
        "baselines": {},
    }
    make_case = WORKLOADS.get(name, build_from_smg)
    case = make_case(art, seed, use_compile)
    out_spec = art.param(case.output)
    if tuple(case.reference.shape) != out_spec.shape:
        raise ValueError(f"reference shape {list(case.reference.shape)} != param O shape {list(out_spec.shape)}")

    kernel = gpu.CudaKernel(art)
    row["backend"] = kernel.compile()
    if kernel.compile_errors:
        row["compile_errors"] = kernel.compile_errors
    # NaN-filled outputs: any element the kernel fails to write shows up as a non-finite error.
    outputs = {
        p.name: torch.full(p.shape, math.nan, dtype=gpu.torch_dtype(p.dtype), device="cuda") for p in art.outputs
    }
    kernel.launch(case.inputs, outputs)
    torch.cuda.synchronize()
    first = check(art, outputs[case.output], case)
    row.update(max_abs_err=first.max_abs_err, rtol=first.tolerance.rtol, atol=first.atol, ok=first.ok)
    if not first.ok:
        row["error"] = f"numerics: {first.problem}"
        return row

    kern_t = timing.time_cuda(lambda: kernel.launch(case.inputs, outputs), warmup=warmup, iters=iters,
                               flush=flush)
    # after all those launches, fresh inputs must still come out right: state a kernel keeps between
    # launches (a sliced kernel's arrival counts) has to be left as the first launch found it
    again = make_case(art, seed + 1, False)
    fresh = {p.name: torch.full(p.shape, math.nan, dtype=gpu.torch_dtype(p.dtype), device="cuda")
             for p in art.outputs}
    kernel.launch(again.inputs, fresh)
    torch.cuda.synchronize()
    second = check(art, fresh[again.output], again)
    row["relaunch_max_abs_err"] = second.max_abs_err
    if not second.ok:
        row.update(ok=False, error=f"numerics after {warmup + iters} launches: {second.problem}")
        return row
    row["kernel"] = kern_t.as_dict()
    for bname, fn in case.baselines.items():
        entry: dict[str, Any] = {}
        try:
            got = fn()  # also triggers torch.compile outside the timed region
            torch.cuda.synchronize()
            berr = max_abs_err(got, case.reference)
            entry["max_abs_err"] = None if math.isnan(berr) else berr
            t = timing.time_cuda(fn, warmup=warmup, iters=iters, flush=flush)
            entry.update(t.as_dict(), ratio=t.median_us / kern_t.median_us)
        except Exception as exc:  # a failing baseline must not hide the kernel's result
            entry["error"] = f"{type(exc).__name__}: {exc}"
        row["baselines"][bname] = entry
    return row


def _fmt_us(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _fmt_err(row: dict[str, Any]) -> str:
    if "max_abs_err" not in row:
        return "-"
    err = row["max_abs_err"]
    return "nan" if err is None else f"{err:.2e}"


def print_table(rows: list[dict[str, Any]]) -> None:
    """One line per artefact; baselines as name=median_us (baseline/kernel ratio)."""
    cols = ("artefact", "workload", "dtype", "max_err", "ok", "backend", "kern_us")
    header = "{:<28} {:<13} {:<8} {:>9} {:<4} {:<7} {:>9}".format(*cols)
    print(header + "  baselines (us, baseline/kernel)")
    print("-" * (len(header) + 34))
    for r in rows:
        kern = (r.get("kernel") or {}).get("median_us")
        bases = []
        for b, e in r.get("baselines", {}).items():
            if "error" in e:
                bases.append(f"{b}=ERR")
            else:
                bases.append(f"{b}={e['median_us']:.1f} (x{e['ratio']:.2f})")
        print(
            f"{Path(r['path']).name[:28]:<28} {str(r.get('workload'))[:13]:<13} {str(r.get('dtype')):<8} "
            f"{_fmt_err(r):>9} {'yes' if r.get('ok') else 'NO':<4} "
            f"{str(r.get('backend', '-')):<7} {_fmt_us(kern):>9}  {', '.join(bases)}"
        )
        if "error" in r:
            print(f"    error: {r['error'].splitlines()[0]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artefacts", nargs="+", type=Path, help="artefact folders (kernel.cu + kernel.json)")
    parser.add_argument("--out", type=Path, default=Path("results.json"), help="JSON results file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile baselines (slow to build)")
    parser.add_argument("--flush", choices=("read", "write"), default="read", help="L2 flush between runs")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("no CUDA device visible to torch", file=sys.stderr)
        return 2
    # Full-precision fp32 matmuls, so fp32 references and baselines are what they claim to be.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    rows: list[dict[str, Any]] = []
    for folder in args.artefacts:
        try:
            row = run_one(folder, seed=args.seed, warmup=args.warmup, iters=args.iters, use_compile=not args.no_compile,
                          flush=args.flush)
        except Exception as exc:  # record and go on: one bad artefact must not lose the others' numbers
            row = {"path": str(folder), "ok": False, "error": f"{type(exc).__name__}: {exc}"}
            row["traceback"] = traceback.format_exc()
        rows.append(row)

    try:
        import cupy

        cupy_version = cupy.__version__
    except ImportError:
        cupy_version = None
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cupy": cupy_version,
        "timing": {
            "warmup": args.warmup,
            "iters": args.iters,
            "flush_l2": True,
            "flush": args.flush,
            "stat": "median of CUDA events",
        },
        "seed": args.seed,
        "check": {"reference": "float32 torch on the same inputs, TF32 off", "rule": tolerance_module().RULE,
                  "rule_source": "smg/tolerance.py"},
        "artefacts": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"device: {result['device']}  torch {result['torch']}  cupy {cupy_version}")
    print_table(rows)
    print(f"wrote {args.out}")
    return 0 if rows and all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
