"""Issue 56: a model's embeddings (``F.embedding``, a data-dependent gather) fused into the norm after them
(``frontend.embeddings``, ``smg.loads``), on tiny ``transformers`` models (seeded weights) against eager.

BERT: the word and token-type gathers, both adds and the LayerNorm are one kernel; torch runs no compute op of
the embeddings any more (3 before: the word embedding and two adds; the position lookup reads buffers only and is
folded at compile time).  Qwen2 below 16 rows: the first RMSNorm is its own kernel and takes the gather, writing
the gathered rows as its kept sum (the residual stream).  LLaMA from 16 rows: that norm is the q/k/v GEMMs'
prologue, so the embedding stays with torch as ``embedding.prologue``.  An id past the table raises
``IndexError`` as eager does; the GPU backend keeps the gather with torch (``library_first``) until the cuda
test here has run."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import spacefusion  # noqa: E402
from spacefusion.frontend.records import Partition  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

#: what the partition calls ops that torch does not run per call, and pure layout (no compute)
NO_COMPUTE = ("left.folded", "left.dead", "left.layout")


def _bert() -> torch.nn.Module:
    torch.manual_seed(1)
    cfg = transformers.BertConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128,
                                  vocab_size=100)
    return transformers.BertModel(cfg).eval()


def _decoder(name: str) -> torch.nn.Module:
    torch.manual_seed(1)
    kw = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=128, vocab_size=100)
    if name == "llama":
        return transformers.LlamaModel(transformers.LlamaConfig(**kw)).eval()
    return transformers.Qwen2Model(transformers.Qwen2Config(**kw)).eval()


def _ids(b: int, s: int) -> torch.Tensor:
    return torch.randint(0, 100, (b, s), generator=torch.Generator().manual_seed(2))


def _partition(compiled: torch.nn.Module) -> Partition:
    (part,) = compiled.spacefusion.partitions
    return part


def _computed_by_torch(part: Partition) -> list[str]:
    """The ops torch still runs per call that compute something (layout views, folded and dead ops aside)."""
    return [op.op for op in part.left if op.code not in NO_COMPUTE]


@pytest.mark.parametrize("target", ["reference", "llvm"])
def test_bert_embeddings_are_one_kernel_and_match_eager(target: str) -> None:
    model, ids = _bert(), _ids(2, 16)
    compiled = spacefusion.compile(model, target=target)
    with torch.no_grad():
        want, got = model(input_ids=ids).last_hidden_state, compiled(input_ids=ids).last_hidden_state
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    part = _partition(compiled)
    (emb,) = [s for s in part.subgraphs if s.kind == "embedding_norm"]
    assert {"inputs_embeds", "token_type_embeddings", "embeddings", "embeddings_1"} <= set(emb.nodes), emb.nodes
    assert "2 embeddings + 1 term + layernorm" in emb.label, emb.label
    assert "F.embedding" not in _computed_by_torch(part) and "left.gather" not in part.left_codes()
    # before: the word embedding and the two adds ran in torch; now no compute op of the model is torch's
    assert _computed_by_torch(part) == [], part.summary()


@pytest.mark.parametrize("target", ["reference", "llvm"])
def test_qwen2_below_16_rows_gathers_into_the_first_norm_and_keeps_the_rows(target: str) -> None:
    model, ids = _decoder("qwen2"), _ids(1, 8)
    compiled = spacefusion.compile(model, target=target)
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).last_hidden_state
        got = compiled(input_ids=ids, use_cache=False).last_hidden_state
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    part = _partition(compiled)
    (emb,) = [s for s in part.subgraphs if s.kind == "embedding_norm"]
    assert "(sum kept)" in emb.label and {r.space for r in emb.results} == {"Y", "T"}, emb
    assert "F.embedding" not in _computed_by_torch(part), part.summary()
    # what torch still computes: the attention under its causal boolean mask (``attention.mask``)
    assert _computed_by_torch(part) == ["F.scaled_dot_product_attention"], part.summary()


def test_llama_from_16_rows_leaves_the_embedding_to_the_norm_prologue_with_why() -> None:
    model, ids = _decoder("llama"), _ids(1, 16)
    compiled = spacefusion.compile(model, target="reference")
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).last_hidden_state
        got = compiled(input_ids=ids, use_cache=False).last_hidden_state
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    part = _partition(compiled)
    assert part.counts()["norm_stacked_gemm"] == 1 and not part.counts()["embedding_norm"]
    (left,) = [op for op in part.left if op.op == "F.embedding"]
    assert left.code == "embedding.prologue" and "prologue of their GEMMs" in left.reason


def test_an_id_past_the_table_raises_as_eager_does() -> None:
    model, ids = _bert(), _ids(2, 16)
    compiled = spacefusion.compile(model, target="reference")
    with torch.no_grad():
        compiled(input_ids=ids)
        bad = ids.clone()
        bad[1, 3] = 100
        with pytest.raises(IndexError):
            model(input_ids=bad)
        with pytest.raises(IndexError, match="out of range"):
            compiled(input_ids=bad)


class _Embed(torch.nn.Module):
    """``LayerNorm(emb(ids) + pos)``: the embeddings of a BERT-like model, traceable by ``torch.fx``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.norm = torch.nn.Embedding(50, 32), torch.nn.LayerNorm(32)
        self.pos = torch.nn.Parameter(torch.randn(1, 8, 32))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.nn.functional.embedding(ids, self.emb.weight) + self.pos)


@pytest.mark.parametrize("library", [False, True])
def test_a_backend_that_keeps_the_gather_with_torch_gets_it_there(library: bool) -> None:
    """The GPU backend names ``embedding_gather`` in its ``library_first`` (the kernel not yet run on a GPU):
    the embedding stays torch's under ``library.first``; without it, one kernel; the output eager's."""
    from spacefusion.frontend.backends import CudaBackend, ReferenceBackend
    from spacefusion.frontend.embeddings import LIBRARY_KEY
    from spacefusion.frontend.fused import fuse

    torch.manual_seed(0)
    be = ReferenceBackend()
    if library:
        be.library_first = {LIBRARY_KEY: CudaBackend.library_first[LIBRARY_KEY]}
    model, ids = _Embed().eval(), torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    fused = fuse(model, ids, backend=be)
    with torch.no_grad():
        torch.testing.assert_close(fused(ids), model(ids), rtol=1e-5, atol=1e-5)
    part = fused.partition
    assert part.counts()["embedding_norm"] == (0 if library else 1), part.summary()
    assert [op.code for op in part.left if op.op == "F.embedding"] == (["library.first"] if library else [])


@pytest.mark.cuda
def test_bert_embeddings_kernel_runs_on_the_gpu(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp16 on the GPU with the gather fused (``library_first`` without ``embedding_gather``): within a few
    times eager fp16's distance from float32."""
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from spacefusion.frontend.backends import CudaBackend
    from spacefusion.frontend.embeddings import LIBRARY_KEY

    monkeypatch.setattr(CudaBackend, "library_first",
                        {k: v for k, v in CudaBackend.library_first.items() if k != LIBRARY_KEY})
    monkeypatch.setenv("SPACEFUSION_CACHE", str(tmp_path))
    model, ids = _bert().cuda(), _ids(2, 16).cuda()
    with torch.no_grad():
        exact = model(input_ids=ids).last_hidden_state
        model.half()
        eager = model(input_ids=ids).last_hidden_state
        compiled = spacefusion.compile(model, measure=False)
        got = compiled(input_ids=ids).last_hidden_state
    report = compiled.spacefusion
    assert report.target == "cuda", str(report)
    assert any(s.kind == "embedding_norm" for p in report.partitions for s in p.subgraphs), str(report)
    eager_err = (eager.float() - exact).abs().max().item()
    ours = (got.float() - exact).abs().max().item()
    assert ours <= 4 * eager_err + 1e-3, f"fused fp16 off by {ours}, eager fp16 by {eager_err}\n{report}"
