"""A channel concatenation as an SMG (``patterns.concat``): each part a One-to-One read at its offset under
zero padding, the parts read and the output written in wide runs, built for llvm (checked against numpy) and
CUDA (compiled), and matched by the frontend where a UNet's skip connections concatenate channels-last images."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import spacefusion
from schedulers.hardware import H200
from schedulers.schedule import make_schedule
from smg import patterns
from smg.errors import ShapeError
from smg.ir import Kind
from smg.ops import Builder
from smg.reference import evaluate, random_inputs
from spacefusion.api import build
from spacefusion.frontend.reasons import CONCAT
from spacefusion.frontend.schedules import ranked


def _want(ins: dict[str, np.ndarray], parts: int) -> np.ndarray:
    return np.concatenate([ins[f"X{i}"] for i in range(parts)], axis=-1)


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=2, max_size=4), st.integers(1, 5))
def test_pattern_is_numpys_concatenate(chans: list[int], pixels: int) -> None:
    g = patterns.concat(2, pixels, tuple(chans), "float32")
    ins = random_inputs(g, seed=len(chans))
    np.testing.assert_array_equal(evaluate(g, ins)["Y"], _want(ins, len(chans)))


def test_every_part_maps_one_to_one_at_its_offset() -> None:
    g = patterns.concat(2, 6, (16, 8, 24), "float16")
    assert [op.kind for op in g.ops] == ["concat"]
    assert [a.index[-1] for a in g.ops[0].inputs] == ["c - 0", "c - 16", "c - 24"]
    assert [g.inner_read(n) for n in g.inputs] == [("c", 0), ("c", -16), ("c", -24)]
    assert all(k is Kind.ONE_TO_ONE for e in g.edges for _, k in e.kinds)


def test_refusals_name_the_problem() -> None:
    with pytest.raises(ShapeError, match="two or more"):
        patterns.concat(1, 4, (8,))
    g = Builder("bad", "float32")
    a, b = g.input("A", {"m": 2, "ca": 3}), g.input("B", {"k": 2, "cb": 3})
    with pytest.raises(ShapeError, match="share every dim but one"):
        g.concat((a, b), "c")


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_llvm_kernels_match_numpy(rank: int) -> None:
    """The model's first picks, and the first with runs of vectors (fp32: 4 a run), built for llvm."""
    g = patterns.concat(2, 12, (16, 8, 24), "float32")
    ins = random_inputs(g, seed=rank)
    order = ranked(g, H200)
    vec = [s for s in order if s.vector > 1]
    s = (order[0], vec[0], vec[1])[rank]
    np.testing.assert_array_equal(build(s, "llvm")(ins)["Y"], _want(ins, 3))


def test_cuda_kernel_moves_16_byte_runs_of_each_part() -> None:
    """At a UNet's 64x64 skip connection the first pick reads each part and writes the output in uint4 runs;
    a part's run lies wholly inside it or wholly outside (zeros), so no element is read past its end."""
    g = patterns.concat(2, 4096, (640, 320), "float16")
    s = ranked(g, H200)[0]
    assert s.vector == 8
    src = build(s, "cuda").source
    body = src[src.index("__global__ void"):]
    assert "*(uint4*)(X0_ptr" in body and "*(uint4*)(X1_ptr" in body and "*(uint4*)(Y_ptr" in body, body
    assert " - 640)" in body  # the second part read at c - 640


def test_parts_not_whole_vectors_are_read_element_by_element() -> None:
    """12 + 20 channels of fp16: a 16-byte run of 8 would straddle the first part's end, so the parts are
    gathered element by element (zeros outside each) while the output is still stored in runs; on llvm the
    result is numpy's, and the CUDA source loads neither part wide."""
    g = patterns.concat(2, 6, (12, 20), "float16")
    s = make_schedule(g, serial="c", step=32, lanes=4, vector=8, tiles={"n": 1, "s": 2})
    ins = random_inputs(g, seed=3)
    np.testing.assert_array_equal(build(s, "llvm")(ins)["Y"], _want(ins, 2))
    body = build(s, "cuda").source.split("__global__ void")[-1]
    assert "*(uint4*)(X0_ptr" not in body and "*(uint4*)(X1_ptr" not in body and "*(uint4*)(Y_ptr" in body, body


class _Skip(nn.Module):
    """A conv, then its output beside a skip input along the channels, then a GroupNorm + SiLU and a 1x1 conv
    of the concatenation (a diffusion up block's ResNet: its norm and its shortcut read it)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 16, 3, padding=1)
        self.norm = nn.GroupNorm(4, 24)
        self.short = nn.Conv2d(24, 8, 1)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        h = torch.cat([self.conv(x), skip], dim=1)
        return self.short(h) + nn.functional.silu(self.norm(h)).mean(1, keepdim=True)


def test_channels_last_skip_connection_is_fused_and_matches_eager() -> None:
    torch.manual_seed(0)
    model = _Skip().eval().to(memory_format=torch.channels_last)
    x = torch.randn(2, 8, 6, 6).to(memory_format=torch.channels_last)
    skip = torch.randn(2, 8, 6, 6).to(memory_format=torch.channels_last)
    with torch.no_grad():
        compiled = spacefusion.compile(model, "llvm")
        got, ref = compiled(x, skip), model(x, skip)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    labels = [s.label for p in compiled.spacefusion.partitions for s in p.subgraphs]
    assert "concat 16 + 8 2x6x6 float32" in labels, labels


def test_nchw_parts_are_bound_channels_last_and_still_match_eager() -> None:
    """An NCHW model: the concatenation is fused all the same (its parts copied channels-last by their
    bindings, as a conv's input is), and the output is torch's values."""
    torch.manual_seed(0)
    model = _Skip().eval()
    x, skip = torch.randn(2, 8, 6, 6), torch.randn(2, 8, 6, 6)
    with torch.no_grad():
        compiled = spacefusion.compile(model, "llvm")
        torch.testing.assert_close(compiled(x, skip), model(x, skip), rtol=1e-4, atol=1e-4)
    labels = [s.label for p in compiled.spacefusion.partitions for s in p.subgraphs]
    assert "concat 16 + 8 2x6x6 float32" in labels, labels


def test_other_concatenations_stay_torchs() -> None:
    """Along the pixels, or of 3-d sequences: no pattern, torch's copy, with the reason."""

    class Rows(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.cat([a, b], dim=2) * 2, torch.cat([a.flatten(2), b.flatten(2)], dim=1) * 3

    a, b = torch.randn(1, 8, 4, 4), torch.randn(1, 8, 4, 4)
    with torch.no_grad():
        compiled = spacefusion.compile(Rows(), "llvm")
        for got, want in zip(compiled(a, b), Rows()(a, b)):
            torch.testing.assert_close(got, want)
    left = [op for p in compiled.spacefusion.partitions for op in p.left if op.op == "torch.cat"]
    assert len(left) == 2 and all(op.reason == CONCAT for op in left), left


@pytest.mark.cuda
@pytest.mark.parametrize("pixels,chans,rank", [(4096, (640, 320), 0), (64, (1280, 1280), 0), (256, (1280, 640), 1),
                                               (6, (12, 20), 0)])
def test_gpu_kernels_copy_every_element_exactly(pixels: int, chans: tuple[int, ...], rank: int, tmp_path) -> None:
    """The UNet's shapes (first picks and a second candidate) and parts that are not whole vectors, on the
    GPU: a concatenation is a copy, so the output must equal numpy's bit for bit (infinities included)."""
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from spacefusion.runtime.gpu import CudaKernel

    g = patterns.concat(2, pixels, chans, "float16")
    s = ranked(g, H200)[rank]
    kernel = CudaKernel(build(s, "cuda").save(tmp_path / "k"))
    xs = random_inputs(g, seed=11)
    xs["X1"].flat[::97] = np.inf
    got = kernel.launch({n: torch.from_numpy(v).cuda() for n, v in xs.items()})
    torch.cuda.synchronize()
    np.testing.assert_array_equal(got["Y"].cpu().numpy(), _want(xs, len(chans)))
