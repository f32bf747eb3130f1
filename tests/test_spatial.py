"""Spatial slicer: which dims are cut into independent blocks, and the reasons given."""

from __future__ import annotations

import pytest

from schedulers.spatial import DimDecision, analyse_spatial, cuttable
from smg import Builder
from smg.workloads import gemm, mha, softmax_gemm


def decisions(g) -> dict[str, DimDecision]:
    out = {d.dim: d for d in analyse_spatial(g)}
    assert list(out) == [d.name for d in g.dims], "one decision per dim, in dim order"
    return out


# -- mha ----------------------------------------------------------------------------------------


def test_mha_cuts_batch_heads_and_queries() -> None:
    dec = decisions(mha(2, 4, 64, 128, 32))
    assert {d for d, x in dec.items() if x.cut} == {"b", "h", "m"}
    assert cuttable(mha(2, 4, 64, 128, 32)) == ("b", "h", "m")
    for dim in ("b", "h", "m"):
        assert f"no All-to-One along {dim}" in dec[dim].reason
    # K and V do not index m: they are inputs, so blocks along m just re-read them
    assert "K" in dec["m"].reason and "V" in dec["m"].reason
    assert "re-read" in dec["m"].reason
    # nothing is broadcast along b or h
    assert "re-read" not in dec["b"].reason and "re-read" not in dec["h"].reason


def test_mha_reduced_dims_are_not_cut_all_to_one() -> None:
    dec = decisions(mha(2, 4, 64, 128, 32))
    assert not dec["d"].cut
    assert "All-to-One" in dec["d"].reason
    assert "along d in S" in dec["d"].reason  # S = Q K^T reduces d
    assert not dec["l"].cut
    assert "All-to-One" in dec["l"].reason
    # every op that reduces over l is named: the max, the sum and the final GEMM
    for op in ("P_max", "P_sum", "O"):
        assert op in dec["l"].reason
    assert "partial results" in dec["l"].reason


def test_mha_n_is_not_cut_one_to_all_from_intermediate() -> None:
    dec = decisions(mha(2, 4, 64, 128, 32))
    assert not dec["n"].cut
    assert "One-to-All" in dec["n"].reason
    assert "intermediate P" in dec["n"].reason
    assert "recompute" in dec["n"].reason
    assert "All-to-One" not in dec["n"].reason


def test_mha_decisions_do_not_depend_on_sizes() -> None:
    a = analyse_spatial(mha(1, 1, 3, 5, 2))
    b = analyse_spatial(mha(8, 16, 1024, 2048, 128))
    assert a == b


# -- softmax_gemm -------------------------------------------------------------------------------


def test_softmax_gemm_decisions() -> None:
    dec = decisions(softmax_gemm(64, 128, 32))
    assert cuttable(softmax_gemm(64, 128, 32)) == ("m",)
    assert dec["m"].cut
    assert "V" in dec["m"].reason and "re-read" in dec["m"].reason
    assert not dec["l"].cut
    assert "All-to-One along l" in dec["l"].reason
    for op in ("P_max", "P_sum", "O"):
        assert op in dec["l"].reason
    assert not dec["n"].cut
    assert "One-to-All along n from intermediate P" in dec["n"].reason


# -- gemm ---------------------------------------------------------------------------------------


def test_gemm_decisions() -> None:
    dec = decisions(gemm(64, 48, 32))
    assert set(cuttable(gemm(64, 48, 32))) == {"m", "n"}
    assert dec["m"].cut and dec["n"].cut
    # C[m, n] = sum_k A[m, k] B[n, k]: B is broadcast along m, A along n
    assert "inputs B" in dec["m"].reason
    assert "inputs A" in dec["n"].reason
    assert not dec["k"].cut
    assert "All-to-One along k in C" in dec["k"].reason


# -- beyond the workloads -------------------------------------------------------------------------


def test_reasons_name_user_ops() -> None:
    """Names come from the graph, not from a table: rename every op and the reasons follow."""
    g = Builder("renamed")
    x = g.input("X", {"r": 8, "c": 16})
    w = g.input("W", {"c": 16, "o": 4})
    mx = g.reduce(x, "c", "max", name="RowPeak")
    e = g.map("exp(X - RowPeak)", x, mx, name="Shifted")
    y = g.matmul(e, w, reduce="c", name="Proj")
    dec = decisions(g.build(y))
    assert dec["r"].cut
    assert not dec["c"].cut and "RowPeak" in dec["c"].reason and "Proj" in dec["c"].reason
    assert not dec["o"].cut and "intermediate Shifted" in dec["o"].reason


@pytest.mark.parametrize("factory", [lambda: mha(2, 2, 8, 8, 4), lambda: softmax_gemm(4, 8, 2),
                                     lambda: gemm(4, 4, 4)])
def test_every_decision_has_a_reason(factory) -> None:
    for d in analyse_spatial(factory()):
        assert d.reason and d.dim in d.reason


def test_decisions_are_memoised_per_content_key() -> None:
    """The search asks for every candidate: the memo answers by content key, equal to a fresh analysis."""
    from schedulers.spatial import _analyse_spatial, analyse_spatial
    from smg import patterns

    a, b = patterns.attention(1, 2, 64, 64, 64), patterns.attention(1, 2, 64, 64, 64)
    assert a is not b and a.key == b.key
    assert analyse_spatial(a) is analyse_spatial(b) and analyse_spatial(a) == _analyse_spatial(b)
    c = patterns.attention(1, 2, 64, 64, 64, causal=True)
    assert analyse_spatial(c) == _analyse_spatial(c)
