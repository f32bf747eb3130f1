"""The end-to-end benchmark's decode step (experiments/dynamo_gpu.py): a StaticCache prefilled once, and a step that
can be timed any number of times (the cache's running lengths rewound before each call), on a tiny LLaMA; issue 57's
batched steps over a random cache, their bytes and bandwidth fraction, the partition dry run and the table's configs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

import dynamo_gpu  # noqa: E402

import spacefusion  # noqa: E402

NAME, PAST = "tiny_llama_decode", 24


@pytest.fixture()
def tiny(monkeypatch: pytest.MonkeyPatch) -> str:
    kw = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
          "num_hidden_layers": 2, "vocab_size": 128, "max_position_embeddings": 256}
    monkeypatch.setitem(dynamo_gpu.MODELS, NAME, ("LlamaConfig", "LlamaModel", kw, "decode", 1, PAST))
    return NAME


def test_a_decode_step_repeats_past_the_caches_spare_room(tiny: str) -> None:
    model, x = dynamo_gpu.build(tiny, "cpu")
    model.float()  # the CPU's matmuls: float32 throughout (a fresh cache takes the model's dtype)
    x = dynamo_gpu.float_inputs(tiny, model, x)
    cache = x[dynamo_gpu.cache_kwarg(model)]
    assert "past_key_values" not in x or dynamo_gpu.cache_kwarg(model) == "past_key_values"  # the modern name
    assert cache.layers[0].keys.dtype == torch.float32 and cache.layers[0].keys.shape[2] == PAST + 64
    assert int(cache.layers[0].cumulative_length) == PAST  # the prefill
    compiled = spacefusion.compile(model, target="reference")
    with torch.no_grad():
        first = dynamo_gpu._last_hidden(model(**x)).clone()
        for fn in (model, compiled):
            for _ in range(70):  # more steps than the cache has room for: each rewound to position PAST
                out = dynamo_gpu._last_hidden(fn(**x))
            torch.testing.assert_close(out, first, rtol=1e-4, atol=1e-4)
    assert int(cache.layers[0].cumulative_length) == PAST + 1
    assert (cache.layers[0].keys[:, :, PAST + 1:] == 0).all()  # nothing written past the step's position


def test_export_builds_the_decode_step_on_meta(tiny: str) -> None:
    model, x = dynamo_gpu.build(tiny, "meta")
    assert x["cache_position"].shape == (1,) and x["input_ids"].shape == (1, 1)
    keys = x[dynamo_gpu.cache_kwarg(model)].layers[0].keys  # allocated as a prefill would have, without one
    assert keys.device.type == "meta" and keys.shape[2] == PAST + 64 and keys.dtype == torch.float16



@pytest.fixture()
def tiny_batched(monkeypatch: pytest.MonkeyPatch) -> str:
    """Issue 57's decode table in miniature: Qwen2's layout (q/k/v biases, GQA) at batch 3 over a random cache."""
    kw = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
          "num_hidden_layers": 2, "vocab_size": 128, "max_position_embeddings": 256}
    monkeypatch.setitem(dynamo_gpu.MODELS, "tiny_qwen2_decode_b3", ("Qwen2Config", "Qwen2Model", kw,
                                                                     "decode_random", 3, PAST))
    return "tiny_qwen2_decode_b3"


def test_a_random_cache_holds_the_same_values_in_both_dtypes_and_repeats(tiny_batched: str) -> None:
    model, x = dynamo_gpu.build(tiny_batched, "cpu")
    cache = x[dynamo_gpu.cache_kwarg(model)]
    assert x["input_ids"].shape == (3, 1) and cache.layers[0].keys.shape == (3, 2, PAST + dynamo_gpu.CACHE_SPARE, 16)
    assert int(cache.layers[0].cumulative_length) == PAST
    assert cache.layers[0].keys[:, :, :PAST].std() > 0.5 and (cache.layers[0].keys[:, :, PAST:] == 0).all()
    assert not torch.equal(cache.layers[0].keys[:, :, :PAST], cache.layers[1].keys[:, :, :PAST])  # seeded per layer
    model.float()
    ref = dynamo_gpu.float_inputs(tiny_batched, model, x)[dynamo_gpu.cache_kwarg(model)]
    for half, full in zip(cache.layers, ref.layers, strict=True):  # the float32 reference reads the same cache
        assert full.keys.dtype == torch.float32
        torch.testing.assert_close(full.keys[:, :, :PAST], half.keys[:, :, :PAST].float(), rtol=0, atol=0)
        torch.testing.assert_close(full.values[:, :, :PAST], half.values[:, :, :PAST].float(), rtol=0, atol=0)
    x = dynamo_gpu.float_inputs(tiny_batched, model, x)
    with torch.no_grad():
        first = dynamo_gpu._last_hidden(model(**x)).clone()
        for _ in range(3):  # rewound to position PAST each time
            out = dynamo_gpu._last_hidden(model(**x))
    assert first.shape == (3, 1, 64)
    torch.testing.assert_close(out, first)


def test_a_decode_steps_bytes_and_its_fraction_of_the_copy_bandwidth(tiny_batched: str) -> None:
    model, x = dynamo_gpu.build(tiny_batched, "cpu")
    got = dynamo_gpu.decode_step_bytes(model, x)
    emb = model.get_input_embeddings().weight
    params = sum(p.numel() for p in model.parameters())
    assert got["weights_bytes"] == 2 * (params - emb.numel() + 3 * 64)  # the table's 3 gathered rows only
    assert got["kv_bytes"] == 2 * (2 * 3 * 2 * (PAST + 1) * 16) * 2  # layers x (K, V) x batch x heads x pos x dim
    frac = dynamo_gpu.bandwidth_fractions({**got, "bytes": 3_000_000}, {"eager": 2.0, "sf": 1.0}, 3000.0)
    assert frac["systems"]["sf"] == {"gb_s": 3000.0, "fraction_of_copy": 1.0}
    assert frac["systems"]["eager"]["fraction_of_copy"] == 0.5 and frac["copy_gb_s"] == 3000.0


def test_the_partition_dry_run_captures_a_prefill_and_a_batched_decode(tiny_batched: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    kw = dynamo_gpu.MODELS[tiny_batched][2]
    monkeypatch.setitem(dynamo_gpu.MODELS, "tiny_qwen2_prefill", ("Qwen2Config", "Qwen2Model", kw, "ids", 2, 32))
    got = dynamo_gpu.partition_only(["tiny_qwen2_prefill", tiny_batched])
    assert any("attention b2 h4/2 32x32 d16 causal" in line for line in got["tiny_qwen2_prefill"])
    assert any("gated gemm" in line for line in got["tiny_qwen2_prefill"])
    decode = got[tiny_batched]
    # GQA read per kv head through repeat_kv (issue 57): h4/2, not K/V copied per query head
    assert any(line.startswith(f"2 x attention b3 h4/2 1x{PAST + dynamo_gpu.CACHE_SPARE}") for line in decode), decode


def test_issue_57s_entries_are_the_real_configs() -> None:
    import transformers

    want = {"qwen2_0p5b": (24, 14, 2, 64, 896, 4864), "llama3_8b_4layers": (4, 32, 8, 128, 4096, 14336)}
    names = [n for n in dynamo_gpu.MODELS if n.startswith(tuple(want))]
    shapes = {(n.split("_decode_")[0] if "_decode_" in n else n.rsplit("_", 1)[0], dynamo_gpu.MODELS[n][3],
               dynamo_gpu.MODELS[n][4], dynamo_gpu.MODELS[n][5]) for n in names}
    for stem in want:
        assert {(stem, "ids", 1, 1024), (stem, "ids", 4, 2048)} <= shapes
        assert {(stem, "decode_random", b, past) for b in (1, 8, 64) for past in (2048, 8192)} <= shapes
    for name in names:
        cfg_cls, _, kw, *_ = dynamo_gpu.MODELS[name]
        cfg = getattr(transformers, cfg_cls)(**kw)
        stem = next(s for s in want if name.startswith(s))
        assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, dynamo_gpu._kv_shape(cfg)[1],
                cfg.hidden_size, cfg.intermediate_size) == want[stem], name
        assert name.endswith(f"_b{dynamo_gpu.MODELS[name][4]}_{dynamo_gpu.MODELS[name][5]}") or "_decode_" not in name


def test_llama3_8b_decode_at_64_x_8192_reads_kv_per_kv_head_within_32_bit_indices() -> None:
    """Issue 57's largest decode: LLaMA-3-8B at batch 64 over 8192 cached tokens, captured on meta.  Through
    repeat_kv, K and V repeated per query head would be [64, 32, 8256, 128] = 2.16e9 elements, past the
    kernels' 32-bit indices (``lower.build.MAX_INDEX``): the attention reads the cache's 8 kv heads instead,
    every space of its SMG addressable."""
    import math

    from spacefusion.frontend.tune import captured_partitions
    from spacefusion.lower.build import MAX_INDEX

    name = "llama3_8b_4layers_decode_b64_8192"
    torch._dynamo.reset()
    model, x = dynamo_gpu.build(name, "meta")
    parts = captured_partitions(model, **x)
    att = [s for p in parts for s in p.subgraphs if s.kind == "attention"]
    assert len(att) == 4 and all(s.label.startswith("attention b64 h32/8 1x8256 d128") for s in att), att
    assert not [op for p in parts for op in p.left if op.code.startswith("attention")]
    for sub in att:
        k = next(op for op in sub.operands if op.space == "K")
        assert k.shape == (64, 8, 8256, 128)
        assert max(math.prod(sub.smg.shape(sp.name)) for sp in sub.smg.spaces) < MAX_INDEX
