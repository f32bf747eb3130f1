"""ALiBi attention through ``baddbmm`` (BLOOM: ``frontend.alibi``, one row of ``frontend.table``) fused into
the attention SMG with the bias and the causal mask as score mods, checked against eager on the CPU targets;
MPT writes its ALiBi as ``matmul * scale + bias`` then ``masked_fill`` (``frontend.eager_attention``'s
``masked_fill_attention`` row): fused the same way, the fill one more score mod."""

from __future__ import annotations

import pytest
import torch

import spacefusion

transformers = pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


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


def _mpt(layers: int = 2) -> torch.nn.Module:
    if not hasattr(transformers, "MptModel"):
        pytest.skip("no MPT in this transformers")
    torch.manual_seed(0)
    cfg = transformers.MptConfig(d_model=64, n_layers=layers, n_heads=4, vocab_size=100, max_seq_len=32)
    return transformers.MptModel(cfg).eval()


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("target", ["reference", "llvm"])
def test_mpt_alibi_attention_is_fused_and_matches_eager(target: str, padded: bool) -> None:
    """MPT adds its ALiBi to ``matmul(q, k^T) * scale`` and masks with ``masked_fill(mask, finfo.min)``
    (``eager_attention.match_masked_fill_attention``): one attention per layer, the scale folded, the bias
    and the fill score mods, nothing of the chain left to torch.  With left padding the padding tokens' rows
    are filled at every key: the mean of V, as in eager."""
    model = _mpt(2)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 16, dtype=torch.long)
    if padded:
        mask[1, :5] = 0
    compiled = spacefusion.compile(model, target=target)
    with torch.no_grad():
        got = compiled(ids, attention_mask=mask).last_hidden_state
        want = model(ids, attention_mask=mask).last_hidden_state
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    att, left = _attention(compiled)
    assert len(att) == 2 and all("+ mask + masked_fill" in s.label for s in att), [s.label for s in att]
    assert att[0].smg.attrs[0] == ("scale", repr(0.25))  # 1 / sqrt(head_dim 16), folded
    assert not [op for op in left if op.op in ("torch.matmul", "F.softmax", "Tensor.masked_fill")], left


class _Filled(torch.nn.Module):
    """MPT's chain on given Q, K, V, bias and boolean mask (true: filled), the fill a number or a tensor."""

    def __init__(self, fill) -> None:
        super().__init__()
        self.fill = fill

    def forward(self, q, k, v, bias, mask, fill=None):
        s = torch.matmul(q, k.transpose(-1, -2)) * 0.25 + bias
        s = s.masked_fill(mask, self.fill if fill is None else fill)
        return torch.matmul(torch.softmax(s.float(), dim=-1), v)


def _filled_inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, 8, 16, generator=g) for _ in range(3))
    bias = torch.randn(4, 1, 8, generator=g)
    mask = torch.zeros(2, 1, 8, 8, dtype=torch.bool)
    mask[1, :, :, :3] = True
    mask[1, :, 2] = True  # a query row filled at every key
    return q, k, v, bias, mask


@pytest.mark.parametrize("target", ["reference", "llvm"])
def test_a_minus_inf_fill_gives_a_filled_row_sdpa_zero(target: str) -> None:
    """``masked_fill(mask, -inf)``: a row filled everywhere is 0 in the fused attention (SDPA's value), NaN
    in eager; every other row matches eager."""
    q, k, v, bias, mask = _filled_inputs()
    compiled = spacefusion.compile(_Filled(float("-inf")), target=target)
    with torch.no_grad():
        got, want = compiled(q, k, v, bias, mask), _Filled(float("-inf"))(q, k, v, bias, mask)
    att, _ = _attention(compiled)
    assert len(att) == 1 and "masked_fill" in att[0].label
    assert torch.isnan(want[1, :, 2]).all() and (got[1, :, 2] == 0).all()
    keep = torch.ones(2, 8, dtype=torch.bool)
    keep[1, 2] = False
    torch.testing.assert_close(got.transpose(1, 2)[keep], want.transpose(1, 2)[keep], rtol=1e-5, atol=1e-5)


def test_the_refusal_of_an_unsupported_fill_is_coded() -> None:
    """A fill read from a tensor (not a number) leaves the attention to torch with ``masked_fill.form``."""
    q, k, v, bias, mask = _filled_inputs()
    fill = torch.tensor(-1e4)
    compiled = spacefusion.compile(_Filled(None), target="reference")
    with torch.no_grad():
        torch.testing.assert_close(compiled(q, k, v, bias, mask, fill), _Filled(None)(q, k, v, bias, mask, fill),
                                   rtol=1e-5, atol=1e-5)
    att, left = _attention(compiled)
    coded = [op for op in left if op.code == "masked_fill.form"]
    assert att == [] and coded and "masked_fill of the scores with" in coded[0].reason, left
