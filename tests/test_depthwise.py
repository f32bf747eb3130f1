"""Depthwise convolutions (groups = channels: MobileNet, EfficientNet, ConvNeXt) as an SMG
(``patterns.depthwise_conv2d``: a per-channel filter times the image read through the window, summed over the
taps) and
through the frontend (``convs._depthwise``), each checked against torch's own convolution."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import spacefusion
from smg import patterns
from smg.ir import Kind
from smg.reference import evaluate, random_inputs
from spacefusion.api import build, schedule

ACTS = {"none": lambda t: t, "relu": F.relu, "silu": F.silu, "gelu": F.gelu}


def _torch(x: dict[str, np.ndarray], k: int, s: int, p: int, act: str, bias: bool, res: bool) -> np.ndarray:
    c = x["X"].shape[-1]
    X = torch.tensor(x["X"], dtype=torch.float64).permute(0, 3, 1, 2)
    W = torch.tensor(x["Wt"], dtype=torch.float64).permute(2, 0, 1)[:, None]
    b = torch.tensor(x["bias"], dtype=torch.float64) if bias else None
    y = F.conv2d(X, W, b, stride=s, padding=p, groups=c).permute(0, 2, 3, 1)
    if res:
        y = y + torch.tensor(x["R"], dtype=torch.float64)
    return ACTS[act](y).numpy()


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 2), h=st.integers(3, 12), w=st.integers(3, 12), c=st.sampled_from([1, 3, 8]),
       k=st.sampled_from([1, 3, 5, 7]), s=st.integers(1, 2), data=st.data(),
       act=st.sampled_from(sorted(ACTS)), bias=st.booleans(), res=st.booleans())
def test_the_smg_is_torchs_depthwise_convolution(n, h, w, c, k, s, data, act, bias, res) -> None:
    p = data.draw(st.integers(0, k // 2))
    if h + 2 * p < k or w + 2 * p < k:
        return
    g = patterns.depthwise_conv2d(n, h, w, c, k, s, p, act, bias, res)
    x = random_inputs(g, seed=3)
    np.testing.assert_allclose(evaluate(g, x)["Y"], _torch(x, k, s, p, act, bias, res), rtol=1e-5, atol=1e-5)


def test_the_channel_is_one_to_one_and_the_taps_are_reduced() -> None:
    """No GEMM and no mask: the window reads zero outside the image, the filter is One-to-All over the
    pixels, the channel One-to-One, and only the taps are reduced."""
    g = patterns.depthwise_conv2d(1, 8, 8, 4, 3, 1, 1)
    reduce = next(op for op in g.ops if op.reduce)
    assert reduce.reduce == ("ky", "kx") and reduce.combiner == "sum" and "c" in reduce.out_index
    view = next(e for e in g.edges if e.src == "X")
    assert view.kind("p") is Kind.WINDOWED and view.kind("c") is Kind.ONE_TO_ONE
    filt = next(e for e in g.edges if e.src == "Wt")
    assert filt.kind("p") is Kind.ONE_TO_ALL and filt.kind("c") is Kind.ONE_TO_ONE
    assert "mask" not in {op.kind for op in g.ops} and g.space("Y").dims == ("n", "p", "q", "c")


@pytest.mark.parametrize("shape", [(2, 9, 7, 8, 3, 1, 1, "relu", True, False),
                                   (1, 12, 12, 16, 7, 1, 3, "none", True, True),
                                   (2, 10, 11, 8, 5, 2, 2, "silu", False, False)])
def test_llvm_kernels_match_torch(shape) -> None:
    n, h, w, c, k, s, p, act, bias, res = shape
    g = patterns.depthwise_conv2d(n, h, w, c, k, s, p, act, bias, res)
    x = random_inputs(g, seed=5)
    got = build(schedule(g), "llvm")(x)["Y"]
    np.testing.assert_allclose(got, _torch(x, k, s, p, act, bias, res), rtol=1e-4, atol=1e-4)


def test_the_cuda_first_pick_builds(tmp_path) -> None:
    """ConvNeXt's 7x7 at batch 32 (fp16): the first pick lowers to CUDA and, where nvcc is, compiles."""
    pytest.importorskip("tvm")
    from spacefusion.frontend.dynamo import first_pick

    art = build(first_pick(patterns.depthwise_conv2d(32, 56, 56, 96, 7, 1, 3, dtype="float16")), "cuda:sm_90a")
    folder = art.save(tmp_path / "dw")
    assert (folder / "kernel.json").is_file() and "__global__" in (folder / "kernel.cu").read_text()


class _Blocks(nn.Module):
    """MobileNet's depthwise conv + BatchNorm + SiLU, ConvNeXt's 7x7 with a residual, a strided 5x5 + ReLU,
    and a grouped (not depthwise) conv that stays with torch."""

    def __init__(self, c: int = 16) -> None:
        super().__init__()
        self.dw = nn.Conv2d(c, c, 3, padding=1, groups=c, bias=False)
        self.bn, self.act = nn.BatchNorm2d(c), nn.SiLU()
        self.dw7 = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.dw5 = nn.Conv2d(c, c, 5, stride=2, padding=2, groups=c)
        self.grouped = nn.Conv2d(c, c, 3, padding=1, groups=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.bn(self.dw(x)))
        y = self.dw7(y) + y
        return self.grouped(torch.relu(self.dw5(y)))


@pytest.mark.parametrize("target", ["reference", "llvm"])
def test_depthwise_blocks_through_dynamo_match_eager(target: str) -> None:
    torch.manual_seed(0)
    model = _Blocks().eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    x = torch.randn(2, 16, 13, 11)
    torch._dynamo.reset()
    compiled = spacefusion.compile(model, target=target)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    (p,) = compiled.spacefusion.partitions
    labels = [s.label for s in p.subgraphs]
    assert sum("dwconv" in lab for lab in labels) == 3, labels
    assert any("groups 4" in left.reason for left in p.left), p.left  # grouped, not depthwise: torch, with why


def test_the_cuda_backend_leaves_depthwise_convs_to_cudnn_with_why(tmp_path) -> None:
    """On the GPU a depthwise conv stays with cuDNN (its kernel measured slower than cuDNN's), reported with the
    measurement; ``library_first = {}`` on the backend fuses them (the kernels' own research path)."""
    from spacefusion.frontend.backends import CudaBackend
    from spacefusion.frontend.partition import partition

    model = _Blocks().eval()
    gm = torch.fx.symbolic_trace(model)
    torch.fx.passes.shape_prop.ShapeProp(gm).propagate(torch.randn(2, 16, 13, 11))
    be = CudaBackend(tmp_path, load=False)
    kept = partition(gm, be.layout_of, be.library_first)
    assert not [s for s in kept.subgraphs if "dwconv" in s.label]
    assert sum("cuDNN" in left.reason and "depthwise" in left.reason for left in kept.left) == 3, kept.left
    fused = partition(gm, be.layout_of, {})
    assert sum("dwconv" in s.label for s in fused.subgraphs) == 3


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(4, 28, 28, 32, 7, 1, 3, "none", True, True),
                                   (4, 30, 30, 48, 3, 2, 1, "silu", True, False),
                                   (2, 14, 14, 96, 5, 1, 2, "relu", False, False)])
def test_depthwise_kernels_on_the_gpu_match_torch(shape, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first pick of each, and the best-ranked candidate that stages the window's input with its halo in
    shared memory (which the first pick need not be: the ranking may prefer reading it from global at these
    small sizes), against torch's fp32 depthwise convolution, on the GPU (TVM there: built in place)."""
    pytest.importorskip("cupy")
    pytest.importorskip("tvm")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from spacefusion.frontend.dynamo import first_pick
    from spacefusion.frontend.schedules import ranked
    from spacefusion.runtime.gpu import load_kernel

    monkeypatch.setenv("SPACEFUSION_CUBIN_CACHE", str(tmp_path / "cubins"))
    n, h, w, c, k, s, p, act, bias, res = shape
    g = patterns.depthwise_conv2d(n, h, w, c, k, s, p, act, bias, res, "float16")
    staged = next(x for x in ranked(g) if dict(x.memory)["X"] == "shared")
    x = random_inputs(g, seed=0)
    want = _torch(x, k, s, p, act, bias, res)
    for i, pick in enumerate((first_pick(g), staged)):
        folder = build(pick, "cuda:sm_90a").save(tmp_path / f"dw{i}")
        got = load_kernel(folder)(**{name: torch.tensor(v, device="cuda").half() for name, v in x.items()})["Y"]
        np.testing.assert_allclose(got.float().cpu().numpy(), want, rtol=2e-2, atol=2e-2, err_msg=str(pick.memory))


@pytest.mark.cuda
def test_depthwise_blocks_on_gpu_kernels(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    monkeypatch.setenv("SPACEFUSION_CACHE", str(tmp_path))
    torch.manual_seed(0)
    model = _Blocks(32).eval().cuda()
    x = torch.randn(4, 32, 28, 28, device="cuda")
    with torch.no_grad():
        exact = model(x)
        model = model.half().to(memory_format=torch.channels_last)
        xh = x.half().to(memory_format=torch.channels_last)
        eager = model(xh)
        torch._dynamo.reset()
        from spacefusion.frontend.backends import CudaBackend
        from spacefusion.frontend.dynamo import first_pick

        be = CudaBackend(tmp_path / "k", schedule_for=first_pick, build_missing=True)
        be.library_first = {}  # the fused kernels, not cuDNN's
        compiled = spacefusion.compile(model, target=be, measure=False)
        got = compiled(xh)
    err, base = (got.float() - exact).abs().max().item(), (eager.float() - exact).abs().max().item()
    assert err <= 4 * base + 1e-3, (err, base)
    labels = [s.label for p in compiled.spacefusion.partitions for s in p.subgraphs]
    assert sum("dwconv" in lab for lab in labels) == 3, labels


@pytest.mark.parametrize(("filt", "kernel", "says"), [
    ({"ky": 3, "kx": 3, "d": 4}, 3, "must be [ky, kx, c]"), ({"ky": 3, "kx": 3, "c": 4}, 5, "is 3x3, the window 5x5"),
    ({"ky": 9, "kx": 9, "c": 4}, 9, "does not fit")])
def test_a_filter_that_does_not_fit_the_window_is_refused_by_name(filt, kernel, says) -> None:
    from smg.errors import ShapeError
    from smg.ops import Builder

    g = Builder("dw", "float32")
    x, w = g.input("X", {"n": 1, "h": 5, "w": 5, "c": 4}), g.input("W", filt)
    with pytest.raises(ShapeError, match=re.escape(says)):
        g.depthwise_window2d(x, w, kernel, 1, 1)
