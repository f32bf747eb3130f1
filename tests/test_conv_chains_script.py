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
        image = (c.n, c.c, c.h, c.w) if c.layout == "nchw" else (c.n, c.h, c.w, c.c)
        assert ("R" in g.inputs) == c.residual and g.shape("X") == image
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
    nhwc = {k for k, c in C.BY_KEY.items() if c.layout == "nhwc"}
    assert "H100" in data["device"] and {e["chain"]["key"] for e in data["chains"]} == nhwc
    for e in data["chains"]:
        ours = [r for r in e["rows"] if r["system"] == "spacefusion"]
        assert len(ours) == C.ROUND and all(r["status"] == "ok" and r["max_abs_err"] < 0.1 for r in ours)
        m = C.summarize(e)
        assert m["first_vs_cudnn_separate"] > 1.3, e["chain"]["key"]
        assert m["best_vs_cudnn_separate"] > 1.5, e["chain"]["key"]


def test_committed_nchw_run_every_candidate_checked_and_the_layouts_trade_places() -> None:
    """The H200 run of four ResNet chains in both layouts (`conv_chains_nchw_h200.json`): every candidate passed
    its check; on an NCHW image the 1x1 conv is fastest read where it lies (ahead of cuDNN and of the transpose
    plus the channels-last kernel), a 3x3 fastest transposed first: the choice a layout search has to make."""
    data = json.loads((RESULTS.parent / "conv_chains_nchw_h200.json").read_text())
    by = {e["chain"]["key"]: e for e in data["chains"]}
    assert "H200" in data["device"] and set(by) == {k for k in C.BY_KEY if k.startswith("r50_l") and
                                                    k.removesuffix("_nchw") in ("r50_l1_3x3", "r50_l1_1x1_in",
                                                                                "r50_l2_3x3_s2", "r50_l3_3x3")}
    for e in data["chains"]:
        assert all(r["status"] == "ok" and r["max_abs_err"] < 0.1 for r in e["rows"] if r["system"] == "spacefusion")

    def us(key: str, system: str) -> float:
        return C.summarize(by[key]).get(f"{system}_us") or 0.0

    def direct(key: str) -> float:
        return C.summarize(by[key])["best_us"]

    via_nhwc = {k: us(f"{k}_nchw", "transpose_to_nhwc") + direct(k) for k in ("r50_l1_1x1_in", "r50_l1_3x3")}
    assert direct("r50_l1_1x1_in_nchw") < min(via_nhwc["r50_l1_1x1_in"], us("r50_l1_1x1_in_nchw", "cudnn_folded"))
    assert direct("r50_l1_3x3_nchw") > via_nhwc["r50_l1_3x3"]
