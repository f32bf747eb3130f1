"""`transformers` models through `torch.compile(backend="spacefusion")` on the GPU, against eager and
torch.compile's modes, measured in one run per model (issue 27).

Two halves, as the lowering and the GPU live on different machines here:

    python experiments/dynamo_gpu.py export art/dynamo            # where TVM is (meta tensors, no GPU)
    python experiments/dynamo_gpu.py run art/dynamo --out r.json  # on the GPU (torch + cupy, no TVM)

``export`` captures every model with TorchDynamo on the meta device and writes the CUDA artefact of each
fused SMG's first pick (``frontend.dynamo.export_cuda``).  ``run`` builds the same models with random weights
in fp16 on the GPU, compiles them with ``spacefusion.compile(model, target=CudaBackend(art))`` (the
artefacts named by SMG content key; a missing one leaves its subgraph to torch, reported), checks each
system against float32 eager, and times eager, torch.compile (default, reduce-overhead), spacefusion as one
CUDA graph replay per Dynamo graph and spacefusion launch by launch, interleaved ``--repeats`` times (CUDA
events, L2 flushed by a read, median).  It also measures the host time of one fused launch without a graph.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: name -> (config class, model class, config kwargs, input kind, batch, seq); the real configs' defaults
MODELS: dict[str, tuple[str, str, dict[str, Any], str, int, int]] = {
    "bert_base_8x128": ("BertConfig", "BertModel", {}, "ids", 8, 128),
    "bert_base_8x128_padding": ("BertConfig", "BertModel", {}, "ids+mask", 8, 128),
    "bert_base_8x512": ("BertConfig", "BertModel", {}, "ids", 8, 512),
    "albert_base_8x128": ("AlbertConfig", "AlbertModel", {"hidden_size": 768, "num_attention_heads": 12,
                                                          "intermediate_size": 3072}, "ids", 8, 128),
    "t5_base_encoder_8x128": ("T5Config", "T5EncoderModel", {"d_model": 768, "d_ff": 3072, "num_layers": 12,
                                                             "num_heads": 12, "d_kv": 64}, "ids", 8, 128),
    "vit_b16_8": ("ViTConfig", "ViTModel", {}, "pixels", 8, 224),
    "gpt2_4x512": ("GPT2Config", "GPT2Model", {}, "ids", 4, 512),
    "llama2_7b_4layers_1x2048": ("LlamaConfig", "LlamaModel", {"hidden_size": 4096, "intermediate_size": 11008,
                                                               "num_attention_heads": 32, "num_key_value_heads": 32,
                                                               "num_hidden_layers": 4, "vocab_size": 32000,
                                                               "max_position_embeddings": 4096},
                                 "ids", 1, 2048),
    # one decode step of the same model: a token at position 2048 attends over a StaticCache holding an eager
    # prefill of 2048 (K and V written in place at cache_position, so every step has one shape: CUDA graphs)
    "llama2_7b_4layers_decode_1x2048": ("LlamaConfig", "LlamaModel", {"hidden_size": 4096, "intermediate_size": 11008,
                                                                      "num_attention_heads": 32,
                                                                      "num_key_value_heads": 32,
                                                                      "num_hidden_layers": 4, "vocab_size": 32000,
                                                                      "max_position_embeddings": 4096},
                                        "decode", 1, 2048),
    # Gemma-2-2B's config (soft-capped attention logits, sliding window, GQA, head dim 256), 4 of its layers
    "gemma2_2b_4layers_1x2048": ("Gemma2Config", "Gemma2Model", {"num_hidden_layers": 4, "vocab_size": 32000},
                                 "ids", 1, 2048),
    # issue 55's table of a user's first session: DistilBERT, CLIP's text encoder (ViT-B/32's), Whisper-base's
    # encoder on 30 s of audio (3000 mel frames), ConvNeXt-T
    "distilbert_8x128": ("DistilBertConfig", "DistilBertModel", {}, "ids", 8, 128),
    "clip_text_8x77": ("CLIPTextConfig", "CLIPTextModel", {}, "ids", 8, 77),
    "whisper_base_encoder_4x3000": ("WhisperConfig", "models.whisper.modeling_whisper.WhisperEncoder", {
        "d_model": 512, "encoder_layers": 6, "encoder_attention_heads": 8, "encoder_ffn_dim": 2048,
        "decoder_layers": 6, "decoder_attention_heads": 8, "decoder_ffn_dim": 2048}, "features", 4, 3000),
    "convnext_t_32x224": ("torchvision", "convnext_tiny", {}, "image", 32, 224),
    # depthwise-separable CNNs (issue 56): 3x3 / 5x5 depthwise convs with BatchNorm and ReLU6 / SiLU
    "mobilenet_v2_32x224": ("torchvision", "mobilenet_v2", {}, "image", 32, 224),
    "efficientnet_b0_32x224": ("torchvision", "efficientnet_b0", {}, "image", 32, 224),
    # issue 28's CNN: torchvision's ResNet-50 (v1.5), fp16 channels-last (what cuDNN and torch.compile are
    # fastest on), batch 32 of 224x224 images
    "resnet50_32x224": ("torchvision", "resnet50", {}, "image", 32, 224),
    # the same in torch's default NCHW memory, as a user who never asks for channels-last runs it (every system
    # gets NCHW weights and images: what each does about the layout is its own)
    "resnet50_32x224_nchw": ("torchvision", "resnet50", {}, "image_nchw", 32, 224),
    # Stable Diffusion 1.5's VAE decoder (diffusers' Decoder with SD 1.5's AutoencoderKL config) on a 64x64
    # latent: a 512x512 image
    "sd15_vae_decoder_1x64": ("diffusers", "Decoder", {
        "in_channels": 4, "out_channels": 3, "up_block_types": ("UpDecoderBlock2D",) * 4,
        "block_out_channels": (128, 256, 512, 512), "layers_per_block": 2, "norm_num_groups": 32, "act_fn": "silu"},
        "latent", 1, 64),
    # Stable Diffusion 1.5's UNet (diffusers' UNet2DConditionModel, SD 1.5's config) on a batch of 2 64x64
    # latents (classifier-free guidance's pair) with CLIP's 77 text tokens for its cross-attention
    "sd15_unet_2x64": ("diffusers", "UNet2DConditionModel", {
        "sample_size": 64, "in_channels": 4, "out_channels": 4, "cross_attention_dim": 768,
        "block_out_channels": (320, 640, 1280, 1280), "layers_per_block": 2, "attention_head_dim": 8,
        "norm_num_groups": 32}, "latent+text", 2, 64),
}



def _torchvision():
    """torchvision; where its C++ ops do not load against this torch (PyPI's CUDA wheel beside a CPU torch:
    "operator torchvision::nms does not exist"), imported without registering their fake kernels, which only
    the detection ops (nms, roi_align, ...) use: the classification models need none of them."""
    try:
        import torchvision
    except RuntimeError as exc:
        if "torchvision::" not in str(exc):
            raise
        import types

        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        sys.modules["torchvision._meta_registrations"] = types.ModuleType("torchvision._meta_registrations")
        print(f"torchvision's C++ ops did not load ({exc}); imported without their fake kernels", flush=True)
        import torchvision
    return torchvision

def _transformers_class(name: str) -> Any:
    """A model class of ``transformers`` by its top-level name, or by its module path below the package where
    it is not exported there (``models.whisper.modeling_whisper.WhisperEncoder``)."""
    import importlib

    import transformers

    if "." not in name:
        return getattr(transformers, name)
    module, _, cls = name.rpartition(".")
    return getattr(importlib.import_module(f"transformers.{module}"), cls)


def build(name: str, device: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The model with random weights (seeded) in fp16 and its inputs, on ``device`` ("meta" for export)."""
    cfg_cls, model_cls, kw, kind, b, s = MODELS[name]
    if cfg_cls in ("torchvision", "diffusers"):  # CNNs: fp16 channels-last, what cuDNN is fastest on (or NCHW)
        if cfg_cls == "torchvision":
            torchvision = _torchvision()

            cls, arg, ch = getattr(torchvision.models, model_cls), "x", 3
        elif kind == "latent+text":
            import diffusers

            cls, arg, ch = getattr(diffusers, model_cls), "sample", kw["in_channels"]
        else:
            from diffusers.models.autoencoders import vae

            cls, arg, ch = getattr(vae, model_cls), "sample", kw["in_channels"]
        fmt = torch.contiguous_format if kind == "image_nchw" else torch.channels_last
        torch.manual_seed(0)
        with torch.device(device):
            model = cls(**kw).eval().half().to(memory_format=fmt)
        gen = torch.Generator().manual_seed(1)
        img = torch.randn(b, ch, s, s, generator=gen).half().to(memory_format=fmt)
        x = {arg: img.to(device)}
        if kind == "latent+text":  # a mid-schedule timestep and 77 text-encoder states per image
            x["timestep"] = torch.full((b,), 500, dtype=torch.long).to(device)
            x["encoder_hidden_states"] = torch.randn(b, 77, kw["cross_attention_dim"], generator=gen).half().to(device)
        return model, x
    import transformers

    cfg = getattr(transformers, cfg_cls)(**kw)
    torch.manual_seed(0)
    with torch.device(device):
        model = _transformers_class(model_cls)(cfg).eval().half()
    gen = torch.Generator().manual_seed(1)
    if kind == "decode":
        model.register_forward_pre_hook(_rewind, with_kwargs=True)
        return model, decode_inputs(model, s, device)
    if kind == "pixels":
        x = {"pixel_values": torch.randn(b, 3, s, s, generator=gen).half()}
    elif kind == "features":  # log-mel frames: (batch, mel bins, frames)
        x = {"input_features": torch.randn(b, cfg.num_mel_bins, s, generator=gen).half()}
    else:
        x = {"input_ids": torch.randint(0, cfg.vocab_size, (b, s), generator=gen)}
        if kind == "ids+mask":  # padding: lengths from s/4 to s
            lengths = torch.linspace(s // 4, s, b).long()
            x["attention_mask"] = (torch.arange(s)[None, :] < lengths[:, None]).long()
    return model, {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in x.items()}


def cache_kwarg(model: torch.nn.Module) -> str:
    """The name under which ``model.forward`` takes its KV cache: ``cache`` in recent ``transformers``, whose
    ``past_key_values`` is a deprecated alias (a FutureWarning on every call), else ``past_key_values``
    (older releases, which a GPU machine may still have)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def decode_inputs(model: torch.nn.Module, past: int, device: str) -> dict[str, Any]:
    """One decode step's inputs: a token at position ``past`` and a StaticCache (room for 64 more) holding an
    eager prefill of ``past`` random tokens in the model's dtype (on "meta", for export, an empty one)."""
    import transformers

    cfg = model.config
    dtype = next(model.parameters()).dtype
    cache = transformers.StaticCache(config=cfg, max_cache_len=past + 64)
    heads, dim = cfg.num_key_value_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = torch.empty(1, heads, 1, dim, dtype=dtype, device=device)
    for layer in cache.layers:  # allocated before the step, as a prefill would have
        layer.lazy_initialization(kv, kv)
    gen = torch.Generator().manual_seed(2)
    if device != "meta":
        prompt = torch.randint(0, cfg.vocab_size, (1, past), generator=gen).to(device)
        with torch.no_grad():
            model(input_ids=prompt, **{cache_kwarg(model): cache}, use_cache=True,
                  cache_position=torch.arange(past, device=device))
    token = torch.randint(0, cfg.vocab_size, (1, 1), generator=gen).to(device)
    return {"input_ids": token, cache_kwarg(model): cache, "use_cache": True,
            "cache_position": torch.tensor([past], device=device)}


def _rewind(_: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    """Before a decode step: the cache's lengths back to the step's position.  A StaticCache writes K and V at
    its own running length, which each call advances: timed hundreds of times, one step would walk off the
    cache's end (an out-of-bounds ``index_copy_`` on the H100 after 64 calls).  Every system runs this, as
    a few in-place copies (in its graph where the hook is traced)."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    pos = kwargs.get("cache_position")
    if cache is not None and pos is not None:
        for layer in cache.layers:
            if torch.is_tensor(getattr(layer, "cumulative_length", None)):
                layer.cumulative_length.copy_(pos[0])


def float_inputs(name: str, model: torch.nn.Module, x: dict[str, Any]) -> dict[str, Any]:
    """``x`` for ``model`` in float32 (the exact reference): floating tensors cast; a decode step's cache
    prefilled again by the float32 model (a cache keeps one dtype)."""
    if MODELS[name][3] == "decode":
        return decode_inputs(model, MODELS[name][5], str(x["input_ids"].device))
    return {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in x.items()}


def export(art: Path, names: list[str], db: Path | None = None, hardware: tuple[str, ...] | None = None) -> int:
    """Each model's first picks, ranked for the first of ``hardware`` (None: this GPU's preset, else the H100,
    reported), as CUDA artefacts; with ``db``, its best schedules measured on the first of ``hardware`` with a
    record of them."""
    from spacefusion.api import export_cuda

    for name in names:
        torch._dynamo.reset()
        t = time.perf_counter()
        # decoders make a KV cache whose first append (cat onto an empty tensor) fake tensors refuse on meta
        prefill = MODELS[name][1] in ("LlamaModel", "GPT2Model") and MODELS[name][3] != "decode"
        model, x = build(name, "cpu" if prefill else "meta")
        backend = export_cuda(model, art / "kernels", db=db, hardware=hardware, **x)
        took = time.perf_counter() - t
        (art / f"{name}.partition.txt").write_text(str(backend) + "\n")
        print(f"{name}: exported in {took:.1f} s\n{backend}\n", flush=True)
    return 0


def tune_kinds(art: Path, names: list[str], kinds: list[str] | None, trials: int, db: Path | None,
               workers: int, gpus: int | None = None) -> int:
    """Tune the distinct SMGs of ``kinds`` in each model on this host's GPUs (TVM here) into ``db``: ``trials``
    candidates each, checked, then timed with L2 flushed (``LocalGPURunner``), on every visible GPU at once (one
    worker each, several SMGs side by side: ``runners.gpu_runner``), or ``gpus`` of them.  ``export --db`` then
    builds the best of each where TVM is."""
    from spacefusion.api import device_hardware
    from spacefusion.tuning import captured_partitions, gpu_runner, tune_partitions

    parts = []
    for name in names:
        torch._dynamo.reset()
        model, x = build(name, "meta")
        parts += captured_partitions(model, kinds=kinds, **x)
    # the most work first (uses x the largest op's iteration space), so a run cut short by the device's time
    # limit has tuned what matters; what the database holds is not measured again on the next run
    uses: dict[str, int] = {}
    for p in parts:
        for sub in p.subgraphs:
            uses[sub.key] = uses.get(sub.key, 0) + 1

    def work(sub: Any) -> float:
        sizes = sub.smg.dim_sizes
        return uses[sub.key] * max(math.prod(sizes[d] for d in op.iter_dims) for op in sub.smg.ops)

    parts = [dataclasses.replace(p, subgraphs=tuple(sorted(p.subgraphs, key=work, reverse=True))) for p in parts]
    runner = gpu_runner(gpus=gpus)
    try:
        report = tune_partitions(parts, runner, db or art / "tuning.db", hw=device_hardware(), trials=trials,
                                 workers=workers, progress=False)
    finally:
        close = getattr(runner, "close", None)
        if callable(close):
            close()
    (art / "tune_report.txt").write_text(str(report) + "\n")
    print(report, flush=True)
    return 0


def _last_hidden(out: Any) -> torch.Tensor:
    if hasattr(out, "sample"):  # diffusers' UNet2DConditionOutput
        return out.sample
    return out[0] if isinstance(out, tuple | list) else out.last_hidden_state if hasattr(out, "last_hidden_state") \
        else out


def host_cost_us(compiled: Any, calls: int = 2000) -> dict[str, Any]:
    """Host time of one fused launch without a graph: a small fused kernel called ``calls`` times back to
    back (the GPU queue keeps up; the CPU is the bound), per call, at three depths (the module, the
    backend's positional call, the runtime's planned launch), with cProfile's top functions of the module
    call; and one eager torch op's for scale."""
    import cProfile
    import pstats

    from spacefusion.api import FusedKernel

    report = compiled.spacefusion
    mods = [m for c in report.compiled for m in c.fused.graph_module.modules()
            if isinstance(m, FusedKernel) and not hasattr(m.kernel, "split")]  # one launch, not a split's two
    if not mods:
        return {}
    fk = min(mods, key=lambda m: sum(math.prod(r.shape) for r in m.sub.results))
    args = [torch.zeros(op.shape, dtype=torch.float16, device="cuda") for op in fk.values]

    def per_call(fn: Any) -> float:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        us = (time.perf_counter() - t) / calls * 1e6
        torch.cuda.synchronize()
        return round(us, 2)

    out: dict[str, Any] = {"kernel": fk.sub.label}
    with torch.no_grad():
        out["fused_call_us"] = per_call(lambda: fk(*args))
        kernel = fk.kernel
        if hasattr(kernel, "positional"):
            xs = [torch.zeros(math.prod(s), dtype=torch.float16, device="cuda") for s in kernel.input_shapes]
            out["backend_call_us"] = per_call(lambda: kernel.positional(*xs))
            launch = kernel.cuda_kernel.launcher(0)
            out["runtime_launch_us"] = per_call(lambda: launch(*xs))
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            fk(*args)
        prof.disable()
        torch.cuda.synchronize()
        stats = pstats.Stats(prof)
        top = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:12]  # by own time
        out["profile_own_us_per_call"] = [(f"{Path(k[0]).name}:{k[1]}:{k[2]}", round(v[2] / calls * 1e6, 2))
                                          for k, v in top]
        w = torch.zeros(64, 64, dtype=torch.float16, device="cuda")
        a = torch.zeros(16, 64, dtype=torch.float16, device="cuda")
        out["torch_linear_call_us"] = per_call(lambda: torch.nn.functional.linear(a, w))
    return out


#: kernel families by name, first match wins: what each system spends its GPU time on
CATEGORIES = (
    ("spacefusion conv", r"^sf_conv"), ("spacefusion attention", r"^sf_attention"),
    ("spacefusion group_norm", r"^sf_group_norm"), ("spacefusion norm", r"^sf_(residual_)?(layer|rms)norm"),
    ("spacefusion pool", r"^sf_max_pool"), ("spacefusion concat", r"^sf_concat"),
    ("spacefusion gemm", r"^sf_"), ("triton (inductor)", r"^triton_"),
    ("torch attention", r"flash|fmha|attention|sdpa"), ("torch pool", r"max_pool|avg_pool"),
    ("cuDNN conv", r"fprop|implicit_gemm|conv|nhwc|nchw|cudnn"), ("cuBLAS gemm", r"gemm|cutlass|cublas|xmma|sm90_"),
    ("torch element-wise", r"elementwise|vectorized|reduce_kernel|cat|copy|CatArray"),
)


def kernel_profile(fn: Any, x: dict[str, Any], n: int = 200) -> dict[str, Any]:
    """One forward under the profiler (after one unprofiled): its kernels' total device time, by family
    (``CATEGORIES``), and the ``n`` largest as (kernel, total µs, calls).  Kernels a CUDA graph replays are
    traced too, so spacefusion's and torch.compile's runs compare family by family."""
    import re

    from torch.profiler import ProfilerActivity, profile

    fn(**x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(**x)
        torch.cuda.synchronize()

    def us(e: Any) -> float:
        return float(getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0))

    rows = sorted(((e.key, us(e), e.count) for e in prof.key_averages() if us(e) > 0), key=lambda r: -r[1])
    cats: dict[str, list[float]] = {}
    for key, t, count in rows:
        cat = next((c for c, pat in CATEGORIES if re.search(pat, key, re.IGNORECASE)), "other")
        got = cats.setdefault(cat, [0.0, 0])
        got[0], got[1] = round(got[0] + t, 1), got[1] + count
    return {"total_us": round(sum(r[1] for r in rows), 1), "by_category": cats,
            "top": [(k[:90], round(t, 1), c) for k, t, c in rows[:n]]}


def run(art: Path, names: list[str], out_path: Path, warmup: int, iters: int, repeats: int,
        modes: tuple[str, ...] = ("default", "reduce-overhead"), build_missing: bool = False,
        tune_trials: int = 0, db_path: Path | None = None, workers: int = 8, second_art: Path | None = None,
        second_name: str = "tuned", pdl_ab: bool = False, map_copy_ab: bool = False,
        without: tuple[str, ...] = ()) -> int:
    from gpu_runtime import runtime_module

    import spacefusion
    from spacefusion.api import CudaBackend, device_hardware, first_pick_for, recorded_hardware

    time_cuda = runtime_module("timing").time_cuda
    # the machine the folder's kernels were ranked for (an export's), else this GPU's: one folder, one machine
    recorded = recorded_hardware(art / "kernels")
    hw = recorded[0] if recorded is not None else device_hardware()
    db = None
    if tune_trials:
        from spacefusion.tuning import TuningDatabase

        db = TuningDatabase(db_path or art / "tuning.db")
    torch._dynamo.config.cache_size_limit = 64  # four compiled systems of one model: never fall back to eager
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "models": {}}
    for name in names:
        torch._dynamo.reset()
        model, x = build(name, "cuda")
        row: dict[str, Any] = {"inputs": {k: list(v.shape) for k, v in x.items() if isinstance(v, torch.Tensor)}}
        with torch.no_grad():
            model.float()
            exact = _last_hidden(model(**float_inputs(name, model, x))).clone()
            model.half()
            systems: dict[str, Any] = {"eager": model}
            backend = CudaBackend(art / "kernels", schedule_for=first_pick_for(hw), build_missing=build_missing,
                                  hardware=hw)
            t = time.perf_counter()
            sf = spacefusion.compile(model, target=backend)
            _last_hidden(sf(**x))
            row["spacefusion_compile_s"] = round(time.perf_counter() - t, 1)
            systems["spacefusion+graph"] = sf
            nog = spacefusion.compile(model, target=backend, mode="max-autotune-no-cudagraphs")
            systems["spacefusion"] = nog
            if tune_trials:  # every distinct SMG measured on this GPU; the best of each built apart
                from spacefusion.api import device_hardware
                from spacefusion.tuning import LocalGPURunner, tune_partitions

                t = time.perf_counter()
                report = tune_partitions(sf.spacefusion.partitions, LocalGPURunner(), db, hw=device_hardware(),
                                         trials=tune_trials, workers=workers, progress=False)
                row["tune"] = {"s": round(time.perf_counter() - t, 1), "trials": tune_trials,
                               "subgraphs": len(report.tuned), "cached": report.cached, "report": str(report)}
                print(report, flush=True)
                tuned = CudaBackend(art / "kernels_tuned", build_missing=True,
                                    schedule_for=report.schedule_for(fallback=first_pick_for(hw)), hardware=hw)
                systems["spacefusion+graph tuned"] = spacefusion.compile(model, target=tuned)
                _last_hidden(systems["spacefusion+graph tuned"](**x))
            # the same kernels with one runtime feature off, captured (and so built into the graph) under it
            ablations = [("no PDL", "SPACEFUSION_PDL", pdl_ab),  # launched plainly, not programmatically dependent
                         ("map copies", "SPACEFUSION_DEFER_MAPS", map_copy_ab)]  # maps copied at every replay
            for ab_name, env, wanted in ablations:
                if not wanted:
                    continue
                os.environ[env] = "0"
                try:
                    off = CudaBackend(art / "kernels", schedule_for=first_pick_for(hw), hardware=hw)
                    systems[f"spacefusion+graph {ab_name}"] = spacefusion.compile(model, target=off)
                    _last_hidden(systems[f"spacefusion+graph {ab_name}"](**x))
                finally:
                    os.environ.pop(env)
            for matcher in without:  # the same kernels with one pattern left to torch (its ops run as captured)
                with _without_matcher(matcher):
                    systems[f"spacefusion+graph without {matcher}"] = spacefusion.compile(
                        model, target=CudaBackend(art / "kernels", schedule_for=first_pick_for(hw), hardware=hw))
                    _last_hidden(systems[f"spacefusion+graph without {matcher}"](**x))
            if second_art is not None:  # another export's artefacts (export --db: the tuned kernels), same code
                second_be = CudaBackend(second_art / "kernels")  # loads what that export built, as it was ranked
                systems[f"spacefusion+graph {second_name}"] = spacefusion.compile(model, target=second_be)
                _last_hidden(systems[f"spacefusion+graph {second_name}"](**x))
            for mode in modes:
                t = time.perf_counter()
                c = torch.compile(model, mode=mode)
                _last_hidden(c(**x))
                row[f"compile_{mode}_s"] = round(time.perf_counter() - t, 1)
                systems[f"torch.compile {mode}"] = c
            # a whole fp16 model against float32: errors compound over the layers, so the bar is eager fp16's
            # own distance from float32 (each system within twice that), not one kernel's rounding rule
            row["check"] = {}
            errs = {k: (_last_hidden(fn(**x)).float() - exact).abs().max().item() for k, fn in systems.items()}
            for sys_name, err in errs.items():
                row["check"][sys_name] = {"ok": err <= 2 * errs["eager"], "max_abs_err": round(err, 5),
                                          "vs_eager_fp16": round(err / errs["eager"], 3)}
            times: dict[str, list[float]] = {k: [] for k in systems}
            for _ in range(repeats):
                for sys_name, fn in systems.items():
                    times[sys_name].append(time_cuda(lambda f=fn, x=x: f(**x), warmup=warmup, iters=iters,
                                                        hold=False).median_us)
            row["us"] = {k: round(statistics.median(v), 1) for k, v in times.items()}
            row["partition"] = str(sf.spacefusion)
            row["partition_no_graph"] = str(nog.spacefusion)
            row["host"] = host_cost_us(nog)
            row["kernels"] = {k: kernel_profile(systems[k], x) for k in ("spacefusion", *(
                f"torch.compile {m}" for m in modes))}
            if second_art is not None or without:  # both systems' kernels as their graphs replay them
                for k in ("spacefusion+graph", *(f"spacefusion+graph {n}" for n in (
                        *((second_name,) if second_art is not None else ()), *(f"without {m}" for m in without)))):
                    row["kernels"][k] = kernel_profile(systems[k], x)
            row["top_kernels"] = row["kernels"]["spacefusion"]["top"][:12]
        best_compile = min(row["us"][f"torch.compile {m}"] for m in modes)
        row["speedup"] = {"vs_eager": round(row["us"]["eager"] / row["us"]["spacefusion+graph"], 3),
                          "vs_best_compile": round(best_compile / row["us"]["spacefusion+graph"], 3)}
        others = {"tuned", second_name, "no PDL", "map copies", *(f"without {m}" for m in without)}
        for other in others & {k.removeprefix("spacefusion+graph ") for k in row["us"]}:
            other_us = row["us"][f"spacefusion+graph {other}"]
            row["speedup"] |= {f"{other}_vs_eager": round(row["us"]["eager"] / other_us, 3),
                               f"{other}_vs_best_compile": round(best_compile / other_us, 3)}
        results["models"][name] = row
        print(json.dumps({name: {k: row[k] for k in ("us", "speedup", "check", "host", "top_kernels")}}), flush=True)
        print(row["partition"], flush=True)
        out_path.write_text(json.dumps(results, indent=1) + "\n")
        del systems, sf, nog, model
        torch.cuda.empty_cache()
    return 0


@contextlib.contextmanager
def _without_matcher(name: str):
    """The partitioner without the pattern ``name`` (a row of ``frontend.table``, by its name or its builder's:
    ``concat`` / ``match_concat``): an in-run A/B of one pattern, whose nodes then run as Dynamo captured them."""
    import spacefusion.frontend.partition  # noqa: F401 (the module: the package exports a function of its name)
    from spacefusion.frontend.table import ROWS

    partition = sys.modules["spacefusion.frontend.partition"]
    known = {r.name: r for r in ROWS} | {r.build.__name__: r for r in ROWS}
    if name not in known:
        raise SystemExit(f"--without {name}: not a pattern; known: {', '.join(r.name for r in ROWS)}")
    saved = partition.ROWS
    partition.ROWS = tuple(r for r in saved if r is not known[name])
    try:
        yield
    finally:
        partition.ROWS = saved


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("phase", choices=("export", "run", "tune"))
    ap.add_argument("art", type=Path)
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--out", type=Path, default=Path("dynamo_gpu.json"))
    from gpu_runtime import timing_args

    timing_args(ap, warmup=5, iters=30, repeats=3)
    ap.add_argument("--build-missing", action="store_true",
                    help="build an SMG's first pick where its artefact is missing (TVM on the GPU machine)")
    ap.add_argument("--tune", type=int, default=0, metavar="TRIALS",
                    help="also tune every distinct SMG on this GPU (TVM here) and time the tuned kernels")
    ap.add_argument("--db", type=Path, default=None,
                    help="the tuning database (tune, run --tune: default ART/tuning.db; export: build its picks)")
    ap.add_argument("--hw", nargs="+", default=None,
                    help="export: the machine the first picks are ranked for (the first named; default: this GPU's "
                         "preset, else the H100, reported) and, with --db, whose measurements to build from, in "
                         "order (e.g. 'H200 H100': a round measured on an H200 where it has one, else the H100's)")
    ap.add_argument("--kinds", nargs="*", default=None,
                    help="tune: only the subgraphs of these kinds (conv, attention, gemm, group_norm, ...)")
    ap.add_argument("--trials", type=int, default=8, help="tune: candidates per SMG")
    ap.add_argument("--gpus", type=int, default=None,
                    help="tune: how many of this host's GPUs measure at once, one worker each (default: all)")
    ap.add_argument("--second-art", "--tuned-art", type=Path, default=None, dest="second_art",
                    help="run: also time the artefacts of this export (export --db: the tuned kernels), built by the "
                         "same code, as 'spacefusion+graph NAME' (--second-name)")
    ap.add_argument("--pdl-ab", action="store_true",
                    help="run: also the same kernels launched without programmatic dependent launch ('no PDL')")
    ap.add_argument("--map-copy-ab", action="store_true",
                    help="run: also the same kernels with each replay copying the tensor maps its capture encoded "
                         "('map copies', SPACEFUSION_DEFER_MAPS=0)")
    ap.add_argument("--second-name", default="tuned",
                    help="run: the second export's system name (default 'tuned'; e.g. 'first picks' or a commit)")
    ap.add_argument("--without", nargs="*", default=[], metavar="MATCHER",
                    help="run: also the same kernels with these matchers off ('spacefusion+graph without "
                         "MATCHER', e.g. match_concat: the pattern's ops as torch runs them), in the same run")
    ap.add_argument("--workers", type=int, default=8, help="parallel TVM builds while tuning")
    ap.add_argument("--max-autotune", action="store_true",
                    help="also torch.compile(mode='max-autotune') (minutes of autotuning per model)")
    a = ap.parse_args(argv)
    if a.phase == "export":
        return export(a.art, a.models, a.db, tuple(a.hw) if a.hw else None)
    if a.phase == "tune":
        return tune_kinds(a.art, a.models, a.kinds, a.trials, a.db, a.workers, a.gpus)
    modes = ("default", "reduce-overhead", *(("max-autotune",) if a.max_autotune else ()))
    return run(a.art, a.models, a.out, a.warmup, a.iters, a.repeats, modes, a.build_missing or bool(a.tune),
               a.tune, a.db, a.workers, a.second_art, a.second_name, a.pdl_ab,
               a.map_copy_ab, tuple(a.without))


if __name__ == "__main__":
    sys.exit(main())
