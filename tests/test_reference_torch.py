"""The torch evaluation of an SMG (the GPU runner's reference for graphs it has no torch form of) agrees
with the numpy ground truth, travels beside an artefact, and refuses what it cannot evaluate."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from smg import patterns
from smg.reference import evaluate, random_inputs
from smg.reference_torch import SMG_FILE, evaluate_torch, load_smg, save_smg
from spacefusion.frontend.builders import gated_gemm

torch = pytest.importorskip("torch")

GRAPHS = {
    "gated_silu": lambda: gated_gemm(24, 40, 32, "silu", "float32"),
    "gated_gelu": lambda: gated_gemm(24, 40, 32, "gelu", "float32"),
    "gemm_sigmoid": lambda: patterns.gemm_epilogue(20, 30, 40, "sigmoid", True, "float32"),
    "attention": lambda: patterns.attention(1, 2, 16, 24, 8, dtype="float32"),
    "layernorm": lambda: patterns.layernorm(8, 32, "float32"),
    "horizontal": lambda: patterns.horizontal_gemms(8, 16, 24),
    "stacked_gelu": lambda: patterns.gemm_epilogue(8, 24, 16, "gelu", True, "float32", stack=3),
    "stacked_nk": lambda: patterns.gemm_epilogue(1, 24, 16, "none", False, "float32", "nk", stack=2),
    "rope": lambda: patterns.rope(2, 5, 3, 8, tables="per_batch", dtype="float32", layout="bshd"),
}


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_torch_evaluation_matches_the_numpy_reference(name: str) -> None:
    g = GRAPHS[name]()
    x = random_inputs(g, 0)
    ref = evaluate(g, x)
    got = evaluate_torch(g, {n: torch.from_numpy(v).double() for n, v in x.items()})
    for out, r in ref.items():
        np.testing.assert_allclose(got[out].numpy(), r, rtol=1e-10, atol=1e-10)


def test_ops_reading_their_indices_are_refused() -> None:
    g = patterns.attention(1, 1, 8, 8, 8, causal=True, dtype="float32")
    x = {n: torch.from_numpy(v) for n, v in random_inputs(g, 0).items()}
    with pytest.raises(ValueError, match="reads its indices"):
        evaluate_torch(g, x)


def test_other_gathers_are_refused() -> None:
    g = patterns.vae_decoder_block(1, 2, 4, 4, 4, 2)  # a window (y + ky - 1) and an upsampling (floor)
    x = {n: torch.from_numpy(v) for n, v in random_inputs(g, 0).items()}
    with pytest.raises(ValueError, match="gathers"):
        evaluate_torch(g, x)


def test_the_graph_travels_beside_the_artefact_and_the_runner_falls_back_to_it(tmp_path: Path) -> None:
    """``make_case_artefacts`` saves each case's graph as ``smg.json``; the GPU runner checks a workload
    it has no torch form of (the gated GEMM) against that graph."""
    g = gated_gemm(64, 128, 64, "silu", "float16")
    assert save_smg(tmp_path, g) == tmp_path / SMG_FILE
    assert load_smg(tmp_path).key == g.key and load_smg(tmp_path / "none") is None
    script = Path(__file__).resolve().parents[1] / "experiments" / "run_artefacts_gpu.py"
    spec = importlib.util.spec_from_file_location("run_artefacts_gpu_t", script)
    mod = sys.modules["run_artefacts_gpu_t"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert g.name not in mod.WORKLOADS and mod.WORKLOADS.get(g.name, mod.build_from_smg) is mod.build_from_smg


def test_input_scales_keep_a_long_gated_gemm_finite() -> None:
    """K ** -1/4 per input of a sum of products: LLaMA's gated GEMM (k = 4096) gets 1/8 on X, Wg and Wu,
    so G and U have unit variance again; inputs of no such sum keep 1."""
    from smg.reference_torch import input_scales

    assert input_scales(gated_gemm(2048, 11008, 4096, "silu", "float16")) == {"X": 0.125, "Wg": 0.125, "Wu": 0.125}
    assert input_scales(patterns.layernorm(8, 32, "float16")) == {"X": 1.0, "W": 1.0, "B": 1.0}
