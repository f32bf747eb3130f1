"""Issue 59: causal attention with a padding mask that leaves a query no key it may see.

A left-padded decoder batch (LLaMA, Qwen2) has padding queries whose only causally visible keys are padding.
What torch and transformers give such a row (torch 2.13, transformers 5.25, measured on the CPU):

- HF's ``sdpa`` attention passes SDPA a boolean mask (causal and padding merged) whose padding rows are all
  false: SDPA (math and CPU flash alike) gives them 0, so the model's padding queries attend to nothing;
- HF's ``eager`` attention merges causal and padding into one float mask of ``finfo.min``: the padding row
  is uniform over every key, future keys included (the mean of all of V).  That graph has no causal mask
  of its own (causal is data in the mask), and ``tests/test_masked_rows.py`` holds it;
- SDPA's ``is_causal`` removes the keys after the query outright (its reference adds -inf), so a float
  padding mask with the causal mask on top gives the exact softmax over the visible keys: 0 where they are
  all -inf, the mean of the visible V where they are all ``finfo.min``.

The contract of ``patterns.attention(causal=True, mods=...)`` is that last one, SDPA's: the causal mask is
``is_causal`` whatever the mods (``patterns.causal_fill``: -inf where a mod may mask keys), so a boolean
padding row (``zero_v``) is 0 as HF's sdpa models give it.  Before, the causal mask filled with a finite
-1e30, above the padding's fill, and such a row was the mean of its FUTURE keys' V, which neither eager
nor SDPA gives.  Rows with a visible key are unchanged (checked bit for bit against the old fill).
"""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest
import torch

from schedulers.interpreter import interpret
from smg import patterns
from smg.reference import evaluate, random_inputs
from spacefusion.api import build, schedule

B, H, N, D, PAD = 2, 2, 16, 8, 5
LOWEST = float(np.finfo(np.float32).min)
FLOAT = patterns.ScoreMod("{s} + Mask", (("Mask", ("b", "m", "l")),))
#: a boolean padding row as the frontend reads one (``attention._index_mask``): 0/1, 0 for the row
KEEP = patterns.ScoreMod("Piecewise(({s}, Keep > 0.5), (-1e30, True))", (("Keep", ("b", "l")),), zero_v="Keep")
FORMS = {"float finfo.min": (FLOAT, LOWEST), "float -inf": (FLOAT, -math.inf), "bool": (KEEP, None)}


def _keep() -> np.ndarray:
    """[b, l]: sequence 1 left-padded by PAD tokens (its queries 0..PAD-1 see only padding)."""
    keep = np.ones((B, N), bool)
    keep[1, :PAD] = False
    return keep


def _case(form: str, causal_fill=None, monkeypatch=None):
    """(graph, inputs) of a causal attention with the padding of ``form``; ``causal_fill`` (with the
    monkeypatch) builds the graph with another causal fill (the old -1e30)."""
    mod, fill = FORMS[form]
    if causal_fill is not None:
        monkeypatch.setattr(patterns, "causal_fill", lambda mods: causal_fill)
    g = patterns.attention(B, H, N, N, D, dtype="float32", causal=True, mods=(mod,))
    x = random_inputs(g, seed=11)
    if fill is None:
        x["Keep"] = _keep().astype(np.float32)
    else:
        x["Mask"] = np.broadcast_to(np.where(_keep(), 0.0, fill)[:, None], (B, N, N)).astype(np.float32)
    return g, x


def _sdpa(x: dict[str, np.ndarray], form: str) -> np.ndarray:
    """torch's value, float64: SDPA with HF's boolean mask (transformers' own ``sdpa_mask``) for ``bool``,
    else with the float mask plus ``is_causal``'s -inf."""
    q, k, v = (torch.tensor(x[n], dtype=torch.float64) for n in "QKV")
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    if form == "bool":
        masking = pytest.importorskip("transformers.masking_utils")
        mask = masking.sdpa_mask(batch_size=B, q_length=N, kv_length=N, allow_is_causal_skip=False,
                                 attention_mask=torch.tensor(_keep()))
        assert mask.dtype == torch.bool and not mask[1, 0, :PAD].any()  # HF's padding queries: all false
    else:
        mask = torch.tensor(x["Mask"]).double()[:, None].masked_fill(~causal, -math.inf)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).numpy()


def _run(g, x: dict[str, np.ndarray], target: str) -> np.ndarray:
    if target == "reference":
        return evaluate(g, x)["O"]
    if target == "interpreter":
        return interpret(schedule(g, step=4), x)["O"]
    return build(schedule(g, step=4), "llvm")(x)["O"]


@pytest.mark.parametrize("target", ["reference", "llvm", "interpreter"])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_padding_queries_of_a_causal_attention_follow_sdpa(form: str, target: str) -> None:
    g, x = _case(form)
    got = _run(g, x, target)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, _sdpa(x, form), rtol=2e-5, atol=2e-6)
    pad = got[1, :, :PAD]  # [h, m, d]: the padding queries of sequence 1
    if form == "float finfo.min":  # the exact softmax over the visible keys: the mean of V[:m + 1]
        for m in range(PAD):
            np.testing.assert_allclose(pad[:, m], x["V"][1, :, : m + 1].mean(1), rtol=1e-5, atol=1e-6)
    else:
        assert np.all(pad == 0)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_rows_with_a_visible_key_are_unchanged(form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On llvm, every row with a visible key is bit for bit the old causal fill's (-1e30); the padding
    queries are not: the old fill gave them the mean of their future keys' V (the bug)."""
    g, x = _case(form)
    new = build(schedule(g, step=4), "llvm")(x)["O"]
    old_g, _ = _case(form, causal_fill=-1e30, monkeypatch=monkeypatch)
    assert old_g.key != g.key
    old = build(schedule(old_g, step=4), "llvm")(x)["O"]
    visible = np.ones((B, N), bool)
    visible[1, :PAD] = False
    np.testing.assert_array_equal(new.transpose(0, 2, 1, 3)[visible], old.transpose(0, 2, 1, 3)[visible])
    assert np.abs(old[1, :, :PAD] - new[1, :, :PAD]).max() > 0.1


def test_graphs_without_masking_mods_keep_their_bodies_and_keys() -> None:
    """The causal fill is -1e30 where no mod can mask a key (every row keeps key 0: the values are the same
    either way), so those graphs' content keys, which committed schedules name, stay."""
    plain = patterns.attention(1, 2, 32, 32, 16, causal=True)
    capped = patterns.attention(1, 2, 32, 32, 16, causal=True, mods=(patterns.ScoreMod("30.0*tanh({s}/30.0)"),))
    masked = patterns.attention(1, 2, 32, 32, 16, causal=True, mods=(FLOAT,))
    body = {g.name + str(i): g.producer("Sm").body for i, g in enumerate((plain, capped, masked))}
    assert list(body.values())[:2] == ["Piecewise((Ss, l <= m), (-1e+30, True))",
                                       "Piecewise((Smod0, l <= m), (-1e+30, True))"]
    assert list(body.values())[2] == "Piecewise((Smod0, l <= m), (-1.0e+400, True))"


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_cuda_kernels_of_causal_padding_fill_with_minus_infinity(dtype: str, tmp_path) -> None:
    """The CUDA builds (compiled only here; nvcc builds the cubin where it exists): fp16 takes the tensor-core
    path, fp32 the CUDA-core one.  Neither holds the old finite causal fill."""
    from schedulers.warp_tile import warp_tile_refusal
    from spacefusion.api import first_pick, hardware

    mask = patterns.ScoreMod("{s} + Mask", (("Mask", ("b", "l")),))
    g = patterns.attention(2, 4, 128, 128, 64, dtype=dtype, causal=True, mods=(mask,))
    s = first_pick(g, hardware("h100"))
    assert (warp_tile_refusal(s) is None) == (dtype == "float16")
    art = build(s, "cuda:sm_90a")
    assert "1.000000e+30" not in art.source and "CUDART_INF_F" in art.source
    if shutil.which("nvcc"):
        assert (art.save(tmp_path / dtype, cache=None) / "kernel.cubin").stat().st_size > 0


@pytest.mark.cuda
@pytest.mark.parametrize("form", ["float", "bool"])
def test_left_padded_causal_fp16_attention_on_the_gpu(form: str, tmp_path) -> None:
    """The H100 first pick of a causal fp16 attention with left padding, run on the GPU: an fp16 float mask
    (sequence 0 padded with fp16's ``finfo.min``, sequence 1 with -inf) or a boolean padding row (0/1).
    Against float32 SDPA with the same mask plus the causal -inf, every row: no NaN, within fp16's error;
    the padding queries of a -inf or boolean row are 0 exactly."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from spacefusion.api import first_pick, hardware
    from spacefusion.runtime.gpu import CudaKernel

    b, h, n, d, pad = 2, 4, 128, 64, 37  # the padding spans a whole first step and part of the next
    mod = patterns.ScoreMod("{s} + Mask", (("Mask", ("b", "l")),)) if form == "float" else \
        patterns.ScoreMod("Piecewise(({s}, Keep > 0.5), (-1e30, True))", (("Keep", ("b", "l")),), zero_v="Keep")
    g = patterns.attention(b, h, n, n, d, dtype="float16", causal=True, mods=(mod,))
    kernel = CudaKernel(build(first_pick(g, hardware("h100")), "cuda").save(tmp_path / form))
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = {c: torch.randn(b, h, n, d, device="cuda", generator=gen, dtype=torch.float16) for c in "QKV"}
    keep = torch.ones(b, n, dtype=torch.bool, device="cuda")
    keep[:, :pad] = False
    if form == "float":
        mask = torch.zeros(b, n, device="cuda", dtype=torch.float16)
        mask[0, :pad], mask[1, :pad] = torch.finfo(torch.float16).min, -math.inf
        x["Mask"] = mask
    else:
        mask = torch.where(keep, 0.0, -math.inf).half()
        x["Keep"] = keep.half()
    got = kernel(**x)["O"].float()
    causal = torch.ones(n, n, dtype=torch.bool, device="cuda").tril()
    full = mask.float()[:, None, None, :].masked_fill(~causal, -math.inf)
    ref = torch.nn.functional.scaled_dot_product_attention(*(x[c].float() for c in "QKV"), attn_mask=full)
    ref = torch.nan_to_num(ref)  # a row of -inf is 0 (torch's math SDPA gives 0 too; the guard if not)
    assert not torch.isnan(got).any()
    assert (got - ref).abs().max().item() < 2e-2
    assert got[1 if form == "float" else 0, :, :pad].abs().max().item() == 0.0
