"""Fused tiny models on the TVM llvm backend against eager PyTorch (fp32, seeded)."""

from __future__ import annotations

import pytest
import torch

from spacefusion.frontend import LLVMBackend, fuse
from spacefusion.models import BertConfig, BertModel, LlamaConfig, LlamaModel, ViTConfig, ViTModel

#: one backend for the module: each distinct SMG (per shape) is built once across the tests
BACKEND = LLVMBackend()


def _case(name: str):
    if name == "bert":
        m = BertModel(BertConfig.tiny(), seed=1)
        return m, m.example_inputs(2, 16, seed=2)
    if name == "vit":
        m = ViTModel(ViTConfig.tiny(), seed=1)
        return m, m.example_inputs(2, seed=2)
    m = LlamaModel(LlamaConfig.tiny(kv_heads=4 if name == "llama_prefill_mha" else 2), seed=1)
    if name == "llama_decode":
        return m, m.example_inputs(2, 1, past=8, seed=2)
    return m, m.example_inputs(1, 16, seed=2)


@pytest.mark.parametrize("name", ["bert", "vit", "llama_prefill", "llama_prefill_mha", "llama_decode"])
def test_fused_model_matches_eager(name: str) -> None:
    model, x = _case(name)
    before = BACKEND.built
    fused = fuse(model, *x, backend=BACKEND)
    assert fused.partition.subgraphs and fused.backend == "llvm"
    if name.startswith("llama"):  # RoPE of Q and K in every layer, [b, h, 1, d] when decoding
        assert fused.partition.counts()["rope"] == 2 * model.config.num_hidden_layers
    assert BACKEND.built - before <= len(fused.partition.distinct)  # identical subgraphs built once
    calls = [n for n in fused.graph_module.graph.nodes if n.op == "call_module" and n.target.startswith("fused_")]
    assert len(calls) == len(fused.partition.subgraphs)
    with torch.no_grad():
        want, got = model(*x), fused(*x)
    assert len(want) == len(got)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["llama_prefill", "llama_decode"])
def test_fused_llama_on_the_numpy_reference(name: str) -> None:
    """The SMGs themselves (float64 numpy, no kernel) give the model's outputs: RoPE's mapping included."""
    model, x = _case(name)
    fused = fuse(model, *x, backend="reference")
    assert fused.partition.counts()["rope"] == 2 * model.config.num_hidden_layers
    with torch.no_grad():
        for w, g in zip(model(*x), fused(*x)):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_second_input_runs_through_the_same_kernels() -> None:
    """The fused model is a function of its inputs, not of the example it was traced with."""
    model, x = _case("bert")
    fused = fuse(model, *x, backend=BACKEND)
    y = model.example_inputs(2, 16, seed=7)
    with torch.no_grad():
        torch.testing.assert_close(fused(*y)[0], model(*y)[0], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(fused(*y)[0], fused(*x)[0])
