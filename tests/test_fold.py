"""Folding two dims of an SMG into one (smg.fold), padded row tiles, and the search offering both."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedulers.errors import ScheduleError
from schedulers.hardware import H100
from schedulers.schedule import make_schedule
from search.space import SearchSpace
from smg import patterns
from smg.fold import FOLD_ATTR, FoldError, fold_dims, fold_reason, foldable
from smg.reference import evaluate


def test_gqa_attention_folds_its_group_into_the_query_rows() -> None:
    g = patterns.attention(2, 8, 3, 40, 16, kv_heads=2)
    assert foldable(g) == (("b", "h"), ("r", "m"))
    f = fold_dims(g, "r", "m")
    assert f.dim_sizes == {"b": 2, "h": 2, "m": 12, "d": 16, "l": 40, "n": 16}
    assert f.shape("Q") == (2, 2, 12, 16) and f.shape("O") == (2, 2, 12, 16) and f.shape("K") == g.shape("K")
    assert dict(f.attrs)[FOLD_ATTR] == "r*m" and f.key != g.key
    assert fold_dims(g, "r", "m").key == f.key  # a content hash: the same fold, the same key


@settings(max_examples=15, deadline=None)
@given(b=st.integers(1, 2), hk=st.integers(1, 3), r=st.integers(1, 4), m=st.integers(1, 5),
       l=st.integers(1, 9), d=st.sampled_from([4, 8]))  # noqa: E741
def test_the_folded_graph_computes_the_same_values_over_the_same_memory(b, hk, r, m, l, d) -> None:  # noqa: E741
    g = patterns.attention(b, hk * r, m, l, d, kv_heads=hk, dtype="float32")
    if r == 1:  # no group: Q has no r
        assert ("r", "m") not in foldable(g)
        return
    f = fold_dims(g, "r", "m")
    rng = np.random.default_rng(b * 1000 + hk * 100 + r * 10 + m)
    x = {n: rng.standard_normal(g.shape(n)) for n in g.inputs}
    ref = evaluate(g, x)["O"]
    got = evaluate(f, {n: v.reshape(f.shape(n)) for n, v in x.items()})["O"]
    np.testing.assert_allclose(got.reshape(ref.shape), ref, rtol=1e-12, atol=1e-12)


def test_folds_that_would_change_the_result_are_refused_with_the_rule_broken() -> None:
    causal = patterns.attention(1, 8, 4, 16, 8, kv_heads=2, causal=True)
    assert "names ['m'] in its body" in fold_reason(causal, "r", "m")  # the mask reads m itself
    g = patterns.attention(1, 8, 4, 16, 8, kv_heads=2)
    assert "is not right before" in fold_reason(g, "m", "r")  # swapped: another memory order
    assert "is not right before" in fold_reason(g, "l", "d")  # K[.., l, d], but Q has d alone
    assert "not a dim" in fold_reason(g, "x", "m")
    with pytest.raises(FoldError, match="cannot fold 'h' into 'r'"):
        fold_dims(g, "h", "r")  # K has h without r: not one dim there


def test_a_padded_row_tile_only_for_a_warp_tile_program() -> None:
    f = fold_dims(patterns.attention(2, 8, 1, 300, 128, kv_heads=2), "r", "m")  # 4 rows
    s = make_schedule(f, {"m": 16}, serial="l", step=32, tensor_cores=True, stages=2, slices=4)
    assert s.warp_tile.rows == 16 and s.num_blocks == 16
    with pytest.raises(ScheduleError, match="larger than the dim"):
        make_schedule(f, {"m": 16}, serial="l", step=32)  # CUDA cores: a thread per element
    with pytest.raises(ScheduleError, match="larger than the dim"):
        make_schedule(f, {"m": 24}, serial="l", step=32, tensor_cores=True)  # not whole MMA tiles
    with pytest.raises(ScheduleError, match="only a warp-tile program's row tile"):
        make_schedule(f, {"b": 16, "m": 1}, serial="l", step=32, tensor_cores=True)


def test_the_search_offers_the_fold_where_a_group_shares_kv_over_few_rows() -> None:
    decode = SearchSpace(patterns.attention(8, 32, 1, 4096, 128, kv_heads=8, dtype="float16"), H100)
    assert decode.folds == (("r", "m"),)
    assert "r*m folded into one row dim" in decode.describe()
    prefill = SearchSpace(patterns.attention(2, 32, 512, 512, 128, kv_heads=8, dtype="float16"), H100)
    assert prefill.folds == ()  # 512 rows fill the tiles already
    mha = SearchSpace(patterns.attention(8, 32, 1, 4096, 128, dtype="float16"), H100)
    assert mha.folds == ()  # no group: nothing shares K/V
    cpu = SearchSpace(patterns.attention(8, 32, 1, 4096, 128, kv_heads=8, dtype="float16"), H100, cuda=False)
    assert cpu.folds == ()


def test_gqa_decode_candidates_put_the_group_on_tensor_core_rows_and_the_model_ranks_them_first() -> None:
    """The issue's GQA decode (8, 32 q / 8 kv heads, 1 query, 4096 keys, d 128): before, every
    candidate was a CUDA-core kernel (the first pick ran 8077 us on the H100); now the cost model's
    first picks are tensor-core kernels whose 16-row tiles hold a kv head's query group, either folded
    into m or as the row dim r itself."""
    from search.cost import estimate_us

    sp = SearchSpace(patterns.attention(2, 32, 1, 1024, 128, kv_heads=8, dtype="float16"), H100)
    cands = sp.candidates()
    est = {s.key: estimate_us(s, H100) for s in cands}  # each estimated once (5.5k candidates)
    ranked = sorted(cands, key=lambda s: (est[s.key], s.key))
    top = ranked[:6]
    assert all(s.tensor_cores and s.warp_tile is not None for s in top)
    assert all(s.warp_tile.rows >= 16 and s.smg.dim_sizes[s.warp_tile.row] == 4 for s in top)
    assert any(dict(s.smg.attrs).get(FOLD_ATTR) == "r*m" for s in cands if s.tensor_cores)
    cuda_core = min(est[s.key] for s in cands if not s.tensor_cores)
    assert est[top[0].key] < cuda_core / 5
