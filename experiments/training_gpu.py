#!/usr/bin/env python3
"""Training steps of `transformers` models on the GPU (issue 58, item 5): eager, torch.compile (default and,
with ``--max-autotune``, max-autotune) and ``torch.compile(model, backend=SpaceFusionBackend(CudaBackend(ART)))``,
each step zero_grad, forward, backward and the same SGD step, in bf16.

Two phases, as the lowering and the GPU live on different machines here:

    python experiments/training_gpu.py export ART [--hw H200] [--models ...] [--small]    # where TVM is
    python experiments/training_gpu.py run ART --out r.json [--max-autotune] [--warmup 3 --iters 10 --repeats 3]

``export`` builds each model on the meta device and runs one training step through
``spacefusion.api.export_cuda_training``: aot_autograd splits each Dynamo graph into a forward and a backward
ATen graph, and each stage writes the CUDA artefact of its fused SMGs' first picks (ranked for ``--hw``) into
``ART/kernels`` (named by SMG content key), its report into ``ART/<model>.partition.txt``.  ``run`` (torch +
cupy, no TVM) builds the same models with the same seeded random weights, compiles ours with
``CudaBackend(ART/kernels)``, which loads those artefacts; an SMG of the GPU's graphs that the meta capture did
not have (the GPU's SDPA ops differ from the meta device's math attention, which runs as bmm/softmax there) has
no artefact and is left to torch, reported (``coverage``: each fused subgraph's artefact found or not).

Precision: **bf16 weights**, not autocast, for every model.  The export captures on meta tensors, which CUDA
autocast does not cast, so an autocast capture would hold other graphs than the GPU's; and under autocast every
GEMM's B is a per-step cast of a float32 parameter, which the GEMM patterns (a parameter laid out once) do not
take, so spacefusion would fuse no GEMM.  bf16 weights give every system the same bf16 GEMMs and the SMGs the
export wrote.  The loss (``training_step.loss_of_output``) is taken in float32.  SGD (lr 1e-4), no momentum:
the step is the same foreach update in every system and holds no optimiser state (LLaMA's 1.4 B parameters
four times over fit one GPU).

Check before timing: from the same initial weights, one step's loss and every gradient of each system against
a float32 eager copy; the error is the gradients' relative L2 distance over all parameters together
(``grad_error``), and a system is ok within twice eager bf16's own error (plus 1e-6), its loss within twice
eager's error or bf16's unit roundoff of the loss.  A system that fails (or raises) is reported, not timed.
Timed: whole steps with ``runtime.timing.time_cuda`` (CUDA events, L2 flushed, ``hold=False``: the host's
pace is part of a step), ``--warmup`` then ``--iters`` steps, the systems taking turns over ``--repeats`` rounds,
the median of the rounds' medians.  The JSON is rewritten after each model.  ``--device cpu --small`` runs the
same logic on tiny configs with ours on the ``reference`` target (a test of both phases, no numbers).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
from dynamo_gpu import LLAMA3_8B_4L  # noqa: E402
from dynamo_gpu import MODELS as INFERENCE_MODELS  # noqa: E402
from dynamo_gpu import build as build_fp16  # noqa: E402
from gpu_runtime import REPO_ROOT, runtime_module, timing_args  # noqa: E402
from training_step import loss_of_output  # noqa: E402

FORMAT = "spacefusion-training-gpu/1"
DTYPE = torch.bfloat16
LR = 1e-4
#: a system is ok within this many times eager bf16's distance from float32 (dynamo_gpu's rule)
SLACK = 2.0
#: bf16's unit roundoff: a loss within it of float32's (relative) is ok whatever eager's luck
BF16_EPS = 2.0**-8

#: name -> dynamo_gpu.MODELS-form spec (config class, model class, config kwargs, input kind, batch, seq)
MODELS: dict[str, tuple[str, str, dict[str, Any], str, int, int]] = {
    "bert_base_8x128": INFERENCE_MODELS["bert_base_8x128"],
    "bert_base_8x512": INFERENCE_MODELS["bert_base_8x512"],
    "llama3_8b_4layers_1x2048": ("LlamaConfig", "LlamaModel", LLAMA3_8B_4L, "ids", 1, 2048),
    "vit_b16_32": ("ViTConfig", "ViTModel", {}, "pixels", 32, 224),
}
#: the same models at CPU-test sizes (one layer, hidden 64)
SMALL: dict[str, tuple[str, str, dict[str, Any], str, int, int]] = {
    "bert_base_8x128": ("BertConfig", "BertModel", {"hidden_size": 64, "num_hidden_layers": 1,
                                                    "num_attention_heads": 2, "intermediate_size": 128,
                                                    "vocab_size": 100}, "ids", 2, 16),
    "bert_base_8x512": ("BertConfig", "BertModel", {"hidden_size": 64, "num_hidden_layers": 1,
                                                    "num_attention_heads": 2, "intermediate_size": 128,
                                                    "vocab_size": 100}, "ids", 2, 32),
    "llama3_8b_4layers_1x2048": ("LlamaConfig", "LlamaModel", {"hidden_size": 64, "num_hidden_layers": 1,
                                                               "num_attention_heads": 4, "num_key_value_heads": 2,
                                                               "intermediate_size": 128, "vocab_size": 100},
                                 "ids", 1, 16),
    "vit_b16_32": ("ViTConfig", "ViTModel", {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                                             "intermediate_size": 128, "image_size": 32, "patch_size": 8},
                   "pixels", 2, 32),
}


def build(name: str, device: str, small: bool) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The model (``dynamo_gpu.build``'s seeded random weights of the real config) in bf16 and its inputs on
    ``device``; decoders without a KV cache (a training step keeps none; and a DynamicCache's first append
    does not run on meta)."""
    spec = (SMALL if small else MODELS)[name]
    model, x = build_fp16(name, device, spec)
    model = model.to(DTYPE)
    x = {k: v.to(DTYPE) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in x.items()}
    if spec[1] == "LlamaModel":
        x["use_cache"] = False
    return model, x


# ---- export (where TVM is) -------------------------------------------------------------------------------


def export(art: Path, names: list[str], hw: str, small: bool) -> int:
    """Each model's training step captured on meta tensors, its stages' fused SMGs exported (first picks for
    ``hw``) into ``art/kernels``; ``art/training_manifest.json`` records what was asked."""
    from spacefusion.api import export_cuda_training

    art.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, Any] = {"format": FORMAT, "hardware_model": hw, "small": small, "models": {}}
    for name in names:
        torch._dynamo.reset()
        t = time.perf_counter()
        model, x = build(name, "meta", small)
        try:
            backend = export_cuda_training(model, art / "kernels", loss_of_output, hardware=hw, **x)
            (art / f"{name}.partition.txt").write_text(str(backend) + "\n")
            manifest["models"][name] = {"export_s": round(time.perf_counter() - t, 1), "keys": exported_keys(backend)}
            print(f"{name}: exported in {time.perf_counter() - t:.1f} s\n{backend}\n", flush=True)
        except Exception as exc:  # the run phase then runs ours on whatever the folder holds, reported
            traceback.print_exc()
            manifest["models"][name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        (art / "training_manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return 1 if any("error" in m for m in manifest["models"].values()) else 0


def _subgraphs(backend: Any) -> list[tuple[str, Any]]:
    """(stage, subgraph) of every fused subgraph of every compiled training stage of ``backend``."""
    out = []
    for g in backend.graphs:
        for stage in ("forward", "backward"):
            r = getattr(g, stage, None)
            if r is not None and r.partition is not None:
                out += [(stage, s) for s in r.partition.subgraphs]
    return out


def exported_keys(backend: Any) -> list[str]:
    """The SMG content keys (16 hex digits, the artefacts' folder names) of ``backend``'s fused subgraphs."""
    return sorted({s.smg.key[:16] for _, s in _subgraphs(backend)})


def coverage(backend: Any, folder: Path) -> dict[str, Any]:
    """Of ``backend``'s fused subgraphs (per stage), which have an artefact in ``folder``, by SMG key: what
    the export wrote that this run's graphs read, and what they read that it did not write (left to torch
    on a machine without TVM)."""
    out: dict[str, Any] = {}
    for stage, s in _subgraphs(backend):
        key = s.smg.key[:16]
        row = out.setdefault(stage, {"found": [], "missing": []})
        row["found" if (folder / key).is_dir() else "missing"].append(f"{s.label} [{key[:10]}]")
    return out


# ---- run -------------------------------------------------------------------------------------------------


def step_of(model: torch.nn.Module, run: Callable[..., Any], x: dict[str, Any]) -> Callable[[], torch.Tensor]:
    """One training step of ``run`` (``model`` or a compiled wrapper of it): zero_grad, forward, the loss,
    backward, the SGD step; returns the loss."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = loss_of_output(run(**x))
        loss.backward()
        opt.step()
        return loss

    return step


def gradients(model: torch.nn.Module, run: Callable[..., Any], x: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """One forward and backward from ``model``'s current weights, no optimiser step: the loss and every
    parameter's gradient."""
    model.zero_grad(set_to_none=True)
    loss = loss_of_output(run(**x))
    loss.backward()
    grads = {n: p.grad.detach() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def grad_error(grads: dict[str, Any], ref: dict[str, Any]) -> tuple[float, str, list[str]]:
    """The gradients' relative L2 distance over all parameters together, ||g - ref|| / ||ref|| (one number a
    model: a parameter whose true gradient is about zero, as a key bias's under softmax, does not dominate it
    as a per-parameter ratio would), the parameter contributing most to it, and the parameters with no
    gradient where the reference has one."""
    diff2, ref2, worst, where = 0.0, 0.0, -1.0, ""
    for n, r in ref.items():
        ref2 += float(r.double().pow(2).sum())
        if n not in grads:
            continue
        d = float((grads[n].double() - r.double()).pow(2).sum())
        diff2 += d
        if d > worst or d != d:
            worst, where = d, n
    return (diff2 / ref2) ** 0.5 if ref2 else diff2 ** 0.5, where, sorted(set(ref) - set(grads))


def systems_of(base: torch.nn.Module, art: Path, device: str, modes: tuple[str, ...], hw: str
               ) -> dict[str, tuple[torch.nn.Module, Callable[..., Any], Any]]:
    """name -> (model, what to call, spacefusion backend or None), each system its own copy of ``base``'s
    weights (eager: ``base`` itself)."""
    from spacefusion.api import CudaBackend, SpaceFusionBackend, first_pick_for, hardware

    out: dict[str, tuple[torch.nn.Module, Callable[..., Any], Any]] = {"eager": (base, base, None)}
    for mode in modes:
        m = copy.deepcopy(base)
        out[f"torch.compile {mode}"] = (m, torch.compile(m, mode=mode, dynamic=False), None)
    m = copy.deepcopy(base)
    if device == "cuda":
        model_hw = hardware(hw)
        target: Any = CudaBackend(art / "kernels", schedule_for=first_pick_for(model_hw), hardware=model_hw)
    else:
        target = "reference"  # the CPU test: the same path, numpy kernels
    backend = SpaceFusionBackend(target, measure=False)
    out["spacefusion"] = (m, torch.compile(m, backend=backend, dynamic=False), backend)
    return out


def run_model(name: str, art: Path, small: bool, device: str, modes: tuple[str, ...], hw: str, warmup: int,
              iters: int, repeats: int, timer: Callable[..., float]) -> dict[str, Any]:
    """One model's row: compile time, the check against float32 eager, the timed steps."""
    torch._dynamo.reset()
    row: dict[str, Any] = {"compile_s": {}, "check": {}, "refused": {}}
    base, x = build(name, device, small)
    ref_model = copy.deepcopy(base).float()  # the same weights, in float32
    ref_loss, ref_grads = gradients(ref_model, ref_model, {k: v.float() if torch.is_tensor(v) and
                                                           v.is_floating_point() else v for k, v in x.items()})
    ref_grads = {n: g.float() for n, g in ref_grads.items()}
    del ref_model
    systems = systems_of(base, art, device, modes, hw)
    checked: dict[str, Callable[[], Any]] = {}
    for sys_name, (model, run, backend) in systems.items():
        try:
            t = time.perf_counter()
            loss, grads = gradients(model, run, x)  # compiles at its first call
            row["compile_s"][sys_name] = round(time.perf_counter() - t, 1)
            err, where, missing = grad_error(grads, ref_grads)
            row["check"][sys_name] = {"loss": loss, "loss_err": abs(loss - ref_loss), "grad_err": err,
                                      "worst_param": where, "no_grad": missing}
            del grads
        except Exception as exc:  # a system that cannot compile or run the step: said, not timed
            row["refused"][sys_name] = f"{type(exc).__name__}: {exc}"[:2000]
            traceback.print_exc()
            continue
        if backend is not None:
            row["partition"] = str(backend)
            row["coverage"] = coverage(backend, art / "kernels")  # on the CPU: the keys the export must match
    eager = row["check"].get("eager")
    for sys_name, c in row["check"].items():
        c["ok"] = eager is not None and not c["no_grad"] and c["grad_err"] <= SLACK * eager["grad_err"] + 1e-6 \
            and c["loss_err"] <= max(SLACK * eager["loss_err"], BF16_EPS * abs(ref_loss))
        if c["ok"]:
            model, run, _ = systems[sys_name]
            checked[sys_name] = step_of(model, run, x)
    del ref_grads
    samples: dict[str, list[float]] = {k: [] for k in checked}
    for _ in range(repeats):
        for sys_name, step in checked.items():
            samples[sys_name].append(timer(step, warmup, iters))
    row["ms"] = {k: round(statistics.median(v) / 1e3, 3) for k, v in samples.items()}
    row["rounds_ms"] = {k: [round(t / 1e3, 3) for t in v] for k, v in samples.items()}
    if "eager" in row["ms"]:
        row["speedup_vs_eager"] = {k: round(row["ms"]["eager"] / v, 3) for k, v in row["ms"].items()}
    return row


def _cuda_timer(fn: Callable[[], Any], warmup: int, iters: int) -> float:
    """A whole step's median in µs: CUDA events, L2 flushed, the host's pace included (``hold=False``)."""
    return float(runtime_module("timing").time_cuda(fn, warmup=warmup, iters=iters, hold=False).median_us)


def run(art: Path, out: Path, names: list[str], small: bool, device: str, modes: tuple[str, ...], hw: str,
        warmup: int, iters: int, repeats: int) -> dict[str, Any]:
    """Every model of ``names`` with eager, torch.compile in each of ``modes`` and ours; the JSON at ``out``
    rewritten after each."""
    from mask_attention import host_timer

    timer = _cuda_timer if device == "cuda" else host_timer
    results: dict[str, Any] = {"format": FORMAT, "torch": torch.__version__, "device": device,
                               "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
                               "dtype": "bfloat16 weights", "optimiser": f"SGD lr {LR}", "small": small,
                               "timing": {"warmup": warmup, "iters": iters, "repeats": repeats}, "models": {}}
    torch._dynamo.config.cache_size_limit = 64
    for name in names:
        t = time.perf_counter()
        try:
            row = run_model(name, art, small, device, modes, hw, warmup, iters, repeats, timer)
        except Exception as exc:  # one model never loses the others
            traceback.print_exc()
            row = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        row["run_s"] = round(time.perf_counter() - t, 1)
        results["models"][name] = row
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1) + "\n")
        print(json.dumps({name: {k: row.get(k) for k in ("ms", "speedup_vs_eager", "check", "refused", "error")}}),
              flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("phase", choices=("export", "run"))
    ap.add_argument("art", type=Path)
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--small", action="store_true", help="tiny configs (a CPU test)")
    ap.add_argument("--hw", default="H200", help="the machine the first picks are ranked for")
    ap.add_argument("--out", type=Path, default=Path("training_gpu.json"))
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--modes", nargs="*", default=["default"], help="torch.compile's modes to time")
    ap.add_argument("--max-autotune", action="store_true", help="also torch.compile max-autotune (minutes)")
    timing_args(ap, warmup=3, iters=10, repeats=3)
    a = ap.parse_args(argv)
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    if a.phase == "export":
        return export(a.art, a.models, a.hw, a.small)
    modes = (*a.modes, *(("max-autotune",) if a.max_autotune else ()))
    run(a.art, a.out, a.models, a.small, a.device, modes, a.hw, a.warmup, a.iters, a.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
