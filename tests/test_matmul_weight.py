"""``x @ W.T`` / ``x @ W`` / ``torch.mm`` on a 2-D parameter read as a linear without bias (``graph.linear_of``):
fused as GEMMs with what follows them, against eager; a product of two values stays what it was."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import spacefusion

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class Products(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.W = nn.Parameter(torch.randn(8, 12) / 4)  # [n, k], as nn.Linear stores it
        self.V = nn.Parameter(torch.randn(12, 8) / 4)  # [k, n]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(x @ self.W.T)
        b = torch.matmul(x, self.W.t())
        c = torch.sigmoid(x @ self.V)
        d = torch.mm(x.reshape(-1, 12), self.W.transpose(0, 1)).reshape(3, 5, 8)
        return a * b + c - d


@pytest.mark.parametrize("target", ["reference", "llvm"])
def test_products_with_parameters_are_gemms(target: str) -> None:
    torch.manual_seed(0)
    model = Products().eval()
    x = torch.randn(3, 5, 12)
    compiled = spacefusion.compile(model, target=target)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    (p,) = compiled.spacefusion.partitions
    kinds = sorted(s.kind for s in p.subgraphs)  # relu(x @ W.T) * (x @ W.t()) is a gated GEMM of two products
    assert kinds == ["gated_gemm", "gemm", "gemm"], str(compiled.spacefusion)
    assert any("sigmoid" in s.label for s in p.subgraphs), str(compiled.spacefusion)
    assert not [op for op in p.left if "matmul" in op.op or op.op == "torch.mm"], p.left


def test_a_product_of_two_values_is_not_a_linear() -> None:
    class TwoValues(nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return x @ y.T

    x, y = torch.randn(6, 4), torch.randn(5, 4)
    compiled = spacefusion.compile(TwoValues(), target="reference")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, y), x @ y.T)
    assert not any(s.kind == "gemm" for p in compiled.spacefusion.partitions for s in p.subgraphs)
