"""Issue 56: RGB stems (and any C_in not a multiple of 8) fuse as implicit GEMMs with K padded.

A first convolution of 3 channels was refused (``conv.form``: the gathered tile reads runs of 8 channels).  Now
K = kh * kw * C_in is padded to a multiple of 8 (``convs.k_align``: ResNet's 7 * 7 * 3 = 147 -> 152, a 3x3
stem's 27 -> 32) with zero weight rows, and the tensor-core tile gathers A element by element
(``gather_tile``'s scalar form), its last step predicated.  Checked here: each stem with its epilogue
(BatchNorm folded, ReLU / ReLU6 / SiLU; ConvNeXt's patchify and its LayerNorm) against torch on both CPU
targets in float32 and bf16; the padded graph against the unpadded one; which path the H100 ranking picks (the
tensor-core warp tile, where without the padding only CUDA-core schedules exist); and the CUDA source compiled.
"""

from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import pytest
import torch
from torch import nn

import spacefusion
from smg import patterns
from smg.reference import evaluate, random_inputs

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class _Patchify(nn.Module):
    """ConvNeXt's stem: a 4x4/4 patchify conv, then a LayerNorm over the channels (channels-last)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv2d(3, 16, 4, 4), nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x).permute(0, 2, 3, 1))


def _bn(c: int) -> nn.BatchNorm2d:
    bn = nn.BatchNorm2d(c)
    bn.running_mean.uniform_(-0.5, 0.5)
    bn.running_var.uniform_(0.5, 2)
    bn.weight.data.uniform_(-1.5, 1.5)
    bn.bias.data.uniform_(-0.5, 0.5)
    return bn


def _stem(name: str) -> tuple[nn.Module, str, int]:
    """The stem, the label its fused conv must start with, and its (padded) K."""
    torch.manual_seed(0)
    if name == "resnet":  # 7x7/2, BatchNorm, ReLU: K = 147 -> 152
        return nn.Sequential(nn.Conv2d(3, 16, 7, 2, 3, bias=False), _bn(16), nn.ReLU()), "conv + bn + relu 7x7/s2", 152
    if name == "mobilenet":  # 3x3/2, BatchNorm, ReLU6: K = 27 -> 32
        return nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), _bn(16), nn.ReLU6()), "conv + bn + relu6 3x3/s2", 32
    if name == "efficientnet":  # 3x3/2, BatchNorm, SiLU
        return nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), _bn(16), nn.SiLU()), "conv + bn + silu 3x3/s2", 32
    if name == "five_channels":  # not RGB: 5 * 9 = 45 -> 48, with a bias
        return nn.Sequential(nn.Conv2d(5, 16, 3, 1, 1), nn.ReLU()), "conv + relu 3x3/s1", 48
    if name == "convnext":  # kernel = stride: the patch GEMM (K = 48, aligned), the LayerNorm apart
        return _Patchify(), "patch conv 4x4 as gemm + bias", 48
    raise ValueError(name)


STEMS = ("resnet", "mobilenet", "efficientnet", "five_channels", "convnext")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("target", ["reference", "llvm"])
@pytest.mark.parametrize("name", STEMS)
def test_stem_is_fused_and_matches_torch(name: str, target: str, dtype: torch.dtype) -> None:
    model, label, k = _stem(name)
    model = model.eval().to(dtype)
    exact = copy.deepcopy(model).float()  # the same (rounded) weights in float32
    c_in = next(m for m in model.modules() if isinstance(m, nn.Conv2d)).in_channels
    x = torch.randn(2, c_in, 32, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    compiled = spacefusion.compile(model, target=target)
    with torch.no_grad():
        got, ref, eager = compiled(x), exact(x.float()), model(x)
    assert got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    else:  # no worse than torch's own bf16 conv, or one bf16 rounding of the output's scale
        err, eager_err = (got.float() - ref).abs().max().item(), (eager.float() - ref).abs().max().item()
        assert err <= max(2 * eager_err, 2.0**-7 * ref.abs().max().item()), (err, eager_err)
    (p,) = compiled.spacefusion.partitions
    convs = [s for s in p.subgraphs if s.label.startswith(label)]
    assert len(convs) == 1, str(p)
    k_dim = convs[0].smg.dim_sizes["k"]
    assert k_dim == k, (k_dim, k)
    assert not [op for op in p.left if op.code in ("conv.form", "left.kernel_build")], str(p)
    if name == "convnext":
        assert any(s.kind == "norm" for s in p.subgraphs), str(p)


def test_padded_k_reads_past_the_kernel_and_zero_weight_rows_cancel_it() -> None:
    """The padded graph with zero weight rows is the unpadded conv; with those rows not zero it is not (the
    padded columns are read: the zeros are what makes the padding exact)."""
    plain = patterns.conv2d(2, 9, 9, 3, 8, 7, 2, 3, act="relu", bias=True, dtype="float32")
    padded = patterns.conv2d(2, 9, 9, 3, 8, 7, 2, 3, act="relu", bias=True, dtype="float32", k_align=8)
    assert (plain.dim_sizes["k"], padded.dim_sizes["k"]) == (147, 152) and plain.key != padded.key
    assert patterns.conv2d(2, 9, 9, 8, 8, 3, k_align=8).key == patterns.conv2d(2, 9, 9, 8, 8, 3).key  # aligned
    ins = random_inputs(plain, seed=0)
    zero = dict(ins, Wt=np.concatenate([ins["Wt"], np.zeros((5, 8), np.float32)]))
    np.testing.assert_allclose(evaluate(padded, zero)["Y"], evaluate(plain, ins)["Y"], rtol=1e-12, atol=1e-12)
    ones = dict(ins, Wt=np.concatenate([ins["Wt"], np.ones((5, 8), np.float32)]))
    assert not np.allclose(evaluate(padded, ones)["Y"], evaluate(plain, ins)["Y"])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_h100_ranking_picks_tensor_cores_for_the_padded_stem(dtype: str) -> None:
    """ResNet's stem at 2x3x64x64: with K padded the first pick is the tensor-core warp tile (its last step
    predicated); unpadded, K = 147 is no multiple of 8 and only CUDA-core schedules exist."""
    from spacefusion.api import candidates, hardware

    hw = hardware("h100")
    padded = patterns.conv2d(2, 64, 64, 3, 64, 7, 2, 3, act="relu", dtype=dtype, k_align=8)
    (first,) = candidates(padded, hw, head=1)
    assert first.warp_tile is not None and first.serial == "k", first
    (plain,) = candidates(patterns.conv2d(2, 64, 64, 3, 64, 7, 2, 3, act="relu", dtype=dtype), hw, head=1)
    assert plain.warp_tile is None, plain


def test_a_stem_reads_its_nchw_image_where_it_lies_when_both_layouts_gather_by_element() -> None:
    """With 3 channels the channels-last kernel gathers element by element as the NCHW one does: no margin
    (``layouts.SCALAR_MARGIN``) for the NCHW read, and the copy alone decides."""
    from schedulers.hardware import H100
    from spacefusion.frontend.layouts import SCALAR_MARGIN, LayoutChoice, choose_layout

    kw = {"act": "relu", "dtype": "float16", "k_align": 8}
    nchw = patterns.conv2d(2, 64, 64, 3, 64, 7, 2, 3, layout="nchw", **kw)
    choice = choose_layout(nchw, patterns.conv2d(2, 64, 64, 3, 64, 7, 2, 3, **kw), H100)
    assert choice.margin == SCALAR_MARGIN and "both gathered element by element" in choice.reason, choice
    assert choice.layout == ("nchw" if choice.nchw_us < choice.copy_us + choice.nhwc_us else "nhwc"), choice
    assert LayoutChoice.from_dict(choice.to_dict()) == choice
    old = {k: v for k, v in choice.to_dict().items() if k != "margin"}  # a record from before the margin field
    assert LayoutChoice.from_dict(old).margin == 1.25


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to compile the CUDA source")
def test_the_bf16_resnet_stem_exports_a_tensor_core_kernel_that_compiles(tmp_path, monkeypatch) -> None:
    """ResNet's stem as it is (64 output channels; 16 rank CUDA cores first) at 2x3x64x64, bf16, ranked for the
    H100, with ``library_first`` emptied (the GPU's default leaves it to cuDNN until measured): the warp-tile
    kernel, compiled by nvcc."""
    from spacefusion.frontend.backends import CudaBackend
    from spacefusion.frontend.dynamo import export_cuda

    monkeypatch.setattr(CudaBackend, "library_first", {})
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), _bn(64), nn.ReLU()).eval().to(torch.bfloat16)
    backend = export_cuda(model, tmp_path, torch.randn(2, 3, 64, 64).bfloat16(), hardware="h100")
    assert "conv + bn + relu 7x7/s2 2x3x64x64 -> 64 bfloat16" in str(backend), str(backend)
    (meta,) = tmp_path.glob("*/kernel.json")
    assert json.loads(meta.read_text()).get("cubin") == "kernel.cubin"
    source = (meta.parent / "kernel.cu").read_text()
    assert "mma" in source and "bfloat16" in source


def test_the_cuda_backend_leaves_stems_to_cudnn_with_why_and_folds_their_batchnorm(tmp_path) -> None:
    """On the GPU a stem stays with cuDNN until measured (``library_first["stem_conv"]``: the model's estimate
    against cuDNN's measured time), said with code ``library.first``; its BatchNorm is folded into the conv
    torch runs, as before; an aligned conv after it is fused."""
    from spacefusion.frontend import fuse
    from spacefusion.frontend.backends import CudaBackend
    from spacefusion.frontend.bn_fold import fold_bn_into_left_convs
    from spacefusion.frontend.capture import capture
    from spacefusion.frontend.partition import partition

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 7, 2, 3, bias=False), _bn(16), nn.ReLU(), nn.Conv2d(16, 16, 3, 1, 1))
    x = torch.randn(2, 3, 32, 32)
    cap = capture(model.eval(), x)
    be = CudaBackend(tmp_path, load=False)
    assert fold_bn_into_left_convs(cap.module, be.library_first)  # the stem's BatchNorm, folded
    p = partition(cap.module, be.layout_of, be.library_first)
    (stem,) = [op for op in p.left if op.code == "library.first"]
    assert "stays with cuDNN on the GPU until measured" in stem.reason, stem
    assert [s.label.split(" 3x3")[0] for s in p.subgraphs] == ["conv"], p
    fused = fuse(model, x, backend="llvm")  # the CPU targets fuse it (no library)
    assert not [op for op in fused.partition.left if op.code == "library.first"]
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), rtol=1e-4, atol=1e-4)


def test_an_upsampling_before_an_unaligned_conv_runs_apart_with_its_reason() -> None:
    """The window read through a nearest upsampling (and the parity form) are not taken with a padded K: the
    upsampling is torch's, said with code ``conv.upsample_apart``; the conv after it is fused."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Upsample(scale_factor=2), nn.Conv2d(3, 8, 3, 1, 1), nn.SiLU()).eval()
    x = torch.randn(1, 3, 8, 8)
    compiled = spacefusion.compile(model, target="llvm")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    (p,) = compiled.spacefusion.partitions
    assert [s.label.split(" [")[0] for s in p.subgraphs] == ["conv + silu 3x3/s1 1x3x16x16 -> 8 float32"], str(p)
    (up,) = p.left
    assert up.code == "conv.upsample_apart" and "3 input channels" in up.reason, up
