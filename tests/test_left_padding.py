"""A left-padded batch through written-out (eager) attention: HF adds a float mask filled with ``finfo.min``,
so a padding token's query row is masked at every key.  The fused attention's online softmax overflowed on
such a row (its running max started at -3e38, above ``finfo.min``, so every exponential underflowed and the
row was 0 / 0) and the llvm kernel gave NaN in every row of the batch.  The kernels' running max now starts at
-inf (``spacefusion.lower.exprs.MAX_IDENTITY``; ``tests/test_masked_rows.py`` for any graph), the mask is
added as it is, and every row, the padding tokens' included, matches eager."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import spacefusion  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.mark.parametrize("target", ["reference", "llvm"])
def test_a_left_padded_batch_matches_eager_in_every_row(target: str) -> None:
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=128, vocab_size=100,
                                   attn_implementation="eager")
    model = transformers.LlamaModel(cfg).eval()
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, :5] = 0
    compiled = spacefusion.compile(model, target=target)
    with torch.no_grad():
        got = compiled(ids, attention_mask=mask).last_hidden_state
        want = model(ids, attention_mask=mask).last_hidden_state
    assert [s.kind for p in compiled.spacefusion.partitions for s in p.subgraphs].count("attention") == 1
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
