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
    m = LlamaModel(LlamaConfig.tiny(kv_heads=2), seed=1)
    return m, m.example_inputs(1, 16, seed=2) if name == "llama_prefill" else m.example_inputs(1, 1, past=8, seed=2)


@pytest.mark.parametrize("name", ["bert", "vit", "llama_prefill", "llama_decode"])
def test_fused_model_matches_eager(name: str) -> None:
    model, x = _case(name)
    before = BACKEND.built
    fused = fuse(model, *x, backend=BACKEND)
    assert fused.partition.subgraphs and fused.backend == "llvm"
    assert BACKEND.built - before <= len(fused.partition.distinct)  # identical subgraphs built once
    calls = [n for n in fused.graph_module.graph.nodes if n.op == "call_module" and n.target.startswith("fused_")]
    assert len(calls) == len(fused.partition.subgraphs)
    with torch.no_grad():
        want, got = model(*x), fused(*x)
    assert len(want) == len(got)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_second_input_runs_through_the_same_kernels() -> None:
    """The fused model is a function of its inputs, not of the example it was traced with."""
    model, x = _case("bert")
    fused = fuse(model, *x, backend=BACKEND)
    y = model.example_inputs(2, 16, seed=7)
    with torch.no_grad():
        torch.testing.assert_close(fused(*y)[0], model(*y)[0], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(fused(*y)[0], fused(*x)[0])
