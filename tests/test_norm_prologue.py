"""A norm as the prologue of the GEMM after it (``rmsnorm(X) @ W``): the rows' statistics are running states
of the GEMM's own A tile, 1/rms applied after the loop.  The slicers' part (the output columns cut, the
postponed factor), the tensor-core forms (wgmma's ss form with row states, its rs form where the norm keeps
its weight, mma.sync), and each on llvm against the numpy reference; the kernels' numerics on the GPU."""

from __future__ import annotations

import numpy as np
import pytest

from experiments.mma_cases import _schedule
from schedulers.errors import ScheduleError
from schedulers.hardware import H100
from schedulers.spatial import analyse_spatial
from search.space import SearchSpace
from smg import patterns
from smg.ops import Builder
from smg.reference import evaluate, random_inputs, reduction_length
from smg.tolerance import assert_close
from smg.workloads import softmax_gemm
from spacefusion.api import build, schedule
from spacefusion.frontend.builders import gated_gemm
from spacefusion.frontend.schedules import model_pick


def _rms_gemm(m: int, k: int, n: int, b_layout: str = "nk", weight: bool = True, dtype: str = "float16"):
    """The issue's ``rmsnorm(x) @ W``, through the Builder: W [n, k] as ``nn.Linear`` stores it."""
    b = Builder("rms_gemm", dtype)
    x = b.input("X", {"m": m, "k": k})
    w = b.input("W", {"n": n, "k": k} if b_layout == "nk" else {"k": k, "n": n})
    y = b.rmsnorm(x, "k", b.input("G", {"k": k}) if weight else None)
    return b.build(b.matmul(y, w, reduce="k", name="O"))


def test_rmsnorm_before_a_linear_weight_gets_a_tensor_core_form() -> None:
    """Was refused ("GEMM operand 'W' ('n', 'k') must be [.., k, .., n]"), and with W [k, n] its only form kept
    all 896 columns in one block (n could not be cut: every block would recompute the norm)."""
    g = _rms_gemm(1024, 896, 896)
    s = schedule(g, tiles={"m": 64, "n": 128}, tensor_cores=True, wgmma=True, step=64, stages=3)
    (gs,) = s.warp_tile.gemm_states
    assert gs.k_major and gs.factor == "G*X" and [u.state for u in s.warp_tile.row_states] == ["X_rmsnorm_sqsum"]
    pick, _ = model_pick(g, H100)
    assert pick.tensor_cores and dict(pick.block)["n"] < 896


def test_the_norm_is_the_gemms_prologue_along_its_output_columns() -> None:
    """The columns of ``rmsnorm(X) @ W`` are cut: each block recomputes its rows' statistics from the A tile
    its GEMM reads anyway, a few operations an element against N multiply-adds.  Not where the intermediate is a
    GEMM of its own (an MLP's hidden tile, attention's scores), nor where N is too short to pay for it."""
    def cut(g, dim: str) -> bool:
        return next(d for d in analyse_spatial(g) if d.dim == dim).cut

    decision = next(d for d in analyse_spatial(_rms_gemm(1024, 896, 896)) if d.dim == "n")
    assert decision.cut and "the prologue of O" in decision.reason
    assert not cut(_rms_gemm(16, 64, 64), "n")  # 4 operations an element against 64 columns: kept whole
    assert not cut(patterns.mlp(64, 256, 1024, 256), "n")
    assert not cut(patterns.attention(1, 2, 64, 64, 64), "n")
    assert not cut(softmax_gemm(64, 128, 64), "n") and cut(softmax_gemm(64, 128, 512), "n")


def test_the_postponed_norm_keeps_its_constant_out_of_the_fp16_operand() -> None:
    """``1/sqrt(sum/K + eps)`` split at sum = 1 left ``sqrt(K) * G * X`` as the tensor cores' A operand (64x
    the activations at K = 4096: an fp16 overflow at a few thousand); the constant is the postponed factor's."""
    s = schedule(_rms_gemm(256, 896, 896), tiles={"m": 64, "n": 128}, tensor_cores=True, step=32, stages=2)
    (gs,) = s.warp_tile.gemm_states
    assert gs.update.body == "G*W*X" and "sqrt" in gs.update.postponed


@pytest.mark.parametrize("name, ss, trans", [("gemm_rms_nk_wgmma", True, False), ("gemm_rms_nk_ws", True, False),
                                             ("gemm_rms_weight_nk_rs", False, False), ("gemm_rms_nk", False, False),
                                             ("gemm_rms_weight_kn", False, True)])
def test_the_prologue_forms(name: str, ss: bool, trans: bool) -> None:
    """Without the norm's weight (folded into W by the frontend) every GEMM state multiplies the staged A itself:
    wgmma's ss form, with the sum of squares read from A's tile by ldmatrix beside the async wgmmas (also under
    a producer warpgroup); with the weight, ``G * X`` is computed in registers (wgmma's rs form)."""
    s = _schedule(name)
    p = s.warp_tile
    assert p.wgmma_ss == ss and [u.state for u in p.row_states] == ["An_sqsum"] and p.row_sums == ()
    src = build(s, "cuda").source
    assert "ldmatrix.sync.aligned.m8n8.x4.shared" in src
    assert ("ldmatrix.sync.aligned.m8n8.x4.trans" in src) == trans


def test_the_search_offers_the_plain_gemms_tma_and_producer_forms() -> None:
    """A GEMM beside its norm's row statistics is offered TMA and a producer warpgroup, as a plain GEMM is."""
    space = SearchSpace(patterns.gemm_epilogue(1024, 896, 896, "none", False, "float16", "nk", norm="rmsnorm"), H100)
    assert space.one_reduction
    assert not SearchSpace(patterns.attention(1, 2, 128, 128, 64), H100).one_reduction
    pick, _ = model_pick(patterns.gemm_epilogue(1024, 896, 4864, "none", False, "float16", "nk", norm="rmsnorm"), H100)
    assert pick.wgmma and pick.warp_tile.wgmma_ss and pick.tma


def test_a_layernorm_with_its_weight_has_no_derived_update() -> None:
    """LayerNorm's ``(X - mean) * rstd * w + b`` before a GEMM is not separable in the running statistics (the
    bias term), so the temporal slicer refuses it; without its affine part it slices (a second accumulator,
    the column sums of W, carries the mean), on CUDA cores only."""
    with pytest.raises(ScheduleError, match="not closed under differentiation"):
        schedule(patterns.gemm_epilogue(64, 96, 128, "none", True, "float16", "nk", norm="layernorm", norm_weight=True))
    with pytest.raises(ScheduleError, match="not a sum accumulator of its space"):
        schedule(patterns.gemm_epilogue(256, 512, 256, "none", True, "float16", "nk", norm="layernorm"),
                 tiles={"m": 64, "n": 128}, tensor_cores=True, recompute=True, step=32, stages=2)


GRAPHS = {
    "rms_nk": lambda dt: patterns.gemm_epilogue(24, 40, 48, "silu", True, dt, "nk", norm="rmsnorm"),
    "rms_weight_kn": lambda dt: patterns.gemm_epilogue(24, 40, 48, "none", False, dt, "kn", norm="rmsnorm",
                                                       norm_weight=True),
    "rms_stacked": lambda dt: patterns.gemm_epilogue(24, 40, 48, "none", True, dt, "nk", stack=2, norm="rmsnorm"),
    "rms_gated": lambda dt: gated_gemm(24, 40, 48, "silu", dt, "nk", norm="rmsnorm"),
    "ln_nk": lambda dt: patterns.gemm_epilogue(24, 40, 48, "gelu", True, dt, "nk", norm="layernorm"),
    "issue": lambda dt: _rms_gemm(24, 48, 40, "nk", dtype=dt),
}


@pytest.mark.parametrize("dt", ["float32", "float16"])
@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_norm_gemm_on_llvm_matches_the_reference(name: str, dt: str) -> None:
    g = GRAPHS[name](dt)
    xs = random_inputs(g, seed=0)
    out, ref = build(schedule(g), "llvm")(xs), evaluate(g, xs)
    for o in g.outputs:
        assert_close(out[o], ref[o], dt, reduction_length(g), o)


def test_the_prologue_equals_the_norm_then_the_gemm() -> None:
    """The reference of the fused SMG is the two ops it fuses, in float64."""
    g = patterns.gemm_epilogue(8, 16, 32, "none", False, "float32", "nk", norm="rmsnorm", norm_weight=True)
    xs = random_inputs(g, seed=1)
    a, w, gn = (xs[n].astype(np.float64) for n in ("A", "Bw", "Gn"))
    want = a / np.sqrt((a * a).mean(-1, keepdims=True) + 1e-6) * gn @ w.T
    np.testing.assert_allclose(evaluate(g, xs)["Y"], want, rtol=1e-12, atol=1e-12)


def _gpu_schedule(form: str, m: int, k: int, n: int):
    """The folded form's first pick for this GPU, or a forced form (mma.sync, wgmma's ss form by cp.async),
    or the first pick of the form with the norm's weight kept apart (the Builder's ``rmsnorm(x, g) @ W.T``)."""
    weight = form == "weight_apart"
    g = patterns.gemm_epilogue(m, n, k, "none", False, "float16", "nk", norm="rmsnorm", norm_weight=weight)
    rows = 16 if m < 64 else 64
    if form == "mma_sync":
        return schedule(g, tiles={"m": rows, "n": 128}, tensor_cores=True, step=32, stages=3, recompute=True)
    if form == "wgmma":
        return schedule(g, tiles={"m": 64, "n": 128}, tensor_cores=True, wgmma=True, step=64, stages=3,
                        recompute=True)
    return model_pick(g)[0]


@pytest.mark.cuda
@pytest.mark.parametrize("m, k, n", [(1024, 896, 896), (1024, 896, 4864), (8, 896, 896), (8, 896, 4864)])
@pytest.mark.parametrize("form", ["first", "mma_sync", "wgmma", "weight_apart"])
def test_norm_gemm_matches_float32_torch_on_gpu(m: int, k: int, n: int, form: str, tmp_path) -> None:
    """Qwen2-0.5B's q and gate/up shapes at 1024 tokens and decoding 8: ``rmsnorm(x) * g @ W.T`` through the
    GPU runtime, W [n, k] with g folded in (or kept apart), against float32 torch (smg/tolerance.py)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from spacefusion.runtime.gpu import CudaKernel

    s = _gpu_schedule(form, m, k, n)
    kernel = CudaKernel(build(s, "cuda").save(tmp_path / form))
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, generator=gen, device="cuda").half()
    w = (torch.randn(n, k, generator=gen, device="cuda") / k ** 0.5).half()
    gn = (1 + 0.1 * torch.randn(k, generator=gen, device="cuda")).half()
    h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * gn.float()
    ref = (h @ w.float().t()).double().cpu().numpy()
    ins = {"A": x, "Bw": w, "Gn": gn} if form == "weight_apart" else {"A": x, "Bw": (w.float() * gn.float()).half()}
    out = kernel.launch(ins)["Y"].double().cpu().numpy()
    assert_close(out, ref, "float16", k, name=f"Y ({form}: {'tensor cores' if s.tensor_cores else 'CUDA cores'})")
