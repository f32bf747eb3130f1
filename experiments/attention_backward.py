#!/usr/bin/env python3
"""Attention forward and backward on the GPU, fp16: ours (the fused forward that saves its LSE, then the kernels
``derive_backward`` + ``backward_passes`` give for the backward, first picks) against SDPA's cuDNN and flash
backends and SDPA's default dispatch (issue 58, item 5).

Two phases, as the lowering and the GPU live on different machines here:

    python experiments/attention_backward.py export ART [--hw H200] [--cases ...] [--small]   # where TVM is
    python experiments/attention_backward.py run ART --out r.json [--warmup 10 --iters 50 --repeats 3]

``export`` derives each case's backward (``derive_backward(attention(...), wrt=Q, K, V)``), cuts it into passes
(``backward_passes``: Delta, dQ, dK_dV) and writes the CUDA artefact of the first pick (ranked for ``--hw``) of
the derived forward (``bw.forward``: O and the saved statistics) and of each pass to ``ART/<case>/<kernel>/``,
with its ``smg.json``; ``ART/manifest.json`` lists each case's kernels in launch order with every operand's
shape, which name is the output gradient (the seed ``dO``) and which are the inputs' gradients.  A case whose
derivation or build fails keeps the error in the manifest, and its ``spacefusion`` row says why.

``run`` (torch + cupy, no TVM) makes seeded fp16 Q, K, V, dO (and the additive bias), a float32 eager SDPA
reference on the math backend (O and, by autograd, dQ, dK, dV), and checks every system's O and gradients with
``smg.tolerance``'s rule (systems not ours with its BASELINE_SLACK) before timing it: a system that fails or
raises (a backend that refuses the case) is reported with why, never timed.  Checked systems take turns over
``--repeats`` rounds; each round times the forward alone and the backward alone (for SDPA:
``torch.autograd.grad`` of a forward made once, ``retain_graph``) with ``mask_attention.cuda_timer`` (CUDA
events, L2 flushed by a read, median), each case in a child process of its own on the GPU (a faulting
kernel's sticky error costs only its case; ``--no-isolate``).  TFLOP/s count the forward as
4·b·h·(kept query-key pairs)·d and the backward as 2.5x that, as the issue does.  The JSON is rewritten after
each case.  ``--device cpu`` runs the same logic on the CPU (a test of both phases: our kernels evaluated from
their ``smg.json`` by ``smg.reference``, SDPA's cuDNN backend refusing, host wall-clock times that measure
nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # experiments/: the shared TVM-free loader
from gpu_runtime import REPO_ROOT, compare_tensors, runtime_module, timing_args  # noqa: E402
from mask_attention import cuda_timer, host_timer  # noqa: E402

FORMAT = "spacefusion-attention-backward/1"
RESULTS_FORMAT = "spacefusion-attention-backward-results/1"
ARCH = "sm_90a"
#: the fill of a score a window removes, in the SMG's mod
MASKED = -1e30
#: the backward counts as this many forwards (FlashAttention's benchmarks, and the issue)
BACKWARD_FLOPS = 2.5
SPACEFUSION = "spacefusion"
SDPA_SYSTEMS = ("sdpa cudnn", "sdpa flash", "sdpa default")


@dataclass(frozen=True)
class Case:
    """One attention: Q [b, heads, m, d], K/V [b, kv_heads, m, d] (bhsd), self-attention (seq_kv = seq).
    ``mod``: "none", "window" (keep ``m - l < window``, with causal: a sliding window) or "bias" (an additive
    fp16 bias [heads, m, l] on the scaled scores, as T5's or ALiBi's position bias)."""

    name: str
    batch: int
    heads: int
    kv_heads: int
    seq: int
    head_dim: int
    causal: bool
    mod: str = "none"
    window: int = 0

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def mods(self) -> list[tuple[str, tuple[tuple[str, tuple[str, ...]], ...]]]:
        """``smg.patterns.ScoreMod`` (body, inputs) of the case's mod (none or one)."""
        if self.mod == "window":
            return [(f"Piecewise(({{s}}, m - l < {self.window}), ({MASKED}, True))", ())]
        if self.mod == "bias":
            return [("{s} + Bias", (("Bias", ("h", "m", "l")),))]
        return []

    def kept_pairs(self) -> int:
        """Query-key pairs a row keeps, summed over the rows of one head (causal: the lower triangle)."""
        s = self.seq
        if not self.causal:
            return s * s
        if self.mod == "window":
            return sum(min(i + 1, self.window) for i in range(s))
        return s * (s + 1) // 2

    def forward_flops(self) -> float:
        """The forward's FLOPs: two GEMMs (S = QKᵀ, O = PV) over the kept pairs, 2 FLOPs a multiply-add."""
        return 4.0 * self.batch * self.heads * self.kept_pairs() * self.head_dim

    def shrunk(self) -> Case:
        """The case at a CPU-test size: batch 1, heads 2 (1 kv head for GQA), sequence 32, d 16, window 8."""
        kv = 1 if self.kv_heads != self.heads else 2
        return dataclasses.replace(self, batch=1, heads=2, kv_heads=kv, seq=32, head_dim=16,
                                   window=min(self.window, 8))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Case:
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


CASES: dict[str, Case] = {c.name: c for c in (
    Case("d128", 8, 16, 16, 2048, 128, False),
    Case("d128_causal", 8, 16, 16, 2048, 128, True),
    Case("d64", 8, 16, 16, 2048, 64, False),
    Case("d64_causal", 8, 16, 16, 2048, 64, True),
    Case("gqa32_8_causal", 8, 32, 8, 2048, 128, True),
    Case("window1024_causal", 8, 16, 16, 2048, 128, True, "window", 1024),
    Case("bias_d128", 8, 16, 16, 2048, 128, False, "bias"),
)}


# ---- export (where TVM is) -------------------------------------------------------------------------------


def build_smg(case: Case, dtype: str = "float16") -> Any:
    """The case's attention SMG (no saved statistics: ``derive_backward`` adds them to its ``forward``)."""
    from spacefusion.api import patterns

    mods = tuple(patterns.ScoreMod(body, inputs) for body, inputs in case.mods())
    return patterns.attention(case.batch, case.heads, case.seq, case.seq, case.head_dim, kv_heads=case.kv_heads,
                     causal=case.causal, dtype=dtype, scale=case.scale, mods=mods)


def _shapes(smg: Any, names: tuple[str, ...]) -> dict[str, list[int]]:
    sizes = smg.dim_sizes
    spaces = {sp.name: sp for sp in smg.spaces}
    return {n: [sizes[d] for d in spaces[n].dims] for n in names}


def export_case(art: Path, case: Case, hw_name: str, cubin: bool) -> dict[str, Any]:
    """The derived forward and backward passes of ``case``, first picks for ``hw_name``, exported into
    ``art/<case>/<kernel>``; the case's manifest entry (its ``error`` where a step failed)."""
    from spacefusion.api import backward_passes, derive_backward, export, first_pick, hardware

    hw = hardware(hw_name)
    entry: dict[str, Any] = {"case": case.to_dict(), "kernels": []}
    t0 = time.perf_counter()
    try:
        bw = derive_backward(build_smg(case), wrt=("Q", "K", "V"))
        passes = backward_passes(bw)
    except Exception as exc:  # not derivable or not cut: the row says why
        entry["error"] = f"derivation: {type(exc).__name__}: {exc}"[:2000]
        return entry
    entry["seed"] = dict(bw.seeds)["O"]
    entry["grads"] = dict(bw.grads)
    for name, smg in (("forward", bw.forward), *((p.name, p.smg) for p in passes)):
        t = time.perf_counter()
        try:
            s = first_pick(smg, hw)
            export(s, art / case.name / name, target=f"cuda:{ARCH}", compile_cubin=cubin)
        except Exception as exc:  # the case cannot run ours; the others still export
            entry["error"] = f"{name}: build: {type(exc).__name__}: {exc}"[:2000]
            traceback.print_exc()
            return entry
        entry["kernels"].append({"name": name, "folder": f"{case.name}/{name}", "smg_key": smg.key,
                                 "schedule_key": s.key, "inputs": _shapes(smg, smg.inputs),
                                 "outputs": _shapes(smg, smg.outputs), "build_s": round(time.perf_counter() - t, 1)})
        print(f"  {case.name} {name}: built in {time.perf_counter() - t:.1f} s", flush=True)
    entry["export_s"] = round(time.perf_counter() - t0, 1)
    return entry


def export(art: Path, names: list[str], hw_name: str, small: bool, cubin: bool = True) -> int:
    """Export every case of ``names`` (``small``: shrunk) into ``art``; the manifest is rewritten after each.
    Returns 1 where a case failed (its entry says why), else 0."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    art.mkdir(parents=True, exist_ok=True)
    path = art / "manifest.json"
    manifest = json.loads(path.read_text()) if path.is_file() else {"format": FORMAT, "cases": {}}
    manifest.update(arch=ARCH, hardware_model=hw_name, small=small)
    failed = 0
    for name in names:
        case = CASES[name].shrunk() if small else CASES[name]
        entry = export_case(art, case, hw_name, cubin)
        failed += "error" in entry
        manifest["cases"][name] = entry
        path.write_text(json.dumps(manifest, indent=1) + "\n")
        print(f"{name}: {entry.get('error') or str(len(entry['kernels'])) + ' kernels'}", flush=True)
    return 1 if failed else 0


# ---- run: inputs, reference, systems (torch; no TVM) --------------------------------------------------------


def read_manifest(art: Path) -> dict[str, Any]:
    manifest = json.loads((art / "manifest.json").read_text())
    if manifest.get("format") != FORMAT:
        raise SystemExit(f"{art / 'manifest.json'}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def make_inputs(case: Case, device: str, dtype: Any) -> dict[str, Any]:
    """Seeded N(0, 1) Q, K, V, dO (and Bias [heads, seq, seq]) in ``dtype`` on ``device``."""
    import torch

    gen = torch.Generator().manual_seed(0)
    b, h, hk, s, d = case.batch, case.heads, case.kv_heads, case.seq, case.head_dim
    shapes = {"Q": (b, h, s, d), "K": (b, hk, s, d), "V": (b, hk, s, d), "dO": (b, h, s, d)}
    if case.mod == "bias":
        shapes["Bias"] = (h, s, s)
    return {n: torch.randn(shape, generator=gen).to(device=device, dtype=dtype) for n, shape in shapes.items()}


def sdpa_kwargs(case: Case, x: dict[str, Any], dtype: Any) -> dict[str, Any]:
    """``scaled_dot_product_attention``'s keywords for the case: the window as a boolean mask (SDPA has no
    window of its own), the bias as a float mask broadcast over the batch, GQA by ``enable_gqa``."""
    import torch

    kw: dict[str, Any] = {"scale": case.scale, "is_causal": case.causal,
                          "enable_gqa": case.kv_heads != case.heads}
    if case.mod == "window":
        i = torch.arange(case.seq, device=x["Q"].device)
        diff = i[:, None] - i[None, :]
        kw.update(is_causal=False, attn_mask=(diff >= 0) & (diff < case.window))
    elif case.mod == "bias":
        kw["attn_mask"] = x["Bias"].to(dtype)[None]
    return kw


def reference(case: Case, x: dict[str, Any]) -> dict[str, Any]:
    """O, dQ, dK, dV of float32 eager SDPA on the math backend (autograd for the gradients)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (x[n].detach().float().clone().requires_grad_() for n in "QKV")  # never x's own tensors
    with sdpa_kernel([SDPBackend.MATH]):
        out = F.scaled_dot_product_attention(q, k, v, **sdpa_kwargs(case, x, torch.float32))
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), x["dO"].float())
    return {"O": out.detach(), "dQ": dq, "dK": dk, "dV": dv}


@dataclass
class Runner:
    """A system made ready: ``forward`` and ``backward`` are what is timed (``backward`` reads the state a
    ``forward`` left); ``results`` runs both and returns O, dQ, dK, dV in torch's shapes."""

    forward: Callable[[], Any]
    backward: Callable[[], Any]
    results: Callable[[], dict[str, Any]]
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclass
class System:
    name: str
    make: Callable[[], Runner]
    ours: bool = False


def sdpa_system(name: str, case: Case, x: dict[str, Any]) -> System:
    """SDPA with the backend ``name`` names forced (``sdpa default``: torch's own dispatch); its backward is
    autograd's of one forward (``retain_graph``), as a training step runs it."""

    def make() -> Runner:
        import contextlib

        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {"sdpa cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa flash": SDPBackend.FLASH_ATTENTION}.get(name)
        q, k, v = (x[n].detach().clone().requires_grad_() for n in "QKV")
        kw = sdpa_kwargs(case, x, q.dtype)

        def fwd() -> Any:
            with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
                return F.scaled_dot_product_attention(q, k, v, **kw)

        saved = [fwd()]  # a backend that refuses the case raises here

        def bwd() -> Any:
            return torch.autograd.grad(saved[0], (q, k, v), x["dO"], retain_graph=True)

        def results() -> dict[str, Any]:
            saved[0] = fwd()
            dq, dk, dv = bwd()
            return {"O": saved[0].detach(), "dQ": dq, "dK": dk, "dV": dv}

        return Runner(fwd, bwd, results)

    return System(name, make)


class Launch:
    """One exported kernel on ``env``'s named tensors, returning its outputs by name: on the GPU through the
    runtime (the first call a checked ``launch`` into NaN-filled outputs, so an element never written fails the
    check; later calls the unchecked ``launcher``), on the CPU its ``smg.json`` evaluated by ``smg.reference``
    in float64 (the same wiring and names, no kernel: what a CPU test can check of the export)."""

    def __init__(self, art: Path, spec: dict[str, Any], device: Any, dtype: Any) -> None:
        self.spec, self.device = spec, device
        folder = art / spec["folder"]
        self.fast: Callable[..., Any] | None = None
        if device.type == "cuda":
            self.kernel = runtime_module("gpu").load_kernel(folder)
            self.backend = self.kernel.compile(device.index)
            art_ = self.kernel.artefact
            self.inputs = [(p.name, tuple(p.shape)) for p in art_.inputs]
            self.outputs = [(p.name, tuple(p.shape), p.dtype) for p in art_.outputs]
        else:
            from spacefusion.api import load_smg

            self.smg = load_smg(folder)
            if self.smg is None:
                raise FileNotFoundError(f"{folder}: no smg.json")
            self.inputs = [(n, tuple(s)) for n, s in spec["inputs"].items()]
            self.dtype = dtype

    def __call__(self, env: dict[str, Any]) -> dict[str, Any]:
        ins = {n: env[n].reshape(shape) for n, shape in self.inputs}
        if self.device.type != "cuda":
            import torch

            from spacefusion.api import evaluate

            got = evaluate(self.smg, {n: t.double().numpy() for n, t in ins.items()})
            return {n: torch.from_numpy(got[n]).to(self.dtype) for n in self.spec["outputs"]}
        if self.fast is None:
            import torch

            gpu = runtime_module("gpu")
            outs = {n: torch.full(s, math.nan, dtype=gpu.torch_dtype(dt), device=self.device)
                    for n, s, dt in self.outputs}
            got = self.kernel.launch(ins, outs)
            self.fast = self.kernel.launcher(self.device.index)  # made after the checked launch, as it asks
            return got
        return dict(zip((n for n, _, _ in self.outputs), self.fast(*ins.values())))


def ours_system(art: Path, entry: dict[str, Any], x: dict[str, Any]) -> System:
    """The exported derived forward, then the backward passes in the manifest's order, on one environment of
    named tensors (the forward's O and statistics read by the passes)."""

    def make() -> Runner:
        if "error" in entry:
            raise Unavailable(entry["error"])
        kernels = [Launch(art, spec, x["Q"].device, x["Q"].dtype) for spec in entry["kernels"]]
        env: dict[str, Any] = {n: t for n, t in x.items() if n != "dO"}
        env[entry["seed"]] = x["dO"]
        grads = entry["grads"]

        def fwd() -> Any:
            env.update(kernels[0](env))
            return env["O"]

        def bwd() -> Any:
            for k in kernels[1:]:
                env.update(k(env))
            return tuple(env[grads[n]] for n in "QKV")

        def results() -> dict[str, Any]:
            o, grad = fwd(), bwd()
            return {"O": o.reshape(x["dO"].shape),
                    **{f"d{n}": g.reshape(x[n].shape) for n, g in zip("QKV", grad)}}

        info = {"kernels": [k["name"] for k in entry["kernels"]]}
        if x["Q"].device.type == "cuda":
            info["backend"] = [k.backend for k in kernels]
        return Runner(fwd, bwd, results, info)

    return System(SPACEFUSION, make, ours=True)


class Unavailable(Exception):
    """A system that cannot run the case (its export failed): reported, not an error of the run."""


# ---- run: checking and timing ------------------------------------------------------------------------------


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def check(case: Case, system: System, ref: dict[str, Any]) -> tuple[dict[str, Any], Runner | None]:
    """Make ``system`` and check O, dQ, dK, dV of two runs (the first, then the timed path's) against ``ref``
    with the tolerance rule for fp16 over each gradient's reduction; its row, and the runner only if every
    tensor matched.  Never raises."""
    row: dict[str, Any] = {"system": system.name, "status": None, "error": None}
    try:
        runner = system.make()
        row["info"] = runner.info
    except Unavailable as exc:
        row.update(status="unavailable", error=str(exc))
        return row, None
    except Exception as exc:  # a backend that refuses the case: said, not timed
        row.update(status="refused", error=f"setup: {type(exc).__name__}: {exc}"[:2000])
        return row, None
    group = case.heads // case.kv_heads
    lengths = {"O": case.seq, "dQ": case.seq, "dK": case.seq * group, "dV": case.seq * group}
    row["check"] = {}
    try:
        for attempt in ("first", "timed"):
            got = runner.results()
            _sync(ref["O"].device)
            for n, r in ref.items():
                c = compare_tensors(got[n], r, "float16", reduction_len=lengths[n], name=n,
                                    baseline=not system.ours)
                row["check"][n] = {"ok": c.ok, "max_abs_err": c.max_abs_err, "atol": c.atol}
                if not c.ok:
                    row.update(status="failed", error=f"numerics of the {attempt} run: {c.problem}")
                    return row, None
            del got
    except Exception as exc:
        row.update(status="error", error=f"run: {type(exc).__name__}: {exc}"[:2000],
                   traceback=traceback.format_exc()[-3000:])
        return row, None
    row["status"] = "checked"
    return row, runner


def run_case(case: Case, entry: dict[str, Any], art: Path, device: str, timer: Callable[..., float],
             warmup: int, iters: int, repeats: int) -> dict[str, Any]:
    """The case's rows: every system checked, the checked ones timed in turns (forward, backward)."""
    import torch

    dtype = torch.float16 if device == "cuda" else torch.float32
    x = make_inputs(case, device, dtype)
    ref = reference(case, x)
    systems = [ours_system(art, entry, x), *(sdpa_system(n, case, x) for n in SDPA_SYSTEMS)]
    rows, runners = [], []
    for system in systems:
        row, runner = check(case, system, ref)
        print(f"  {case.name} {system.name}: {row['status']}" + (f" ({row['error'][:200]})" if row["error"] else ""),
              flush=True)
        rows.append(row)
        runners.append(runner)
    del ref
    samples: dict[int, dict[str, list[float]]] = {i: {"forward": [], "backward": []}
                                                  for i, r in enumerate(runners) if r is not None}
    for _ in range(repeats):
        for i, r in enumerate(runners):
            if r is not None:
                samples[i]["forward"].append(timer(r.forward, warmup, iters))
                r.forward()  # the state the backward reads
                samples[i]["backward"].append(timer(r.backward, warmup, iters))
    fwd_flops = case.forward_flops()
    for i, got in samples.items():
        for stage, flops in (("forward", fwd_flops), ("backward", BACKWARD_FLOPS * fwd_flops)):
            us = statistics.median(got[stage])
            rows[i][f"{stage}_us"] = round(us, 2)
            rows[i][f"{stage}_rounds_us"] = [round(t, 2) for t in got[stage]]
            rows[i][f"{stage}_tflops"] = round(flops / us / 1e6, 1)
    return {"case": case.to_dict(), "forward_flops": fwd_flops, "backward_flops": BACKWARD_FLOPS * fwd_flops,
            "rows": rows}


def environment(device: str) -> dict[str, Any]:
    import platform

    import torch

    env: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(), "device": device}
    if device == "cuda":
        env.update(gpu=torch.cuda.get_device_name(), cudnn=torch.backends.cudnn.version())
    return env


def format_table(results: dict[str, Any]) -> str:
    lines = [f"{'case':<20} {'system':<13} {'fwd us':>9} {'TF/s':>6} {'bwd us':>9} {'TF/s':>6}  status"]
    for name, got in results["cases"].items():
        for r in got.get("rows", []):
            cells = [f"{r.get(k, '-')!s:>{w}}" for k, w in (("forward_us", 9), ("forward_tflops", 6),
                                                          ("backward_us", 9), ("backward_tflops", 6))]
            why = f" {r['error'][:80]}" if r.get("error") else ""
            lines.append(f"{name:<20} {r['system']:<13} {' '.join(cells)}  {r['status']}{why}")
        if "error" in got:
            lines.append(f"{name:<20} (case) {got['error'][:100]}")
    return "\n".join(lines)


def run_child(art: Path, name: str, device: str, warmup: int, iters: int, repeats: int) -> dict[str, Any]:
    """One case in a child process of its own: a kernel that faults leaves a sticky CUDA error, which dies with
    the child instead of failing every later case (SDPA's rows included).  The case's results, or why none."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "case.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "run", str(art), "--out", str(out), "--cases", name,
               "--device", device, "--warmup", str(warmup), "--iters", str(iters), "--repeats", str(repeats),
               "--no-isolate"]
        rc = subprocess.run(cmd, check=False).returncode
        got = json.loads(out.read_text())["cases"].get(name) if out.is_file() else None
    if got is None:
        return {"error": f"the child process exited with {rc} before writing the case (its output is above)"}
    if rc:
        got["error"] = f"the child process exited with {rc} (its output is above)"
    return got


def run(art: Path, out: Path, names: list[str] | None, device: str, warmup: int, iters: int,
        repeats: int, isolate: bool = False) -> dict[str, Any]:
    """Every case of the manifest (or ``names``), each in a child process where ``isolate`` (``run_child``),
    the JSON at ``out`` rewritten after each; the results."""
    manifest = read_manifest(art)
    names = names or list(manifest["cases"])
    timer = cuda_timer if device == "cuda" else host_timer
    results: dict[str, Any] = {"format": RESULTS_FORMAT, "environment": environment(device),
                               "export": {k: manifest.get(k) for k in ("arch", "hardware_model", "small")},
                               "timing": {"warmup": warmup, "iters": iters, "repeats": repeats,
                                          "timer": "cuda events, L2 flushed by a read" if device == "cuda"
                                          else "host wall clock (a smoke test)"},
                               "cases": {}}
    for name in names:
        entry = manifest["cases"][name]
        case = Case.from_dict(entry["case"])
        t = time.perf_counter()
        try:
            got = run_child(art, name, device, warmup, iters, repeats) if isolate else \
                run_case(case, entry, art, device, timer, warmup, iters, repeats)
        except Exception as exc:  # one case never loses the others
            traceback.print_exc()
            got = {"case": case.to_dict(), "error": f"{type(exc).__name__}: {exc}"[:2000]}
        got["run_s"] = round(time.perf_counter() - t, 1)
        results["cases"][name] = got
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1) + "\n")
        if device == "cuda":
            import torch

            torch.cuda.empty_cache()
    print(format_table(results), flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("phase", choices=("export", "run"))
    ap.add_argument("art", type=Path)
    ap.add_argument("--cases", nargs="*", default=None, choices=list(CASES))
    ap.add_argument("--small", action="store_true", help="export: every case shrunk (a CPU test)")
    ap.add_argument("--hw", default="H200", help="export: the machine the first picks are ranked for")
    ap.add_argument("--no-cubin", action="store_true", help="export: kernel.cu only (the GPU machine's nvcc "
                                                            "compiles it at load)")
    ap.add_argument("--out", type=Path, default=Path("attention_backward.json"))
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--no-isolate", action="store_true",
                    help="run: every case in this process (default on the GPU: each in a child process)")
    timing_args(ap, warmup=10, iters=50, repeats=3)
    a = ap.parse_args(argv)
    if a.phase == "export":
        return export(a.art, a.cases or list(CASES), a.hw, a.small, cubin=not a.no_cubin)
    run(a.art, a.out, a.cases, a.device, a.warmup, a.iters, a.repeats,
        isolate=a.device == "cuda" and not a.no_isolate)
    return 0


if __name__ == "__main__":
    sys.exit(main())
