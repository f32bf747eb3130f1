"""A per-channel scale after a linear folded into its weight (``frontend.scale_fold``: ConvNeXt's layer scale,
ViT LayerScale), and the residual add after the permute back to NCHW taken by the GEMM's epilogue where the
images are channels-last (``gemms._residual_through_permute``).  Each against eager."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import spacefusion

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class CNBlock(nn.Module):
    """torchvision's ConvNeXt block as its source writes it (depthwise 7x7, permute, LayerNorm, MLP, permute
    back, layer scale, residual)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.l1, self.l2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.layer_scale = nn.Parameter(torch.rand(dim, 1, 1) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dw(x).permute(0, 2, 3, 1)
        y = self.l2(F.gelu(self.l1(self.norm(y)))).permute(0, 3, 1, 2)
        return self.layer_scale * y + x


def _compiled(model: nn.Module, x: torch.Tensor, target: str = "llvm"):
    compiled = spacefusion.compile(model, target=target)
    with torch.no_grad():
        got, want = compiled(x), model(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert got.stride() == want.stride()
    (p,) = compiled.spacefusion.partitions
    return compiled, p


def test_convnext_blocks_channels_last_leave_no_elementwise_op() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(CNBlock(16), CNBlock(16)).eval().to(memory_format=torch.channels_last)
    x = torch.randn(2, 16, 8, 8).to(memory_format=torch.channels_last)
    _, p = _compiled(model, x)
    labels = [s.label for s in p.subgraphs]
    assert sum("gemm + bias + permute + add" in lab for lab in labels) == 2, labels
    assert not [op for op in p.left if "permute" not in op.op], p.left


def test_a_residual_not_stored_channels_last_stays_with_torch() -> None:
    """NCHW input: the first block's residual would need a copy to bind as rows, so torch adds it (the scale is
    still folded); the second block's input is the first one's channels-last sum, and its add is fused."""
    torch.manual_seed(1)
    model = nn.Sequential(CNBlock(8), CNBlock(8)).eval()
    _, p = _compiled(model, torch.randn(2, 8, 6, 6))
    left = [op.op for op in p.left if "permute" not in op.op]
    assert left == ["operator.add"], p.left
    assert not any("mul" in op.op for op in p.left)


class Scaled(nn.Module):
    def __init__(self, scale: torch.Tensor, permute: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(12, 8)
        self.gamma = nn.Parameter(scale)
        self.permute = permute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        y = y.permute(0, 2, 1) if self.permute else y
        return torch.relu(self.gamma * y)


@pytest.mark.parametrize("scale, permute, folds", [
    (torch.rand(8) + 0.5, False, True),          # ViT's LayerScale: per output feature
    (torch.tensor(0.7), False, True),            # one number
    (torch.rand(8, 1) + 0.5, True, True),        # per feature after a permute to [b, n, s]
    (torch.rand(5, 1) + 0.5, False, False),      # along the rows: not a feature scale
    (torch.rand(5, 8) + 0.5, False, False),      # per element
])
def test_scales_fold_only_along_the_linears_features(scale: torch.Tensor, permute: bool, folds: bool) -> None:
    torch.manual_seed(2)
    model = Scaled(scale, permute).eval()
    _, p = _compiled(model, torch.randn(3, 5, 12), target="reference")
    muls = [op for op in p.left if "mul" in op.op]
    assert (not muls) == folds, p.left


def test_a_scale_written_after_compiling_rebuilds() -> None:
    torch.manual_seed(3)
    model = Scaled(torch.rand(8) + 0.5).eval()
    x = torch.randn(3, 5, 12)
    compiled = spacefusion.compile(model, target="reference")
    with torch.no_grad():
        compiled(x)
        model.gamma.mul_(-2.0)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
        model.gamma.data.copy_(torch.full((8,), 0.25))
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
def test_convnext_blocks_fp16_channels_last_on_gpu_kernels(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused GEMM + permute + add on the GPU's first picks (fp16, channels-last), against float32 eager
    within 4x eager fp16's own error."""
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    monkeypatch.setenv("SPACEFUSION_CACHE", str(tmp_path))
    torch.manual_seed(0)
    model = nn.Sequential(CNBlock(96), CNBlock(96)).eval().cuda().to(memory_format=torch.channels_last)
    x = torch.randn(4, 96, 28, 28, device="cuda").to(memory_format=torch.channels_last)
    with torch.no_grad():
        exact = model(x)
        model.half()
        eager = model(x.half())
        compiled = spacefusion.compile(model, measure=False)
        got = compiled(x.half())
    (p,) = compiled.spacefusion.partitions
    assert sum("permute + add" in s.label for s in p.subgraphs) == 2, str(compiled.spacefusion)
    err, base = (got.float() - exact).abs().max().item(), (eager.float() - exact).abs().max().item()
    assert err <= 4 * base + 1e-3, (err, base)
