"""Stacked GEMMs (the Q/K/V projections of one input as one kernel): the SMG, its CPU build against the
unfused numpy linears, and the fused model's binding of the stacked weights and sliced outputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from smg.errors import UnknownAxisError, UnknownOperatorError
from smg.ops import Builder
from smg.patterns import gemm_epilogue
from spacefusion.api import build, schedule
from spacefusion.frontend import capture, fuse, partition

_ACTS = {"none": lambda v: v, "relu": lambda v: np.maximum(v, 0),
         "gelu": lambda v: 0.5 * v * (1 + np.vectorize(math.erf)(v / math.sqrt(2)))}


def test_the_smg_broadcasts_x_along_t_and_lays_y_out_t_first() -> None:
    g = gemm_epilogue(32, 48, 16, "none", True, "float16", stack=3)
    assert g.shape("Y") == (3, 32, 48) and g.shape("Bw") == (3, 16, 48) and g.shape("bias") == (3, 48)
    assert gemm_epilogue(1, 48, 16, b_layout="nk", stack=2).shape("Bw") == (2, 48, 16)
    text = str(g)
    assert "A -> C.it  t:1:A" in text  # One-to-All: every projection reads the same X
    with pytest.raises(UnknownOperatorError, match="unknown activation 'swish'"):
        gemm_epilogue(4, 4, 4, "swish", stack=2)


def test_matmul_order_must_permute_its_dims() -> None:
    g = Builder("bad")
    a, b = g.input("A", {"m": 4, "k": 4}), g.input("B", {"t": 2, "k": 4, "n": 4})
    with pytest.raises(UnknownAxisError, match=r"not a permutation of \('m', 't', 'n'\)"):
        g.matmul(a, b, reduce="k", order=("t", "m"))


@settings(max_examples=6, deadline=None)
@given(t=st.integers(2, 3), m=st.integers(1, 40), n=st.sampled_from([8, 24, 40]), k=st.sampled_from([8, 32]),
       bias=st.booleans(), act=st.sampled_from(sorted(_ACTS)), nk=st.booleans())
def test_llvm_kernel_matches_the_unfused_linears(t, m, n, k, bias, act, nk) -> None:
    g = gemm_epilogue(m, n, k, act, bias, "float32", "nk" if nk else "kn", stack=t)
    rng = np.random.default_rng(m * 7 + n)
    x = {"A": rng.standard_normal((m, k), dtype=np.float32),
         "Bw": rng.standard_normal(g.shape("Bw"), dtype=np.float32)}
    if bias:
        x["bias"] = rng.standard_normal((t, n), dtype=np.float32)
    got = build(schedule(g, step=8), "llvm")(x)["Y"]
    for i in range(t):  # each projection on its own, as torch's nn.Linear computes it
        w = x["Bw"][i].T if nk else x["Bw"][i]
        want = _ACTS[act](x["A"] @ w + (x["bias"][i] if bias else 0))
        np.testing.assert_allclose(got[i], want, rtol=1e-4, atol=1e-4)


class _Heads(nn.Module):
    """Three projections of x with one odd one out (another width), and a fourth of the same shape read
    through an activation."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(16, 32), nn.Linear(16, 32), nn.Linear(16, 32)
        self.wide, self.g1, self.g2 = nn.Linear(16, 48), nn.Linear(16, 32, bias=False), nn.Linear(16, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.q(x) * self.k(x) - self.v(x)
        return s.sum(-1) + self.wide(x).sum(-1) + torch.relu(self.g1(x)).sum(-1) + torch.relu(self.g2(x)).sum(-1)


def test_linears_sharing_an_input_stack_by_shape_bias_and_activation() -> None:
    torch.manual_seed(0)
    model, x = _Heads().eval(), torch.randn(2, 5, 16)
    p = partition(capture(model, x).module)
    stacked = sorted((s for s in p.subgraphs if s.kind == "stacked_gemm"), key=lambda s: s.label)
    assert [s.label for s in stacked] == ["2 stacked gemms + relu 10x32x16 float32",
                                          "3 stacked gemms + bias 10x32x16 float32"]
    assert [s.label for s in p.subgraphs if s.kind == "gemm"] == ["gemm + bias 10x48x16 float32"]
    fused = fuse(model, x, backend="llvm")
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), rtol=1e-4, atol=1e-4)
