"""Max pooling as an SMG (a windowed All-to-One max per channel), and ResNet's stem around it: the BatchNorm
folded into the cuDNN conv torch keeps, the ReLU moved after the max and fused with the pool."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import spacefusion
from smg import patterns
from smg.errors import ShapeError
from smg.ir import Kind
from smg.reference import evaluate, random_inputs
from spacefusion.api import build
from spacefusion.frontend.schedules import ranked


def _torch_pool(x: np.ndarray, b: np.ndarray | None, k: int, s: int, pad: int, relu: bool) -> np.ndarray:
    """torch's ``max_pool2d(relu(x + b))`` of the NHWC ``x`` (its -inf padding), NHWC."""
    t = torch.from_numpy(x.astype(np.float64)).permute(0, 3, 1, 2)
    if b is not None:
        t = t + torch.from_numpy(b.astype(np.float64))[None, :, None, None]
    y = F.max_pool2d(F.relu(t) if relu else t, k, s, pad)
    return y.permute(0, 2, 3, 1).numpy()


@settings(max_examples=12, deadline=None)
@given(n=st.integers(1, 2), hw=st.integers(3, 9), c=st.integers(1, 5), k=st.integers(1, 3), s=st.integers(1, 3),
       pad=st.integers(0, 1), relu=st.booleans(), bias=st.booleans())
def test_reference_is_torchs_pool(n: int, hw: int, c: int, k: int, s: int, pad: int, relu: bool, bias: bool) -> None:
    """The masked view pads as torch does (-inf), so any input pools exactly; the shift and the ReLU after the
    max give torch's values with them before it."""
    if 2 * pad > k:
        with pytest.raises(ShapeError, match="half the kernel"):
            patterns.max_pool2d(n, hw, hw, c, k, s, pad)
        return
    g = patterns.max_pool2d(n, hw, hw, c, k, s, pad, "relu" if relu else "none", bias)
    x = random_inputs(g, seed=3)
    want = _torch_pool(x["X"], x.get("bias"), k, s, pad, relu)
    np.testing.assert_allclose(evaluate(g, x)["Y"], want, rtol=0, atol=1e-6)


def test_the_pool_is_a_windowed_reduction_over_taps_alone() -> None:
    g = patterns.max_pool2d(2, 8, 8, 16, 3, 2, 1, "relu", bias=True)
    assert (g.dim_sizes["p"], g.dim_sizes["q"], g.dim_sizes["ky"], g.dim_sizes["kx"]) == (4, 4, 3, 3)
    reduce = next(op for op in g.ops if op.reduce)
    assert reduce.reduce == ("ky", "kx") and reduce.combiner == "max"
    view = next(e for e in g.edges if e.src == "X")
    assert view.kind("p") is Kind.WINDOWED and view.kind("ky") is Kind.WINDOWED
    assert g.space("Y").dims == ("n", "p", "q", "c")
    assert "mask" in {op.kind for op in g.ops}  # padded: the taps outside are masked
    assert "mask" not in {op.kind for op in patterns.max_pool2d(2, 8, 8, 16, 2, 2, 0).ops}


@pytest.mark.parametrize("rank", [0, 5])
def test_llvm_kernels_match_the_reference(rank: int) -> None:
    g = patterns.max_pool2d(2, 9, 9, 8, 3, 2, 1, "relu", bias=True)
    s = ranked(g)[rank]
    x = random_inputs(g, seed=1)
    got = build(s, "llvm")(x)
    np.testing.assert_allclose(got["Y"], evaluate(g, x)["Y"], rtol=1e-6, atol=1e-6)


def test_the_model_ranks_whole_channel_rows_first() -> None:
    """The measured ranking (``experiments/tuning/raw/pool_round_view3_h100.json``, ResNet-50's stem pool): threads
    over 32+ contiguous channels first; 8-channel runs (100 us there against 37) and a block per few outputs
    (485 us: 802816 blocks) far behind."""
    from schedulers.hardware import H100
    from schedulers.schedule import make_schedule
    from search.cost import estimate_us

    g = patterns.max_pool2d(32, 112, 112, 64, 3, 2, 1, "relu", bias=True, dtype="float16")
    first = ranked(g)[0]
    assert first.thread_dim == "c" and dict(first.block)["c"] >= 32 and first.lanes == 1, first
    est = lambda **t: estimate_us(make_schedule(g, tiles=t, thread_dim="c", serial="ky", step=3), H100)  # noqa: E731
    assert est(n=1, p=1, q=8, c=8) > 1.5 * estimate_us(first, H100)
    assert est(n=1, p=1, q=1, c=8) > 3 * estimate_us(first, H100)


class _Stem(nn.Module):
    """ResNet's stem, its conv one that stays with cuDNN, and a second block whose conv is ours.  The stem's
    kernel is 7x5 (padded 3, 2: the 7x7's output), which the implicit GEMM does not take: ResNet's own 7x7 RGB
    stem is fused since issue 56 (``convs.k_align``), and these tests are of a conv left to torch."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, (7, 5), 2, (3, 2), bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.conv2 = nn.Conv2d(16, 16, 3, 1, 1)
        self.bn2 = nn.BatchNorm2d(16)
        self.pool2 = nn.MaxPool2d(2)
        self.pool3 = nn.MaxPool2d(3, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.pool2(self.pool(self.relu(self.bn1(self.conv1(x)))))
        y = F.max_pool2d(torch.relu(self.bn2(self.conv2(y))), 3, 2, 1)
        return self.pool3(y - 0.5)  # padded, of values that may be negative: -inf padding


def _model() -> nn.Module:
    torch.manual_seed(0)
    m = _Stem().eval()
    for bn in (m.bn1, m.bn2):  # statistics and affine parameters far from the identity, negative scales too
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.data.uniform_(-1.5, 1.5)
        bn.bias.data.uniform_(-1, 1)
    return m


def test_resnet_stem_through_dynamo_matches_eager() -> None:
    model, x = _model(), torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        compiled = spacefusion.compile(model, "llvm")
        got, ref = compiled(x), model(x)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    text = str(compiled.spacefusion.partitions[0])
    labels = sorted(s.label for p in compiled.spacefusion.partitions for s in p.subgraphs)
    # the stem's shift and ReLU join its pool; the second ReLU is the conv's (match_conv runs first)
    assert labels == ["add + relu + max_pool 3x3/s2 2x16x16x16 float32", "conv + bn + relu 3x3/s1 2x16x4x4 -> 16 "
                      "float32", "max_pool 2x2/s2 2x16x8x8 float32", "max_pool 3x3/s1 2x16x2x2 float32",
                      "max_pool 3x3/s2 2x16x4x4 float32"], labels
    assert "its inference BatchNorm's scale folded into its weight, the shift into the pool's kernel" in text, text
    assert "F.batch_norm" not in text and "square kernels" in text, text


def test_the_fold_keeps_a_batchnorm_read_twice() -> None:
    """A BatchNorm whose conv output something else reads too is not folded (the conv's value is needed)."""

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.conv(x)
            return self.bn(y) + y

    torch.manual_seed(0)
    model = Two().eval()
    model.bn.running_var.uniform_(0.5, 2)
    x = torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        compiled = spacefusion.compile(model, "llvm")
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert "folded into its weight" not in str(compiled.spacefusion.partitions[0])


@pytest.mark.cuda
def test_resnet_stem_on_gpu_kernels(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp16 on the GPU (TVM builds each first pick): the stem's pools against eager fp16, within a few times
    eager fp16's own error against float32."""
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    monkeypatch.setenv("SPACEFUSION_CACHE", str(tmp_path))
    model = _model().cuda().to(memory_format=torch.channels_last)
    x = torch.randn(4, 3, 64, 64, device="cuda").to(memory_format=torch.channels_last)
    with torch.no_grad():
        exact = model(x)
        model.half()
        eager = model(x.half())
        compiled = spacefusion.compile(model, measure=False)
        got = compiled(x.half()).clone()
    text = str(compiled.spacefusion)
    assert text.count("max_pool") >= 3, text
    eager_err = (eager.float() - exact).abs().max().item()
    ours = (got.float() - exact).abs().max().item()
    assert ours <= 4 * eager_err + 1e-3, f"fused fp16 off by {ours}, eager fp16 by {eager_err}\n{text}"


def test_a_stem_without_a_pool_folds_its_batchnorm_whole() -> None:
    """No pool after the ReLU: the shift goes into the cuDNN conv's bias, and the BatchNorm node is gone (a 3x1
    kernel: a conv the implicit GEMM leaves to torch)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, (3, 1), padding=(1, 0), bias=True), nn.BatchNorm2d(8), nn.SiLU()).eval()
    model[1].running_mean.uniform_(-1, 1)
    model[1].running_var.uniform_(0.5, 2)
    model[1].weight.data.uniform_(-1.5, 1.5)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        compiled = spacefusion.compile(model, "llvm")
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    text = str(compiled.spacefusion.partitions[0])
    assert "its inference BatchNorm folded into its weight and bias" in text and "batch_norm" not in text, text
