"""An fp16 clamp after a residual add (Whisper's, and other HF encoders': ``clamp(h, -(finfo.max - 1000),
finfo.max - 1000)``) fused into the next norm's kernel with the add (``builders.norm(clamp=...)``,
``norms._clamped_sum``), checked against numpy / torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import spacefusion
from smg.reference import evaluate, random_inputs
from spacefusion.api import build, schedule
from spacefusion.frontend import builders


def _numpy(x: dict[str, np.ndarray], lo: float, hi: float, eps: float) -> tuple[np.ndarray, np.ndarray]:
    t = np.clip(x["X"].astype(np.float64) + x["R"], lo, hi)
    mean, var = t.mean(-1, keepdims=True), t.var(-1, keepdims=True)
    return (t - mean) / np.sqrt(var + eps) * x["W"] + x["B"], t


@settings(max_examples=15, deadline=None)
@given(m=st.integers(1, 9), n=st.sampled_from([4, 16, 24]), lo=st.floats(-2, 0), width=st.floats(0, 3),
       keep=st.booleans())
def test_the_smg_is_clamp_of_the_sum_then_layernorm(m, n, lo, width, keep) -> None:
    """Bounds inside the inputs' range, so the clamp bites; the kept sum is the clamped one."""
    g = builders.norm("layernorm", m, n, True, keep, "float32", 1e-5, clamp=(lo, lo + width))
    x = random_inputs(g, seed=4)
    y, t = _numpy(x, lo, lo + width, 1e-5)
    got = evaluate(g, x)
    np.testing.assert_allclose(got["Y"], y, rtol=1e-4, atol=1e-4)
    if keep:
        np.testing.assert_allclose(got["T"], t, rtol=1e-6, atol=1e-6)


def test_a_nan_passes_through_the_clamp_as_torchs_does() -> None:
    g = builders.norm("layernorm", 2, 8, True, True, "float32", 1e-5, clamp=(-1.0, 1.0))
    x = random_inputs(g, seed=1)
    x["X"][0, 3] = np.nan
    t = evaluate(g, x)["T"]
    want = torch.clamp(torch.tensor(x["X"]) + torch.tensor(x["R"]), -1.0, 1.0).numpy()
    np.testing.assert_array_equal(np.isnan(t), np.isnan(want))


def test_a_clamp_needs_a_residual_sum() -> None:
    with pytest.raises(ValueError, match="residual sum"):
        builders.norm("layernorm", 2, 8, False, False, "float32", 1e-5, clamp=(-1.0, 1.0))


def test_llvm_kernel_matches_numpy() -> None:
    g = builders.norm("layernorm", 37, 24, True, True, "float32", 1e-5, clamp=(-0.5, 0.75))
    x = random_inputs(g, seed=2)
    got = build(schedule(g), "llvm")(x)
    y, t = _numpy(x, -0.5, 0.75, 1e-5)
    np.testing.assert_allclose(got["Y"], y, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got["T"], t, rtol=1e-5, atol=1e-5)


def test_whisper_base_clamp_norm_first_pick_builds_for_sm90a(tmp_path) -> None:
    """Whisper-base's (4 x 1500 rows of 512, fp16, the clamped sum kept for the next residual)."""
    pytest.importorskip("tvm")
    from spacefusion.frontend.dynamo import first_pick

    bound = 65504.0 - 1000
    g = builders.norm("layernorm", 4 * 1500, 512, True, True, "float16", 1e-5, clamp=(-bound, bound))
    folder = build(first_pick(g), "cuda:sm_90a").save(tmp_path / "k")
    assert "__global__" in (folder / "kernel.cu").read_text()


def test_whispers_fp16_clamps_join_the_norms_after_them() -> None:
    """The real WhisperEncoder (tiny config) in fp16: each layer's ``clamp(residual + ffn)`` is fused with its add
    into the norm that reads it, none is left to torch, and the output is within eager fp16's error of float32."""
    pytest.importorskip("transformers")
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    cfg = WhisperConfig(d_model=64, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=128,
                        num_mel_bins=16, max_source_positions=50)
    torch.manual_seed(0)
    model = WhisperEncoder(cfg).eval()
    x = torch.randn(2, 16, 100)
    with torch.no_grad():
        exact = model(x).last_hidden_state
        model = model.half()
        eager = model(x.half()).last_hidden_state
        torch._dynamo.reset()
        compiled = spacefusion.compile(model, target="reference")
        got = compiled(x.half()).last_hidden_state
    err, base = (got.float() - exact).abs().max().item(), (eager.float() - exact).abs().max().item()
    assert err <= 2 * base, (err, base)
    (p,) = compiled.spacefusion.partitions
    labels = [s.label for s in p.subgraphs]
    assert sum(lab.startswith("add + clamp + layernorm") for lab in labels) == 2, labels
    assert not any(left.op == "torch.clamp" for left in p.left), p.left
