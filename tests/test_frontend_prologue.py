"""The frontend takes a pre-norm transformer's RMSNorm as the prologue of the projections reading it
(``frontend/prologue.py``): LLaMA's and Qwen2's q/k/v and gate/up GEMMs normalise the rows they multiply, the
norm's weight folded into theirs once, and the residual add before the norm goes to the epilogue of the
linear before it.  On the CPU targets against eager; the kernels on the GPU against float32 torch."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import spacefusion  # noqa: E402
from spacefusion.frontend import fuse  # noqa: E402
from spacefusion.frontend.prologue import PROLOGUE_MIN_ROWS  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _model(name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(1)
    kw = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=128, vocab_size=100)
    cls, cfg = (transformers.Qwen2Model, transformers.Qwen2Config) if name == "qwen2" else \
        (transformers.LlamaModel, transformers.LlamaConfig)
    return cls(cfg(**kw)).eval().to(dtype)


def _ids(s: int = 16) -> torch.Tensor:
    return torch.randint(0, 100, (1, s), generator=torch.Generator().manual_seed(2))


def _counts(compiled) -> dict[str, int]:
    report = compiled.spacefusion
    return dict(sum((p.counts() for p in report.partitions), start=type(report.partitions[0].counts())()))


@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.parametrize("target", ["reference", "llvm"])
def test_each_layers_norms_are_the_prologues_of_their_projections(name: str, target: str) -> None:
    """Two layers: their input norms fused into q (Qwen2: + bias) and the stacked k/v GEMMs; the norms before
    the gated MLPs stay kernels of their own (no prologue for a gated pair), taking o_proj's residual adds;
    the first layer's down_proj takes the next residual add; the final norm (read by no linear) stays a kernel
    of its own.  21 kernels without prologues, 19 now."""
    model, ids = _model(name), _ids()
    compiled = spacefusion.compile(model, target=target)
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids)[0], model(ids)[0], rtol=1e-4, atol=1e-4)
    counts = _counts(compiled)
    assert counts["norm_gemm"] == counts["norm_stacked_gemm"] == counts["gated_gemm"] == 2, counts
    assert counts["residual_norm"] == 3 and "norm" not in counts and "norm_gated_gemm" not in counts, counts
    assert sum(counts.values()) == 19, counts
    text = str(compiled.spacefusion)
    assert "2 x gemm 16x64x64" in text and "1 x gemm + add 16x64x128" in text, text
    assert "rmsnorm + 2 stacked gemms" in text and "2 x add + rmsnorm (sum kept)" in text, text


def test_a_norm_read_by_anything_but_linears_stays_a_kernel_of_its_own() -> None:
    """The normalised rows are written anyway where something else reads them: no prologue."""
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.lin = torch.nn.RMSNorm(64, eps=1e-6), torch.nn.Linear(64, 96)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = self.norm(x)
            return self.lin(y), y * 2

    torch.manual_seed(0)
    m, x = Block().eval(), torch.randn(32, 64)
    fused = fuse(m, x, backend="reference")
    assert fused.partition.counts()["norm"] == 1 and "norm_gemm" not in fused.partition.counts()
    torch.testing.assert_close(fused(x)[0], m(x)[0], rtol=1e-5, atol=1e-5)


def test_an_nn_rmsnorm_before_two_linears_folds_its_weight_into_both() -> None:
    """``nn.RMSNorm`` read by two linears of different widths: two GEMMs, each reading x and W * g as stored
    ([n, k]: no transpose), the norm's own nodes gone; from ``PROLOGUE_MIN_ROWS`` rows on, not below."""
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = torch.nn.RMSNorm(64, eps=1e-5)
            self.a, self.b = torch.nn.Linear(64, 96), torch.nn.Linear(64, 48, bias=False)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = self.norm(x)
            return self.a(y), torch.relu(self.b(y))

    torch.manual_seed(0)
    m = Block().eval()
    with torch.no_grad():
        m.norm.weight.mul_(torch.linspace(0.5, 1.5, 64))
    for rows in (32, 16, 15, 1):
        x = torch.randn(rows, 64)
        fused = fuse(m, x, backend="llvm")
        if rows < PROLOGUE_MIN_ROWS:  # a decoding step's GEMVs: the norm is a kernel of its own
            assert "norm_gemm" not in fused.partition.counts(), fused.partition
            assert fused.partition.counts()["norm"] == 1, fused.partition
            for got, want in zip(fused(x), m(x)):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            continue
        assert fused.partition.counts() == {"norm_gemm": 2}, fused.partition
        for sub in fused.partition.subgraphs:
            (w,) = [op for op in sub.operands if op.space == "Bw"]
            assert not w.transpose and w.fold_norm == ("norm.weight", 0.0) and sub.smg.space("Bw").dims == ("n", "k")
            assert [op.ref for op in sub.operands if op.space == "A"] == ["x"]
        for got, want in zip(fused(x), m(x)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_changed_norm_weight_is_folded_again() -> None:
    """The folded weight is a baked constant: the norm's weight written in place rebuilds it."""
    model, ids = _model("llama"), _ids(8)
    compiled = spacefusion.compile(model, target="reference")
    with torch.no_grad():
        compiled(ids)
        model.layers[0].input_layernorm.weight.mul_(1.5)
        torch.testing.assert_close(compiled(ids)[0], model(ids)[0], rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_the_prologue_gemms_match_eager_on_gpu(name: str) -> None:
    """fp16 on the GPU (its first picks built with TVM there), against eager fp16 within twice eager's own
    distance from float32, as the model benchmarks hold every system."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model, ids = _model(name, torch.float16).cuda(), _ids(64).cuda()
    ref = _model(name, torch.float32).cuda()
    compiled = spacefusion.compile(model, target="cuda", measure=False)
    with torch.no_grad():
        got, want, exact = compiled(ids)[0].float(), model(ids)[0].float(), ref(ids)[0]
    assert _counts(compiled)["norm_stacked_gemm"] == 2
    assert (got - exact).abs().max() <= 2 * (want - exact).abs().max() + 1e-3
