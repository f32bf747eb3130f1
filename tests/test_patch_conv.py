"""A convolution whose kernel is its stride (ViT's patch embedding) fused as the GEMM of its patches."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from spacefusion.frontend import fuse
from spacefusion.frontend.capture import capture
from spacefusion.frontend.partition import partition


class Patches(nn.Module):
    def __init__(self, c: int, cout: int, k: tuple[int, int], bias: bool, **kw) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, cout, k, stride=kw.pop("stride", k), bias=bias, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).flatten(2).transpose(1, 2) * 2.0


@pytest.mark.parametrize(("c", "cout", "k", "hw", "bias"), [
    (3, 32, (4, 4), (8, 12), True),  # a non-square image, bias
    (2, 16, (2, 3), (6, 9), False),  # a non-square kernel, no bias
])
def test_patch_conv_is_one_gemm_and_matches_eager(c: int, cout: int, k: tuple[int, int], hw: tuple[int, int],
                                                  bias: bool) -> None:
    torch.manual_seed(0)
    m = Patches(c, cout, k, bias).eval()
    x = torch.randn(2, c, *hw)
    p = partition(capture(m, x).module)
    (sub,) = [s for s in p.subgraphs if s.kind == "gemm"]
    nh, nw = hw[0] // k[0], hw[1] // k[1]
    assert sub.smg.shape("A") == (2 * nh * nw, c * k[0] * k[1]) and sub.smg.shape("Y") == (2 * nh * nw, cout)
    assert ("bias" in sub.smg.inputs) == bias and not any(op.op == "Conv2d" for op in p.left)
    fused = fuse(m, x, backend="reference")
    with torch.no_grad():
        torch.testing.assert_close(fused(x), m(x), rtol=1e-4, atol=1e-4)
        y = torch.randn(2, c, *hw)  # a second input through the same kernel
        torch.testing.assert_close(fused(y), m(y), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kw", [{"stride": (2, 2)}, {"padding": 1}])
def test_convs_that_are_not_patch_grids_are_the_implicit_gemms(kw: dict) -> None:
    """Overlapping or padded windows are not patches: the implicit GEMM's convolution takes them, of 3
    channels too since issue 56 (K = 4 * 4 * 3 = 48, a multiple of 8 already: no padding)."""
    m = Patches(3, 8, (4, 4), True, **kw).eval()
    p = partition(capture(m, torch.randn(1, 3, 8, 8)).module)
    (sub,) = p.subgraphs
    assert sub.kind == "conv" and sub.smg.dim_sizes["k"] == 48 and not any(op.op == "Conv2d" for op in p.left)
    fused = fuse(m, torch.randn(1, 3, 8, 8), backend="reference")
    x = torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), m(x), rtol=1e-4, atol=1e-4)


def test_an_image_of_partial_patches_is_refused_with_the_reason() -> None:
    m = Patches(3, 8, (4, 4), True).eval()
    p = partition(capture(m, torch.randn(1, 3, 10, 8)).module)
    conv = next(op for op in p.left if op.op == "Conv2d")
    assert "10x8 image is not a whole number of 4x4 patches" in conv.reason
