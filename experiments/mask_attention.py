#!/usr/bin/env python3
"""Masked and modded attention ("score mods": padding, sliding window, ALiBi, soft-cap) against FlexAttention,
SDPA and eager PyTorch on the GPU (issue 27).

Two phases, as the lowering and the GPU live on different machines here:

    python experiments/mask_attention.py export ART [--candidates 4] [--cases ...] [--small]   # where TVM is
    python experiments/mask_attention.py run ART --out results.json [--warmup 10 --iters 100 --repeats 3]

``export`` builds each case's attention SMG (``smg.patterns.attention`` with its ``ScoreMod``), ranks its
schedules with the analytical model (``spacefusion.frontend.schedules.ranked`` for the H100) and writes the
CUDA artefacts (kernel.cu, kernel.json, kernel.cubin, schedule.json) of the first ``--candidates`` that build
to ``ART/<case>/<rank>/``; ``ART/manifest.json`` holds each case's shape and mods and each candidate's rank,
folder, knobs and keys (and the error of any that failed to build).  ``--small`` shrinks every shape (a CPU
test of the export).

``run`` (torch + cupy + triton, no TVM: the runtime and the tolerance rule are loaded by file path through
``experiments/gpu_runtime.py``; ``spacefusion``, ``smg`` and ``schedulers`` are never imported) makes seeded
fp16 inputs for each case in the manifest, a float32 torch reference (scores in fp32, the same mod and mask,
softmax, @ V, unfused), and checks every system against it with ``smg/tolerance.py``'s rule (third-party
systems with its BASELINE_SLACK) before timing it: every exported candidate (a checked launch into
NaN-filled outputs, then timed through the runtime's unchecked ``launcher``), ``torch.compile(flex_attention)``
with a block mask made once outside the timing, SDPA with a backend forced (a materialised mask where the
backend has no native one), and eager attention written the HuggingFace way.  Checked systems are timed
with the runtime's ``time_cuda`` (CUDA events, L2 flushed by a read, median), taking turns over
``--repeats`` rounds (the median of the rounds' medians).  Each case runs in a child process of its own
(``--no-isolate``: in this one), so a kernel that faults (a sticky CUDA error) costs only its case; the JSON
is rewritten after every case and a table printed at the end (``--ranks`` leaves out candidates, e.g. one
that faults).  ``--device cpu`` runs the same logic without a GPU (a smoke test: spacefusion rows fail,
times are host wall clock).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # experiments/: the shared TVM-free loader
from gpu_runtime import compare_tensors, runtime_module, timing_args, tolerance_module  # noqa: E402

FORMAT = "spacefusion-mask-attention/1"
RESULTS_FORMAT = "spacefusion-mask-attention-results/1"
ARCH = "sm_90a"
DTYPE = "float16"
#: the fill of a masked score, in the SMG's mods and in the reference alike
MASKED = -1e30
#: a materialised SDPA mask above this many bytes is not worth a baseline
MAX_MASK_BYTES = 512 * 1024 * 1024
#: the reference's fp32 score blocks are at most this large (batch chunks)
REF_CHUNK_BYTES = 1 << 30
MOD_KINDS = ("padding", "window", "alibi", "softcap", "none")
SPACEFUSION = "spacefusion"


# ---- cases (stdlib only: both phases) ------------------------------------------------------------------


def padding_lengths(batch: int, seq: int, seed: int = 0) -> tuple[int, ...]:
    """Per-sequence lengths, seeded uniform in [seq/4, seq]; the first is seq/4 and the last seq, so both
    ends occur."""
    lo = max(1, seq // 4)
    rng = random.Random(seed)
    out = [rng.randint(lo, seq) for _ in range(batch)]
    out[0] = lo
    if batch > 1:
        out[-1] = seq
    return tuple(out)


@dataclass(frozen=True)
class Case:
    """One benchmark case: attention of layout bhsd (Q [b, h, m, d], K/V [b, h, l, d]) with one score mod."""

    name: str
    batch: int
    heads: int
    seq_q: int
    seq_kv: int
    head_dim: int
    causal: bool
    mod: str = "none"  # one of MOD_KINDS
    window: int = 0  # "window": keep m - l < window
    softcap: float = 0.0  # "softcap": cap * tanh(s / cap)
    lengths: tuple[int, ...] = ()  # "padding": keys kept per sequence

    def __post_init__(self) -> None:
        if self.mod not in MOD_KINDS:
            raise ValueError(f"case {self.name}: mod {self.mod!r}, known {MOD_KINDS}")
        if self.mod == "padding" and len(self.lengths) != self.batch:
            raise ValueError(f"case {self.name}: {len(self.lengths)} lengths for batch {self.batch}")

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def shape(self) -> dict[str, int]:
        return {"b": self.batch, "h": self.heads, "m": self.seq_q, "l": self.seq_kv, "d": self.head_dim}

    def mods(self) -> list[tuple[str, tuple[tuple[str, tuple[str, ...]], ...], str | None]]:
        """``smg.patterns.ScoreMod`` arguments (body, inputs, zero_v) of the case's mod (none or one)."""
        if self.mod == "padding":
            return [("Piecewise(({s}, Keep > 0.5), (-1e30, True))", (("Keep", ("b", "l")),), "Keep")]
        if self.mod == "window":
            return [(f"Piecewise(({{s}}, m - l < {self.window}), (-1e30, True))", (), None)]
        if self.mod == "alibi":
            return [("{s} + Slope*(l - m)", (("Slope", ("h",)),), None)]
        if self.mod == "softcap":
            return [(f"{self.softcap!r}*tanh({{s}}/{self.softcap!r})", (), None)]
        return []

    def shrunk(self) -> Case:
        """The case at a CPU-test size: batch and heads at most 2, sequences at most 256 (window scaled)."""
        b, h = min(self.batch, 2), min(self.heads, 2)
        m, l = min(self.seq_q, 256), min(self.seq_kv, 256)  # noqa: E741
        window = max(1, self.window * l // self.seq_kv) if self.window else 0
        lengths = padding_lengths(b, l) if self.mod == "padding" else ()
        return dataclasses.replace(self, batch=b, heads=h, seq_q=m, seq_kv=l, window=window, lengths=lengths)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["lengths"] = list(self.lengths)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Case:
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        kw["lengths"] = tuple(kw.get("lengths", ()))
        return cls(**kw)


CASES: dict[str, Case] = {c.name: c for c in (
    Case("bert_padding", 32, 12, 512, 512, 64, False, "padding", lengths=padding_lengths(32, 512)),
    Case("window1024_causal", 1, 32, 4096, 4096, 128, True, "window", window=1024),
    Case("alibi_causal", 4, 32, 2048, 2048, 128, True, "alibi"),
    Case("softcap30_causal", 4, 32, 2048, 2048, 128, True, "softcap", softcap=30.0),
    Case("causal", 4, 32, 2048, 2048, 128, True),
)}


# ---- export (where TVM is) -------------------------------------------------------------------------------


def schedule_summary(s: Any) -> dict[str, Any]:
    """The knobs that tell candidates apart, and the warp-tile program in words (the full schedule is in
    the candidate's schedule.json)."""
    from spacefusion.api import warp_tile_summary

    d = s.to_dict()
    keep = ("step", "tensor_cores", "stages", "warps", "split", "slices", "reload_a", "early_scores",
            "lazy_rescale", "mma_row_sums", "wgmma", "tma", "producer", "persistent", "pingpong", "fast_math",
            "lanes", "vector")
    out: dict[str, Any] = {"block": dict(s.block), "serial": s.serial, **{k: d[k] for k in keep if k in d},
                           "blocks": s.num_blocks, "threads": s.threads}
    attrs = dict(s.smg.attrs)
    if "fold" in attrs:
        out["fold"] = attrs["fold"]
    if s.warp_tile is not None:
        out["text"] = warp_tile_summary(s)
    return out


def build_smg(case: Case) -> Any:
    """The case's attention SMG."""
    from spacefusion.api import patterns

    mods = tuple(patterns.ScoreMod(body, inputs, zero_v=zero) for body, inputs, zero in case.mods())
    return patterns.attention(case.batch, case.heads, case.seq_q, case.seq_kv, case.head_dim, causal=case.causal,
                              mods=mods)


def read_manifest(art: Path) -> dict[str, Any]:
    path = art / "manifest.json"
    if path.is_file():
        return json.loads(path.read_text())
    return {"format": FORMAT, "arch": ARCH, "hardware_model": "H100", "cases": {}}


def export_case(art: Path, case: Case, candidates: int, max_tries: int) -> dict[str, Any]:
    """Build the first ``candidates`` of the model's ranking that lower (trying at most ``max_tries``) into
    ``art/<case>/<rank>``; the case's manifest entry."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    from spacefusion.api import H100, build, estimate
    from spacefusion.api import candidates as ranked  # ``candidates`` is this function's count

    t0 = time.perf_counter()
    g = build_smg(case)
    order = ranked(g, H100)
    rank_s = time.perf_counter() - t0
    print(f"{case.name}: {len(order)} ranked candidates in {rank_s:.1f} s", flush=True)
    shutil.rmtree(art / case.name, ignore_errors=True)  # no stale candidates of an earlier export
    rows: list[dict[str, Any]] = []
    built = 0
    for rank, s in enumerate(order[:max_tries]):
        if built >= candidates:
            break
        folder = art / case.name / str(rank)
        row: dict[str, Any] = {"rank": rank, "folder": f"{case.name}/{rank}", "schedule_key": s.key,
                               "smg_key": s.smg.key, "estimate_us": round(estimate(s, H100), 2)}
        t = time.perf_counter()
        try:
            row["summary"] = schedule_summary(s)
            build(s, f"cuda:{ARCH}").save(folder, compile_cubin=True)
            (folder / "schedule.json").write_text(s.to_json() + "\n")
            row["cubin"] = (folder / "kernel.cubin").is_file()
            built += 1
        except Exception as exc:  # the next candidate; the error is kept
            shutil.rmtree(folder, ignore_errors=True)
            row.update(folder=None, error=f"{type(exc).__name__}: {exc}"[:2000])
        row["build_s"] = round(time.perf_counter() - t, 1)
        rows.append(row)
        status = "built" if row.get("folder") else f"FAILED: {row['error'][:300]}"
        print(f"  rank {rank}: {status} in {row['build_s']} s (est {row['estimate_us']} us) "
              f"{row.get('summary', {}).get('text', '')}", flush=True)
    if not built:
        print(f"  {case.name}: none of the {min(max_tries, len(order))} best schedules built", flush=True)
    return {"case": case.to_dict(), "shape": case.shape, "causal": case.causal, "scale": case.scale,
            "mods": [{"body": b, "inputs": [[n, list(d)] for n, d in i], "zero_v": z} for b, i, z in case.mods()],
            "smg_key": g.key, "ranked": len(order), "rank_s": round(rank_s, 1),
            "build_s": round(time.perf_counter() - t0, 1), "candidates": rows}


def export(art: Path, names: list[str], candidates: int, small: bool, max_tries: int) -> int:
    """Export every case in ``names`` (``small``: shrunk) into ``art``; the manifest is rewritten after each."""
    art.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(art)
    t0 = time.perf_counter()
    failures = 0
    for name in names:
        case = CASES[name].shrunk() if small else CASES[name]
        try:
            entry = export_case(art, case, candidates, max_tries)
        except Exception as exc:  # one case never loses the others
            traceback.print_exc()
            entry = {"case": case.to_dict(), "shape": case.shape, "error": f"{type(exc).__name__}: {exc}"[:2000],
                     "candidates": []}
        failures += not any(c.get("folder") for c in entry["candidates"])
        manifest["cases"][name] = entry
        manifest["small"] = small
        (art / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        print(f"{name}: {sum(bool(c.get('folder')) for c in entry['candidates'])} candidates in "
              f"{entry.get('build_s', '-')} s", flush=True)
    print(f"export done in {time.perf_counter() - t0:.0f} s -> {art / 'manifest.json'}", flush=True)
    return 1 if failures else 0


# ---- run: inputs, reference, systems (torch; no TVM) --------------------------------------------------------


def alibi_slopes(heads: int) -> list[float]:
    """ALiBi's head slopes, 2^(-8 (h + 1) / heads)."""
    return [2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)]


def make_inputs(case: Case, device: str, seed: int = 0) -> dict[str, Any]:
    """Seeded fp16 Q, K, V (unit normal: the scaled scores are O(1)) and the mod's inputs: Keep [b, l]
    (1.0 where l < length[b]) or Slope [h]."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    b, h, m, l, d = case.batch, case.heads, case.seq_q, case.seq_kv, case.head_dim  # noqa: E741
    x = {n: torch.randn(shape, generator=gen, device=device, dtype=torch.float32).half()
         for n, shape in (("Q", (b, h, m, d)), ("K", (b, h, l, d)), ("V", (b, h, l, d)))}
    if case.mod == "padding":
        lengths = torch.tensor(case.lengths, device=device)
        x["Keep"] = (torch.arange(l, device=device)[None, :] < lengths[:, None]).half()
    if case.mod == "alibi":
        x["Slope"] = torch.tensor(alibi_slopes(h), device=device).half()
    return x


def mod_scores(case: Case, s: Any, x: dict[str, Any], b0: int = 0) -> Any:
    """The case's mod, then its causal mask, on float32 scores ``s`` [bc, h, m, l] of batches b0..b0+bc."""
    import torch

    m = torch.arange(case.seq_q, device=s.device)[:, None]
    l = torch.arange(case.seq_kv, device=s.device)[None, :]  # noqa: E741
    if case.mod == "padding":
        keep = x["Keep"][b0:b0 + s.shape[0]].float()[:, None, None, :]
        s = torch.where(keep > 0.5, s, MASKED)
    elif case.mod == "window":
        s = torch.where(m - l < case.window, s, MASKED)
    elif case.mod == "alibi":
        s = s + x["Slope"].float()[None, :, None, None] * (l - m).float()
    elif case.mod == "softcap":
        s = case.softcap * torch.tanh(s / case.softcap)
    if case.causal:  # after the mod, as FlexAttention masks after its score_mod
        s = torch.where(l <= m, s, MASKED)
    return s


def reference(case: Case, x: dict[str, Any], chunk_bytes: int = REF_CHUNK_BYTES) -> Any:
    """float32 attention, unfused (scores, mod, mask, softmax, @ V), on the inputs' device, in batch chunks."""
    import torch

    q, k, v = (x[n].float() for n in ("Q", "K", "V"))
    out = torch.empty(case.batch, case.heads, case.seq_q, case.head_dim, dtype=torch.float32, device=q.device)
    per_batch = case.heads * case.seq_q * case.seq_kv * 4
    step = max(1, chunk_bytes // per_batch)
    for b0 in range(0, case.batch, step):
        sl = slice(b0, b0 + step)
        s = torch.matmul(q[sl], k[sl].transpose(-1, -2)) * case.scale
        p = torch.softmax(mod_scores(case, s, x, b0), dim=-1)
        out[sl] = torch.matmul(p, v[sl])
        del s, p
    return out


def eager_mask(case: Case, x: dict[str, Any]) -> Any:
    """The additive float mask an HF model adds to its scores (0 kept, fp16's min dropped; ALiBi's bias
    folded in), broadcast over what it does not depend on; None where there is nothing to add."""
    import torch

    dev = x["Q"].device
    low = torch.finfo(torch.float16).min
    if case.mod == "padding":
        pad = x["Keep"] > 0.5  # [b, l]
        return torch.zeros(pad.shape, device=dev).masked_fill(~pad, low).half()[:, None, None, :]
    if not (case.causal or case.mod in ("window", "alibi")):
        return None
    m = torch.arange(case.seq_q, device=dev)[:, None]
    l = torch.arange(case.seq_kv, device=dev)[None, :]  # noqa: E741
    keep = torch.ones(case.seq_q, case.seq_kv, dtype=torch.bool, device=dev)
    if case.causal:
        keep = keep & (l <= m)
    if case.mod == "window":
        keep = keep & (m - l < case.window)
    bias = torch.zeros(1, 1, case.seq_q, case.seq_kv, device=dev)
    if case.mod == "alibi":
        bias = x["Slope"].float()[None, :, None, None] * (l - m).float()
    return torch.where(keep, bias, low).clamp_min(low).half()


def sdpa_mask(case: Case, x: dict[str, Any]) -> tuple[Any, bool, str]:
    """(attn_mask, is_causal, how) for SDPA: its native causal flag where that is all, a bool mask for
    padding and window ([b,1,1,l] / [1,1,m,l]), ALiBi's float bias (causal folded in, [1,h,m,l]); raises
    NotImplementedError where SDPA cannot express the case (soft-cap) or the mask would be too large."""
    import torch

    if case.mod == "softcap":
        raise NotImplementedError("SDPA has no soft-cap")
    if case.mod == "none":
        return None, case.causal, "is_causal" if case.causal else "none"
    if case.mod == "padding":
        return (x["Keep"] > 0.5)[:, None, None, :], False, "bool mask [b,1,1,l]"
    heads = case.heads if case.mod == "alibi" else 1
    nbytes = heads * case.seq_q * case.seq_kv * (2 if case.mod == "alibi" else 1)
    if nbytes > MAX_MASK_BYTES:
        raise NotImplementedError(f"a materialised mask of {nbytes / 2**20:.0f} MiB")
    dev = x["Q"].device
    m = torch.arange(case.seq_q, device=dev)[:, None]
    l = torch.arange(case.seq_kv, device=dev)[None, :]  # noqa: E741
    if case.mod == "window":
        keep = m - l < case.window
        if case.causal:
            keep = keep & (l <= m)
        return keep[None, None], False, "bool mask [1,1,m,l]"
    return eager_mask(case, x), False, "float bias [1,h,m,l] (ALiBi + causal)"


def flex_mods(case: Case, x: dict[str, Any]) -> tuple[Callable | None, Callable | None, int | None]:
    """FlexAttention's (score_mod, mask_mod, B of the block mask) for the case."""
    import torch

    score_mod = mask_mod = None
    batch = None
    if case.mod == "alibi":
        slope = x["Slope"].float()  # the fp16 slopes, exactly, in fp32

        def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return score + slope[h] * (kv_idx - q_idx)
    elif case.mod == "softcap":
        cap = case.softcap

        def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return cap * torch.tanh(score / cap)

    if case.mod == "padding":
        keep = x["Keep"] > 0.5
        batch = case.batch

        def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return keep[b, kv_idx]
    elif case.mod == "window":
        window, causal = case.window, case.causal

        def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            near = q_idx - kv_idx < window
            return (q_idx >= kv_idx) & near if causal else near
    elif case.causal:
        def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return q_idx >= kv_idx
    return score_mod, mask_mod, batch


class Unavailable(Exception):
    """A system that does not apply to the case (reported as such, not as an error)."""


@dataclass
class Prepared:
    """A system ready to run: ``fn`` gives the output checked; ``timed`` (if not ``fn``) is what is timed."""

    fn: Callable[[], Any]
    timed: Callable[[], Any] | None = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class System:
    name: str
    make: Callable[[], Prepared]
    ours: bool = False
    rank: int | None = None
    folder: str | None = None


def baseline_systems(case: Case, x: dict[str, Any], compile_flex: bool = True) -> list[System]:
    """FlexAttention (compiled, block mask made here), SDPA with each backend that applies forced, eager."""
    import torch
    import torch.nn.functional as F

    q, k, v = x["Q"], x["K"], x["V"]
    systems: list[System] = []

    def make_flex() -> Prepared:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        score_mod, mask_mod, batch = flex_mods(case, x)
        bm = None if mask_mod is None else create_block_mask(mask_mod, batch, None, case.seq_q, case.seq_kv,
                                                             device=q.device)
        fa = torch.compile(flex_attention, dynamic=False) if compile_flex else flex_attention
        info: dict[str, Any] = {"compiled": compile_flex, "score_mod": score_mod is not None}
        if bm is not None:
            info["block_mask_sparsity_pct"] = round(float(bm.sparsity()), 2)

        def flex() -> Any:
            return fa(q, k, v, score_mod=score_mod, block_mask=bm, scale=case.scale)

        return Prepared(flex, info=info)

    systems.append(System("flex", make_flex))
    if case.mod == "padding":  # the same mask as lengths (kv_idx < length[b]): FlexAttention's other usual form
        def make_flex_lengths() -> Prepared:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            lengths = (x["Keep"] > 0.5).sum(-1).to(torch.int32)

            def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
                return kv_idx < lengths[b]

            bm = create_block_mask(mask_mod, case.batch, None, case.seq_q, case.seq_kv, device=q.device)
            fa = torch.compile(flex_attention, dynamic=False) if compile_flex else flex_attention

            def flex() -> Any:
                return fa(q, k, v, block_mask=bm, scale=case.scale)

            return Prepared(flex, info={"compiled": compile_flex, "mask_mod": "kv_idx < lengths[b]",
                                        "block_mask_sparsity_pct": round(float(bm.sparsity()), 2)})

        systems.append(System("flex_lengths", make_flex_lengths))
    sdpa = [("sdpa_cudnn", "CUDNN_ATTENTION"), ("sdpa_efficient", "EFFICIENT_ATTENTION")]
    if case.mod == "none":
        sdpa.insert(0, ("sdpa_flash", "FLASH_ATTENTION"))
    for name, backend_name in sdpa:
        def make_sdpa(backend_name: str = backend_name) -> Prepared:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            try:
                mask, is_causal, how = sdpa_mask(case, x)
            except NotImplementedError as exc:
                raise Unavailable(str(exc)) from None
            backend = getattr(SDPBackend, backend_name)

            def run_sdpa() -> Any:
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                                          scale=case.scale)

            return Prepared(run_sdpa, info={"backend": backend_name, "mask": how})

        systems.append(System(name, make_sdpa))

    def make_eager() -> Prepared:
        mask = eager_mask(case, x)

        def eager() -> Any:
            s = torch.matmul(q, k.transpose(-1, -2)) * case.scale
            if case.mod == "softcap":  # Gemma-2's way: capped, then masked
                s = torch.tanh(s / case.softcap) * case.softcap
            if mask is not None:
                s = s + mask
            p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
            return torch.matmul(p, v)

        return Prepared(eager, info={"softmax": "float32"})

    systems.append(System("eager", make_eager))
    return systems


def spacefusion_system(art: Path, cand: dict[str, Any], x: dict[str, Any]) -> System:
    """An exported candidate: checked by a launch into NaN-filled outputs (an element never written fails),
    timed through the runtime's ``launcher`` (no per-call checks)."""

    def make() -> Prepared:
        import torch

        gpu = runtime_module("gpu")
        kernel = gpu.load_kernel(art / cand["folder"])
        a = kernel.artefact
        missing = [p.name for p in a.inputs if p.name not in x]
        if missing:
            raise ValueError(f"kernel inputs {missing} are not among the case's tensors {sorted(x)}")
        device = x["Q"].device
        backend = kernel.compile(device.index)
        # a folded schedule's kernel takes the same memory with merged dims: views, never copies
        ins = {p.name: x[p.name].view(p.shape) for p in a.inputs}
        outs = {p.name: torch.full(p.shape, math.nan, dtype=gpu.torch_dtype(p.dtype), device=device)
                for p in a.outputs}
        out_slot = [p.name for p in a.outputs].index("O")
        ordered = [ins[p.name] for p in a.inputs]
        launch: list[Callable[..., Any]] = []

        def checked() -> Any:
            kernel.launch(ins, outs)
            return outs["O"]

        def timed() -> Any:
            if not launch:  # made after the checked launch, as its contract asks
                launch.append(kernel.launcher(device.index))
            return launch[0](*ordered)[out_slot]

        info = {"backend": backend, "kernel_name": a.kernel_name, "grid": list(a.grid), "block": list(a.block),
                "dynamic_smem_bytes": a.dynamic_smem_bytes}
        return Prepared(checked, timed, info)

    return System(f"{SPACEFUSION}[{cand['rank']}]", make, ours=True, rank=cand["rank"], folder=cand["folder"])


# ---- run: checking and timing ------------------------------------------------------------------------------


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:2000]


def _sync(device: Any) -> None:
    import torch

    if getattr(device, "type", device) == "cuda":
        torch.cuda.synchronize()


def check_system(case: Case, system: System, ref: Any) -> tuple[dict[str, Any], Callable[[], Any] | None]:
    """Prepare ``system``, run it once and check its output against ``ref`` (the tolerance rule for fp16
    over a reduction of seq_kv; BASELINE_SLACK for a system not ours); its row, and the function to time
    only if it matched.  Never raises."""
    row: dict[str, Any] = {"system": system.name, "checked": False, "us": None, "error": None}
    if system.ours:
        row.update(rank=system.rank, folder=system.folder)
    try:
        prep = system.make()
        row["info"] = prep.info
    except Unavailable as u:
        row.update(status="unavailable", error=str(u))
        return row, None
    except Exception as exc:
        row.update(status="error", error=f"setup: {_error(exc)}", traceback=traceback.format_exc()[-3000:])
        return row, None
    try:
        t0 = time.perf_counter()
        out = prep.fn()
        _sync(ref.device)
        row["first_call_s"] = round(time.perf_counter() - t0, 3)
        c = compare_tensors(out, ref, DTYPE, reduction_len=case.seq_kv, name="O", baseline=not system.ours)
        row.update(max_abs_err=c.max_abs_err, over=c.over, atol=c.atol, rtol=c.tolerance.rtol)
        if not c.ok:
            row.update(status="failed", error=f"numerics: {c.problem}")
            return row, None
        fn = prep.fn
        if prep.timed is not None:  # what is timed must give what was checked
            got = prep.timed()
            _sync(ref.device)
            if not bool((got.reshape(out.shape) == out).all()):
                c2 = compare_tensors(got, ref, DTYPE, reduction_len=case.seq_kv, name="O", baseline=not system.ours)
                if not c2.ok:
                    row.update(status="failed", error=f"numerics of the timed launch: {c2.problem}")
                    return row, None
            fn = prep.timed
        del out
    except Exception as exc:
        row.update(status="error", error=f"run: {_error(exc)}", traceback=traceback.format_exc()[-3000:])
        return row, None
    row.update(checked=True, status="checked")
    return row, fn


Timer = Callable[[Callable[[], Any], int, int], float]


def cuda_timer(fn: Callable[[], Any], warmup: int, iters: int) -> float:
    """The runtime's timer: CUDA events per run, L2 flushed by a read between runs; the median in us."""
    return float(runtime_module("timing").time_cuda(fn, warmup=warmup, iters=iters, flush="read").median_us)


def host_timer(fn: Callable[[], Any], warmup: int, iters: int) -> float:
    """Wall-clock median in us (``--device cpu``: a smoke test of the script, not a measurement)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t) * 1e6)
    return statistics.median(samples)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The first pick (the lowest rank exported, as ``model_pick`` would take it), the best checked
    candidate, and each timed baseline's time over theirs (> 1: spacefusion is faster)."""
    ours = sorted((r for r in rows if r.get("rank") is not None and r.get("status") != "not built"),
                  key=lambda r: r["rank"])
    timed = [r for r in ours if r.get("us")]
    out: dict[str, Any] = {}
    keys = ("rank", "folder", "us", "checked", "max_abs_err", "error")
    if ours:
        out["spacefusion_first_pick"] = {k: ours[0].get(k) for k in keys}
    if timed:
        best = min(timed, key=lambda r: r["us"])
        out["spacefusion_best"] = {k: best.get(k) for k in keys}
    ratios: dict[str, float] = {}
    for r in rows:
        if r.get("rank") is not None or not r.get("us"):
            continue
        for pick in ("first_pick", "best"):
            sf = out.get(f"spacefusion_{pick}", {}).get("us")
            if sf:
                ratios[f"{r['system']}_over_{pick}"] = round(r["us"] / sf, 3)
    out["ratios"] = ratios
    return out


def run_case(art: Path, entry: dict[str, Any], cfg: dict[str, Any], timer: Timer,
             save: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Inputs, reference, every system checked, then timed in turns; the case's results."""
    import torch

    case = Case.from_dict(entry["case"])
    device = cfg["device"]
    torch._dynamo.reset()  # fresh compile caches for this case's flex_attention
    result: dict[str, Any] = {"case": case.to_dict(), "shape": case.shape, "mods": entry.get("mods"),
                              "smg_key": entry.get("smg_key"), "rows": []}
    t0 = time.perf_counter()
    with torch.no_grad():
        x = make_inputs(case, device, cfg["seed"])
        ref = reference(case, x)
        _sync(ref.device)
        result["reference_s"] = round(time.perf_counter() - t0, 2)
        systems = baseline_systems(case, x, compile_flex=device == "cuda")
        ranks = cfg.get("ranks")
        cands = [c for c in entry.get("candidates", []) if ranks is None or c["rank"] in ranks]
        systems += [spacefusion_system(art, c, x) for c in cands if c.get("folder")]
        checked = []
        for system in systems:  # the baselines first: a kernel that faults takes only what comes after it
            row, fn = check_system(case, system, ref)
            checked.append((row, fn))
            result["rows"].append(row)
            err = "" if row.get("max_abs_err") is None else f" (max err {row['max_abs_err']:.3g})"
            why = "" if not row["error"] else ": " + row["error"][:300]
            print(f"  {case.name:<18} {system.name:<16} {row['status']}{err}{why}", flush=True)
        for c in cands:
            if not c.get("folder"):
                result["rows"].append({"system": f"{SPACEFUSION}[{c['rank']}]", "rank": c["rank"], "checked": False,
                                       "us": None, "status": "not built", "error": c.get("error")})
        if save is not None:
            save(result)
        for _ in range(cfg["repeats"]):  # the systems take turns: a slow spell hits one round of each
            for row, fn in checked:
                if fn is None or row["status"] == "error":
                    continue
                try:
                    row.setdefault("us_rounds", []).append(round(timer(fn, cfg["warmup"], cfg["iters"]), 2))
                except Exception as exc:
                    row.update(status="error", error=f"timing: {_error(exc)}", us=None)
        for row, _ in checked:
            if row["status"] == "checked" and row.get("us_rounds"):
                row.update(status="ok", us=round(statistics.median(row["us_rounds"]), 2))
        del checked, systems, x, ref
    result.update(summarize(result["rows"]))
    result["case_s"] = round(time.perf_counter() - t0, 1)
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def environment(device: str) -> dict[str, Any]:
    """Device and library versions."""
    import importlib

    import torch

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__}
    if device == "cuda":
        env.update(device=torch.cuda.get_device_name(), device_capability=list(torch.cuda.get_device_capability()),
                   cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    else:
        env["device"] = f"cpu ({platform.processor() or platform.machine()})"
    for name in ("triton", "cupy"):
        try:
            env[name] = importlib.import_module(name).__version__
        except Exception:
            env[name] = None
    return env


def format_table(results: dict[str, Any]) -> str:
    """One line per system and case (us, or why not), and the ratios."""
    lines = []
    for name, c in results["cases"].items():
        lines.append(f"== {name} {c.get('shape', '')}" + (f"  ERROR {c['error']}" if c.get("error") else ""))
        for r in c.get("rows", []):
            us = f"{r['us']:10.1f}" if r.get("us") else "         -"
            why = "" if r.get("status") == "ok" else f"  {r.get('status')}: {str(r.get('error'))[:120]}"
            lines.append(f"  {r['system']:<18}{us} us{why}")
        for pick in ("spacefusion_first_pick", "spacefusion_best"):
            if c.get(pick):
                lines.append(f"  {pick}: rank {c[pick]['rank']}, {c[pick]['us']} us")
        if c.get("ratios"):
            lines.append("  " + ", ".join(f"{k} {v:.2f}" for k, v in c["ratios"].items()))
    return "\n".join(lines)


def _write(path: Path, results: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, default=str) + "\n")


def run(art: Path, out_path: Path, names: list[str] | None, cfg: dict[str, Any], isolate: bool = True,
        child: bool = False) -> int:
    """Every case of the manifest (or ``names``): in a child process each (``isolate``) or here (``child``: as
    one, leaving the table to its parent)."""
    manifest = read_manifest(art)
    names = names or list(manifest["cases"])
    unknown = [n for n in names if n not in manifest["cases"]]
    if unknown:
        print(f"cases {unknown} are not in {art / 'manifest.json'} (it has {list(manifest['cases'])})",
              file=sys.stderr)
        return 2
    results: dict[str, Any] = {"format": RESULTS_FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                               "command": " ".join([Path(sys.executable).name, *sys.argv]), "art": str(art),
                               "settings": {**cfg, "timer": "spacefusion.runtime.timing.time_cuda" if cfg["device"]
                                            == "cuda" else "host wall clock", "flush": "read", "stat":
                                            "median over --repeats rounds of each round's median"},
                               "check": {"reference": "float32 torch, unfused, TF32 off",
                                         "rule": tolerance_module().RULE,
                                         "baseline_slack": tolerance_module().BASELINE_SLACK},
                               "complete": False, "cases": {}}
    if not isolate:
        import torch

        if cfg["device"] == "cuda":
            if not torch.cuda.is_available():
                print("no CUDA device visible to torch", file=sys.stderr)
                return 2
            torch.backends.cuda.matmul.allow_tf32 = False  # a float32 reference (fp16 systems are unaffected)
            torch.backends.cudnn.allow_tf32 = False
        results.update(environment(cfg["device"]))
        timer = cuda_timer if cfg["device"] == "cuda" else host_timer
    for name in names:
        t0 = time.perf_counter()
        if not child:
            print(f"== {name}", flush=True)
        entry = manifest["cases"][name]
        if isolate:
            got = run_child(art, name, cfg)
            for k, v in got["env"].items():
                results.setdefault(k, v)
            results["cases"][name] = got["case"]
        else:
            def save(partial: dict[str, Any], name: str = name) -> None:
                results["cases"][name] = {**partial, "incomplete": True}
                _write(out_path, results)

            try:
                results["cases"][name] = run_case(art, entry, cfg, timer, save)
            except Exception as exc:  # one case never loses the others
                traceback.print_exc()
                results["cases"][name] = {**results["cases"].get(name, {}), "error": _error(exc)}
        results["cases"][name].setdefault("wall_s", round(time.perf_counter() - t0, 1))
        _write(out_path, results)
    results["complete"] = True
    _write(out_path, results)
    if not child:
        print(format_table(results))
        print(f"wrote {out_path}")
    return 0


ENV_KEYS = ("python", "torch", "device", "device_capability", "cuda", "cudnn", "triton", "cupy")


def run_child(art: Path, name: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Run one case in a child process (a sticky CUDA error from a faulting kernel dies with it); its
    results and environment, or the case's error."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "case.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "run", str(art), "--out", str(out), "--cases", name,
               "--warmup", str(cfg["warmup"]), "--iters", str(cfg["iters"]), "--repeats", str(cfg["repeats"]),
               "--seed", str(cfg["seed"]), "--device", cfg["device"], "--no-isolate", "--child"]
        if cfg.get("ranks") is not None:
            cmd += ["--ranks", *map(str, cfg["ranks"])]
        rc = subprocess.run(cmd, check=False).returncode
        data = json.loads(out.read_text()) if out.is_file() else {}
    case = data.get("cases", {}).get(name)
    if case is None:
        case = {"error": f"the child process exited with {rc} before writing results (its output is above)"}
    elif rc != 0:
        case["error"] = f"the child process exited with {rc} (its output is above)"
    case.setdefault("child_rc", rc)
    return {"case": case, "env": {k: data[k] for k in ENV_KEYS if k in data}}


# ---- command line ----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="phase", required=True)
    e = sub.add_parser("export", help="build the candidates' CUDA artefacts (needs TVM and nvcc)")
    e.add_argument("art", type=Path)
    e.add_argument("--candidates", type=int, default=4, help="artefacts per case: the model's first that build")
    e.add_argument("--max-tries", type=int, default=None,
                   help="schedules tried per case at most (default: 3 x --candidates)")
    e.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    e.add_argument("--small", action="store_true", help="shrink every shape (a CPU test of the export)")
    r = sub.add_parser("run", help="check and time every system on the GPU (torch + cupy, no TVM)")
    r.add_argument("art", type=Path)
    r.add_argument("--out", type=Path, default=Path("mask_attention.json"))
    r.add_argument("--cases", nargs="+", default=None, help="default: every case of the manifest")
    timing_args(r, warmup=10, iters=100, repeats=3)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--ranks", nargs="+", type=int, default=None,
                   help="time only these exported candidates (default: all; e.g. to leave out one that faults)")
    r.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: run the script's logic without a GPU (a smoke test; times mean nothing)")
    r.add_argument("--no-isolate", action="store_true", help="run every case in this process, not one child each")
    r.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one case for an isolating parent
    a = ap.parse_args(argv)
    if a.phase == "export" and a.candidates < 1:
        ap.error("--candidates must be at least 1")
    if a.phase == "run" and min(a.repeats, a.iters) < 1:
        ap.error("--iters and --repeats must be at least 1")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.phase == "export":
        return export(a.art, a.cases, a.candidates, a.small, a.max_tries or 3 * a.candidates)
    cfg = {"device": a.device, "warmup": a.warmup, "iters": a.iters, "repeats": a.repeats, "seed": a.seed,
           "ranks": a.ranks}
    return run(a.art, a.out, a.cases, cfg, isolate=not a.no_isolate, child=a.child)


if __name__ == "__main__":
    sys.exit(main())
