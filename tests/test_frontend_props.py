"""Property tests of the torch -> SMG mappings: random small shapes of linear(+activation), attention
(MHA / GQA, causal or not) and residual norms, evaluated through the SMG reference against torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from spacefusion.frontend import fuse

SETTINGS = settings(max_examples=12, deadline=None)


class _Linear(nn.Module):
    def __init__(self, k: int, n: int, bias: bool, act: str | None) -> None:
        super().__init__()
        self.fc, self.act = nn.Linear(k, n, bias=bias), act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return getattr(F, self.act)(y) if self.act else y


class _LinearResidual(nn.Module):
    """A transformer block's ``ff(x) + r``; with ``norm`` a LayerNorm reads the sum (BERT's, the norm's add)."""

    def __init__(self, k: int, n: int, bias: bool, norm: bool) -> None:
        super().__init__()
        self.fc, self.norm = nn.Linear(k, n, bias=bias), nn.LayerNorm(n) if norm else None

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        y = self.fc(x) + r
        return self.norm(y) if self.norm is not None else y


class _Attention(nn.Module):
    def __init__(self, causal: bool, gqa: bool) -> None:
        super().__init__()
        self.causal, self.gqa = causal, gqa

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=self.gqa)


class _Gated(nn.Module):
    def __init__(self, k: int, n: int, act: str) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(k, n, bias=False), nn.Linear(k, n, bias=False)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(F, self.act)(self.gate_proj(x)) * self.up_proj(x)


class _Geglu(nn.Module):
    """diffusers' GEGLU: one projection to 2n columns, chunked; ``gate_first`` swaps which half is gated."""

    def __init__(self, k: int, n: int, bias: bool, gate_first: bool) -> None:
        super().__init__()
        self.proj, self.gate_first = nn.Linear(k, 2 * n, bias=bias), gate_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.proj(x).chunk(2, dim=-1)
        gate, h = (a, b) if self.gate_first else (b, a)
        return h * F.gelu(gate)


class _ResidualNorm(nn.Module):
    def __init__(self, n: int, rms: bool) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(n, eps=1e-6) if rms else nn.LayerNorm(n)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x + r
        return self.norm(h), h * 2


def _check(model: nn.Module, *x: torch.Tensor, kind: str) -> None:
    fused = fuse(model, *x, backend="reference")
    assert [s.kind for s in fused.partition.subgraphs] == [kind]
    want, got = model(*x), fused(*x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@SETTINGS
@given(lead=st.lists(st.integers(1, 4), min_size=1, max_size=2), k=st.integers(1, 24), n=st.integers(1, 24),
       bias=st.booleans(), act=st.sampled_from([None, "gelu", "silu", "relu", "sigmoid", "tanh"]),
       seed=st.integers(0, 2**16))
def test_linear_epilogue_mapping(lead: list[int], k: int, n: int, bias: bool, act: str | None, seed: int) -> None:
    torch.manual_seed(seed)
    model = _Linear(k, n, bias, act).eval()
    _check(model, torch.randn(*lead, k), kind="gemm")


@SETTINGS
@given(m=st.integers(1, 6), k=st.integers(1, 16), n=st.integers(1, 16), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_linear_residual_add_in_the_epilogue(m: int, k: int, n: int, bias: bool, seed: int) -> None:
    torch.manual_seed(seed)
    _check(_LinearResidual(k, n, bias, norm=False).eval(), torch.randn(2, m, k), torch.randn(2, m, n), kind="gemm")


def test_a_residual_add_a_norm_reads_stays_the_norms() -> None:
    """BERT's ``LayerNorm(dense(x) + r)``: the add is fused with the norm (``residual_norm``), not the GEMM."""
    torch.manual_seed(0)
    model = _LinearResidual(8, 16, True, norm=True).eval()
    fused = fuse(model, torch.randn(3, 8), torch.randn(3, 16), backend="reference")
    assert [s.kind for s in fused.partition.subgraphs] == ["gemm", "residual_norm"]
    assert "+ add" not in fused.partition.subgraphs[0].label


@SETTINGS
@given(b=st.integers(1, 2), kv=st.integers(1, 3), group=st.integers(1, 3), m=st.integers(1, 9), extra=st.integers(0, 6),
       d=st.sampled_from([4, 8, 12]), causal=st.booleans(), seed=st.integers(0, 2**16))
def test_attention_mapping(b: int, kv: int, group: int, m: int, extra: int, d: int, causal: bool, seed: int) -> None:
    torch.manual_seed(seed)
    l = m + extra  # noqa: E741
    q = torch.randn(b, kv * group, m, d)
    k, v = torch.randn(b, kv, l, d), torch.randn(b, kv, l, d)
    _check(_Attention(causal, group > 1), q, k, v, kind="attention")


@SETTINGS
@given(m=st.integers(1, 6), k=st.integers(1, 16), n=st.integers(1, 16), bias=st.booleans(), gate_first=st.booleans(),
       seed=st.integers(0, 2**16))
def test_geglu_chunked_projection_is_one_gated_gemm(m: int, k: int, n: int, bias: bool, gate_first: bool,
                                                    seed: int) -> None:
    """The two halves of one chunked linear read as slices of its weight and bias rows."""
    torch.manual_seed(seed)
    _check(_Geglu(k, n, bias, gate_first).eval(), torch.randn(2, m, k), kind="gated_gemm")


@SETTINGS
@given(m=st.integers(1, 6), n=st.integers(2, 24), rms=st.booleans(), seed=st.integers(0, 2**16))
def test_residual_norm_mapping_keeps_the_sum(m: int, n: int, rms: bool, seed: int) -> None:
    torch.manual_seed(seed)
    model = _ResidualNorm(n, rms).eval()
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
    fused = fuse(model, torch.randn(m, n), torch.randn(m, n), backend="reference")
    assert [len(s.results) for s in fused.partition.subgraphs] == [2]
    _check(model, torch.randn(2, m, n), torch.randn(2, m, n), kind="residual_norm")


@SETTINGS
@given(m=st.integers(1, 6), k=st.integers(1, 16), n=st.integers(1, 16), act=st.sampled_from(["silu", "gelu"]),
       seed=st.integers(0, 2**16))
def test_gated_gemm_mapping(m: int, k: int, n: int, act: str, seed: int) -> None:
    torch.manual_seed(seed)
    _check(_Gated(k, n, act).eval(), torch.randn(1, m, k), kind="gated_gemm")
