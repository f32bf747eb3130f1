"""A convolution reading an NCHW image where it lies (``patterns.conv2d(..., layout="nchw")``): the same im2col
view over [n, c, h, w], whose im2col tile the tensor-core kernels gather element by element (a run of 8 columns
is 8 channels apart there: ``schedulers.gather_tile``'s scalar form), never by TMA im2col; checked against
torch's conv on the CPU (numpy reference, llvm build) and on the GPU (cuda marker)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from schedulers.gather_tile import gather_tile, im2col_of
from schedulers.hardware import H200
from search.warp_tile_cost import gather_ops
from smg import patterns
from smg.reference import evaluate, random_inputs
from spacefusion.api import build
from spacefusion.frontend.schedules import ranked


def _torch_conv(ins: dict[str, np.ndarray], k: int, stride: int, pad: int, co: int) -> np.ndarray:
    """float64 torch conv of the NCHW input with the [kh * kw * c, co] weight, as [m, co] (NHWC rows)."""
    x = torch.from_numpy(ins["X"].astype(np.float64))
    c = x.shape[1]
    w = torch.from_numpy(ins["Wt"].astype(np.float64)).reshape(k, k, c, co).permute(3, 2, 0, 1)
    y = torch.nn.functional.conv2d(x, w, torch.from_numpy(ins["bias"].astype(np.float64)), stride, pad)
    return y.permute(0, 2, 3, 1).reshape(-1, co).numpy()


@pytest.mark.parametrize("k,stride,pad", [(3, 1, 1), (3, 2, 1), (1, 1, 0), (5, 1, 2)])
def test_the_nchw_view_is_torchs_conv(k: int, stride: int, pad: int) -> None:
    g = patterns.conv2d(2, 7, 6, 8, 16, k, stride, pad, dtype="float32", layout="nchw")
    assert g.space("X").dims == ("n", "c", "h", "w") and g.name.endswith("_nchw")
    ins = random_inputs(g, seed=k + stride)
    np.testing.assert_allclose(evaluate(g, ins)["Y"], _torch_conv(ins, k, stride, pad, 16), rtol=1e-10, atol=1e-10)


def test_an_unknown_layout_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="layout 'nhcw'"):
        patterns.conv2d(1, 4, 4, 8, 8, layout="nhcw")


def test_the_nchw_tile_is_gathered_element_by_element_never_by_tma() -> None:
    nchw = patterns.conv2d(2, 16, 16, 64, 64, dtype="float16", layout="nchw")
    nhwc = patterns.conv2d(2, 16, 16, 64, 64, dtype="float16")
    g = gather_tile(nchw, nchw.producer("A"), "m", "k")
    assert g.scalar and "NCHW" in im2col_of(nchw, g)
    assert not gather_tile(nhwc, nhwc.producer("A"), "m", "k").scalar
    order = ranked(nchw, H200)
    tc = [s for s in order if s.warp_tile is not None]
    assert tc and not any(s.warp_tile.hopper.tma for s in tc) and order[0].warp_tile is not None
    # the model charges every element's address: more than 8 times the integer work of 16-byte chunks
    prog = tc[0].warp_tile
    chunked = dataclasses.replace(prog, gathers=tuple(dataclasses.replace(t, scalar=False) for t in prog.gathers))
    assert gather_ops(tc[0], prog) > 8 * gather_ops(tc[0], chunked) > 0


def test_the_cuda_kernel_loads_the_image_plainly_and_stores_16_byte_chunks() -> None:
    g = patterns.conv2d(2, 16, 16, 64, 64, dtype="float16", layout="nchw")
    src = build(ranked(g, H200)[0], "cuda").source
    body = src[src.index("__global__ void"):]
    assert "X_ptr[" in body  # element loads of the image, each behind its bounds check
    assert "cp_async" in body or "cp.async" in body  # the weight still streams by cp.async


def test_llvm_kernel_matches_torch() -> None:
    g = patterns.conv2d(2, 6, 5, 8, 8, 3, 2, 1, dtype="float32", layout="nchw")
    ins = random_inputs(g, seed=4)
    got = build(ranked(g, H200)[0], "llvm")(ins)["Y"]
    np.testing.assert_allclose(got, _torch_conv(ins, 3, 2, 1, 8), rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
@pytest.mark.parametrize("shape,rank", [((2, 16, 16, 64, 64, 3, 1, 1), 0), ((2, 16, 16, 64, 64, 3, 1, 1), 3),
                                        ((4, 28, 28, 128, 128, 3, 2, 1), 0), ((4, 14, 14, 256, 64, 1, 1, 0), 0),
                                        ((2, 7, 9, 64, 128, 3, 1, 1), 0)])
def test_tensor_core_kernels_match_the_reference_on_the_gpu(shape: tuple[int, ...], rank: int, tmp_path) -> None:
    """fp16 NCHW images (odd sizes, strided, 1x1) on tensor cores against the float64 reference."""
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from smg.reference import check_numerics
    from spacefusion.runtime.gpu import CudaKernel

    g = patterns.conv2d(*shape, dtype="float16", layout="nchw")
    s = [s for s in ranked(g, H200) if s.warp_tile is not None][rank]
    kernel = CudaKernel(build(s, "cuda").save(tmp_path / "k"))
    xs = random_inputs(g, seed=5)
    got = kernel.launch({n: torch.from_numpy(v).cuda() for n, v in xs.items()})
    torch.cuda.synchronize()
    ref = evaluate(g, {n: v.astype(np.float64) for n, v in xs.items()})
    _, why = check_numerics(g, ref, {n: t.float().cpu().numpy() for n, t in got.items()})
    assert why is None, why


class _Head(torch.nn.Module):
    """A 1x1 conv + BatchNorm + ReLU on the model's NCHW input, then a 3x3 conv of its output."""

    def __init__(self) -> None:
        super().__init__()
        self.one, self.bn, self.three = torch.nn.Conv2d(16, 8, 1), torch.nn.BatchNorm2d(8), torch.nn.Conv2d(8, 8, 3,
                                                                                                           padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.three(torch.relu(self.bn(self.one(x))))


@pytest.mark.parametrize("channels_last", [False, True])
def test_a_1x1_conv_reads_an_nchw_graph_input_where_it_lies(channels_last: bool) -> None:
    """The search's layout decision (``frontend.layouts``): the 1x1 conv of an NCHW input reads it as it lies;
    the 3x3 after it reads the 1x1's channels-last output; a channels-last input is read channels-last."""
    import spacefusion

    torch.manual_seed(0)
    model = _Head().eval()
    model.bn.running_var.uniform_(0.5, 2)
    x = torch.randn(2, 16, 6, 6)
    if channels_last:
        model, x = model.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
    with torch.no_grad():
        compiled = spacefusion.compile(model, "llvm")
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    labels = sorted(s.label for p in compiled.spacefusion.partitions for s in p.subgraphs)
    one = "conv + bn + relu 1x1/s1 2x16x6x6 -> 8 float32"
    assert labels == [one + ("" if channels_last else " (NCHW image)"), "conv 3x3/s1 2x8x6x6 -> 8 float32"], labels
