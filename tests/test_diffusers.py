"""`diffusers`' own classes (tiny configs, random weights) through ``spacefusion.compile`` on the CPU, against
eager: the UNet (convs, GroupNorm + SiLU, self- and cross-attention, the projections) and the VAE decoder."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import spacefusion

diffusers = pytest.importorskip("diffusers")


def _labels(compiled) -> list[str]:
    return [s.label for p in compiled.spacefusion.partitions for s in p.subgraphs]


def test_tiny_unet_matches_eager() -> None:
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=8, out_channels=8, block_out_channels=(32, 64), layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8).eval()
    x, t, text = torch.randn(2, 8, 8, 8), torch.tensor([10, 500]), torch.randn(2, 7, 32)
    with torch.no_grad():
        ref = unet(x, t, encoder_hidden_states=text).sample
        compiled = spacefusion.compile(unet, target="llvm")
        got = compiled(x, t, encoder_hidden_states=text).sample
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    labels = _labels(compiled)
    for kind in ("group_norm + silu", "conv 3x3", "attention b2 h8/8 16x7", "attention b2 h8/8 64x64",
                 "add + layernorm",
                 "add + group_norm + silu",  # the time embedding added before each ResNet block's second norm
                 "gated gemm gelu(X@Wg + bg)*(X@Wu + bu) (one chunked linear)",  # GEGLU
                 "gemm + bias + add",  # the feed-forward's residual
                 "5 stacked gemms + bias 2x64x128"):  # the ResNet blocks' time-embedding projections: one silu(temb)
        assert any(kind in label for label in labels), (kind, labels)
    # its upsampler's image (2x64x8x8: 128 pixels) is small: torch upsamples it, the conv reads a plain image
    reasons = [op.reason for p in compiled.spacefusion.partitions for op in p.left if op.op == "F.interpolate"]
    assert reasons and all("runs apart" in r for r in reasons), reasons
    # nothing element-wise of a feature map's size is left: GEGLU's GELU, the ``/ 1.0`` output scales and
    # the NCHW copy before each Transformer2D's proj_out went, and the blocks' repeated silu(temb) is one
    # (fused into the time embedding's last GEMM); the embedding's sin/cos stay
    left = {op.op for p in compiled.spacefusion.partitions for op in p.left}
    assert not left & {"F.gelu", "F.silu", "Tensor.contiguous", "Tensor.to"}, left


def test_tiny_vae_decoder_splits_its_group_norms_and_matches_eager() -> None:
    """With a machine of few SMs, the decoder's GroupNorms run as split reductions (three kernels each), the
    attention block's on its 3-d input too."""
    from diffusers.models.autoencoders.vae import Decoder

    from schedulers.hardware import H100
    from spacefusion.frontend.backends import LLVMBackend

    torch.manual_seed(0)
    dec = Decoder(in_channels=4, out_channels=8, up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 32),
                  layers_per_block=1, norm_num_groups=8, act_fn="silu").eval()
    z = torch.randn(1, 4, 16, 16)
    backend = LLVMBackend(split_hw=dataclasses.replace(H100, name="small", num_sms=64))
    backend.split_kw = {"min_chunk": 64, "one_kernel_max_row": 0}  # short rows would stay one kernel
    with torch.no_grad():
        ref = dec(z)
        compiled = spacefusion.compile(dec, target=backend)
        got = compiled(z)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    labels = _labels(compiled)
    assert any("group_norm + silu" in label for label in labels)
    # the mid block's attention normalises the flattened image [n, c, h * w] (a 3-d GroupNorm)
    assert "group_norm 1x32x256 /8 float32" in labels, labels
    assert "as 3 kernels: " in str(compiled.spacefusion), str(compiled.spacefusion)
