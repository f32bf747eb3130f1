"""``torch.export`` programs of real ``transformers`` models (tiny configs, random weights): their ATen graphs
canonicalised into the torch-level forms the matchers know, fused, and checked against eager."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from spacefusion.frontend import FrontendError  # noqa: E402
from spacefusion.frontend.export import canonicalize, fuse_exported  # noqa: E402


def _case(name: str) -> tuple[torch.nn.Module, tuple, dict]:
    torch.manual_seed(1)
    T = transformers
    g = torch.Generator().manual_seed(2)
    if name == "bert":
        cfg = T.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                           vocab_size=100)
        return T.BertModel(cfg), (torch.randint(0, 100, (2, 16), generator=g),), {}
    if name == "vit":
        cfg = T.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                          image_size=32, patch_size=8)
        return T.ViTModel(cfg), (torch.randn(2, 3, 32, 32, generator=g),), {}
    if name == "llama":
        cfg = T.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=128, vocab_size=100)
        return T.LlamaModel(cfg), (torch.randint(0, 100, (1, 16), generator=g),), {"use_cache": False}
    cfg = T.GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=100, n_positions=64, bos_token_id=0,
                       eos_token_id=0)
    return T.GPT2Model(cfg), (torch.randint(0, 100, (2, 16), generator=g),), {"use_cache": False}


#: kinds each exported model must get fused at least (per layer counts times 2 layers)
EXPECT = {
    "bert": {"attention": 2, "stacked_gemm": 2, "gemm": 7, "residual_norm": 4},
    "vit": {"attention": 2, "stacked_gemm": 2, "gemm": 8, "residual_norm": 4},
    "llama": {"rope": 4, "gated_gemm": 2, "stacked_gemm": 2},
    "gpt2": {"gemm": 8, "residual_norm": 4},
}
#: where the attention is left to torch, and why: without a cache GPT-2 and LLaMA build their causal mask with
#: a packed-sequence test (cumsum/diff of the positions), not index arithmetic alone, as a [b, 1, m, l] tensor
LEFT = {"gpt2": "may mask every key of a query row", "llama": "may mask every key of a query row"}


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_exported_program_fuses_and_matches_eager(name: str) -> None:
    model, args, kwargs = _case(name)
    model.eval()
    ep = torch.export.export(model, args, kwargs)
    fused = fuse_exported(ep, *args, backend="reference", **kwargs)
    with torch.no_grad():
        want, got = model(*args, **kwargs), fused(*args, **kwargs)
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    counts = fused.partition.counts()
    for kind, n in EXPECT[name].items():
        assert counts[kind] >= n, f"{name}: {kind} fused {counts[kind]} times, want {n}\n{fused.partition}"
    if name in LEFT:
        assert any(LEFT[name] in op.reason for op in fused.partition.left), str(fused.partition)


def test_aten_calls_become_the_torch_forms() -> None:
    model, args, kwargs = _case("bert")
    gm = torch.export.export(model.eval(), args, kwargs).module()
    assert canonicalize(gm) > 20
    targets = {n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")}
    assert torch._C._nn.linear in targets and "view" in targets
    assert torch.ops.aten.linear.default not in targets


def test_wrong_inputs_are_named() -> None:
    model, args, kwargs = _case("vit")
    ep = torch.export.export(model.eval(), args, kwargs)
    with pytest.raises(FrontendError, match="takes 1 inputs, got 2"):
        fuse_exported(ep, *args, args[0], backend="reference")
