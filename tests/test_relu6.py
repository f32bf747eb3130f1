"""ReLU6 (MobileNet's ``nn.ReLU6``, which Dynamo records as ``F.hardtanh(x, 0, 6)``) as an SMG unary, fused in
the epilogue of the conv or GEMM before it; a hardtanh of other bounds stays with torch, with its reason."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import spacefusion
from smg import patterns
from smg.reference import evaluate, random_inputs
from spacefusion.frontend.graph import activation_of


@pytest.mark.parametrize(("module", "want"), [
    (nn.ReLU6(), "relu6"), (nn.ReLU6(inplace=True), "relu6"), (nn.Hardtanh(0.0, 6.0), "relu6"),
    (nn.Hardtanh(), None), (nn.Hardtanh(-6.0, 6.0), None), (nn.ReLU(), "relu")])
def test_the_modules_and_functions_that_are_relu6(module: nn.Module, want: str | None) -> None:
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Identity(), module))
    node = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == "1")
    assert activation_of(node, gm) == want

    class Fn(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.relu6(x) + F.hardtanh(x, 0.0, 6.0) + F.hardtanh(x, min_val=0.0, max_val=6.0) + F.hardtanh(x)

    gf = torch.fx.symbolic_trace(Fn())
    got = [activation_of(n, gf) for n in gf.graph.nodes if n.op == "call_function" and "tanh" in str(n.target)
           or n.op == "call_function" and "relu6" in str(n.target)]
    assert got == ["relu6", "relu6", "relu6", None], got


def test_the_unary_clamps_to_zero_and_six() -> None:
    g = patterns.gemm_epilogue(8, 16, 32, act="relu6", bias=True)
    x = random_inputs(g, seed=1, scale=3.0)
    want = np.clip(x["A"] @ x["Bw"] + x["bias"], 0.0, 6.0)
    got = evaluate(g, x)["Y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert (got == 6.0).any() and (got == 0.0).any()  # both bounds reached: the test can see either wrong


class _MobileBlock(nn.Module):
    """MobileNetV2's expansion: a 1x1 conv + BatchNorm + ReLU6, then a 1x1 projection + BatchNorm (no act)."""

    def __init__(self, c: int = 16, e: int = 64) -> None:
        super().__init__()
        self.expand = nn.Sequential(nn.Conv2d(c, e, 1, bias=False), nn.BatchNorm2d(e), nn.ReLU6(inplace=True))
        self.project = nn.Sequential(nn.Conv2d(e, c, 1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.project(self.expand(x))


@pytest.mark.parametrize("target", ["reference", "llvm"])
def test_a_mobilenet_block_fuses_its_relu6(target: str) -> None:
    torch.manual_seed(0)
    model = _MobileBlock().eval()
    with torch.no_grad():
        for bn in (model.expand[1], model.project[1]):
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
    x = torch.randn(2, 16, 9, 7) * 3
    torch._dynamo.reset()
    compiled = spacefusion.compile(model, target=target)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    (p,) = compiled.spacefusion.partitions
    labels = [s.label for s in p.subgraphs]
    assert any("relu6" in lab for lab in labels), labels
    assert not [left for left in p.left if "hardtanh" in left.op], p.left


def test_a_tensor_core_conv_takes_relu6_in_its_epilogue() -> None:
    """MobileNetV2's 1x1 expansion at batch 32 (fp16): the first pick is a tensor-core program and lowers to
    CUDA with the clamp in its epilogue."""
    pytest.importorskip("tvm")
    from spacefusion.api import build
    from spacefusion.frontend.dynamo import first_pick

    s = first_pick(patterns.conv2d(32, 56, 56, 96, 24, 1, 1, 0, "relu6", True, False, dtype="float16"))
    assert s.tensor_cores
    assert "__global__" in build(s, "cuda:sm_90a").source
