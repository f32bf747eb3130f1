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
CUDA graph replay per Dynamo graph and spacefusion launch by launch (both with ``measure=False``: the fused
kernels whatever their speed), spacefusion with its measured choice (the GPU's default: each graph's fused
path or torch's, whichever its first calls timed faster, ``frontend.measure``; ``measured`` in the row says
what each graph kept), interleaved ``--repeats`` times (CUDA
events, L2 flushed by a read, median).  It also measures the host time of one fused launch without a graph.
``partition`` is ``export``'s capture and partition alone, nothing built: a dry run in seconds.

Issue 57's tables (Qwen2.5-0.5B whole, LLaMA-3-8B's first 4 layers; prefill at 1 x 1024 and 4 x 2048; one
decode step at batch 1, 8, 64 over 2048 and 8192 cached tokens of a StaticCache filled with random K/V).  A
decode row also has ``bandwidth``: the step's necessary bytes (weights + the K/V it attends to) over each
system's time, as a fraction of the device-to-device copy bandwidth measured at the start of the same run.
Exported here for the H200's hardware model, then on the GPU, one ``run`` call per line (each under 10 min):

    python experiments/dynamo_gpu.py export art/i57_models --hw H200 --models qwen2_0p5b_1x1024 ...  # here
    python experiments/dynamo_gpu.py run art/i57_models --sdpa-cudnn --out $OUT/i57_prefill_qwen2.json \
        --models qwen2_0p5b_1x1024 qwen2_0p5b_4x2048
    python experiments/dynamo_gpu.py run art/i57_models --sdpa-cudnn --out $OUT/i57_prefill_llama3.json \
        --models llama3_8b_4layers_1x1024 llama3_8b_4layers_4x2048
    python experiments/dynamo_gpu.py run art/i57_models --sdpa-cudnn --out $OUT/i57_decode_qwen2.json \
        --models qwen2_0p5b_decode_b{1,8,64}_{2048,8192}
    python experiments/dynamo_gpu.py run art/i57_models --sdpa-cudnn --out $OUT/i57_decode_llama3.json \
        --models llama3_8b_4layers_decode_b{1,8,64}_{2048,8192}
    python experiments/dynamo_gpu.py run art/i57_models --max-autotune --out $OUT/i57_max_autotune.json \
        --models qwen2_0p5b_1x1024 llama3_8b_4layers_decode_b1_2048     # minutes of autotuning per model

The results file is rewritten after each model, so a call cut off at its time limit keeps the models it ran.
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

#: Qwen2.5-0.5B's config (24 layers, GQA 14/2, head dim 64, hidden 896, FFN 4864, q/k/v biases, tied embeddings)
QWEN2_0P5B: dict[str, Any] = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                              "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
                              "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                              "tie_word_embeddings": True, "use_sliding_window": False}
#: LLaMA-3-8B's config, 4 of its 32 layers (GQA 32/8, head dim 128, hidden 4096, FFN 14336, vocab 128256)
LLAMA3_8B_4L: dict[str, Any] = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 4,
                                "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                                "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5}

#: name -> (config class, model class, config kwargs, input kind, batch, seq); the real configs' defaults.
#: Input kinds: "ids" token ids (b, seq); "ids+mask" with a padding mask; "decode" one token at position seq
#: over a StaticCache an eager prefill of seq tokens filled (batch 1); "decode_random" b tokens at position seq
#: over a StaticCache of seq tokens of seeded random K/V; "pixels", "features", "image", "latent" the rest.
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
    # issue 57's prefill table: Qwen2.5-0.5B whole, LLaMA-3-8B's first 4 layers
    **{f"qwen2_0p5b_{b}x{s}": ("Qwen2Config", "Qwen2Model", QWEN2_0P5B, "ids", b, s)
       for b, s in ((1, 1024), (4, 2048))},
    **{f"llama3_8b_4layers_{b}x{s}": ("LlamaConfig", "LlamaModel", LLAMA3_8B_4L, "ids", b, s)
       for b, s in ((1, 1024), (4, 2048))},
    # issue 57's decode table: one step of batch b over a StaticCache of `past` tokens filled with seeded random
    # K/V in place of a prefill (b x 8192 tokens of eager prefill, twice with the float32 reference, would
    # cost more GPU time than the table; the step's work does not depend on the cache's values)
    **{f"{stem}_decode_b{b}_{past}": (cfg, "Qwen2Model" if stem.startswith("qwen2") else "LlamaModel", kw,
                                      "decode_random", b, past)
       for stem, cfg, kw in (("qwen2_0p5b", "Qwen2Config", QWEN2_0P5B),
                             ("llama3_8b_4layers", "LlamaConfig", LLAMA3_8B_4L))
       for past in (2048, 8192) for b in (1, 8, 64)},
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



#: decoders whose prefill makes a DynamicCache: its first append (a cat onto an empty tensor) fake tensors refuse
#: on meta, so their prefill is captured from CPU weights
DYNAMIC_CACHE = ("LlamaModel", "GPT2Model", "Qwen2Model")


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


def build(name: str, device: str, spec: tuple[str, str, dict[str, Any], str, int, int] | None = None
          ) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The model with random weights (seeded) in fp16 and its inputs, on ``device`` ("meta" for export);
    ``spec``: a ``MODELS``-form entry in place of ``MODELS[name]`` (another script's models)."""
    cfg_cls, model_cls, kw, kind, b, s = spec or MODELS[name]
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
    if kind.startswith("decode"):
        model.register_forward_pre_hook(_rewind, with_kwargs=True)
        return model, decode_inputs(model, s, device, batch=b, prefill=kind == "decode")
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


#: a decode step's StaticCache holds this many positions past the step's (written by no step: the rewind)
CACHE_SPARE = 64


def _kv_shape(cfg: Any) -> tuple[int, int]:
    """(KV heads, head dim) of a decoder's config."""
    return cfg.num_key_value_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def decode_inputs(model: torch.nn.Module, past: int, device: str, batch: int = 1,
                  prefill: bool = True) -> dict[str, Any]:
    """One decode step's inputs: ``batch`` tokens at position ``past`` and a StaticCache (room for
    ``CACHE_SPARE`` more) in the model's dtype holding ``past`` positions: an eager prefill of random tokens
    (``prefill``), or K and V drawn from a seeded N(0, 1) (fp16 numbers: the same values in fp16 and float32),
    which costs no GPU time at any batch (a prefill of 64 x 8192 tokens would cost more than the step's whole
    table) and leaves the step's work unchanged. On "meta", for export, the cache is allocated and left empty."""
    import transformers

    cfg = model.config
    dtype = next(model.parameters()).dtype
    cache = transformers.StaticCache(config=cfg, max_cache_len=past + CACHE_SPARE)
    heads, dim = _kv_shape(cfg)
    kv = torch.empty(batch, heads, 1, dim, dtype=dtype, device=device)
    for layer in cache.layers:  # allocated before the step, as a prefill would have
        layer.lazy_initialization(kv, kv)
    gen = torch.Generator().manual_seed(2)
    if device != "meta" and prefill:
        prompt = torch.randint(0, cfg.vocab_size, (batch, past), generator=gen).to(device)
        with torch.no_grad():
            model(input_ids=prompt, **{cache_kwarg(model): cache}, use_cache=True,
                  cache_position=torch.arange(past, device=device))
    elif device != "meta":
        for i, layer in enumerate(cache.layers):  # seeded per layer and tensor on the device: one draw, any dtype
            for j, t in enumerate((layer.keys, layer.values)):
                g = torch.Generator(device=device).manual_seed(1000 + 2 * i + j)
                t[:, :, :past].copy_(torch.randn(t[:, :, :past].shape, generator=g, device=device).half())
            if torch.is_tensor(getattr(layer, "cumulative_length", None)):  # as a prefill of `past` leaves it
                layer.cumulative_length.fill_(past)
    token = torch.randint(0, cfg.vocab_size, (batch, 1), generator=gen).to(device)
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
    _, _, _, kind, b, s = MODELS[name]
    if kind.startswith("decode"):
        return decode_inputs(model, s, str(x["input_ids"].device), batch=b, prefill=kind == "decode")
    return {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in x.items()}


def export(art: Path, names: list[str], db: Path | None = None, hardware: tuple[str, ...] | None = None) -> int:
    """Each model's first picks, ranked for the first of ``hardware`` (None: this GPU's preset, else the H100,
    reported), as CUDA artefacts; with ``db``, its best schedules measured on the first of ``hardware`` with a
    record of them."""
    from spacefusion.api import export_cuda

    for name in names:
        torch._dynamo.reset()
        t = time.perf_counter()
        prefill = MODELS[name][1] in DYNAMIC_CACHE and not MODELS[name][3].startswith("decode")
        model, x = build(name, "cpu" if prefill else "meta")
        backend = export_cuda(model, art / "kernels", db=db, hardware=hardware, **x)
        took = time.perf_counter() - t
        (art / f"{name}.partition.txt").write_text(str(backend) + "\n")
        print(f"{name}: exported in {took:.1f} s\n{backend}\n", flush=True)
    return 0


def partition_only(names: list[str]) -> dict[str, list[str]]:
    """Each model captured and partitioned as ``export`` does it (same device, same inputs), nothing ranked or
    built: a check in seconds that a MODELS entry captures and what it fuses, before an export's minutes.
    Returns name -> one line per distinct fused SMG ("count x label [key]"), printed as it goes."""
    from spacefusion.tuning import captured_partitions

    out: dict[str, list[str]] = {}
    for name in names:
        torch._dynamo.reset()
        t = time.perf_counter()
        prefill = MODELS[name][1] in DYNAMIC_CACHE and not MODELS[name][3].startswith("decode")
        model, x = build(name, "cpu" if prefill else "meta")
        counts: dict[tuple[str, str], int] = {}
        for part in captured_partitions(model, **x):
            for sub in part.subgraphs:
                counts[(sub.label, sub.key)] = counts.get((sub.label, sub.key), 0) + 1
        out[name] = [f"{n} x {label} [{key[:10]}]" for (label, key), n in counts.items()]
        print(f"{name}: {sum(counts.values())} fused subgraphs, {len(counts)} distinct SMGs, captured in "
              f"{time.perf_counter() - t:.1f} s\n  " + "\n  ".join(out[name]), flush=True)
    return out


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


def copy_bandwidth(nbytes: int = 1 << 30, warmup: int = 3, iters: int = 20) -> dict[str, float]:
    """This GPU's device-to-device copy bandwidth, the roof a decode step's bytes are held to: one ``nbytes``
    copy timed with CUDA events (median; the buffers dwarf L2, so nothing is flushed), counted as bytes read
    plus bytes written over time, as CUDA's bandwidthTest counts a device-to-device copy."""
    from gpu_runtime import runtime_module

    bufs = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
    t = runtime_module("timing").time_cuda(lambda: bufs[1].copy_(bufs[0]), warmup=warmup, iters=iters,
                                           flush_l2=False)
    bufs.clear()  # 2 x nbytes back before the models
    torch.cuda.empty_cache()
    return {"bytes_copied": nbytes, "us": round(t.median_us, 1), "gb_s": round(2 * nbytes / t.median_us / 1e3, 1)}


def decode_step_bytes(model: torch.nn.Module, x: dict[str, Any]) -> dict[str, int]:
    """The fewest bytes one decode step must read: every weight once (the embedding table only for the
    ``batch`` rows it gathers; shared weights once) and, per layer, K and V of the ``past + 1`` positions the
    step attends to (the cache's ``past`` and its own).  What a kernel reads beyond that (the StaticCache's
    spare, masked positions; activations) is not counted: the fraction of copy bandwidth is of the step's
    necessary traffic."""
    emb = model.get_input_embeddings().weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if p is not emb)
    batch = x["input_ids"].shape[0]
    weights += batch * emb.shape[1] * emb.element_size()
    attended = int(x["cache_position"][-1]) + 1
    kv = 0
    for layer in x[cache_kwarg(model)].layers:
        b, heads, _, dim = layer.keys.shape
        kv += 2 * b * heads * attended * dim * layer.keys.element_size()
    return {"weights_bytes": weights, "kv_bytes": kv, "bytes": weights + kv}


def bandwidth_fractions(step_bytes: dict[str, int], us: dict[str, float], copy_gb_s: float) -> dict[str, Any]:
    """Each system's decode step as achieved bandwidth (``step_bytes['bytes']`` over its time) and as a fraction
    of the measured copy bandwidth ``copy_gb_s``."""
    out: dict[str, Any] = {**step_bytes, "copy_gb_s": copy_gb_s, "systems": {}}
    for sys_name, t in us.items():
        gb_s = step_bytes["bytes"] / t / 1e3
        out["systems"][sys_name] = {"gb_s": round(gb_s, 1), "fraction_of_copy": round(gb_s / copy_gb_s, 3)}
    return out


def _sdpa_cudnn(fn: Any) -> Any:
    """``fn`` with every scaled_dot_product_attention forced onto cuDNN's backend (an error where cuDNN cannot
    take a call's mask or head layout, rather than a silent fallback)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def call(**x: Any) -> Any:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return fn(**x)

    return call


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
        without: tuple[str, ...] = (), sdpa_cudnn: bool = False) -> int:
    """Time ``names`` on this GPU against eager and torch.compile's ``modes`` (see the module docstring) into
    ``out_path``, rewritten after each model.  A decode step's row also has ``bandwidth``: its necessary bytes
    (``decode_step_bytes``) over each system's time, as a fraction of this GPU's copy bandwidth, measured once
    at the start (``copy_bandwidth``).  ``sdpa_cudnn``: also eager and torch.compile reduce-overhead with SDPA
    forced onto cuDNN (a system cuDNN refuses is reported under ``refused``, not timed), each profiled
    (``kernels``): the kernel names say whether cuDNN's attention ran, as Dynamo may reuse the graph it
    compiled for the plain reduce-overhead system where it does not guard on the SDPA backend."""
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
    if any(MODELS[n][3].startswith("decode") for n in names):
        results["copy_bandwidth"] = copy_bandwidth()
        print(f"copy bandwidth: {results['copy_bandwidth']}", flush=True)
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
            sf = spacefusion.compile(model, target=backend, measure=False)
            _last_hidden(sf(**x))
            row["spacefusion_compile_s"] = round(time.perf_counter() - t, 1)
            systems["spacefusion+graph"] = sf
            nog = spacefusion.compile(model, target=backend, mode="max-autotune-no-cudagraphs", measure=False)
            systems["spacefusion"] = nog
            # the product's default on the GPU: each graph's fused path timed against torch's, the faster kept
            # (``frontend.measure``); called until every graph decided, so the timed calls run the choice
            from spacefusion.api import measure

            measured = spacefusion.compile(model, target=backend)
            for _ in range(2 * (measure.WARMUP + measure.SAMPLES) + 1):
                _last_hidden(measured(**x))
            systems["spacefusion+graph measured"] = measured
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
                systems["spacefusion+graph tuned"] = spacefusion.compile(model, target=tuned, measure=False)
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
                    systems[f"spacefusion+graph {ab_name}"] = spacefusion.compile(model, target=off, measure=False)
                    _last_hidden(systems[f"spacefusion+graph {ab_name}"](**x))
                finally:
                    os.environ.pop(env)
            for matcher in without:  # the same kernels with one pattern left to torch (its ops run as captured)
                with _without_matcher(matcher):
                    systems[f"spacefusion+graph without {matcher}"] = spacefusion.compile(
                        model, target=CudaBackend(art / "kernels", schedule_for=first_pick_for(hw), hardware=hw),
                        measure=False)
                    _last_hidden(systems[f"spacefusion+graph without {matcher}"](**x))
            if second_art is not None:  # another export's artefacts (export --db: the tuned kernels), same code
                second_be = CudaBackend(second_art / "kernels")  # loads what that export built, as it was ranked
                systems[f"spacefusion+graph {second_name}"] = spacefusion.compile(model, target=second_be,
                                                                                  measure=False)
                _last_hidden(systems[f"spacefusion+graph {second_name}"](**x))
            for mode in modes:
                t = time.perf_counter()
                c = torch.compile(model, mode=mode)
                _last_hidden(c(**x))
                row[f"compile_{mode}_s"] = round(time.perf_counter() - t, 1)
                systems[f"torch.compile {mode}"] = c
            if sdpa_cudnn:
                for sys_name, base in (("eager sdpa-cudnn", model),  # torch.compile compiles at the first call
                                       ("torch.compile reduce-overhead sdpa-cudnn",
                                        torch.compile(model, mode="reduce-overhead"))):
                    try:
                        wrapped = _sdpa_cudnn(base)
                        _last_hidden(wrapped(**x))
                        systems[sys_name] = wrapped
                    except Exception as exc:  # cuDNN refused the mask or layout: say so, time the rest
                        row.setdefault("refused", {})[sys_name] = f"{type(exc).__name__}: {exc}"[:400]
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
            row["measured"] = [{"graph": g.index, "sizes": sizes, "kept": r.kept, "measured": r.measured}
                               for g in measured.spacefusion.graphs
                               for sizes, r in ([("", g)] if not g.shapes else list(g.shapes.items()))]
            row["host"] = host_cost_us(nog)
            row["kernels"] = {k: kernel_profile(systems[k], x) for k in ("spacefusion", *(
                f"torch.compile {m}" for m in modes))}
            if second_art is not None or without:  # both systems' kernels as their graphs replay them
                for k in ("spacefusion+graph", *(f"spacefusion+graph {n}" for n in (
                        *((second_name,) if second_art is not None else ()), *(f"without {m}" for m in without)))):
                    row["kernels"][k] = kernel_profile(systems[k], x)
            for k in ("eager sdpa-cudnn", "torch.compile reduce-overhead sdpa-cudnn"):
                if k in systems:  # which attention kernels ran: cuDNN's, or a graph compiled before the flag
                    row["kernels"][k] = kernel_profile(systems[k], x, n=24)
            row["top_kernels"] = row["kernels"]["spacefusion"]["top"][:12]
            if MODELS[name][3].startswith("decode"):
                row["bandwidth"] = bandwidth_fractions(decode_step_bytes(model, x), row["us"],
                                                       results["copy_bandwidth"]["gb_s"])
        best_compile = min(row["us"][f"torch.compile {m}"] for m in modes)
        row["speedup"] = {"vs_eager": round(row["us"]["eager"] / row["us"]["spacefusion+graph"], 3),
                          "vs_best_compile": round(best_compile / row["us"]["spacefusion+graph"], 3)}
        others = {"tuned", second_name, "no PDL", "map copies", *(f"without {m}" for m in without)}
        for other in others & {k.removeprefix("spacefusion+graph ") for k in row["us"]}:
            other_us = row["us"][f"spacefusion+graph {other}"]
            row["speedup"] |= {f"{other}_vs_eager": round(row["us"]["eager"] / other_us, 3),
                               f"{other}_vs_best_compile": round(best_compile / other_us, 3)}
        results["models"][name] = row
        print(json.dumps({name: {k: row[k] for k in ("us", "speedup", "check", "host", "top_kernels", "bandwidth",
                                                     "refused") if k in row}}), flush=True)
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
    ap.add_argument("phase", choices=("export", "run", "tune", "partition"),
                    help="partition: capture and partition only (nothing built; ART unused): a dry run of export")
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
    ap.add_argument("--sdpa-cudnn", action="store_true",
                    help="run: also eager and torch.compile reduce-overhead with SDPA forced onto cuDNN")
    ap.add_argument("--max-autotune", action="store_true",
                    help="also torch.compile(mode='max-autotune') (minutes of autotuning per model)")
    a = ap.parse_args(argv)
    if a.phase == "export":
        return export(a.art, a.models, a.db, tuple(a.hw) if a.hw else None)
    if a.phase == "partition":
        partition_only(a.models)
        return 0
    if a.phase == "tune":
        return tune_kinds(a.art, a.models, a.kinds, a.trials, a.db, a.workers, a.gpus)
    modes = ("default", "reduce-overhead", *(("max-autotune",) if a.max_autotune else ()))
    return run(a.art, a.models, a.out, a.warmup, a.iters, a.repeats, modes, a.build_missing or bool(a.tune),
               a.tune, a.db, a.workers, a.second_art, a.second_name, a.pdl_ab,
               a.map_copy_ab, tuple(a.without), a.sdpa_cudnn)


if __name__ == "__main__":
    sys.exit(main())
