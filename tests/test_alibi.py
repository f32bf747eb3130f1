"""ALiBi attention through ``baddbmm`` (BLOOM: ``frontend.alibi``, one row of ``frontend.table``) fused into
the attention SMG with the bias and the causal mask as score mods, checked against eager on the CPU targets;
MPT writes its ALiBi as ``matmul * scale + bias`` then ``masked_fill``, which no row takes (counted here)."""

from __future__ import annotations

import pytest
import torch

import spacefusion

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _bloom(layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.BloomConfig(hidden_size=64, n_layer=layers, n_head=4, vocab_size=100)
    return transformers.BloomModel(cfg).eval()


def _attention(compiled) -> tuple[list, list]:
    subs = [s for p in compiled.spacefusion.partitions for s in p.subgraphs]
    left = [op for p in compiled.spacefusion.partitions for op in p.left]
    return [s for s in subs if s.kind == "attention"], left


@pytest.mark.parametrize("target", ["reference", "llvm"])
def test_bloom_alibi_attention_is_fused_and_matches_eager(target: str) -> None:
    model = _bloom()
    ids = torch.randint(0, 100, (2, 16))
    compiled = spacefusion.compile(model, target=target)
    with torch.no_grad():
        got, want = compiled(ids).last_hidden_state, model(ids).last_hidden_state
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    att, left = _attention(compiled)
    assert len(att) == 2 and all("alibi baddbmm" in s.label and "+ mask" in s.label for s in att), \
        [s.label for s in att]
    assert not [op for op in left if op.op in ("Tensor.baddbmm", "torch.bmm", "F.softmax")], left


@pytest.mark.parametrize("target", ["reference", "llvm"])
def test_bloom_with_left_padding_reads_the_per_row_alibi(target: str) -> None:
    """With a padding mask BLOOM builds its ALiBi per batch row from the mask's cumsum ([b * h, 1, l]): bound
    as an input.  Left padding masks every key of the padding tokens' query rows with ``finfo.min``, which
    overflowed the llvm kernel's online softmax to NaN: the kernels' running max now starts at -inf
    (``spacefusion.lower.exprs.MAX_IDENTITY``, issue 59), so such a row is the mean of V as in eager and
    every row matches, the padding tokens' too."""
    model = _bloom(2)
    ids = torch.randint(0, 100, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, :5] = 0
    compiled = spacefusion.compile(model, target=target)
    with torch.no_grad():
        got = compiled(ids, attention_mask=mask).last_hidden_state
        want = model(ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    att, _ = _attention(compiled)
    assert len(att) == 2


def test_the_refusal_of_an_unsupported_alibi_is_coded() -> None:
    """A bias the pattern does not take ([b * h, m, 1]: broadcast along the keys) leaves the attention to
    torch with ``alibi.form`` and a sentence, and the output is still right."""

    class Odd(torch.nn.Module):
        def forward(self, q, k, v, bias):
            b, h, s, d = q.shape
            q3, k3, v3 = (x.reshape(b * h, s, d) for x in (q, k, v))
            s3 = bias.baddbmm(q3, k3.transpose(-1, -2), beta=1.0, alpha=0.5).view(b, h, s, s)
            p = torch.softmax(s3, dim=-1)
            return torch.bmm(p.view(b * h, s, s), v3)

    q, k, v = (torch.randn(2, 4, 8, 16) for _ in range(3))
    bias = torch.randn(8, 8, 1)
    compiled = spacefusion.compile(Odd(), target="reference")
    with torch.no_grad():
        torch.testing.assert_close(compiled(q, k, v, bias), Odd()(q, k, v, bias), rtol=1e-5, atol=1e-5)
    _, left = _attention(compiled)
    coded = [op for op in left if op.code == "alibi.form"]
    assert coded and "ALiBi baddbmm with a bias of shape (8, 8, 1)" in coded[0].reason


def test_mpt_alibi_is_written_in_ops_no_row_takes() -> None:
    """MPT adds its ALiBi to ``matmul(q, k^T) * scale`` and masks with ``masked_fill``: the written-out attention
    row does not take ``masked_fill`` or the fp32 cast of the scores, so its attention stays torch's; correct."""
    if not hasattr(transformers, "MptModel"):
        pytest.skip("no MPT in this transformers")
    torch.manual_seed(0)
    cfg = transformers.MptConfig(d_model=64, n_layers=1, n_heads=4, vocab_size=100, max_seq_len=32)
    model = transformers.MptModel(cfg).eval()
    ids = torch.randint(0, 100, (2, 16))
    compiled = spacefusion.compile(model, target="reference")
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids).last_hidden_state, model(ids).last_hidden_state,
                                   rtol=1e-4, atol=1e-4)
    att, _ = _attention(compiled)
    assert att == []
