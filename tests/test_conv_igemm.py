"""Convolutions as implicit GEMMs (issue 28): the im2col view's index expressions, the slicers' reading of
it, the gathered tile's chunk analysis, the CPU kernel, and the frontend's conv + BatchNorm + add + activation
(and Upsample -> conv) chains through Dynamo, against eager torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import spacefusion
from schedulers.errors import ScheduleError
from schedulers.gather_tile import _chunked, gather_tile
from schedulers.spatial import analyse_spatial
from smg import patterns
from smg.fold import fold_reason
from smg.ops import Builder
from smg.reference import evaluate, random_inputs
from spacefusion.api import build, schedule


def _torch_conv(x: dict[str, np.ndarray], n: int, c: int, co: int, k: int, stride: int, pad: int, up: int,
                act: str, residual: bool) -> np.ndarray:
    """The conv2d pattern's output from torch (float64), laid out as the pattern's Y [n * p * q, co]."""
    xt = torch.from_numpy(x["X"]).permute(0, 3, 1, 2)
    if up > 1:
        xt = F.interpolate(xt, scale_factor=up, mode="nearest")
    w = torch.from_numpy(x["Wt"]).reshape(k, k, c, co).permute(3, 2, 0, 1)
    y = F.conv2d(xt, w, torch.from_numpy(x["bias"]), stride=stride, padding=pad).permute(0, 2, 3, 1).reshape(-1, co)
    if residual:
        y = y + torch.from_numpy(x["R"])
    return {"none": y, "relu": torch.relu(y), "silu": F.silu(y)}[act].numpy()


@given(n=st.integers(1, 2), h=st.integers(3, 9), w=st.integers(3, 9), k=st.sampled_from([1, 3, 5]),
       stride=st.integers(1, 3), up=st.sampled_from([1, 2]), act=st.sampled_from(["none", "relu", "silu"]),
       residual=st.booleans())
@settings(max_examples=40, deadline=None)
def test_the_im2col_view_computes_torchs_convolution(n, h, w, k, stride, up, act, residual) -> None:
    """The window's index expressions (stride, padding k // 2, a nearest upsampling read through floor) and the
    epilogue give torch's conv2d exactly (float64): the reference evaluates them in integer arithmetic."""
    g = patterns.conv2d(n, h, w, 8, 16, k, stride, k // 2, act, residual=residual, upsample=up, dtype="float64")
    x = random_inputs(g, seed=1)
    got = evaluate(g, x)["Y"]
    np.testing.assert_allclose(got, _torch_conv(x, n, 8, 16, k, stride, k // 2, up, act, residual), atol=1e-10)


def test_integer_floor_is_exact_where_float_division_is_not() -> None:
    """A 1x1 conv of two 7x7 images: pixel m = 49 is image 1, row floor(49/7) - 7 = 0; lambdify's float
    ``floor((1/49)*m)`` gave 0.999.. -> 0 (image 0) there, and the reference read the wrong pixel."""
    g = patterns.conv2d(2, 7, 7, 8, 16, 1, 1, 0, dtype="float64")
    x = random_inputs(g, seed=3)
    np.testing.assert_allclose(evaluate(g, x)["Y"], _torch_conv(x, 2, 8, 16, 1, 1, 0, 1, "none", False), atol=1e-10)


def test_the_view_of_an_input_is_re_read_per_block_not_recomputed() -> None:
    """Cutting the output channels re-reads the image through its im2col view, as for an input: the spatial
    slicer cuts both the pixels and the channels (else every block of channels would be one whole row)."""
    g = patterns.conv2d(2, 8, 8, 16, 32, 3, 1, 1, "relu", dtype="float16")
    cuts = {d.dim: d for d in analyse_spatial(g)}
    assert cuts["m"].cut and cuts["co"].cut and not cuts["k"].cut
    assert fold_reason(g, "n", "h") is not None and "index expression" in fold_reason(g, "n", "h")


def test_the_gathered_tile_is_read_in_chunks_of_eight_channels() -> None:
    g = patterns.conv2d(1, 6, 6, 16, 16, 3, 2, 1, dtype="float16")
    t = gather_tile(g, g.producer("A"), "m", "k")
    assert t.src == "X" and t.index[-1] == "k - 16*floor(k/16)"
    assert not t.scalar
    # where 8 columns are not 8 consecutive channels the tile is gathered element by element (``scalar``)
    narrow = patterns.conv2d(1, 6, 6, 12, 16, 3, 1, 1, dtype="float16")
    assert gather_tile(narrow, narrow.producer("A"), "m", "k").scalar
    b = Builder("strided_c", "float16")  # the channel index stepping by 2: not 8 consecutive elements
    b.input("X", {"r": 4, "c": 32})
    b._dim("m", 4)
    b._dim("k", 16)
    from smg.ir import Access, Op

    a = b._emit(Op("window", "A", ("m", "k"), (Access("X", ("m", "2*k")),), "X"))
    bad = b.build(a)
    assert gather_tile(bad, bad.producer("A"), "m", "k").scalar
    with pytest.raises(ScheduleError, match="8-aligned runs of 8 consecutive"):  # why it is not chunked
        _chunked(bad, bad.producer("A"), "k")


def test_tensor_core_conv_schedule_gathers_a_and_refuses_tma_where_no_map_describes_it() -> None:
    """A strided window is gathered by cp.async or loaded by TMA im2col (the map's traversal stride); a
    window read through a nearest upsampling has no map, and ``tma=True`` says why."""
    g = patterns.conv2d(2, 9, 9, 64, 64, 3, 2, 1, "relu", residual=True, dtype="float16")
    kw = {"tiles": {"m": 64, "co": 64}, "serial": "k", "step": 64, "tensor_cores": True, "stages": 3, "warps": 4,
          "wgmma": True}
    s = schedule(g, **kw)
    p = s.warp_tile
    assert p.tiles_in == ("A",) and p.gather("A").src == "X" and p.wgmma_ss
    assert schedule(g, tma=True, **kw).warp_tile.im2col("A").stride == 2
    up = patterns.conv2d(2, 5, 5, 64, 64, 3, 1, 1, "relu", upsample=2, dtype="float16")
    with pytest.raises(ScheduleError, match="gathered"):
        schedule(up, tma=True, **kw)


@pytest.mark.parametrize("k, stride, up", [(3, 1, 1), (3, 2, 1), (1, 1, 1), (3, 1, 2)])
def test_llvm_conv_kernel_matches_the_reference(k, stride, up) -> None:
    g = patterns.conv2d(2, 6, 5, 8, 16, k, stride, k // 2, "relu", residual=True, upsample=up)
    kern = build(schedule(g), "llvm")
    x = random_inputs(g, seed=2)
    np.testing.assert_allclose(kern(x)["Y"], evaluate(g, x)["Y"], rtol=1e-4, atol=1e-4)


class _Bottleneck(nn.Module):
    """ResNet's bottleneck (1x1, 3x3, 1x1, each + BatchNorm; the input added before the last ReLU), then a
    VAE-style Upsample -> Conv -> SiLU and a strided conv."""

    def __init__(self, c: int = 16, mid: int = 8) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.c2, self.b2 = nn.Conv2d(mid, mid, 3, padding=1, bias=False), nn.BatchNorm2d(mid)
        self.c3, self.b3 = nn.Conv2d(mid, c, 1, bias=False), nn.BatchNorm2d(c)
        self.up, self.c4 = nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv2d(c, 16, 3, padding=1)
        self.c5 = nn.Conv2d(16, 8, 3, stride=2, padding=1)
        self.grouped = nn.Conv2d(8, 8, 3, padding=1, groups=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.b1(self.c1(x)))
        y = F.relu(self.b2(self.c2(y)))
        y = self.b3(self.c3(y))
        y += x  # torchvision's bottleneck: operator.iadd in Dynamo's graph
        y = F.relu(y)
        return self.grouped(self.c5(F.silu(self.c4(self.up(y)))))


def test_conv_chains_through_dynamo_match_eager() -> None:
    """Every convolution fused with what follows it (BatchNorm folded, the residual add, ReLU / SiLU; the
    upsampling read through the window); a grouped conv left to torch with its reason; eager's output."""
    torch.manual_seed(0)
    model = _Bottleneck().eval()
    for bn in (model.b1, model.b2, model.b3):
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.data.uniform_(0.5, 1.5)
        bn.bias.data.uniform_(-0.3, 0.3)
    x = torch.randn(2, 16, 6, 5)
    with torch.no_grad():
        ref = model(x)
        compiled = spacefusion.compile(model, target="llvm")
        got = compiled(x)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    report = compiled.spacefusion
    labels = sorted(s.label for p in report.partitions for s in p.subgraphs)
    # the first 1x1 reads the NCHW input where it lies (the cost model's decision, ``frontend.layouts``); the rest
    # read channels-last
    assert labels == ["conv + bn + add + relu 1x1/s1 2x8x6x5 -> 16 float32",
                      "conv + bn + relu 1x1/s1 2x16x6x5 -> 8 float32 (NCHW image)",
                      "conv + bn + relu 3x3/s1 2x8x6x5 -> 8 float32",
                      "conv + silu (upsample x2) 3x3/s1 2x16x12x10 -> 16 float32",
                      "conv 3x3/s2 2x16x12x10 -> 8 float32"], labels
    left = [op.reason for p in report.partitions for op in p.left]
    assert any("groups 2" in r for r in left), left


def test_an_rgb_stem_is_fused_and_an_rgb_head_stays_with_torch_with_its_reason() -> None:
    """The stem's K = 3 * 3 * 3 = 27 is padded to 32 (``convs.k_align``: zero weight rows, issue 56); a head of 3
    output channels stays with cuDNN (the tensor-core GEMM's columns come in 8s)."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 3, 3, padding=1)).eval()
    x = torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        compiled = spacefusion.compile(model, target="llvm")
        torch.testing.assert_close(compiled(x), model(x))
    (p,) = compiled.spacefusion.partitions
    (stem,) = p.subgraphs
    assert stem.label.startswith("conv + relu 3x3/s1 1x3x8x8 -> 8") and stem.smg.dim_sizes["k"] == 32, stem
    left = [op.reason for op in p.left]
    assert not any("input channels" in r for r in left) and any("3 output channels" in r for r in left), left


def test_the_cost_model_charges_the_gathered_addresses() -> None:
    """Each 16-byte chunk of the im2col tile evaluates the window's index expressions on the MMA threads: a
    convolution's step costs more SIMT work than the GEMM of the same shape whose A is a plain input."""
    from schedulers.hardware import H100
    from search.warp_tile_cost import gather_ops, step_cost

    conv = patterns.conv2d(8, 14, 14, 64, 128, 3, 1, 1, "relu", dtype="float16")
    m, k = conv.dim_sizes["m"], conv.dim_sizes["k"]
    gemm = patterns.gemm_epilogue(m, 128, k, "relu", True, "float16")
    kw = {"serial": "k", "step": 64, "tensor_cores": True, "stages": 3, "warps": 4, "wgmma": True}
    sc, sg = schedule(conv, tiles={"m": 128, "co": 128}, **kw), schedule(gemm, tiles={"m": 128, "n": 128}, **kw)
    assert gather_ops(sg, sg.warp_tile) == 0
    ops = gather_ops(sc, sc.warp_tile)
    assert ops > 128 * 64 / 8 * 20  # tens of integer ops per chunk: floors, bounds, the offset
    assert step_cost(sc, H100).simt_s > step_cost(sg, H100).simt_s


def test_a_conv_without_bias_or_batchnorm_is_fused_without_a_bias_input() -> None:
    model = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.ReLU()).eval()
    x = torch.randn(1, 8, 6, 6)
    with torch.no_grad():
        compiled = spacefusion.compile(model, target="llvm")
        torch.testing.assert_close(compiled(x), model(x))
    (sub,) = [s for p in compiled.spacefusion.partitions for s in p.subgraphs]
    # at this size the model reads the NCHW input where it lies (the copy would cost a launch): either layout
    assert sub.label.startswith("conv + relu 3x3/s1 1x8x6x6 -> 8 float32") and "bias" not in sub.smg.inputs
