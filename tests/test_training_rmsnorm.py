"""A training forward's RMSNorm whose rsqrt the backward reads (issue 58): aot_autograd traces LLaMA's and
Qwen2's ``LlamaRMSNorm`` / ``Qwen2RMSNorm`` and ``F.rms_norm`` as primitives (pow, mean, add, rsqrt, mul) and
saves the rsqrt; ``norms.match_norm`` fuses the norm (with the residual add before it) as
``patterns.rmsnorm_stats``, the rsqrt a kernel output bound to torch's node, which the backward reads.
Checked against eager training; what is still refused says why (``norm.saved_stats``)."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

from smg import patterns

transformers = pytest.importorskip("transformers")

from test_training import _compare, _train  # noqa: E402

from spacefusion.frontend.dynamo import SpaceFusionBackend  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _decoder(name: str) -> torch.nn.Module:
    """One decoder layer of LLaMA or Qwen2 (hidden 64, 4 query heads over 2 KV heads), seeded random weights."""
    torch.manual_seed(1)
    sizes = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=100)
    if name == "llama":
        return transformers.LlamaModel(transformers.LlamaConfig(**sizes))
    return transformers.Qwen2Model(transformers.Qwen2Config(**sizes))


def _rms_norms(report: object) -> list[object]:
    return [s for s in report.partition.subgraphs if "rmsnorm" in s.label]


@pytest.mark.parametrize("name,target", [("llama", "reference"), ("qwen2", "reference"), ("llama", "llvm"),
                                         ("qwen2", "llvm")])
def test_decoder_training_fuses_every_rmsnorm_with_its_rstd(name: str, target: str) -> None:
    """Three SGD steps: losses and every parameter's gradient within 1e-5 of eager's; the forward's three
    RMSNorms (input, post-attention with its residual add, final with the second residual add; both sums
    kept: the next block and the backward read them) are each one kernel outputting the rsqrt the backward
    reads, no norm op left to torch."""
    model = _decoder(name)
    eager = copy.deepcopy(model)
    backend = SpaceFusionBackend(target)
    got = _train(model, torch.compile(model, backend=backend, dynamic=False))
    worst = _compare(got, _train(eager, eager), rtol=1e-5, atol=1e-6)
    assert worst < 1e-6, worst
    fw = backend.graphs[0].forward
    norms = _rms_norms(fw)
    assert [s.label for s in norms] == ["rmsnorm + rstd saved 32x64 float32",
                                        "add + rmsnorm (sum kept) + rstd saved 32x64 float32",
                                        "add + rmsnorm (sum kept) + rstd saved 32x64 float32"], str(backend)
    assert all([r.space for r in s.results][:2] == ["Y", "Rstd"] for s in norms), str(backend)
    assert not any(op.op.startswith(("torch.rsqrt", "rmsnorm", "add + rmsnorm")) for op in fw.partition.left), \
        str(backend)
    assert not fw.partition.left_codes()["norm.saved_stats"], str(backend)
    # the backward's three RMSNorm backwards (aot's primitives) are the kernels derived from the RMSNorm SMG,
    # reading these rsqrts (``derived_rmsnorm``)
    assert sum(line.startswith("rmsnorm backward 32x64") for line in backend.graphs[0].backward.derived) == 3, \
        str(backend)


class _Norms(torch.nn.Module):
    """``F.rms_norm(linear(x))`` then ``F.rms_norm(h + x)`` (eps given, then torch's default)."""

    def __init__(self, n: int = 32) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(n, n)
        self.w1 = torch.nn.Parameter(1 + 0.1 * torch.randn(n))
        self.w2 = torch.nn.Parameter(1 + 0.1 * torch.randn(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.rms_norm(self.lin(x), (x.shape[-1],), self.w1, 1e-6)
        return torch.nn.functional.rms_norm(h + x, (x.shape[-1],), self.w2)


def _step(dtype: torch.dtype) -> tuple[SpaceFusionBackend, float]:
    """One step of ``_Norms`` in ``dtype``, compiled and eager: the backend and the largest gradient difference
    relative to the gradient's largest magnitude."""
    torch.manual_seed(0)
    model = _Norms().to(dtype)
    eager = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    x, r = torch.randn(2, 8, 32, generator=gen).to(dtype), torch.randn(2, 8, 32, generator=gen).to(dtype)
    backend = SpaceFusionBackend("reference")
    (torch.compile(model, backend=backend, dynamic=False)(x) * r).float().sum().backward()
    (eager(x) * r).float().sum().backward()
    worst = max(((p.grad - q.grad).abs().max() / q.grad.abs().max()).item()
                for p, q in zip(model.parameters(), eager.parameters(), strict=True))
    return backend, worst


def test_functional_rms_norm_fuses_with_its_rstd() -> None:
    """``F.rms_norm`` (its ATen form: ``add.Scalar`` of torch's eps, ``(x * rsqrt) * w``) in float32: both norms
    fused, the second with its residual add, gradients as eager's."""
    backend, worst = _step(torch.float32)
    assert worst < 1e-6, worst
    labels = [s.label for s in _rms_norms(backend.graphs[0].forward)]
    assert labels == ["rmsnorm + rstd saved 16x32 float32", "add + rmsnorm + rstd saved 16x32 float32"], labels


def test_a_half_precision_rms_norm_whose_rstd_is_saved_is_refused_with_why() -> None:
    """bf16: torch computes the statistics in float32 from a cast of x (one SMG holds one dtype): left to
    torch, each norm with ``norm.saved_stats`` and the dtypes in its sentence; the step is eager's."""
    backend, worst = _step(torch.bfloat16)
    assert worst == 0.0, worst
    fw = backend.graphs[0].forward
    assert not _rms_norms(fw), str(backend)
    refused = [op for op in fw.partition.left if op.code == "norm.saved_stats"]
    assert len(refused) == 2 and all("of bfloat16 to float32" in op.reason for op in refused), str(backend)


def test_the_rstd_saving_rmsnorm_lowers_to_cuda(tmp_path) -> None:
    """``rmsnorm_stats`` with its residual add and kept sum (three outputs, one per row) lowers for sm_90a;
    nvcc builds its cubin where it exists (compile only: no GPU here)."""
    from spacefusion.api import build, schedule

    smg = patterns.rmsnorm_stats(256, 4096, residual=True, keep_sum=True)
    assert smg.outputs == ("Y", "Rstd", "T")
    art = build(schedule(smg), "cuda:sm_90a")
    assert "__global__" in art.source
    if shutil.which("nvcc"):
        assert (art.save(tmp_path / "rmsnorm_stats", cache=None) / "kernel.cubin").stat().st_size > 0


class _MixedNorm(torch.nn.Module):
    """HF's RMSNorm on a bf16 input with a float32 weight (a model cast to bf16 but its norms kept float32):
    ``w * (x.float() * rsqrt(..)).to(bf16)`` is float32, the input bf16."""

    def __init__(self, n: int = 32) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(n, n).to(torch.bfloat16)
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        h32 = h.float()
        r = torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * (h32 * r).to(torch.bfloat16)


def test_a_mixed_dtype_rmsnorm_is_refused_with_why() -> None:
    """A bf16 input with a float32 weight and output: not one SMG dtype (bf16 LLaMA, one dtype with its float32
    rsqrt, is fused: ``test_training_half``), left to torch with ``norm.saved_stats``; gradients eager's."""
    torch.manual_seed(3)
    model = _MixedNorm()
    eager = copy.deepcopy(model)
    backend = SpaceFusionBackend("reference")
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    torch.compile(model, backend=backend, dynamic=False)(x).pow(2).mean().backward()
    eager(x).pow(2).mean().backward()
    fw = backend.graphs[0].forward
    refused = [op for op in fw.partition.left if op.code == "norm.saved_stats"]
    assert len(refused) == 1 and "of bfloat16 to float32 with a float32 rstd and a float32 weight" in \
        refused[0].reason, str(backend)
    assert not _rms_norms(fw), str(backend)
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
