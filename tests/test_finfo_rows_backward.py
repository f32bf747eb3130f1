"""Issue 59: the attention backward of a query row whose every key is masked with a large *finite* fill.

HF's eager attention adds ``torch.finfo(float32).min`` to masked scores, so every score of such a row is
about -3.4e38 and ``s + fill`` rounds to the fill: the exact softmax (float64 included) is uniform, 1/L per
key, and the forward gives the mean of V.  The single saved ``LSE = max + log(sum)`` rounds to ``max``
there (log L is below its ulp), so a backward recomputing ``P = exp(s - LSE)`` gets 1 per key and dV L times
too big (torch's CPU flash backward has that flaw).  ``smg.autodiff.backward._split_statistics``: where the
scores add a forward input, the forward saves the max and the log-sum apart and the backward recomputes
``P = exp((X - max) - log(sum))`` from the differences, as the forward does.  Checked against float64 torch
autograd of eager attention on the float32 and float64 reference and llvm, the schedule interpreter too.
"""

from __future__ import annotations

import math

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
FILL = float(np.finfo(np.float32).min)
MASK = patterns.ScoreMod("{s} + Mask", (("Mask", ("b", "m", "l")),))


def _case(dtype: str):
    """(backward, inputs, dO, [b, m] rows masked whole): sequence 0's row 5 and sequence 1's rows 0-2 masked
    whole with the fill; sequence 1's keys 6-7 padded with the fill in every other row (HF's key padding);
    a moderate mask (-3.5) on one key of row 1; the rest 0."""
    g = patterns.attention(B, H, M, L, D, dtype=dtype, mods=(MASK,))
    bw = derive_backward(g, wrt=("Q", "K", "V"))
    x = random_inputs(g, seed=11)
    mask = np.zeros((B, M, L), x["Q"].dtype)
    mask[1, :, 6:] = FILL
    mask[1, :3] = FILL
    mask[0, 5] = FILL
    mask[0, 1, 3] = -3.5
    x["Mask"] = mask
    do = np.random.default_rng(3).standard_normal(g.shape("O")).astype(x["Q"].dtype)
    return bw, x, do, (mask == FILL).all(-1)


def _eager_grads(x: dict[str, np.ndarray], do: np.ndarray) -> dict[str, np.ndarray]:
    """float64 torch autograd of eager ``softmax(q k^T * scale + mask) v`` (the fill as float64)."""
    q, k, v = (torch.tensor(x[n], dtype=torch.float64, requires_grad=True) for n in "QKV")
    mask = torch.tensor(x["Mask"], dtype=torch.float64)[:, None]
    o = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D) + mask, -1) @ v
    o.backward(torch.tensor(do, dtype=torch.float64))
    return {"O": o.detach().numpy(), "dQ": q.grad.numpy(), "dK": k.grad.numpy(), "dV": v.grad.numpy()}


def _reference(bw, x, do) -> dict[str, np.ndarray]:
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # both Piecewise branches evaluated
        env = dict(x) | evaluate(bw.forward, x) | {"dO": do}
        return env | evaluate(bw.graph, {n: env[n] for n in bw.graph.inputs})


def test_masked_graphs_save_the_row_statistics_in_two_parts_and_plain_ones_do_not() -> None:
    bw, *_ = _case("float32")
    assert bw.saved == ("LSE", "LSE_max", "LSE_log", "O")
    assert "LSE" in bw.forward.outputs and "LSE" not in bw.graph.inputs  # kept for torch's own backward
    assert str(bw.graph.producer("P").body) == "exp(-LSE_log + P_shift)"
    plain = derive_backward(patterns.attention(B, H, M, L, D, dtype="float32", causal=True))
    assert plain.saved == ("LSE", "O") and "LSE_max" not in plain.graph.inputs


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_finfo_rows_match_float64_eager_autograd(dtype: str) -> None:
    """Reference and llvm gradients within float32 rounding of float64 eager in every element, dV of the
    whole-masked rows' contributions included (those rows' forward: the mean of V)."""
    bw, x, do, full = _case(dtype)
    assert full.any() and not full.all()
    want = _eager_grads(x, do)
    o = want["O"].transpose(0, 2, 1, 3)[full]  # the forward of such a row: the mean of V (uniform softmax)
    mean_v = np.broadcast_to(x["V"].astype(np.float64).mean(2)[:, :, None], (B, H, M, D))
    np.testing.assert_allclose(o, mean_v.transpose(0, 2, 1, 3)[full], rtol=1e-12)
    runs = {"reference": _reference(bw, x, do)}
    if dtype == "float32":
        runs["llvm"] = run_backward_llvm(bw, x, {"dO": do})
    tol = 2e-5 if dtype == "float32" else 1e-12
    for where, got in runs.items():
        for name in ("O", "dQ", "dK", "dV"):
            g = got[name].reshape(want[name].shape)
            assert np.isfinite(g).all(), (where, name)
            assert rel_err(g, want[name]) < tol, (where, name, rel_err(g, want[name]))


def test_single_logsumexp_recompute_is_the_flaw_the_split_avoids() -> None:
    """The old recompute ``exp(s + mask - LSE)`` in float32 from the saved LSE gives 1 per key of a
    whole-masked row (dV off by ~L there); from the two parts, 1/L."""
    bw, x, do, full = _case("float32")
    fwd = evaluate(bw.forward, x)
    s = (np.einsum("bhmd,bhld->bhml", x["Q"], x["K"]) / np.float32(math.sqrt(D)) + x["Mask"][:, None])
    old = np.exp(s - fwd["LSE"].reshape(B, H, M)[..., None]).transpose(0, 2, 1, 3)[full]
    assert np.all(old == 1)
    shift = s - fwd["LSE_max"].reshape(B, H, M)[..., None]
    new = np.exp(shift - fwd["LSE_log"].reshape(B, H, M)[..., None]).transpose(0, 2, 1, 3)[full]
    np.testing.assert_allclose(new, 1 / L, rtol=1e-6)


def test_interpreter_runs_the_split_passes() -> None:
    """The schedule interpreter (the tiles the kernels run) of the forward and every pass: llvm's values."""
    from spacefusion.api import schedule

    bw, x, do, _ = _case("float32")
    want = _eager_grads(x, do)
    env = dict(x) | interpret(schedule(bw.forward), x) | {"dO": do}
    for p in backward_passes(bw):
        env |= interpret(schedule(p.smg), {k: env[k] for k in p.smg.inputs})
    for name in ("dQ", "dK", "dV"):
        assert rel_err(env[name].reshape(want[name].shape), want[name]) < 2e-5, name


def test_split_passes_build_for_cuda(tmp_path) -> None:
    """The forward saving both parts and every pass reading them lower to CUDA for sm_90a (nvcc builds the
    cubins where it exists)."""
    import shutil

    from spacefusion.api import build, schedule

    bw, *_ = _case("float32")
    for i, smg in enumerate((bw.forward, *(p.smg for p in backward_passes(bw)))):
        art = build(schedule(smg), "cuda:sm_90a")
        assert "__global__" in art.source, smg.name
        if "LSE_max" in (*smg.inputs, *smg.outputs):
            assert "LSE_max" in art.source and "LSE_log" in art.source, smg.name
        if shutil.which("nvcc"):
            assert (art.save(tmp_path / str(i), cache=None) / "kernel.cubin").stat().st_size > 0
