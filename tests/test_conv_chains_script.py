"""The conv-chain benchmark (experiments/conv_chains.py): its shapes and arithmetic, and what the committed H100
results say about the implicit-GEMM convolution's first round against cuDNN."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
import conv_chains as C  # noqa: E402

RESULTS = ROOT / "experiments" / "results" / "conv_chains_h100.json"


def test_chains_build_the_pattern_of_their_shape() -> None:
    for c in C.CHAINS:
        g = C.smg_of(c)
        p, q = c.out_hw
        assert ("R" in g.inputs) == c.residual and g.shape("X") == (c.n, c.h, c.w, c.c)
        if C.by_parity(c):  # the output [nh, a, j, b, co] is the upsampled image; 4 merged taps a pixel, not 9
            assert g.shape("Y") == (c.n * c.h, 2, c.w, 2, c.co) and p * q == 4 * c.h * c.w, c.key
            assert g.shape("Wt") == (2, 2, 4 * c.c, c.co)
            continue
        assert g.shape("Y") == (c.n * p * q, c.co), c.key
        assert g.shape("Wt") == (c.kernel ** 2 * c.c, c.co)
    assert [c.key for c in C.CHAINS if C.by_parity(c)] == ["vae_up_conv"]
    s2 = C.BY_KEY["r50_l2_3x3_s2"]
    assert s2.out_hw == (28, 28) and C.BY_KEY["vae_up_conv"].out_hw == (128, 128)
    assert C.BY_KEY["r50_l1_3x3"].flops == pytest.approx(2 * 32 * 56 * 56 * 64 * 9 * 64)


def test_summary_ratios_compare_the_first_pick_with_each_baseline() -> None:
    rows = [{"system": "spacefusion", "rank": 0, "status": "ok", "median_us": 20.0},
            {"system": "spacefusion", "rank": 1, "status": "ok", "median_us": 10.0},
            {"system": "spacefusion", "rank": 2, "status": "error", "error": "max abs error over tolerance"},
            {"system": "cudnn_separate", "status": "ok", "median_us": 40.0},
            {"system": "cudnn_folded", "status": "ok", "median_us": 30.0},
            {"system": "torch_compile", "status": "ok", "median_us": 25.0}]
    m = C.summarize({"chain": {"key": "x"}, "rows": rows})
    assert (m["first_us"], m["best_us"], m["failed"]) == (20.0, 10.0, 1)
    assert m["first_vs_cudnn_separate"] == pytest.approx(2.0) and m["best_vs_torch_compile"] == pytest.approx(2.5)


@pytest.mark.skipif(not RESULTS.is_file(), reason="no committed results")
def test_committed_results_every_candidate_checked_and_the_fused_chain_ahead_of_cudnn() -> None:
    """Every candidate of every chain passed the check before it was timed; the first pick beats cuDNN's conv
    with torch's separate epilogues by the issue's 1.3x on every chain (1.63x-4.57x measured; the VAE
    upsampler by output parity 3.10x), the round's best by 1.5x or more."""
    data = json.loads(RESULTS.read_text())
    assert "H100" in data["device"] and {e["chain"]["key"] for e in data["chains"]} == set(C.BY_KEY)
    for e in data["chains"]:
        ours = [r for r in e["rows"] if r["system"] == "spacefusion"]
        assert len(ours) == C.ROUND and all(r["status"] == "ok" and r["max_abs_err"] < 0.1 for r in ours)
        m = C.summarize(e)
        assert m["first_vs_cudnn_separate"] > 1.3, e["chain"]["key"]
        assert m["best_vs_cudnn_separate"] > 1.5, e["chain"]["key"]
