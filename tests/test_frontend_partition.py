"""Capture + partition of the tiny HF-style models: which subgraphs are fused, what torch keeps and why."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from spacefusion.frontend import capture, fuse, partition
from spacefusion.frontend.prologue import PROLOGUE_MIN_ROWS
from spacefusion.frontend.reasons import CONCAT, GATHER, LAYOUT, ROPE, ROPE_TABLES
from spacefusion.models import BertConfig, BertModel, LlamaConfig, LlamaModel, ViTConfig, ViTModel

LAYERS = 2


def _partition(model: nn.Module, *args: torch.Tensor):
    return partition(capture(model, *args).module)


def test_bert_layer_is_qkv_attention_two_gemm_norms_and_gelu_gemm() -> None:
    m = BertModel(BertConfig.tiny(layers=LAYERS))
    p = _partition(m, *m.example_inputs(2, 16))
    c = p.counts()
    # per layer: Q, K, V as one stacked GEMM + bias; attention output and FFN output GEMMs + bias; FFN input
    # GEMM + GELU; pooler + tanh
    assert c["attention"] == LAYERS
    assert c["residual_norm"] == 2 * LAYERS  # post-LN: LayerNorm(dense(h) + input), twice a layer
    assert c["norm"] == 1  # the embeddings' LayerNorm (its add broadcasts positions over the batch)
    labels = [s.label for s in p.subgraphs if s.kind == "gemm"]
    assert sum("gelu" in lb for lb in labels) == LAYERS
    assert sum("tanh" in lb for lb in labels) == 1
    assert len(labels) == 3 * LAYERS + 1
    qkv = [s for s in p.subgraphs if s.kind == "stacked_gemm"]
    assert len(qkv) == LAYERS and all(s.smg.shape("Y") == (3, 32, 64) for s in qkv)
    assert [r.index for r in qkv[0].results] == [0, 1, 2]
    assert [o.stack for o in qkv[0].operands if o.space == "Bw"] == [
        tuple(f"encoder.layer.0.attention.self.{p}.weight" for p in ("query", "key", "value"))]
    # identical layers share SMGs: 8 distinct (LN, QKV, 3 GEMM shapes, attention, residual LN, pooler)
    assert len(p.distinct) == 8
    assert max(len(v) for v in p.distinct.values()) == 2 * LAYERS  # attention output and the residual norms
    reasons = {op.op: op.reason for op in p.left}
    assert reasons["Embedding"] == GATHER
    # split_heads' / merge_heads' transposes are the bshd attention's; their unflatten/flatten views stay
    assert "Tensor.transpose" not in reasons and reasons["Tensor.unflatten"] == LAYOUT


def test_vit_pre_ln_keeps_the_residual_sum_as_a_second_output() -> None:
    m = ViTModel(ViTConfig.tiny(layers=LAYERS))
    p = _partition(m, *m.example_inputs(2))
    c = p.counts()
    # the GEMMs: out-projection and MLP per layer, the pooler, and the patch embedding (a conv of kernel =
    # stride: the GEMM of its patches)
    assert (c["attention"], c["stacked_gemm"], c["gemm"], c["norm"]) == (LAYERS, LAYERS, 3 * LAYERS + 2, 1)
    # x + attn feeds layernorm_after and the next residual: its sum is kept; the last layer's sum
    # feeds only the final LayerNorm
    kept = [s for s in p.subgraphs if s.kind == "residual_norm" and len(s.results) == 2]
    assert len(kept) == 2 * LAYERS - 1
    assert c["residual_norm"] == 2 * LAYERS
    assert {s.smg.shape("Y") for s in kept} == {(2 * 17, 64)}
    assert not any(op.op == "Conv2d" for op in p.left)
    patch = next(s for s in p.subgraphs if s.label.startswith("patch conv 8x8"))
    assert patch.smg.shape("A") == (2 * 16, 3 * 8 * 8) and patch.results[0].shape == (2, 64, 4, 4)
    assert any(op.op == "torch.cat" and op.reason == CONCAT for op in p.left)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_llama_prefill_gated_mlp_gqa_and_rope(kv_heads: int) -> None:
    m = LlamaModel(LlamaConfig.tiny(layers=LAYERS, kv_heads=kv_heads))
    p = _partition(m, *m.example_inputs(1, 16))
    c = p.counts()
    # Q, K and V share the input norm's output: one stacked GEMM (GQA: Q alone, K and V stacked), each with the
    # norm as its prologue; the gated MLP reads its norm's output (no prologue for a gated pair:
    # ``prologue.py``), so o_proj's residual add goes to that norm's kernel and down_proj takes the next
    # layer's (the last down_proj's goes to the final norm, read by no linear)
    assert (c["attention"], c["gated_gemm"], c["norm_stacked_gemm"]) == (LAYERS, LAYERS, LAYERS)
    assert c["gemm"] == 2 * LAYERS and c["norm_gemm"] == (0 if kv_heads == 4 else LAYERS)
    stacked = next(s for s in p.subgraphs if s.kind == "norm_stacked_gemm")
    assert stacked.smg.shape("Y")[0] == (3 if kv_heads == 4 else 2)
    assert (c["norm"], c["residual_norm"], c["norm_gated_gemm"]) == (0, 1 + LAYERS, 0)
    assert sum(s.label.startswith("gemm + add") for s in p.subgraphs) == LAYERS - 1  # the down_projs but the last
    att = next(s for s in p.subgraphs if s.kind == "attention").smg
    assert dict(att.attrs)["causal"] == "True" and dict(att.attrs)["kv_heads"] == str(kv_heads)
    # RoPE's outputs keep split_heads' strides: Q, K, V are read where they lie, as [b, s, h, d] (GQA's Q
    # as [b, s, kv_heads, group, d]), through a permuted view, and merge_heads' transpose is the kernel's
    sub = next(s for s in p.subgraphs if s.kind == "attention")
    assert dict(att.attrs)["layout"] == "bshd" and sub.label.endswith("bshd")
    ops = {o.space: o for o in sub.operands}
    assert all(o.permute == (0, 2, 1, 3) for o in ops.values())
    assert ops["Q"].shape == ((1, 16, 4, 16) if kv_heads == 4 else (1, 16, kv_heads, 4 // kv_heads, 16))
    assert ops["K"].shape == (1, 16, kv_heads, 16)
    # RoPE of Q and of K: one SMG where they have the same heads, two with GQA's fewer kv heads
    ropes = [s for s in p.subgraphs if s.kind == "rope"]
    assert len(ropes) == 2 * LAYERS and len({s.key for s in ropes}) == (1 if kv_heads == 4 else 2)
    assert {s.smg.shape("X") for s in ropes} == {(1, 16, 4, 16), (1, 16, kv_heads, 16)}
    assert all(s.label.endswith("bshd") and s.results[0].permute == (0, 2, 1, 3) for s in ropes)
    # what torch keeps of RoPE: the cos/sin tables, once, and the tables' unsqueeze(1) views
    assert not [op for op in p.left if op.reason == ROPE]
    tables = {op.op for op in p.left if op.reason == ROPE_TABLES}
    assert {"Tensor.cos", "Tensor.sin", "torch.cat"} <= tables
    assert sum(op.reason == ROPE_TABLES for op in p.left) == 8  # independent of the layers
    unsq = [op for op in p.left if op.op == "Tensor.unsqueeze" and op.reason == LAYOUT]
    assert len(unsq) == 2 * LAYERS + 1  # cos and sin per layer, and the positions'
    assert all(s.kind != "gemm" or "bias" not in s.label for s in p.subgraphs)


def test_llama_decode_attends_to_cache_without_causal_mask() -> None:
    m = LlamaModel(LlamaConfig.tiny(layers=LAYERS, kv_heads=2))
    p = _partition(m, *m.example_inputs(1, 1, past=8))
    att = [s for s in p.subgraphs if s.kind == "attention"]
    assert len(att) == LAYERS
    assert dict(att[0].smg.attrs)["causal"] == "False"
    assert "layout" not in dict(att[0].smg.attrs)  # the cache's K/V lie as [b, h, s, d]: bhsd, no permute
    assert att[0].smg.dim_sizes["m"] == 1 and att[0].smg.dim_sizes["l"] == 9
    cats = [op for op in p.left if op.op == "torch.cat" and op.reason == CONCAT]
    assert len(cats) == 2 * LAYERS  # the KV-cache appends
    ropes = [s for s in p.subgraphs if s.kind == "rope"]  # one new token: [b, h, 1, d]
    assert len(ropes) == 2 * LAYERS and {s.smg.dim_sizes["s"] for s in ropes} == {1}


class _Odd(nn.Module):
    """A linear, a cumulative sum (no SMG op), an attention with an additive mask and a GELU after it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        y = torch.cumsum(self.fc(x), dim=1)
        q = y.unflatten(-1, (2, 8)).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        return F.gelu(o.transpose(1, 2).flatten(2), approximate="tanh")


def test_unsupported_ops_are_left_to_torch_with_reasons_not_a_crash(capsys) -> None:
    torch.manual_seed(0)
    model = _Odd().eval()
    x, mask = torch.randn(2, 8, 16), torch.randn(8, 8)
    fused = fuse(model, x, mask, backend="reference", verbose=True)
    assert "torch.cumsum: no SMG pattern covers this op" in capsys.readouterr().out
    left = {op.op: op.reason for op in fused.partition.left}
    assert "no SMG pattern" in left["torch.cumsum"]
    assert "no fusable producer" in left["F.gelu"]  # after an attention: no GEMM epilogue to join
    assert [s.kind for s in fused.partition.subgraphs] == ["gemm", "attention"]
    assert "+ bias" in fused.partition.subgraphs[1].label  # the float mask, added to the scores
    torch.testing.assert_close(fused(x, mask), model(x, mask), rtol=1e-5, atol=1e-5)


class _Failing:
    name = "failing"

    def compile(self, smg):
        from schedulers.errors import ScheduleError

        raise ScheduleError(f"no schedule for {smg.name}")


def test_a_kernel_that_cannot_be_built_leaves_its_subgraph_to_torch() -> None:
    m = BertModel(BertConfig.tiny(layers=1))
    x = m.example_inputs(1, 8)
    fused = fuse(m, *x, backend=_Failing())
    assert not fused.partition.subgraphs
    assert any("kernel build failed: ScheduleError: no schedule for attention" in op.reason
               for op in fused.partition.left)
    for a, b in zip(fused(*x), m(*x)):
        torch.testing.assert_close(a, b)


def test_inputs_that_do_not_fit_the_model_are_a_frontend_error() -> None:
    from spacefusion.frontend import FrontendError

    m = BertModel(BertConfig.tiny(layers=1))
    ids = torch.zeros(1, 200, dtype=torch.long)  # beyond the 64 positions of the tiny config
    with pytest.raises(FrontendError, match="running the traced BertModel on the example inputs failed"):
        capture(m, ids, ids)


def test_real_configs() -> None:
    b, v, lm = BertConfig(), ViTConfig(), LlamaConfig()
    assert (b.hidden_size, b.num_attention_heads, b.num_hidden_layers, b.intermediate_size) == (768, 12, 12, 3072)
    assert (v.seq_len, v.head_dim, v.intermediate_size) == (197, 64, 3072)
    assert (lm.hidden_size, lm.head_dim, lm.intermediate_size, lm.num_key_value_heads) == (4096, 128, 11008, 32)
    assert lm.gqa().num_key_value_heads == 8


@pytest.mark.parametrize(("seq", "past", "layout"), [(16, 0, ("k", "n")), (1, 8, ("n", "k"))])
def test_decoding_gemms_read_the_weights_as_stored(seq: int, past: int, layout: tuple[str, str]) -> None:
    """Prefill (16 rows) streams B = W.T [k, n] for tensor cores; a decoding step (1 row, a GEMV) reads W as
    ``nn.Linear`` stores it, [n, k]: no transposed copy, and its lanes read rows along k.  A prefill GEMM
    taking its norm as a prologue reads W [n, k] (the norm's weight folded in: a copy either way; the tensor
    cores read it K-major); a decoding step takes no prologue (``prologue.PROLOGUE_MIN_ROWS``)."""
    m = LlamaModel(LlamaConfig.tiny(kv_heads=2), seed=1)
    p = _partition(m, *m.example_inputs(1, seq, past=past))
    kinds = ("gemm", "gated_gemm", "stacked_gemm", "norm_gemm", "norm_gated_gemm", "norm_stacked_gemm")
    weights = {(s.kind, op.space): (s.smg.space(op.space).dims, op.transpose, op.fold_norm) for s in p.subgraphs
               for op in s.operands if op.source == "param" and s.kind in kinds and op.space.startswith(("B", "W"))}
    prologues = {("norm_gemm", "Bw"), ("norm_stacked_gemm", "Bw")}
    if seq >= PROLOGUE_MIN_ROWS:
        assert {("gemm", "Bw"), ("gated_gemm", "Wg"), ("gated_gemm", "Wu"), *prologues} <= set(weights)
    else:
        assert {("gemm", "Bw"), ("gated_gemm", "Wg"), ("stacked_gemm", "Bw")} <= set(weights)
        assert not prologues & set(weights)
    for (kind, _), (dims, transpose, fold) in weights.items():
        prologue = kind.startswith("norm_")
        assert dims[-2:] == (("n", "k") if prologue else layout)
        assert transpose == (not prologue and layout == ("k", "n"))
        assert (fold is not None) == prologue
    fused = fuse(m, *m.example_inputs(1, seq, past=past), backend="reference")
    with torch.no_grad():
        want, got = m(*m.example_inputs(1, seq, past=past)), fused(*m.example_inputs(1, seq, past=past))
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)


class _Verbose:
    name = "verbose"

    def compile(self, smg):
        from schedulers.errors import ScheduleError

        raise ScheduleError(f"no schedule for {smg.name}: " + "x" * 5000)


def test_a_long_build_failure_is_cut_in_the_reason() -> None:
    """A failure message of thousands of characters (a failed sympy derivation prints whole update functions)
    is kept to its first 400 in the partition's reason, saying how much was cut."""
    m = BertModel(BertConfig.tiny(layers=1))
    x = m.example_inputs(1, 8)
    fused = fuse(m, *x, backend=_Verbose())
    reasons = [op.reason for op in fused.partition.left if "kernel build failed" in op.reason]
    assert reasons and all(len(r) < 600 and "more chars)" in r for r in reasons), reasons[:1]
    for a, b in zip(fused(*x), m(*x)):
        torch.testing.assert_close(a, b)
