"""Issue 59: the attention backward of a query row whose every score a mask removes (-inf).

The contract (``smg.autodiff.backward.empty_row_guard``, FlashAttention-2's rule): the forward that saves
the logsumexp stores +inf for such a row (its exact value is ``-inf + log 0 = -inf``), so the backward's
recomputed ``P = exp(s - LSE)`` is ``exp(-inf) = 0`` there and the row's gradients are 0; with -inf it was
``exp(-inf + inf)``, NaN in the row's dQ and, through dK's and dV's sums over the rows, in every key.
Rows with a finite score keep their logsumexp exactly.

What torch gives (2.13, CPU): float64 autograd through SDPA's math kernel is finite, 0 for the empty row's
dQ (its output is the constant 0); through eager ``softmax(s + mask) @ V`` it is NaN (the forward is NaN);
torch's CPU flash attention stores 0 as such a row's logsumexp and its backward gives the same gradients
reading +inf, NaN reading -inf.  Checked on the reference, llvm, the schedule interpreter and the CUDA build
(compile only here).
"""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest
import torch

from schedulers.interpreter import interpret
from schedulers.passes import backward_passes
from smg import patterns
from smg.autodiff import derive_backward
from smg.reference import evaluate, random_inputs
from tests.backward_helpers import rel_err, run_backward_llvm

B, H, M, L, D = 2, 2, 8, 8, 4
MASK = patterns.ScoreMod("{s} + Mask", (("Mask", ("b", "m", "l")),))


def _case(causal: bool):
    """(backward, inputs, dO, [b, m] empty rows): -inf over sequence 1's first 3 keys (left padding: with
    ``causal`` its first 3 queries see nothing else; without, those rows are masked whole), one more row
    masked whole in sequence 0, and a key masked in a row that keeps others."""
    g = patterns.attention(B, H, M, L, D, dtype="float32", causal=causal, mods=(MASK,))
    bw = derive_backward(g, wrt=("Q", "K", "V"))
    x = random_inputs(g, seed=5)
    mask = np.zeros((B, M, L), np.float32)
    mask[1, :, :3] = -np.inf
    if not causal:
        mask[1, :3] = -np.inf
    mask[0, 5] = -np.inf
    mask[0, 6, 2] = -np.inf
    x["Mask"] = mask
    do = np.random.default_rng(9).standard_normal(g.shape("O")).astype(np.float32)
    visible = np.where(np.tril(np.ones((M, L), bool)), mask, -np.inf) if causal else mask
    return bw, x, do, np.isneginf(visible).all(-1)


def _torch_grads(x: dict[str, np.ndarray], do: np.ndarray, causal: bool, sdpa: bool) -> dict[str, np.ndarray]:
    """float64 autograd of torch's attention: SDPA (math) or eager softmax, the causal mask as -inf."""
    q, k, v = (torch.tensor(x[n], dtype=torch.float64, requires_grad=True) for n in "QKV")
    mask = torch.tensor(x["Mask"], dtype=torch.float64)[:, None]
    if causal:
        mask = mask.masked_fill(~torch.ones(M, L, dtype=torch.bool).tril(), -math.inf)
    if sdpa:
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    else:
        o = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D) + mask, -1) @ v
    o.backward(torch.tensor(do, dtype=torch.float64))
    return {"O": o.detach().numpy(), "dQ": q.grad.numpy(), "dK": k.grad.numpy(), "dV": v.grad.numpy()}


@pytest.mark.parametrize("causal", [False, True])
def test_saved_logsumexp_of_an_empty_row_is_plus_infinity(causal: bool) -> None:
    from spacefusion.api import build, schedule

    bw, x, _, empty = _case(causal)
    assert empty.any() and not empty.all()
    q, k = x["Q"].astype(np.float64), x["K"].astype(np.float64)
    s = np.einsum("bhmd,bhld->bhml", q, k) / math.sqrt(D) + x["Mask"][:, None]
    if causal:
        s = np.where(np.tril(np.ones((M, L), bool)), s, -np.inf)
    with np.errstate(divide="ignore", invalid="ignore"):
        top = s.max(-1, keepdims=True)
        want = (top + np.log(np.exp(s - top).sum(-1, keepdims=True)))[..., 0]
    kernels = (build(schedule(bw.forward, step=4), "llvm")(x), interpret(schedule(bw.forward, step=4), x))
    for got in (evaluate(bw.forward, x), *kernels):
        lse = got["LSE"].reshape(B, H, M)
        assert np.all(lse.transpose(0, 2, 1)[empty] == np.inf)
        full = ~empty[:, None].repeat(H, 1)
        np.testing.assert_allclose(lse[full], want[full], rtol=1e-6)
        assert np.all(got["O"].reshape(B, H, M, D).transpose(0, 2, 1, 3)[empty] == 0)


@pytest.mark.parametrize("causal", [False, True])
def test_backward_of_empty_rows_matches_torch_autograd(causal: bool) -> None:
    """llvm (forward, Delta, dQ, dK_dV) and the reference: finite, torch SDPA's float64 gradients in every
    element (the empty rows' dQ 0 exactly); eager's are NaN there, the value the contract does not copy."""
    bw, x, do, empty = _case(causal)
    want = _torch_grads(x, do, causal, sdpa=True)
    assert all(np.isfinite(want[n]).all() for n in ("dQ", "dK", "dV"))
    eager = _torch_grads(x, do, causal, sdpa=False)
    assert np.isnan(eager["dQ"].transpose(0, 2, 1, 3)[empty]).all() and np.isnan(eager["dK"][1]).any()
    with np.errstate(divide="ignore", invalid="ignore"):  # numpy's reference evaluates both Piecewise branches
        ref = dict(x) | evaluate(bw.forward, x) | {"dO": do}
        ref |= evaluate(bw.graph, {n: ref[n] for n in bw.graph.inputs})
    for got in (run_backward_llvm(bw, x, {"dO": do}), ref):
        for name in ("O", "dQ", "dK", "dV"):
            g = got[name].reshape(want[name].shape)
            assert np.isfinite(g).all(), name
            assert rel_err(g, want[name]) < 2e-5, name
        assert np.all(got["dQ"].reshape(B, H, M, D).transpose(0, 2, 1, 3)[empty] == 0)


def test_torch_flash_backward_reads_the_fused_logsumexp() -> None:
    """The training step's route (``frontend.training``: the fused forward ``attention_lse``, torch's CPU flash
    attention backward): fed the fused O and +inf LSE, torch's backward gives its own gradients, finite.  The
    old -inf LSE makes them NaN."""
    from spacefusion.api import build, schedule

    bw, x, do, _ = _case(causal=False)
    fused = build(schedule(bw.forward, step=4), "llvm")(x)
    q, k, v = (torch.tensor(x[n]) for n in "QKV")
    mask, dout = torch.tensor(x["Mask"])[:, None], torch.tensor(do)
    out, lse = torch.tensor(fused["O"]).reshape(B, H, M, D), torch.tensor(fused["LSE"]).reshape(B, H, M)
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    want = backward(dout, q, k, v, *torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=mask), 0.0, False, attn_mask=mask)
    got = backward(dout, q, k, v, out, lse, 0.0, False, attn_mask=mask)
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    old = backward(dout, q, k, v, out, lse.where(lse != math.inf, -math.inf), 0.0, False, attn_mask=mask)
    assert torch.isnan(old[0]).any()


def test_backward_of_a_masked_causal_attention_builds_for_cuda(tmp_path) -> None:
    """The forward saving LSE and every backward pass of a causal fp16 attention with a padding mask lower
    to CUDA for sm_90a (nvcc builds the cubins where it exists); the forward stores +inf (FA2's rule), on
    the tensor-core path too (the H100 first pick of a larger shape)."""
    from schedulers.warp_tile import warp_tile_refusal
    from spacefusion.api import build, first_pick, hardware, schedule

    mask = patterns.ScoreMod("{s} + Mask", (("Mask", ("b", "l")),))
    g = patterns.attention(1, 2, 64, 64, 16, dtype="float16", causal=True, mods=(mask,))
    bw = derive_backward(g, wrt=("Q", "K", "V"))
    assert "(1.0e+400, True)" in bw.forward.producer("LSE").body
    big = patterns.attention(2, 4, 128, 128, 64, dtype="float16", causal=True, mods=(mask,), save_lse=True)
    pick = first_pick(big, hardware("h100"))
    assert warp_tile_refusal(pick) is None
    arts = {"tensor_core": build(pick, "cuda:sm_90a")}
    assert "= CUDART_INF_F;" in arts["tensor_core"].source
    arts |= {smg.name + str(i): build(schedule(smg), "cuda:sm_90a")
             for i, smg in enumerate((bw.forward, *(p.smg for p in backward_passes(bw))))}
    for name, art in arts.items():
        assert "__global__" in art.source, name
        if shutil.which("nvcc"):
            assert (art.save(tmp_path / name, cache=None) / "kernel.cubin").stat().st_size > 0
