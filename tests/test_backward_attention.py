"""The derived attention backward (smg.autodiff) is FlashAttention-2's, and its kernels match float64 numpy."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schedulers.passes import backward_passes
from smg.autodiff import derive_backward
from smg.patterns import attention
from tests.backward_helpers import attention_grads, rel_err, run_backward_llvm


def _bodies(bw):
    return {op.out: (op.reduce, op.body) for op in bw.graph.ops}


@pytest.mark.parametrize("causal", [False, True])
def test_derivation_arrives_at_flash_attention_2(causal: bool) -> None:
    bw = derive_backward(attention(1, 2, 16, 24, 8, dtype="float32", causal=causal))
    ops = _bodies(bw)
    assert bw.saved == ("LSE", "O")
    assert dict(bw.grads) == {"Q": "dQ", "K": "dK", "V": "dV"}
    assert ops["Delta"] == (("n",), "O*dO")  # rowsum(dO * O), by reassociation
    assert ops["P"][1].startswith("exp(-LSE + ")  # recomputed from the saved logsumexp
    assert ops["dS"][1].startswith("0.35355339059327373*P*(-Delta + dP)")
    assert ops["dV"] == (("m",), "P*dO") and ops["dK"] == (("m",), "Q*dS") and ops["dQ"] == (("l",), "K*dS")
    assert ("Piecewise" in ops["dS"][1]) is causal
    text = "\n".join(bw.derivation)
    assert "P_max: a stabiliser, adjoint 0" in text and "the forward saves LSE = P_max + log(P_sum)" in text
    names = [p.name for p in backward_passes(bw)]
    assert names == ["Delta", "dQ", "dK_dV"]
    assert bw.forward.outputs == ("O", "LSE")


def test_forward_without_saves_is_unchanged() -> None:
    g = attention(1, 2, 16, 24, 8, dtype="float32")
    key = g.key
    bw = derive_backward(g)
    assert g.key == key and "LSE" not in g.outputs and bw.forward.key != key


@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(b=st.integers(1, 2), h=st.integers(1, 2), group=st.sampled_from([1, 2]), m=st.integers(2, 20),
       l=st.integers(2, 20), d=st.sampled_from([4, 8]), causal=st.booleans(), scale=st.sampled_from([None, 0.5]))
def test_backward_kernels_match_float64(b, h, group, m, l, d, causal, scale) -> None:
    """Plain, causal, a given scale and grouped-query heads (K and V broadcast along ``r``: dK and dV reduce
    over the group's query heads too)."""
    if causal and l < m:  # a query row with no key: torch's SDPA gives NaN there
        l = m
    g = attention(b, h * group, m, l, d, kv_heads=h, dtype="float32", causal=causal, scale=scale)
    bw = derive_backward(g)
    rng = np.random.default_rng(b * 1000 + m * 31 + l)
    x = {n: rng.standard_normal(g.shape(n)).astype(np.float32) for n in g.inputs}
    do = rng.standard_normal(g.shape("O")).astype(np.float32)
    got = run_backward_llvm(bw, x, {"dO": do})
    flat = (b, h * group, m, d)  # query head h * group + r
    want = attention_grads(x["Q"].reshape(flat), np.repeat(x["K"], group, 1), np.repeat(x["V"], group, 1),
                           do.reshape(flat), 1 / math.sqrt(d) if scale is None else scale, causal)
    want["dK"] = want["dK"].reshape(b, h, group, l, d).sum(2)
    want["dV"] = want["dV"].reshape(b, h, group, l, d).sum(2)
    for name in ("O", "LSE", "dQ", "dK", "dV"):
        assert rel_err(got[name].reshape(want[name].shape), want[name]) < 2e-5, name


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_backward_passes_compile_for_cuda(causal, dtype, tmp_path) -> None:
    """Every pass, and the forward that saves the logsumexp, lowers to CUDA for sm_90a (compile only here;
    nvcc builds the cubins of one case where it exists)."""
    import shutil

    from spacefusion.api import build, schedule

    bw = derive_backward(attention(1, 2, 64, 64, 16, dtype=dtype, causal=causal))
    for smg in (bw.forward, *(p.smg for p in backward_passes(bw))):
        art = build(schedule(smg), "cuda:sm_90a")
        assert "__global__" in art.source, smg.name
        if causal and dtype == "float16" and shutil.which("nvcc"):
            assert (art.save(tmp_path / smg.name, cache=None) / "kernel.cubin").stat().st_size > 0


def test_schedule_printout_shows_the_derivation() -> None:
    from spacefusion.api import schedule

    bw = derive_backward(attention(1, 2, 16, 24, 8, dtype="float32"))
    text = str(schedule(backward_passes(bw)[-1].smg))
    assert "backward derivation (smg.autodiff):" in text and "dS[b, h, m, l] = " in text
    assert "backward derivation" not in str(schedule(attention(1, 2, 16, 24, 8, dtype="float32")))


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [False, True])
def test_backward_kernels_on_gpu_match_torch_autograd(causal: bool, tmp_path) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    from spacefusion.api import build, schedule
    from spacefusion.runtime.gpu import CudaKernel

    def run(smg, env, name):
        kernel = CudaKernel(build(schedule(smg), "cuda").save(tmp_path / name))
        return kernel(**{k: env[k].contiguous() for k in smg.inputs})

    b, h, m, l, d = 2, 4, 128, 128, 64
    g = attention(b, h, m, l, d, dtype="float32", causal=causal)
    bw = derive_backward(g)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = {n: torch.randn(g.shape(n), device="cuda", generator=gen) for n in g.inputs}
    do = torch.randn(g.shape("O"), device="cuda", generator=gen)
    env = dict(x)
    env |= run(bw.forward, env, "forward")
    env["dO"] = do
    for p in backward_passes(bw):
        env |= run(p.smg, env, p.name)
    q, k_, v = (x[n].double().requires_grad_() for n in ("Q", "K", "V"))
    o = torch.nn.functional.scaled_dot_product_attention(q, k_, v, is_causal=causal)
    o.backward(do.double())
    for name, ref in (("dQ", q.grad), ("dK", k_.grad), ("dV", v.grad)):
        assert rel_err(env[name].double().cpu().numpy(), ref.cpu().numpy()) < 1e-4, name


def test_the_docs_show_the_printout_as_printed() -> None:
    """docs/backward.md's printout is what the dK/dV pass of causal attention prints (its key line aside)."""
    from spacefusion.api import schedule
    from tests.mdblocks import ROOT, blocks

    bw = derive_backward(attention(2, 8, 512, 512, 64, dtype="float16", causal=True))
    printed = str(schedule(backward_passes(bw)[-1].smg, tiles={"l": 64}, step=32)).splitlines()[1:]
    documented = blocks(ROOT / "docs" / "backward.md", "text")[0].strip("\n").splitlines()[1:]
    assert documented == printed


def test_a_learned_bias_gets_its_gradient() -> None:
    """A score mod's input that requires grad (an additive bias over [h, m, l]): dBias = sum_b dS, a pass of
    its own (it reduces over the batch), against float64 torch autograd."""
    torch = pytest.importorskip("torch")
    from smg.patterns import ScoreMod

    g = attention(2, 2, 6, 7, 4, dtype="float32", causal=True,
                  mods=(ScoreMod("{s} + Bias", (("Bias", ("h", "m", "l")),)),))
    bw = derive_backward(g)
    assert [p.name for p in backward_passes(bw)] == ["Delta", "dQ", "dK_dV", "dBias"]
    rng = np.random.default_rng(3)
    x = {n: rng.standard_normal(g.shape(n)).astype(np.float32) for n in g.inputs}
    do = rng.standard_normal(g.shape("O")).astype(np.float32)
    got = run_backward_llvm(bw, x, {"dO": do})
    t = {n: torch.tensor(v, dtype=torch.float64, requires_grad=True) for n, v in x.items()}
    mask = torch.ones(6, 7, dtype=torch.bool).tril()
    s = (t["Q"] @ t["K"].transpose(-1, -2)) * 0.5 + t["Bias"]
    o = torch.softmax(s.masked_fill(~mask, -float("inf")), -1) @ t["V"]
    o.backward(torch.tensor(do, dtype=torch.float64))
    for n in ("Q", "K", "V", "Bias"):
        assert rel_err(got[f"d{n}"], t[n].grad.numpy()) < 2e-5, n


@pytest.mark.parametrize("causal", [False, True])
def test_attention_save_lse_is_the_derived_forward(causal: bool) -> None:
    """``attention(..., save_lse=True)`` is the forward ``derive_backward`` asks for, its LSE the rows'
    logsumexp of the scaled (masked) scores (the reference evaluator against numpy); without the flag the
    graph and its key are unchanged."""
    from smg.reference import evaluate, random_inputs

    plain = attention(1, 2, 12, 12, 8, causal=causal, dtype="float32")
    saving = attention(1, 2, 12, 12, 8, causal=causal, dtype="float32", save_lse=True)
    assert saving.key == derive_backward(plain).forward.key and saving.outputs == ("O", "LSE")
    assert attention(1, 2, 12, 12, 8, causal=causal, dtype="float32").key == plain.key
    x = random_inputs(saving, seed=3)
    got = evaluate(saving, x)
    s = np.einsum("bhmd,bhld->bhml", x["Q"].astype(np.float64), x["K"].astype(np.float64)) / math.sqrt(8)
    if causal:
        s = np.where(np.tril(np.ones((12, 12), dtype=bool)), s, -np.inf)
    want = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
    np.testing.assert_allclose(got["LSE"], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["O"], evaluate(plain, x)["O"], rtol=1e-6, atol=1e-6)
