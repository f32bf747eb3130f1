"""The end-to-end benchmark's decode step (experiments/dynamo_gpu.py): a StaticCache prefilled once, and a step that
can be timed any number of times (the cache's running lengths rewound before each call), on a tiny LLaMA."""

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

