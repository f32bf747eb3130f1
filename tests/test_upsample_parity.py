"""An ``Upsample -> Conv`` pair by output parity (issue 28): each parity (a, b) of the upsampled output reads a
merged window of the small image with its own merged weight, so a 3x3 conv after a 2x upsampling costs four
taps an output pixel, not nine.  The view, the weight merge, the output's layout, the TMA im2col reading of
the view and the frontend's choice; the kernels' numerics on the GPU are the cuda tests' (``tests/test_mma``'s
``upconv_*`` cases) and the offline batch's (``experiments/tuning/upsample_parity_h100.json``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import sympy as sp
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import spacefusion
from schedulers.gather_tile import Im2col, gather_tile, im2col_of
from smg import patterns
from smg.errors import ShapeError
from smg.ops import upsample_fold, upsample_taps
from smg.reference import evaluate
from spacefusion.api import schedule

ROOT = Path(__file__).resolve().parents[1]


def _upsampled_conv(x: np.ndarray, w: np.ndarray, pad: int) -> np.ndarray:
    """Unfused numpy: nearest 2x upsampling of x [n, h, w, c], then a stride-1 conv with w [kh, kw, c, co]."""
    u = x.repeat(2, 1).repeat(2, 2)
    up = np.pad(u, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    k, (n, hh, ww, _) = w.shape[0], u.shape
    out = np.zeros((n, hh, ww, w.shape[-1]))
    for ky in range(k):
        for kx in range(k):
            out += up[:, ky:ky + hh, kx:kx + ww, :] @ w[ky, kx]
    return out


def _merged(w: np.ndarray, pad: int) -> np.ndarray:
    f = np.array(upsample_fold(w.shape[0], pad))
    return np.einsum("aty,bux,yxco->abtuco", f, f, w).reshape(2, 2, -1, w.shape[-1])


def test_taps_merge_per_parity() -> None:
    # a 3x3 'same' conv: output row 2i reads small rows i-1 (tap 0) and i (taps 1, 2); row 2i+1 rows i (taps
    # 0, 1) and i+1 (tap 2)
    assert upsample_taps(3, 1) == ((-1, (0, 1, 1)), (0, (0, 0, 1)))
    assert upsample_taps(1, 0) == ((0, (0,)), (0, (0,)))
    assert upsample_taps(5, 2) == ((-1, (0, 0, 1, 1, 2)), (-1, (0, 1, 1, 2, 2)))
    assert upsample_fold(3, 1) == [[[1, 0, 0], [0, 1, 1]], [[1, 1, 0], [0, 0, 1]]]
    with pytest.raises(ShapeError, match="depending on the output's parity"):
        upsample_taps(2, 0)  # parity 0 reads one small row, parity 1 two
    with pytest.raises(ShapeError, match="factor >= 2"):
        upsample_taps(3, 1, 1)


@settings(max_examples=12, deadline=None)
@given(k=st.sampled_from([1, 3, 5]), n=st.integers(1, 2), h=st.integers(1, 5), w=st.integers(1, 5),
       res=st.booleans(), seed=st.integers(0, 2**16))
def test_the_parity_form_computes_the_upsampled_conv(k, n, h, w, res, seed) -> None:
    """The SMG's reference with the merged weight is the unfused upsample + conv, its output [nh, a, j, b, co]
    lying exactly as the upsampled image [n, 2h, 2w, co]."""
    rng = np.random.default_rng(seed)
    c, co, pad = 8, 3, (k - 1) // 2
    g = patterns.upsample_conv2d(n, h, w, c, co, k, pad, "relu", residual=res)
    x, wt, bias = rng.standard_normal((n, h, w, c)), rng.standard_normal((k, k, c, co)), rng.standard_normal(co)
    r = rng.standard_normal((n, 2 * h, 2 * w, co))
    want = np.maximum(_upsampled_conv(x, wt, pad) + bias + (r if res else 0), 0)
    ins = {"X": x, "Wt": _merged(wt, pad), "bias": bias} | ({"R": r.reshape(n * h, 2, w, 2, co)} if res else {})
    got = evaluate(g, ins)["Y"]
    assert got.shape == (n * h, 2, w, 2, co)
    np.testing.assert_allclose(got.reshape(n, 2 * h, 2 * w, co), want, rtol=1e-12, atol=1e-12)


def test_only_same_convs_and_images_run_by_parity() -> None:
    with pytest.raises(ShapeError, match="not a 'same' convolution"):
        patterns.upsample_conv2d(1, 4, 4, 8, 8, 3, 0)


def _view(g):
    return gather_tile(g, g.producer("A"), "j", "k")


def test_the_parity_view_is_an_im2col_load_with_shifted_boxes() -> None:
    g = patterns.upsample_conv2d(2, 6, 10, 128, 64, 3, 1, dtype="float16")
    im = im2col_of(g, _view(g))
    assert im == Im2col("X", (2, 2), 1, 128, (6, 10), (-1, 0))
    # the box's first pixel is j + shift[b] (and the row i + shift[a]): [-1, size - 1 + 0] holds both parities
    assert im.corners == ([-1, -1], [0, 0])
    five = patterns.upsample_conv2d(1, 4, 4, 64, 64, 5, 2, dtype="float16")
    assert im2col_of(five, _view(five)) == Im2col("X", (3, 3), 2, 64, (4, 4), (-1, -1))


@settings(max_examples=15, deadline=None)
@given(h=st.integers(2, 7), w=st.integers(2, 7), data=st.data())
def test_parity_taps_and_pixels_are_what_the_view_reads(h, w, data) -> None:
    """For any output pixel and column, the view reads the small image at (i + shift[a] + ty, j + shift[b] +
    tx): what the im2col load from the shifted box with the merged tap as its offsets fetches."""
    g = patterns.upsample_conv2d(2, h, w, 64, 8, 3, 1, dtype="float16")
    view = _view(g)
    im = im2col_of(g, view)
    pos = {d: data.draw(st.integers(0, g.dim_sizes[d] - 1)) for d in ("nh", "a", "b", "j", "k")}
    syms = {d: sp.Symbol(d, integer=True) for d in pos}
    got = [int(sp.sympify(e, locals=syms).subs({syms[d]: v for d, v in pos.items()})) for e in view.index]
    ty, tx, ch = im.tap(pos["k"])
    img, i = divmod(pos["nh"], h)
    assert got == [img, i + im.shift[pos["a"]] + ty, pos["j"] + im.shift[pos["b"]] + tx, ch]


def test_rows_along_a_column_of_image_rows_take_the_cp_async_gather_and_say_why() -> None:
    g = patterns.upsample_conv2d(2, 40, 3, 64, 64, 3, 1, dtype="float16")
    tc = {"serial": "k", "step": 64, "tensor_cores": True, "stages": 3, "warps": 4, "wgmma": True}
    s = schedule(g, tiles={"nh": 64, "a": 1, "b": 1, "j": 1, "co": 64}, **tc)
    assert s.warp_tile.row == "nh" and "walks the pixels j of an image row" in s.warp_tile.im2col_why
    along = schedule(g, tiles={"nh": 1, "a": 1, "b": 1, "j": 64, "co": 64}, tma=True, **tc)
    assert along.warp_tile.im2col("A").shift == (-1, 0)


def test_the_im2col_kernel_shifts_its_box_by_the_parity() -> None:
    from spacefusion.lower.build import build_cuda
    from spacefusion.lower.mma_tma import IM2COL_LOAD

    g = patterns.upsample_conv2d(1, 8, 64, 128, 64, 3, 1, "silu", dtype="float16")
    s = schedule(g, tiles={"nh": 1, "a": 1, "b": 1, "j": 64, "co": 64}, serial="k", step=64, tensor_cores=True,
                 stages=3, warps=4, wgmma=True, tma=True)
    art = build_cuda(s)
    assert art.source.count(f"{IM2COL_LOAD}(") >= 2
    (spec,) = [p for p in art.meta["params"] if p["name"] == "A__tmap"]
    assert spec["tensor_map"]["im2col"] == {"lower": [-1, -1], "upper": [0, 0]}


class _UpConv(nn.Module):
    def __init__(self, c: int, factor: int = 2) -> None:
        super().__init__()
        self.factor = factor
        self.up = nn.Upsample(scale_factor=factor, mode="nearest")
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = x.repeat_interleave(self.factor, 2).repeat_interleave(self.factor, 3)
        return torch.nn.functional.silu(self.conv(self.up(x)) + skip)


def _compiled_upconv(factor: int, size: int):
    """``_UpConv`` of a 1x8x2x``size`` image through TorchDynamo on llvm, checked against eager: the compiled
    model and its conv subgraph."""
    torch.manual_seed(0)
    model = _UpConv(8, factor).eval()
    x = torch.randn(1, 8, 2, size)
    with torch.no_grad():
        ref = model(x)
        compiled = spacefusion.compile(model, target="llvm")
        got = compiled(x)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    (sub,) = [s for p in compiled.spacefusion.partitions for s in p.subgraphs if s.kind == "conv"]
    return compiled, sub


@pytest.mark.parametrize("size, factor, parity", [(64, 2, True), (6, 2, False), (64, 3, False)])
def test_the_frontend_runs_an_upsampling_conv_by_parity_where_its_rows_fill_an_mma(size, factor, parity) -> None:
    """Through TorchDynamo: the conv's weight merged per parity once, the residual and the output in the
    upsampled image's layout; a small image (rows short of a 64-row MMA tile), and a 3x upsampling (whose
    parities read windows of different widths), keep the upsampled read."""
    compiled, sub = _compiled_upconv(factor, size)
    assert sub.smg.name.startswith("upsample_conv2d") == parity, sub.smg.name
    assert f"(upsample x{factor})" in sub.label


def test_the_measured_parity_convs_beat_the_upsampled_read_where_the_frontend_takes_them() -> None:
    """The committed H100 batch: every kernel passed its check, and the frontend's rule (``PARITY_MIN_ROWS``)
    takes the parity form exactly where its first pick was faster than the upsampled read's."""
    from search.records import MeasureResult
    from spacefusion.frontend.convs import by_parity

    data = json.loads((ROOT / "experiments/tuning/upsample_parity_h100.json").read_text())
    assert data["device"].startswith("NVIDIA H100")
    picks: dict[tuple, dict[str, float]] = {}
    for lab, r in zip(data["labels"], data["results"], strict=True):
        res = MeasureResult.from_dict(r)
        assert res.ok and res.max_abs_err is not None
        if lab["rank"] == 0:
            picks.setdefault(tuple(lab["shape"]), {})[lab["form"]] = res.median_us
    assert len(picks) == 6
    for (b, size, _, _), us in picks.items():
        assert by_parity(b * size, size, 3, 1, 1, 2) == (us["parity"] < us["plain"]), (b, size, us)


def test_a_small_upsampled_image_runs_apart() -> None:
    """Too few rows for the parity form and few pixels: torch upsamples and the conv reads a plain image by TMA
    im2col (SD 1.5's UNet's 8x8 1280-channel upsampler, where the window read measured 2x the plain conv). The
    16x16 one, a parity conv, a stride, or channels TMA cannot band keep the fused read; the rule needs no cost
    model, so the GPU machine partitions alike."""
    from spacefusion.frontend.convs import upsample_apart
    from spacefusion.frontend.graph import Conv

    def conv(c: int, stride: int = 1) -> Conv:
        return Conv(None, "w", "b", c, 3, 3, c, (stride, stride), (1, 1), (1, 1), 1)

    why = upsample_apart((2, 1280, 8, 8), conv(1280), 2)
    assert why is not None and "runs apart" in why and "512 pixels" in why, why
    assert upsample_apart((2, 1280, 16, 16), conv(1280), 2) is None  # 2048 pixels
    assert upsample_apart((2, 640, 32, 32), conv(640), 2) is None  # by parity
    assert upsample_apart((2, 1280, 8, 8), conv(1280, 2), 2) is None
    assert upsample_apart((2, 40, 8, 8), conv(40), 2) is None


def test_an_upsampling_run_apart_is_left_to_torch_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the rule says apart: torch upsamples (the reason in the report) and the conv reads the result as a
    plain image; the output is eager's."""
    from spacefusion.frontend import convs

    monkeypatch.setattr(convs, "upsample_apart", lambda *a: "apart, as the rule says")
    compiled, sub = _compiled_upconv(2, 6)
    assert "upsample" not in sub.label and sub.smg.dim_sizes["m"] == 1 * 4 * 12, sub.label
    assert "apart, as the rule says" in str(compiled.spacefusion.partitions[0])
