"""Attention with score mods (masks, biases, index expressions: FlexAttention's score_mod / mask_mod) as
element-wise ops of the attention SMG: the slicers derive the online softmax through them, TVM's llvm
kernel is checked against a plain numpy attention (scores, mod, softmax, P @ V: unfused, float64)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from smg import patterns
from smg.errors import ShapeError
from smg.reference import random_inputs
from smg.tolerance import assert_close
from spacefusion.api import build, schedule

B, H, HK, M, L, D = 2, 4, 2, 12, 20, 8

PADDING = patterns.ScoreMod("Piecewise(({s}, Mask > 0.5), (-1e30, True))", (("Mask", ("b", "l")),), zero_v="Mask")
BIAS = patterns.ScoreMod("{s} + Bias", (("Bias", ("h", "r", "m", "l")),))
ALIBI = patterns.ScoreMod("{s} + Slope*(l - m)", (("Slope", ("h", "r")),))
SOFTCAP = patterns.ScoreMod("5.0*tanh({s}/5.0)")
WINDOW = patterns.ScoreMod("Piecewise(({s}, m - l < 4), (-1e30, True))")


def _numpy_attention(x: dict[str, np.ndarray], mod, causal: bool) -> np.ndarray:
    """Unfused float64 attention with GQA: Q [b, h, m, d] as [b, hk, r, m, d]; K/V [b, hk, l, d]."""
    q = x["Q"].astype(np.float64).reshape(B, HK, H // HK, M, D)
    k, v = x["K"].astype(np.float64), x["V"].astype(np.float64)
    s = np.einsum("bhrmd,bhld->bhrml", q, k) / math.sqrt(D)
    mi, li = np.arange(M)[:, None], np.arange(L)[None, :]
    s = mod(s, x, mi, li)
    if causal:  # after the mod, as FlexAttention masks after its score_mod
        s = np.where(li <= mi, s, -1e30)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhrml,bhld->bhrmd", p, v).reshape(B, H, M, D)


MODS = {
    "padding": (PADDING, lambda s, x, mi, li: np.where(x["Mask"][:, None, None, None, :] > 0.5, s, -1e30)),
    "bias": (BIAS, lambda s, x, mi, li: s + x["Bias"][None].astype(np.float64)),
    "alibi": (ALIBI, lambda s, x, mi, li: s + x["Slope"][None, :, :, None, None].astype(np.float64) * (li - mi)),
    "softcap": (SOFTCAP, lambda s, x, mi, li: 5.0 * np.tanh(s / 5.0)),
    "window": (WINDOW, lambda s, x, mi, li: np.where(mi - li < 4, s, -1e30)),
}


def _inputs(g, seed: int) -> dict[str, np.ndarray]:
    x = random_inputs(g, seed=seed)
    if "Mask" in x:  # padding: sequence lengths 20 and 7 (every row keeps a key)
        x["Mask"] = (np.arange(L)[None, :] < np.array([L, 7])[:, None]).astype(x["Mask"].dtype)
    return x


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", sorted(MODS))
def test_score_mod_kernel_matches_unfused_numpy(name: str, causal: bool) -> None:
    mod, ref_mod = MODS[name]
    g = patterns.attention(B, H, M, L, D, kv_heads=HK, causal=causal, dtype="float32", mods=(mod,))
    x = _inputs(g, seed=3)
    out = build(schedule(g, step=4), "llvm")(x)["O"]
    assert_close(out.reshape(B, H, M, D), _numpy_attention(x, ref_mod, causal), "float32", L, "O")


def test_mods_change_the_content_key_and_two_mods_compose() -> None:
    plain = patterns.attention(B, H, M, L, D, kv_heads=HK, dtype="float32")
    both = patterns.attention(B, H, M, L, D, kv_heads=HK, dtype="float32", mods=(SOFTCAP, PADDING))
    assert plain.key != both.key != patterns.attention(B, H, M, L, D, kv_heads=HK, dtype="float32",
                                                       mods=(PADDING,)).key
    x = _inputs(both, seed=5)
    out = build(schedule(both, step=4), "llvm")(x)["O"]
    # FlexAttention's order: the score mod (soft-cap), then the mask
    want = _numpy_attention(x, lambda s, x_, mi, li: MODS["padding"][1](MODS["softcap"][1](s, x_, mi, li),
                                                                        x_, mi, li), False)
    assert_close(out.reshape(B, H, M, D), want, "float32", L, "O")


def test_a_mod_input_on_an_unknown_dim_is_named() -> None:
    bad = patterns.ScoreMod("{s} + X", (("X", ("b", "t")),))
    with pytest.raises(ShapeError, match=r"'X' has dims \('b', 't'\)"):
        patterns.attention(B, H, M, L, D, mods=(bad,))


@settings(max_examples=6, deadline=None)
@given(lengths=st.lists(st.integers(1, L), min_size=B, max_size=B), seed=st.integers(0, 1000))
def test_any_padding_lengths(lengths: list[int], seed: int) -> None:
    """Padding masks of any lengths (one key at least): the online softmax's running max starts below
    every kept score, so a tile with no kept key changes nothing."""
    g = patterns.attention(B, H, M, L, D, kv_heads=HK, dtype="float32", mods=(PADDING,))
    x = random_inputs(g, seed=seed)
    x["Mask"] = (np.arange(L)[None, :] < np.array(lengths)[:, None]).astype("float32")
    out = build(schedule(g, step=4), "llvm")(x)["O"]
    assert_close(out.reshape(B, H, M, D), _numpy_attention(x, MODS["padding"][1], False), "float32", L, "O")


def test_a_query_row_with_no_key_gives_zero_as_torch_does() -> None:
    """A padding row that masks every key (an empty sequence): the finite fill alone would average V over
    all keys; V times the 0/1 row (``zero_v``) gives 0, what torch's SDPA returns there."""
    g = patterns.attention(B, H, M, L, D, kv_heads=HK, dtype="float32", mods=(PADDING,))
    x = random_inputs(g, seed=9)
    x["Mask"] = (np.arange(L)[None, :] < np.array([L, 0])[:, None]).astype("float32")
    out = build(schedule(g, step=4), "llvm")(x)["O"].reshape(B, H, M, D)
    assert np.all(out[1] == 0.0)
    assert_close(out[0], _numpy_attention(x, MODS["padding"][1], False)[0], "float32", L, "O")
