"""Issue 59: query rows whose every score an added float mask removes, through any graph the patterns build.

The contract (``spacefusion.lower.exprs``, ``smg.reference.guarded_reads``): a row of finite scores, however
low (HF's ``finfo(float32).min``), has its exact softmax, as torch eager's: all equal, it is the mean of V.
A row whose every score is -inf is 0, torch SDPA's value (eager's ``softmax`` gives 0 / 0 = NaN there, which
a next layer's attention would spread to every row).  The kernels' running max starts at -inf (it started at
a finite -3e38, above ``finfo.min``: such a row never raised it, every exponential underflowed and the row
was NaN on llvm) and is read as 0 while it is -inf (FlashAttention-2's guard).  Checked on the reference
and on llvm against torch, one kernel per graph run on many masks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from schedulers.interpreter import interpret
from smg import patterns
from smg.ops import Builder
from smg.reference import evaluate, random_inputs
from spacefusion.api import build, schedule

B, H, M, L, D = 2, 2, 12, 16, 8
LOWEST = float(np.finfo(np.float32).min)
FILLS = {"finfo.min": LOWEST, "-inf": -math.inf}
MASK = patterns.ScoreMod("{s} + Mask", (("Mask", ("b", "m", "l")),))


def _graph(causal: bool = False, save_lse: bool = False):
    return patterns.attention(B, H, M, L, D, dtype="float32", causal=causal, mods=(MASK,), save_lse=save_lse)


_KERNELS: dict[tuple, object] = {}


def _llvm(g):
    """One llvm kernel per graph (steps of 4 keys: a left padding of 5 fills a whole first step)."""
    if g.key not in _KERNELS:
        _KERNELS[g.key] = build(schedule(g, step=4), "llvm")
    return _KERNELS[g.key]


def _inputs(g, mask: np.ndarray) -> dict[str, np.ndarray]:
    x = random_inputs(g, seed=7)
    x["Mask"] = mask.astype(np.float32)
    return x


def _torch(x: dict[str, np.ndarray], sdpa: bool) -> np.ndarray:
    """torch's attention of the inputs, [b, h, m, d]: SDPA or eager (softmax, then @ V), in float64."""
    q, k, v = (torch.tensor(x[n], dtype=torch.float64) for n in "QKV")
    mask = torch.tensor(x["Mask"], dtype=torch.float64)[:, None]
    if sdpa:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).numpy()
    s = q @ k.transpose(-1, -2) / math.sqrt(D) + mask
    return (torch.softmax(s, -1) @ v).numpy()


def _padding_mask(lengths: tuple[int, ...], fill: float, causal: bool = False) -> np.ndarray:
    """Left padding: sequence b keeps its last ``lengths[b]`` keys (query m is the token at key position
    m + L - M).  With ``causal``, the causal mask merged into the same float mask, as HF's eager models
    build it: a padding token's query row sees only padding keys, so it is masked at every key.  Without,
    the padding tokens' query rows are masked too (a mask of queries and keys, as an encoder's may be)."""
    mask = np.zeros((B, M, L))
    pos = np.arange(M) + (L - M)
    for b, n in enumerate(lengths):
        mask[b, :, : L - n] = fill
        if not causal:
            mask[b, pos < L - n] = fill
    if causal:
        keep = np.arange(L)[None, :] <= pos[:, None]
        mask = np.where(keep[None], mask, fill)
    return mask


def _fully_masked(mask: np.ndarray) -> np.ndarray:
    """[b, m]: rows whose every key is masked."""
    return (mask <= LOWEST).all(-1)


@pytest.mark.parametrize("target", ["reference", "llvm"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("fill", sorted(FILLS))
def test_left_padding_matches_torch_in_every_row(fill: str, causal: bool, target: str) -> None:
    g = _graph()
    mask = _padding_mask((L, 7), FILLS[fill], causal)
    assert _fully_masked(mask).any() and not _fully_masked(mask).all()
    x = _inputs(g, mask)
    got = (evaluate(g, x) if target == "reference" else _llvm(g)(x))["O"]
    assert not np.isnan(got).any()
    # finfo.min: eager's and SDPA's agree (a masked row is the mean of V); -inf: SDPA's (0), eager's is NaN
    want = _torch(x, sdpa=True)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    rows = _fully_masked(mask)
    if fill == "finfo.min":
        np.testing.assert_allclose(got, _torch(x, sdpa=False), rtol=2e-5, atol=2e-6)
        b, m = np.argwhere(rows)[0]
        np.testing.assert_allclose(got[b, :, m], x["V"][b].mean(1), rtol=1e-5, atol=1e-6)  # the mean of V
    else:
        assert np.all(got.transpose(0, 2, 1, 3)[rows] == 0)
        eager = _torch(x, sdpa=False)
        assert np.isnan(eager.transpose(0, 2, 1, 3)[rows]).all()  # the value the contract does not copy


@settings(max_examples=25, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(0, B - 1), st.integers(0, M - 1)), max_size=8),
       first=st.integers(0, L - 1), fill=st.sampled_from(sorted(FILLS)))
def test_any_rows_masked_match_sdpa(rows: list[tuple[int, int]], first: int, fill: str) -> None:
    """Whichever rows are masked everywhere (and keys ``< first`` masked in every row: whole leading steps),
    llvm, the reference and the schedule interpreter give SDPA's answer, NaN nowhere."""
    g = _graph()
    mask = np.zeros((B, M, L))
    mask[:, :, :first] = FILLS[fill]
    for b, m in rows:
        mask[b, m] = FILLS[fill]
    x = _inputs(g, mask)
    want = _torch(x, sdpa=True)
    for got in (_llvm(g)(x)["O"], evaluate(g, x)["O"], interpret(schedule(g, step=4), x)["O"]):
        assert not np.isnan(got).any()
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("fill", sorted(FILLS))
def test_save_lse_of_a_masked_row_is_its_logsumexp(fill: str) -> None:
    """The forward a training step runs: O as above, LSE of a finfo.min row is finfo.min + log(L) (finite)
    and of a -inf row +inf (FlashAttention-2's rule, so a backward's exp(s - LSE) is 0 there:
    ``tests/test_masked_rows_backward.py``)."""
    g = _graph(save_lse=True)
    mask = _padding_mask((L, 9), FILLS[fill])
    mask[0, 3] = FILLS[fill]
    x = _inputs(g, mask)
    q, k = x["Q"].astype(np.float64), x["K"].astype(np.float64)
    s = np.einsum("bhmd,bhld->bhml", q, k) / math.sqrt(D) + mask[:, None].astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        top = np.where(np.isfinite(s.max(-1, keepdims=True)), s.max(-1, keepdims=True), 0.0)
        want = (top + np.log(np.exp(s - top).sum(-1, keepdims=True)))[..., 0]
    for got in (_llvm(g)(x), evaluate(g, x)):
        lse = got["LSE"].reshape(B, H, M)
        np.testing.assert_array_equal(np.isinf(lse), np.isinf(want))
        assert np.all(lse[np.isinf(want)] == np.inf)
        fin = np.isfinite(want)
        np.testing.assert_allclose(lse[fin], want[fin], rtol=1e-6)
        np.testing.assert_allclose(got["O"].reshape(B, H, M, D), _torch(x, sdpa=True), rtol=2e-5, atol=2e-6)
    assert (np.isinf(want) == (fill == "-inf")).any()


@pytest.mark.parametrize("fill", sorted(FILLS))
def test_a_builder_softmax_row_of_the_lowest_values(fill: str) -> None:
    """Not only attention: a softmax the Builder composes, rows of ``finfo.min`` uniform as torch's, rows of
    -inf 0 (SDPA's rule), and a max reduction of -inf stays -inf (an output reads the max as it is)."""
    g = Builder("softmax_max", "float32")
    x = g.input("X", {"m": 4, "n": 24})
    sm = g.build(g.softmax(x, "n", name="Y"), g.reduce(x, "n", "max", name="Mx"))
    xs = np.random.default_rng(0).standard_normal((4, 24)).astype(np.float32)
    xs[1] = FILLS[fill]
    xs[2, :10] = FILLS[fill]
    got = build(schedule(sm, step=8), "llvm")({"X": xs})
    want = torch.softmax(torch.tensor(xs, dtype=torch.float64), -1).numpy()
    if fill == "-inf":
        want[1] = 0.0
    np.testing.assert_allclose(got["Y"], want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(evaluate(sm, {"X": xs})["Y"], want, rtol=1e-6, atol=1e-12)
    assert got["Mx"][1] == FILLS[fill] and got["Mx"][2] == xs[2].max()


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_cuda_kernels_start_the_max_at_minus_infinity(dtype: str) -> None:
    """The CUDA build of a masked attention (compiled only here): the running max starts at -inf, the
    finite -3e38 is gone, and a float32 mask keeps log2 e out of the folded exponent (its finfo.min times
    log2 e is -inf)."""
    from spacefusion.api import first_pick, hardware

    mask = patterns.ScoreMod("{s} + Mask", (("Mask", ("b", "m", "l")),), dtype="float32")
    g = patterns.attention(2, 4, 128, 128, 64, dtype=dtype, mods=(mask,))
    src = build(first_pick(g, hardware("h100")), "cuda:sm_90a").source
    assert "CUDART_INF_F" in src
    assert "3.000000e+38" not in src


@pytest.mark.cuda
def test_left_padded_fp16_attention_on_the_gpu(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels as the GPU runs them (TVM builds the first pick for the device): SDPA with an fp16 float mask
    that removes whole query rows, filled with fp16's ``finfo.min`` (HF's left padding) in one batch and with
    -inf in the other.  Against float32 SDPA with the same mask, every row: no NaN, within fp16's error.  A row
    of fp16's ``finfo.min`` is not uniform (-65504 + s keeps the scores' differences in float32: its softmax
    is the unmasked one, as SDPA's); a row of -inf is 0 exactly (SDPA's value)."""
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    import spacefusion

    monkeypatch.setenv("SPACEFUSION_CACHE", str(tmp_path))

    class Attn(torch.nn.Module):
        def forward(self, q, k, v, mask):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    torch.manual_seed(0)
    b, h, n, d, pad = 2, 4, 128, 64, 5
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
    mask = torch.zeros(b, 1, n, n, device="cuda", dtype=torch.float16)
    for i, fill in enumerate((float(torch.finfo(torch.float16).min), -math.inf)):
        mask[i, :, :, :pad] = fill  # the padded keys
        mask[i, :, :pad, :] = fill  # the padded queries: whole rows
    with torch.no_grad():
        got = spacefusion.compile(Attn(), measure=False)(q, k, v, mask).float()
    assert not torch.isnan(got).any()
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask.float())
    assert (got - ref).abs().max().item() < 2e-2
    assert got[1, :, :pad].abs().max().item() == 0.0
