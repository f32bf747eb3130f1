"""1-D convolutions (Whisper's encoder, Wav2Vec2's feature encoder, time-series models) as the 2-D implicit GEMM
over an image one row high (``patterns.conv1d``: kernel (1, k), padding (0, p)) and through the frontend
(``convs._conv1d``), each checked against torch's own ``conv1d``; the real ``transformers`` encoders fused
and checked against eager."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import sympy as sp
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import spacefusion
from schedulers.gather_tile import Im2col, gather_tile, im2col_of
from smg import patterns
from smg.errors import ShapeError
from smg.ops import pads2d
from smg.reference import evaluate, random_inputs
from spacefusion.api import build, schedule

ACTS = {"none": lambda t: t, "relu": F.relu, "gelu": F.gelu, "silu": F.silu}


def _torch(x: dict[str, np.ndarray], c: int, k: int, s: int, p: int, act: str, bias: bool, res: bool,
           layout: str = "nhwc") -> np.ndarray:
    """torch's ``conv1d`` (float64) of the SMG's inputs, as the SMG's Y [n * L', co]."""
    X = torch.tensor(x["X"], dtype=torch.float64)
    X = X[:, :, 0, :] if layout == "nchw" else X[:, 0].permute(0, 2, 1)  # [n, c, L]
    co = x["Wt"].shape[1]
    W = torch.tensor(x["Wt"], dtype=torch.float64).reshape(k, c, co).permute(2, 1, 0)  # [co, c, k]
    b = torch.tensor(x["bias"], dtype=torch.float64) if bias else None
    y = F.conv1d(X, W, b, stride=s, padding=p).permute(0, 2, 1).reshape(-1, co)
    if res:
        y = y + torch.tensor(x["R"], dtype=torch.float64)
    return ACTS[act](y).numpy()


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 2), length=st.integers(1, 24), c=st.sampled_from([1, 3, 8, 16]), co=st.sampled_from([4, 8]),
       k=st.integers(1, 7), s=st.integers(1, 2), data=st.data(), act=st.sampled_from(sorted(ACTS)),
       bias=st.booleans(), res=st.booleans(), layout=st.sampled_from(["nhwc", "nchw"]))
def test_the_smg_is_torchs_conv1d(n, length, c, co, k, s, data, act, bias, res, layout) -> None:
    p = data.draw(st.integers(0, k))
    if length + 2 * p < k:
        with pytest.raises(ShapeError, match="does not fit"):
            patterns.conv1d(n, length, c, co, k, s, p)
        return
    g = patterns.conv1d(n, length, c, co, k, s, p, act, bias, res, layout=layout)
    x = random_inputs(g, seed=3)
    assert g.space("Y").dims == ("m", "co") and g.dim_sizes["m"] == n * ((length + 2 * p - k) // s + 1)
    np.testing.assert_allclose(evaluate(g, x)["Y"], _torch(x, c, k, s, p, act, bias, res, layout),
                               rtol=1e-5, atol=1e-5)


def test_a_square_padding_gives_the_2d_windows_index_unchanged() -> None:
    """One int and a pair of equal ints are one padding: the 2-D convs' SMGs (and so their keys, kernels and
    first picks) are what they were before the padding became per dim."""
    a = patterns.conv2d(2, 9, 7, 16, 8, 3, 2, 1)
    b = patterns.conv2d(2, 9, 7, 16, 8, (3, 3), 2, (1, 1))
    assert a.key == b.key
    assert pads2d(2) == (2, 2) and pads2d((0, 3)) == (0, 3)
    with pytest.raises(ShapeError, match="an int or a pair"):
        pads2d("same")


@pytest.mark.parametrize("shape", [(2, 37, 16, 24, 3, 1, 1, "gelu", True, False, "nhwc"),
                                   (2, 37, 16, 24, 3, 2, 1, "gelu", True, True, "nhwc"),
                                   (1, 20, 8, 16, 5, 2, 0, "none", False, False, "nhwc"),
                                   (2, 30, 16, 8, 3, 1, 1, "relu", True, False, "nchw")])
def test_llvm_kernels_match_torch(shape) -> None:
    n, length, c, co, k, s, p, act, bias, res, layout = shape
    g = patterns.conv1d(n, length, c, co, k, s, p, act, bias, res, layout=layout)
    x = random_inputs(g, seed=5)
    got = build(schedule(g), "llvm")(x)["Y"]
    np.testing.assert_allclose(got, _torch(x, c, k, s, p, act, bias, res, layout), rtol=1e-4, atol=1e-4)


def _view(g):
    return gather_tile(g, g.producer("A"), "m", "k")


@settings(max_examples=15, deadline=None)
@given(k=st.integers(1, 7), length=st.integers(8, 40), stride=st.sampled_from([1, 2]), bands=st.integers(1, 2),
       data=st.data())
def test_a_1d_window_is_an_im2col_load_padded_along_its_row_only(k, length, stride, bands, data) -> None:
    """A 16-bit 1-D window over whole 64-channel bands is a TMA im2col load of the image one row high: its pixel
    box pads the row (w) by p and the column (h) by nothing, and each row and column of the view reads the
    image at the output pixel's first tap plus the column's tap, as the load with that tap as its offsets does."""
    pad = data.draw(st.integers(0, min(3, k)))
    if length + 2 * pad < k:
        return
    c = 64 * bands
    g = patterns.conv1d(2, length, c, 16, k, stride, pad, dtype="float16")
    view = _view(g)
    im = im2col_of(g, view)
    q = (length + 2 * pad - k) // stride + 1
    assert im == Im2col("X", (1, k), pad if pad == 0 else (0, pad), c, (1, q), stride=stride)
    lower, upper = im.corners
    assert lower == [-pad, 0] and upper == [pad - (k - 1), 0]
    box_w = (length - 1 + upper[0]) - lower[0] + 1
    assert -(-box_w // stride) == q
    m, col = data.draw(st.integers(0, 2 * q - 1)), data.draw(st.integers(0, k * c - 1))
    syms = {"m": sp.Symbol("m", integer=True), "k": sp.Symbol("k", integer=True)}
    got = [int(sp.sympify(e, locals=syms).subs({syms["m"]: m, syms["k"]: col})) for e in view.index]
    ky, kx, ch = im.tap(col)
    assert ky == 0 and got == [m // q, 0, stride * (m % q) - pad + kx, ch]


#: Whisper-base's two convolutions (batch 4, 30 s of log-mel frames): 80 -> 512 channels, then 512 -> 512 stride 2
WHISPER_BASE = ((4, 3000, 80, 512, 3, 1, 1), (4, 3000, 512, 512, 3, 2, 1))


@pytest.mark.parametrize("args, layout", [(WHISPER_BASE[0], "nhwc"), (WHISPER_BASE[0], "nchw"),
                                          (WHISPER_BASE[1], "nhwc")])
def test_whisper_base_first_picks_build_for_sm90a(tmp_path, args, layout) -> None:
    """The first picks of Whisper-base's convolutions + GELU (fp16) lower to CUDA and, where nvcc is, compile
    for sm_90a.  The 512-channel stride-2 one loads its window by TMA im2col; the 80-channel one (not whole
    64-channel bands) gathers it by cp.async, and read NCL where it lies element by element."""
    pytest.importorskip("tvm")
    from spacefusion.frontend.dynamo import first_pick

    s = first_pick(patterns.conv1d(*args, act="gelu", dtype="float16", layout=layout))
    art = build(s, "cuda:sm_90a")
    folder = art.save(tmp_path / "k")
    src = (folder / "kernel.cu").read_text()
    assert (folder / "kernel.json").is_file() and "__global__" in src
    assert (folder / "kernel.cubin").is_file() or shutil.which("nvcc") is None
    assert ("sf_tma_load_im2col_4d(" in src) == (args[2] % 64 == 0), s


class _Convs(nn.Module):
    """Whisper's stem (conv1d + GELU, conv1d stride 2 + GELU, the frames transposed after it), a conv1d with a
    BatchNorm1d, a residual add and a ReLU, a reflect-padded one (Dynamo writes its padding as an ``F.pad``
    before an unpadded conv, which is fused), and two that stay with torch: a depthwise one and one on a
    single channel (a raw waveform)."""

    def __init__(self, c: int = 16, d: int = 24) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(c, d, 3, padding=1)
        self.conv2 = nn.Conv1d(d, d, 3, stride=2, padding=1)
        self.conv3 = nn.Conv1d(d, d, 5, padding="same", bias=False)
        self.bn = nn.BatchNorm1d(d)
        self.dw = nn.Conv1d(d, d, 3, padding=1, groups=d)
        self.reflect = nn.Conv1d(d, d, 3, padding=1, padding_mode="reflect")
        self.wave = nn.Conv1d(1, 8, 10, stride=5)

    def forward(self, x: torch.Tensor, wave: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = F.gelu(self.conv2(F.gelu(self.conv1(x))))
        y = torch.relu(self.bn(self.conv3(y)) + y)
        y = self.reflect(self.dw(y))
        return y.permute(0, 2, 1), self.wave(wave)


@pytest.mark.parametrize("target", ["reference", "llvm"])
def test_conv1d_blocks_through_dynamo_match_eager(target: str) -> None:
    torch.manual_seed(0)
    model = _Convs().eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    x, wave = torch.randn(2, 16, 37), torch.randn(2, 1, 200)
    torch._dynamo.reset()
    compiled = spacefusion.compile(model, target=target)
    with torch.no_grad():
        for got, want in zip(compiled(x, wave), model(x, wave)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    (p,) = compiled.spacefusion.partitions
    labels = sorted(s.label for s in p.subgraphs)
    assert len(labels) == 5 and any(lab.startswith("conv1d + gelu k3/s1 2x16x37") for lab in labels), labels
    # the raw waveform's one channel: K = 10 padded to 16 (``convs.k_align``, issue 56)
    assert "conv1d k10/s5 2x1x200 -> 8 float32 (NCL frames)" in labels, labels
    assert any(lab.startswith("conv1d k3/s1 2x24x21") for lab in labels), labels  # after the reflect pad
    assert any(lab.startswith("conv1d + gelu k3/s2 2x24x37") for lab in labels), labels
    assert any(lab.startswith("conv1d + bn + add + relu k5/s1 2x24x19") for lab in labels), labels
    reasons = " | ".join(left.reason for left in p.left)
    assert "a depthwise 1-D convolution" in reasons and "input channels" not in reasons, reasons
    assert "computed" not in reasons, reasons


class _WeightNormConv(nn.Module):
    """A conv whose weight is computed in the graph every call (weight norm, Wav2Vec2's positional conv's)."""

    def __init__(self) -> None:
        super().__init__()
        self.v = nn.Parameter(torch.randn(8, 8, 3))
        self.g = nn.Parameter(torch.rand(8, 1, 1) + 0.5)

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weight = self.g * self.v / self.v.norm(dim=(1, 2), keepdim=True)
        return F.conv1d(x, weight, padding=1), F.conv1d(x, w, padding=1)


def test_a_conv_left_to_torch_says_what_its_weight_is() -> None:
    """'computed, not a parameter' only for a weight computed in the graph; a weight that is a graph input
    says so (a parameter the backend did not lift would read that way)."""
    from torch import fx

    from spacefusion.frontend.reasons import conv_reason, weight_kind

    model = _WeightNormConv().eval()
    gm = fx.symbolic_trace(model)
    by_name = {n.name: n for n in gm.graph.nodes}
    convs = [n for n in gm.graph.nodes if n.target is F.conv1d]
    computed, given_w = (conv_reason(1, 1, 1, 1, c.args[1]) for c in convs)
    assert weight_kind(convs[0].args[1]) == "computed" and "computed in the graph" in computed
    assert weight_kind(by_name["w"]) == "input" and "graph input" in given_w
    assert "3-D convolution" in conv_reason(1, 1, 1, 1, None, spatial=3)


def _whisper(num_mel_bins: int = 16, d: int = 64, frames: int = 100):
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    cfg = WhisperConfig(d_model=d, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=2 * d,
                        num_mel_bins=num_mel_bins, max_source_positions=frames // 2)
    torch.manual_seed(0)
    return WhisperEncoder(cfg).eval()


def _partition_matching_eager(model: nn.Module, x: torch.Tensor):
    """The partition of ``model``'s one Dynamo graph on the reference target, its output checked against eager."""
    torch._dynamo.reset()
    compiled = spacefusion.compile(model, target="reference")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x).last_hidden_state, model(x).last_hidden_state, rtol=1e-4, atol=1e-4)
    (p,) = compiled.spacefusion.partitions
    return p


def test_whisper_encoders_convolutions_are_fused_with_their_gelus() -> None:
    """The real ``transformers`` WhisperEncoder (tiny config): both 1-D convolutions fused with their GELUs
    (they were refused as 'computed, not a parameter'), the log-mel frames read as the layout decision says,
    and the output as eager's."""
    pytest.importorskip("transformers")
    p = _partition_matching_eager(_whisper(), torch.randn(2, 16, 100))
    labels = [s.label for s in p.subgraphs]
    assert sum(lab.startswith("conv1d + gelu k3/s1 2x16x100 -> 64") for lab in labels) == 1, labels
    assert sum(lab.startswith("conv1d + gelu k3/s2 2x64x100 -> 64") for lab in labels) == 1, labels
    assert not any("conv" in left.op or left.op == "F.gelu" for left in p.left), p.left


def test_wav2vec2s_feature_encoder_convolutions_are_fused() -> None:
    """Wav2Vec2's feature encoder (tiny config): the convolutions after the first fused with their GELUs, the
    first (one channel: the waveform, K = 10 padded to 16) fused too (issue 56; its GroupNorm runs apart); the
    grouped positional conv stays with torch, with its reason."""
    pytest.importorskip("transformers")
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    cfg = Wav2Vec2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                         conv_dim=(16, 16, 16), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 2),
                         num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4)
    torch.manual_seed(0)
    p = _partition_matching_eager(Wav2Vec2Model(cfg).eval(), torch.randn(2, 800))
    labels = [s.label for s in p.subgraphs]
    assert sum(lab.startswith("conv1d + gelu") for lab in labels) == 2, labels
    assert sum(lab.startswith("conv1d k10/s5 2x1x800 -> 16") for lab in labels) == 1, labels
    reasons = [left.reason for left in p.left if left.op == "torch.conv1d"]
    assert len(reasons) == 1 and "groups 4" in reasons[0], reasons


def _torchvision():
    """torchvision, imported as ``experiments/dynamo_gpu.py`` does it (its C++ ops need not load against this
    torch: the classification models use none of them); skipped where it is not installed."""
    if importlib.util.find_spec("torchvision") is None:
        pytest.skip("torchvision is not installed")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
    from dynamo_gpu import _torchvision as load

    return load()


@pytest.mark.parametrize("channels_last", [False, True])
def test_convnext_reduced_fuses_its_convolutions_and_matches_eager(channels_last: bool) -> None:
    """torchvision's ConvNeXt (its classes, two reduced stages) channels-last or not: the 4x4/4 stem and the 2x2/2
    downsampling convs fuse (as patch GEMMs), the 7x7 depthwise ones too; none is refused as 'computed'."""
    tv = _torchvision()
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    torch.manual_seed(0)
    model = ConvNeXt([CNBlockConfig(16, 32, 1), CNBlockConfig(32, None, 1)], num_classes=10).eval()
    x = torch.randn(2, 3, 32, 32)
    if channels_last:
        model, x = model.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
    assert tv is not None
    torch._dynamo.reset()
    compiled = spacefusion.compile(model, target="reference")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    (p,) = compiled.spacefusion.partitions
    labels = [s.label for s in p.subgraphs]
    assert sum("patch conv" in lab for lab in labels) == 2 and sum("dwconv" in lab for lab in labels) == 2, labels
    assert not any("conv" in left.op for left in p.left), p.left


@pytest.mark.cuda
def test_whisper_base_convolutions_on_gpu_kernels(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whisper-base's stem at its real shapes (batch 4, 80 -> 512 channels, 3000 frames; 512 -> 512 stride 2,
    each + GELU) in fp16 on the GPU's first picks, against float32 eager (within 4x eager fp16's error), and
    the tiny WhisperEncoder's output."""
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    monkeypatch.setenv("SPACEFUSION_CACHE", str(tmp_path))

    class Stem(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv1d(80, 512, 3, padding=1)
            self.conv2 = nn.Conv1d(512, 512, 3, stride=2, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.gelu(self.conv2(F.gelu(self.conv1(x)))).permute(0, 2, 1)

    torch.manual_seed(0)
    for model, x in ((Stem().eval().cuda(), torch.randn(4, 80, 3000, device="cuda")),
                     (_whisper().cuda(), torch.randn(2, 16, 100, device="cuda"))):
        with torch.no_grad():
            exact = model(x)
            exact = getattr(exact, "last_hidden_state", exact)
            model = model.half()
            eager = model(x.half())
            eager = getattr(eager, "last_hidden_state", eager)
            torch._dynamo.reset()
            compiled = spacefusion.compile(model, measure=False)
            got = compiled(x.half())
            got = getattr(got, "last_hidden_state", got)
        labels = [s.label for p in compiled.spacefusion.partitions for s in p.subgraphs]
        assert sum(lab.startswith("conv1d") for lab in labels) == 2, labels
        err, base = (got.float() - exact).abs().max().item(), (eager.float() - exact).abs().max().item()
        assert err <= 4 * base + 1e-3, (err, base)
