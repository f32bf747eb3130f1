#!/usr/bin/env python3
"""Convolution chains as implicit GEMMs on tensor cores, one tuning round each, against cuDNN in one run.

    python experiments/conv_chains.py build ART              # where TVM runs: the tuner's first round per chain
    python experiments/conv_chains.py run ART --out R.json   # on the GPU (torch + cupy, no TVM)
    python experiments/conv_chains.py report R.json          # anywhere: the table and ratios

Each chain is one fused kernel (``smg.patterns.conv2d``): the convolution's im2col tile gathered into shared
memory (no im2col in memory), the inference BatchNorm folded into the weight and bias, ReLU and a residual
add in the epilogue, or a 2x nearest upsampling folded into the read (by output parity where the frontend
takes that form: ``patterns.upsample_conv2d``, the weight merged per parity).  ``run`` checks every candidate
against a float32 torch reference and times, in the same process and on the same channels-last fp16
tensors, taking turns: cuDNN's convolution followed by torch's separate epilogues (BatchNorm, add, ReLU;
``F.interpolate`` before it), cuDNN's convolution with the BatchNorm folded (bias in the conv) and the rest
separate, and the same chain under ``torch.compile`` (default mode).  CUDA events, warm-up, the median of
many runs, L2 flushed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

FORMAT = "spacefusion-conv-chains/1"
ROUND = 8
EPS = 1e-5


@dataclass(frozen=True)
class Chain:
    """``act(BN(conv(up(x))) (+ residual))`` on an NCHW-shaped fp16 image, channels-last in memory, or NCHW
    (``layout="nchw"``: our kernel reads it where it lies, cuDNN takes it as torch's default format)."""

    key: str
    n: int
    h: int
    w: int
    c: int
    co: int
    kernel: int
    stride: int = 1
    act: str = "relu"
    residual: bool = False
    upsample: int = 1
    bn: bool = True
    why: str = ""
    layout: str = "nhwc"

    @property
    def pad(self) -> int:
        return self.kernel // 2

    @property
    def out_hw(self) -> tuple[int, int]:
        h, w = self.h * self.upsample, self.w * self.upsample
        return (h + 2 * self.pad - self.kernel) // self.stride + 1, (w + 2 * self.pad - self.kernel) // self.stride + 1

    @property
    def flops(self) -> float:
        p, q = self.out_hw
        return 2.0 * self.n * p * q * self.co * self.kernel ** 2 * self.c


CHAINS = (
    Chain("r50_l1_3x3", 32, 56, 56, 64, 64, 3, why="ResNet-50 layer1 3x3 (+BN+ReLU), batch 32"),
    Chain("r50_l1_1x1_res", 32, 56, 56, 64, 256, 1, residual=True,
          why="ResNet-50 layer1 expanding 1x1 (+BN, + the block's input, ReLU)"),
    Chain("r50_l1_1x1_in", 32, 56, 56, 256, 64, 1, why="ResNet-50 layer1 reducing 1x1 (+BN+ReLU)"),
    Chain("r50_l2_3x3_s2", 32, 56, 56, 128, 128, 3, stride=2, why="ResNet-50 layer2's strided 3x3 (v1.5)"),
    Chain("r50_l3_3x3", 32, 14, 14, 256, 256, 3, why="ResNet-50 layer3 3x3"),
    Chain("r50_l4_3x3", 32, 7, 7, 512, 512, 3, why="ResNet-50 layer4 3x3"),
    Chain("vae_up_conv", 1, 64, 64, 512, 512, 3, act="none", upsample=2, bn=False,
          why="SD 1.5 VAE decoder's first upsampler: Upsample 2x nearest -> Conv 3x3 (+bias), 64 -> 128"),
)
#: the same chains with the image in torch's default NCHW memory: the implicit GEMM gathering the im2col tile
#: element by element (``schedulers.gather_tile``'s scalar form), against cuDNN on NCHW tensors and the
#: transpose to channels-last that the NHWC kernel would need first (timed as its own row)
NCHW = tuple(dataclasses.replace(c, key=f"{c.key}_nchw", layout="nchw", why=f"{c.why}; NCHW memory")
             for c in CHAINS if c.key in ("r50_l1_3x3", "r50_l1_1x1_in", "r50_l2_3x3_s2", "r50_l3_3x3"))
CHAINS = CHAINS + NCHW
BY_KEY = {c.key: c for c in CHAINS}


def by_parity(c: Chain) -> bool:
    """Whether the frontend computes this chain's conv by output parity (its rule, asked)."""
    from spacefusion.frontend.convs import by_parity as frontend_rule

    return frontend_rule(c.n * c.h, c.w, c.kernel, c.stride, c.pad, c.upsample)


def smg_of(c: Chain) -> Any:
    """The chain's SMG as the frontend builds it."""
    from spacefusion.api import patterns

    if by_parity(c):
        return patterns.upsample_conv2d(c.n, c.h, c.w, c.c, c.co, c.kernel, c.pad, c.act, bias=True,
                                        residual=c.residual, factor=c.upsample, dtype="float16")
    return patterns.conv2d(c.n, c.h, c.w, c.c, c.co, c.kernel, c.stride, c.pad, c.act, bias=True,
                           residual=c.residual, upsample=c.upsample, dtype="float16", layout=c.layout)


def build(art: Path, keys: list[str], trials: int, workers: int) -> int:
    from first_round import build_round

    art.mkdir(parents=True, exist_ok=True)
    for k in keys:
        c = BY_KEY[k]
        manifest = build_round(smg_of(c), art / k, trials, workers, {"chain": asdict(c)})
        print(f"{k}: {len(manifest['candidates'])} candidates in {manifest['search_s']} s", flush=True)
    return 0


# ---- run (on the GPU machine) ---------------------------------------------------------------------


def _setup(c: Chain, seed: int) -> dict[str, Any]:
    """Channels-last fp16 input, conv weight, eval BatchNorm statistics, residual; the folded weight and bias."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    p, q = c.out_hw

    def rnd(*shape: int, scale: float = 1.0) -> Any:
        return torch.randn(*shape, generator=g, device="cuda") * scale

    x = rnd(c.n, c.c, c.h, c.w).half()
    x = x if c.layout == "nchw" else x.to(memory_format=torch.channels_last)
    w = (rnd(c.co, c.c, c.kernel, c.kernel) / math.sqrt(c.c * c.kernel ** 2)).half()
    b = rnd(c.co, scale=0.1)
    bn = {"mean": rnd(c.co, scale=0.1), "var": rnd(c.co).abs() + 0.5, "gamma": rnd(c.co, scale=0.2) + 1.0,
          "beta": rnd(c.co, scale=0.1)} if c.bn else None
    if bn is not None:
        s = bn["gamma"] / torch.sqrt(bn["var"] + EPS)
        wf, bf = (w.float() * s[:, None, None, None]).half(), (b - bn["mean"]) * s + bn["beta"]
    else:
        wf, bf = w, b
    res = rnd(c.n, c.co, p, q).half().to(memory_format=torch.channels_last) if c.residual else None
    return {"x": x, "w": w.to(memory_format=torch.channels_last), "b": b.half(), "bn": bn, "wf": wf,
            "bf": bf.half(), "res": res}


def _epilogue(c: Chain, y: Any, t: dict[str, Any]) -> Any:
    import torch

    if t["res"] is not None:
        y = y + t["res"]
    return torch.relu(y) if c.act == "relu" else y


def _reference(c: Chain, t: dict[str, Any]) -> Any:
    """float32 chain on the folded fp16 weight (what every system computes, up to its rounding)."""
    import torch.nn.functional as F

    x = t["x"].float()
    if c.upsample > 1:
        x = F.interpolate(x, scale_factor=c.upsample, mode="nearest")
    y = F.conv2d(x, t["wf"].float(), t["bf"].float(), stride=c.stride, padding=c.pad)
    return _epilogue(c, y, {"res": None if t["res"] is None else t["res"].float()})


def _torch_fns(c: Chain, t: dict[str, Any]) -> dict[str, Any]:
    """The baselines: cuDNN conv + separate BatchNorm/add/ReLU; cuDNN conv with BN folded + the rest; the
    same chain under torch.compile (default mode)."""
    import torch
    import torch.nn.functional as F

    def up(x: Any) -> Any:
        return F.interpolate(x, scale_factor=c.upsample, mode="nearest") if c.upsample > 1 else x

    def separate() -> Any:
        y = F.conv2d(up(t["x"]), t["w"], t["b"], stride=c.stride, padding=c.pad)
        if t["bn"] is not None:
            bn = t["bn"]
            y = F.batch_norm(y, bn["mean"].half(), bn["var"].half(), bn["gamma"].half(), bn["beta"].half(), False,
                             0.0, EPS)
        return _epilogue(c, y, t)

    def folded() -> Any:
        return _epilogue(c, F.conv2d(up(t["x"]), t["wf"], t["bf"], stride=c.stride, padding=c.pad), t)

    fns = {"cudnn_separate": separate, "cudnn_folded": folded, "torch_compile": torch.compile(separate)}
    if c.layout == "nchw":  # what reading it channels-last would cost first: the image transposed
        fns["transpose_to_nhwc"] = lambda: t["x"].contiguous(memory_format=torch.channels_last)
    return fns


def _kernel_fn(folder: Path, c: Chain, t: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    """Launch closure of an artefact: X the channels-last input seen as [n, h, w, c], Wt the folded weight as
    [kh * kw * c, co] (permuted once; by output parity merged as [a, b, taps * c, co]), Y [m, co] (by parity
    [nh, a, j, b, co], the same memory) seen back as the NCHW-shaped channels-last output."""
    import torch
    from gpu_runtime import runtime_module

    artefact_mod, gpu = runtime_module("artefact"), runtime_module("gpu")
    kernel = gpu.CudaKernel(artefact_mod.KernelArtefact.load(folder))
    info = {"backend": kernel.compile(), "grid": list(kernel.artefact.grid), "block": list(kernel.artefact.block)}
    wt = t["wf"].permute(2, 3, 1, 0)  # [kh, kw, c, co]
    (spec,) = [p for p in kernel.artefact.inputs if p.name == "Wt"]
    if len(spec.shape) == 4:  # by output parity: the taps merged per parity, [a, b, taps * c, co]
        from smg.ops import upsample_fold

        fold = torch.tensor(upsample_fold(c.kernel, c.pad, c.upsample), dtype=torch.float32, device="cuda")
        wt = torch.einsum("aty,bux,yxco->abtuco", fold, fold, wt.float()).half()
    wt = wt.reshape(spec.shape).contiguous()
    ins = {"X": t["x"] if c.layout == "nchw" else t["x"].permute(0, 2, 3, 1), "Wt": wt, "bias": t["bf"]}
    if t["res"] is not None:
        ins["R"] = t["res"].permute(0, 2, 3, 1).reshape(-1, c.co)
    ins = {p.name: ins[p.name].reshape(p.shape) for p in kernel.artefact.inputs}
    (op,) = kernel.artefact.outputs
    out = torch.full(op.shape, math.nan, dtype=torch.float16, device="cuda")
    p, q = c.out_hw
    nchw = out.view(c.n, p, q, c.co).permute(0, 3, 1, 2)
    return (lambda: kernel.launch(ins, {op.name: out})), nchw, info


def _check(out: Any, ref: Any, c: Chain, baseline: bool = False) -> float:
    from gpu_runtime import compare_tensors

    r = compare_tensors(out, ref, "float16", c.kernel ** 2 * c.c, "Y", baseline)
    if not r.ok:
        raise ValueError(r.problem)
    return r.max_abs_err


def run(art: Path, out_path: Path, keys: list[str], warmup: int, iters: int, repeats: int) -> int:
    import torch
    from gpu_runtime import runtime_module

    timing = runtime_module("timing")
    result: dict[str, Any] = {"format": FORMAT, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "warmup": warmup, "iters": iters,
                              "repeats": repeats, "l2_flush": "read", "chains": []}
    for k in keys:
        c = BY_KEY[k]
        manifest = json.loads((art / k / "manifest.json").read_text())
        t = _setup(c, 0)
        ref = _reference(c, t)
        rows: list[dict[str, Any]] = []
        for i, cand in enumerate(manifest["candidates"]):
            row = {"system": "spacefusion", "rank": i, "schedule_key": cand["schedule_key"],
                   "estimate_us": cand.get("estimate_us"),
                   "schedule": {n: cand["schedule"].get(n) for n in ("block", "step", "stages", "warps", "wgmma",
                                                                     "slices", "split")}}
            try:
                if cand.get("error") or not cand.get("artefact"):
                    raise ValueError(cand.get("error") or "no artefact")
                fn, out, info = _kernel_fn(art / k / cand["artefact"], c, t)
                fn()
                torch.cuda.synchronize()
                row.update(info, max_abs_err=_check(out, ref, c))
                row["fn"] = fn
            except Exception as exc:
                row.update(status="error", error=f"{type(exc).__name__}: {exc}"[:600])
            rows.append(row)
        with torch.no_grad():
            for name, fn in _torch_fns(c, t).items():
                row = {"system": name}
                try:
                    t0 = time.perf_counter()
                    y = fn()
                    torch.cuda.synchronize()
                    if name == "transpose_to_nhwc":  # a copy: the same values, channels-last
                        if not (torch.equal(y, t["x"]) and y.is_contiguous(memory_format=torch.channels_last)):
                            raise ValueError("the transposed image differs from the NCHW one")
                        row.update(first_call_s=round(time.perf_counter() - t0, 2), max_abs_err=0.0)
                    else:
                        row.update(first_call_s=round(time.perf_counter() - t0, 2),
                                   max_abs_err=_check(y, ref, c, baseline=True))
                    row["fn"] = fn
                except Exception as exc:
                    row.update(status="error", error=f"{type(exc).__name__}: {exc}"[:600])
                rows.append(row)
            for _ in range(repeats):  # the systems take turns
                for row in rows:
                    if "fn" in row:
                        row.setdefault("medians_us", []).append(
                            timing.time_cuda(row["fn"], warmup=warmup, iters=iters).median_us)
        for row in rows:
            row.pop("fn", None)
            if row.get("medians_us"):
                row.update(status="ok", median_us=statistics.median(row["medians_us"]))
        entry = {"chain": asdict(c), "flops": c.flops, "search_s": manifest.get("search_s"), "rows": rows}
        result["chains"].append(entry)
        print(format_chain(entry), flush=True)
        out_path.write_text(json.dumps(result, indent=1) + "\n")
        del t, ref
        torch.cuda.empty_cache()
    return 0


# ---- report ---------------------------------------------------------------------------------------


def summarize(entry: dict[str, Any]) -> dict[str, Any]:
    rows = entry["rows"]
    ours = [r for r in rows if r["system"] == "spacefusion"]
    ok = [r for r in ours if r.get("status") == "ok"]
    first = next((r for r in ours if r["rank"] == 0), None)
    best = min(ok, key=lambda r: r["median_us"], default=None)
    out = {"key": entry["chain"]["key"], "first_us": first.get("median_us") if first else None,
           "best_us": best["median_us"] if best else None, "failed": len(ours) - len(ok),
           **{f"{r['system']}_us": r.get("median_us") for r in rows if r["system"] != "spacefusion"}}
    for b in ("cudnn_separate", "cudnn_folded", "torch_compile"):
        for which in ("first", "best"):
            if out.get(f"{b}_us") and out[f"{which}_us"]:
                out[f"{which}_vs_{b}"] = out[f"{b}_us"] / out[f"{which}_us"]  # > 1: ours faster
    return out


def _f(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def format_chain(entry: dict[str, Any]) -> str:
    m = entry["chain"]
    s = summarize(entry)
    shape = (f"{m['n']}x{m['c']}x{m['h']}x{m['w']} -> {m['co']} {m['kernel']}x{m['kernel']}/s{m['stride']}"
             f"{' up2' if m['upsample'] > 1 else ''}{' +res' if m['residual'] else ''}")
    return (f"{m['key']:<15} {shape:<32} first {_f(s['first_us'])} best {_f(s['best_us'])} | cuDNN+sep "
            f"{_f(s.get('cudnn_separate_us'))} ({_f(s.get('first_vs_cudnn_separate'), '.2f')}x) cuDNN folded "
            f"{_f(s.get('cudnn_folded_us'))} ({_f(s.get('first_vs_cudnn_folded'), '.2f')}x) compile "
            f"{_f(s.get('torch_compile_us'))} ({_f(s.get('first_vs_torch_compile'), '.2f')}x) failed {s['failed']}")


def report(path: Path) -> int:
    data = json.loads(path.read_text())
    print(f"{data['device']}, torch {data['torch']}, {data['created']}; median of {data['iters']} runs x "
          f"{data['repeats']} repeats, L2 flushed; ratios of the first pick (> 1: the fused kernel is faster)")
    for e in data["chains"]:
        print(format_chain(e))
    return 0


def main(argv: list[str] | None = None) -> int:
    from first_round import round_cli

    ap, _, _ = round_cli(__doc__, "--chains", list(BY_KEY), ROUND)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "build":
            return build(a.art, a.chains or list(BY_KEY), a.trials, a.workers)
        if a.cmd == "run":
            keys = a.chains or [k for k in BY_KEY if (a.art / k / "manifest.json").is_file()]
            return run(a.art, a.out, keys, a.warmup, a.iters, a.repeats)
        return report(a.results)
    except Exception:
        traceback.print_exc()
        return 2


if __name__ == "__main__":
    sys.exit(main())
