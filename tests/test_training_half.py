"""Half-precision training steps (issue 58): every norm of the step fused, forward and backward.

A LLaMA / Qwen2 decoder cast to bf16 or fp16 (``model.to(dtype)``, no autocast): HF's RMSNorm upcasts x to float32
and saves a float32 rsqrt, so each forward norm is ``rmsnorm_stats`` in the model's dtype with ``Rstd`` stored
float32, and each backward the kernels derived from ``rmsnorm`` in that dtype reading it.  BERT under
``torch.autocast(cpu, bf16)``: autocast runs ``layer_norm`` in float32 (its input, the bf16 GEMM's output plus
the float32 residual, is float32), so its norms are the float32 ones, with bf16 GEMMs beside them.

Tolerance, as ``tests/test_bf16.py`` for inference: each step's loss and every gradient within twice eager's own
distance (eager in the same dtype) from a float32 run of the same step from the same weights, or 2^-7 of the
float32 value's largest magnitude (two bf16 ulps there), whichever is larger; and the gradients' distance from
eager's is reported.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_training import _ids, _model  # noqa: E402
from test_training_rmsnorm import _decoder  # noqa: E402

from spacefusion.frontend.dynamo import SpaceFusionBackend  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _loss(model: object, ids: torch.Tensor) -> torch.Tensor:
    """A fixed random projection of the last hidden state (plus BERT's pooled output): ``test_training``'s mean
    of squares after a final norm is nearly scale-invariant, its gradients before the norm nearly 0, which in
    bf16 are rounding noise as large as themselves (eager's own distance from float32 was 100% of q_proj's)."""
    out = model(input_ids=ids)
    h = out.last_hidden_state.float()
    proj = torch.randn(h.shape[1:], generator=torch.Generator().manual_seed(7))
    loss = (h * proj).mean()
    pooled = getattr(out, "pooler_output", None)
    return loss + pooled.float().sum() * 0.1 if pooled is not None else loss


def _grads(model: torch.nn.Module, run: object, step: int, autocast: torch.dtype | None) -> tuple:
    """The float32 loss and every gradient of one step of ``run`` (``model`` or its compiled form), under CPU
    autocast to ``autocast`` if given."""
    model.zero_grad()
    with torch.autocast("cpu", dtype=autocast) if autocast else nullcontext():
        loss = _loss(run, _ids(2, 16, seed=2 + step))
    loss.backward()
    return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}


def _steps(model: torch.nn.Module, run: object, autocast: torch.dtype | None, steps: int = 3) -> list[tuple]:
    """``steps`` SGD steps of ``run``, the compiled ``model``: per step (its loss and gradients, eager's from the
    same weights in the same precision, a float32 run's from those weights upcast, without autocast)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for i in range(steps):
        eager, f32 = copy.deepcopy(model), copy.deepcopy(model).float()
        out.append((_grads(model, run, i, autocast), _grads(eager, eager, i, autocast), _grads(f32, f32, i, None)))
        opt.step()
    return out


def within_half(steps: list[tuple]) -> tuple[float, float]:
    """Assert every step's loss and gradient within the module docstring's tolerance of the float32 run's, given
    eager's (``_steps``' triples); returns (the largest gradient distance from eager's, the largest fraction of
    its tolerance a distance from float32's used: at most 1)."""
    from_eager = used = 0.0
    for (gl, gg), (el, eg), (rl, rg) in steps:
        pairs = [("loss", gl, el, rl), *((n, gg[n], eg[n], rg[n]) for n in rg)]
        for name, g, e, r in pairs:
            err, eager_err = (g - r).abs().max().item(), (e - r).abs().max().item()
            scale = r.abs().max().item()
            tol = max(2 * eager_err, 2.0**-7 * scale)
            assert err <= tol, (name, err, eager_err, scale)
            from_eager = max(from_eager, (g - e).abs().max().item())
            used = max(used, err / tol if tol else 0.0)
    return from_eager, used


def _derived(backend: SpaceFusionBackend, head: str) -> int:
    return sum(line.startswith(head) for g in backend.graphs for line in g.backward.derived)


@pytest.mark.parametrize("name,dtype,target", [("llama", torch.bfloat16, "reference"),
                                               ("qwen2", torch.bfloat16, "llvm"),
                                               ("llama", torch.float16, "llvm")])
def test_half_decoder_training_fuses_every_rmsnorm_forward_and_backward(name: str, dtype: torch.dtype,
                                                                        target: str) -> None:
    """``model.to(dtype)``, three SGD steps: the three RMSNorms each one kernel saving a float32 rsqrt, their three
    backwards each the derived kernels reading it, the gated MLP's SiLU backward the down projection's derived
    epilogue; within bf16's tolerance of float32 training."""
    half = _decoder(name).to(dtype)
    backend = SpaceFusionBackend(target)
    from_eager, rel = within_half(_steps(half, torch.compile(half, backend=backend, dynamic=False), None))
    print(f"gradients: from eager {from_eager:.3g}, tolerance used {rel:.3g}")
    dt = str(dtype).removeprefix("torch.")
    fw = backend.graphs[0].forward
    labels = [s.label for s in fw.partition.subgraphs if "rmsnorm" in s.label]
    assert labels == [f"rmsnorm + float32 rstd saved 32x64 {dt}",
                      f"add + rmsnorm (sum kept) + float32 rstd saved 32x64 {dt}",
                      f"add + rmsnorm (sum kept) + float32 rstd saved 32x64 {dt}"], str(backend)
    assert not fw.partition.left_codes()["norm.saved_stats"], str(backend)
    assert not fw.partition.left_codes()["left.kernel_build"], str(backend)
    assert _derived(backend, f"rmsnorm backward 32x64 {dt}, the forward's saved float32 rsqrt") == 3, str(backend)
    # the gated MLP's SiLU backward: the down projection's input-gradient GEMM writing dG and dU (derived_gated)
    assert _derived(backend, f"gated silu backward as the epilogue of grad @ W 32x128x64 {dt}") == 1, str(backend)


@pytest.mark.parametrize("target", ["reference", "llvm"])
def test_bert_training_under_bf16_autocast_fuses_its_float32_layernorms(target: str) -> None:
    """``torch.autocast("cpu", bf16)``, three SGD steps of float32 BERT: autocast's layer_norm is float32 (the
    GEMMs bf16), so the three LayerNorms are float32 ``layernorm_stats`` and their backwards the derived float32
    kernels; losses and gradients within bf16's tolerance of float32 training without autocast."""
    model = _model("bert")
    backend = SpaceFusionBackend(target)
    from_eager, rel = within_half(_steps(model, torch.compile(model, backend=backend, dynamic=False), torch.bfloat16))
    print(f"gradients: from eager {from_eager:.3g}, tolerance used {rel:.3g}")
    fw = backend.graphs[0].forward
    norms = [s.label for s in fw.partition.subgraphs if s.kind == "norm"]
    assert norms == ["layernorm + mean/rstd saved 32x64 float32"] * 3, str(backend)
    assert not any("native_layer_norm" in op.op for op in fw.partition.left), str(backend)
    assert _derived(backend, "layernorm backward 32x64 float32") == 3, str(backend)
    assert any("bfloat16" in s.label for s in fw.partition.subgraphs), str(backend)  # autocast's bf16 kernels


def test_fp16_bert_training_fuses_its_layernorms_with_fp16_statistics() -> None:
    """``model.to(float16)``, three SGD steps on llvm: torch's CPU ``native_layer_norm`` saves fp16 statistics for
    fp16 weights, so the three LayerNorms are fp16 ``layernorm_stats`` storing them so, and their backwards the
    derived fp16 kernels reading them; its GELU backward the fp16 epilogue of the input-gradient GEMM.  (bf16
    BERT without autocast is not asserted so: its query weight's gradient, 1e-4 of the others', is bf16 rounding
    noise from the attention backward, eager's included, the same before the norms were fused.)"""
    model = _model("bert").to(torch.float16)
    backend = SpaceFusionBackend("llvm")
    from_eager, used = within_half(_steps(model, torch.compile(model, backend=backend, dynamic=False), None))
    print(f"gradients: from eager {from_eager:.3g}, tolerance used {used:.3g}")
    fw = backend.graphs[0].forward
    assert [s.label for s in fw.partition.subgraphs if s.kind == "norm"] == \
        ["layernorm + mean/rstd saved 32x64 float16"] * 3, str(backend)
    assert _derived(backend, "layernorm backward 32x64 float16, the forward's saved mean and rstd") == 3, \
        str(backend)
    assert _derived(backend, "gelu backward as the epilogue of grad @ W") == 1, str(backend)  # fp16 too
    assert any(line.endswith("float16: 1 kernel (dZ)") for g in backend.graphs for line in g.backward.derived)


@pytest.mark.parametrize("dtype,stats", [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                                         (torch.float16, torch.float32)])
def test_half_layernorm_backward_is_derived_reading_its_statistics_dtype(dtype: torch.dtype,
                                                                          stats: torch.dtype) -> None:
    """``native_layer_norm_backward`` of fp16/bf16 grad, input and weights with statistics in float32 (torch's
    CUDA op saves them so) or in the input's dtype (its CPU op): one derived call (llvm), dX, dW and dB in the
    input's dtype, each within two roundings of that dtype (2^-7 bf16, 2^-10 fp16, relative to the float64
    gradient's largest element) of the float64 gradients of the same rounded values."""
    from test_training_norm_backward import _backward_graph, _inputs

    from spacefusion.frontend.backends import get_backend
    from spacefusion.frontend.derived_norms import derive_norm_backwards

    vals = {k: v.to(stats if k in ("mean", "rstd") else dtype) for k, v in _inputs((2, 12), 48, 4).items()}
    want = {k: v.double().requires_grad_(k in ("x", "w", "b")) for k, v in vals.items()}
    out = torch.nn.functional.layer_norm(want["x"], [48], want["w"], want["b"], 1e-5)
    dx, dw, db = torch.autograd.grad(out, (want["x"], want["w"], want["b"]), want["g"])
    gm = _backward_graph(48, [True, True, True], dict(vals))
    (line,) = derive_norm_backwards(gm, get_backend("llvm"), {})
    word = "float32 " if stats is torch.float32 else ""
    assert line.startswith(f"layernorm backward 24x48 {str(dtype)[6:]}, the forward's saved {word}mean"), line
    got = gm(vals["g"], vals["x"], vals["mean"], vals["rstd"])
    eps = 2.0**-7 if dtype is torch.bfloat16 else 2.0**-10
    for name, t, w in zip(("dX", "dW", "dB"), got, (dx, dw, db), strict=True):
        assert t.dtype == dtype and t.shape == w.shape, (name, t.dtype, t.shape)
        err = (t.double() - w).abs().max().item() / w.abs().max().item()
        assert err < 2 * eps, (name, err)


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_half_norm_kernels_lower_to_cuda(norm: str, tmp_path) -> None:
    """The bf16 statistics-saving forward (float32 statistics stored, as torch's CUDA kernels and HF's upcast save
    them) and the bf16 derived backward passes reading float32 statistics lower for sm_90a; nvcc builds their
    cubins where it exists (compile only: no GPU here)."""
    import shutil

    from schedulers.passes import backward_passes
    from smg import patterns
    from smg.autodiff import derive_backward
    from spacefusion.api import build, schedule
    from spacefusion.frontend.derived_norms import half_derivation

    stats = {"layernorm": ("Y_mean", "Y_rstd"), "rmsnorm": ("Y_rstd",)}[norm]
    fwd = half_derivation(getattr(patterns, norm)(256, 768, "bfloat16"), dict.fromkeys(stats, "float32"))
    saving = (patterns.layernorm_stats(256, 768, "bfloat16", stats_dtype="float32") if norm == "layernorm" else
              patterns.rmsnorm_stats(256, 768, "bfloat16", residual=True, keep_sum=True, stats_dtype="float32"))
    graphs = [("forward", saving), *((p.name, p.smg) for p in backward_passes(derive_backward(fwd)))]
    assert all(fwd.space(s).dtype == "float32" for s in stats)
    for name, smg in graphs:
        art = build(schedule(smg), "cuda:sm_90a")
        assert "__global__" in art.source and "float" in art.source, name
        if shutil.which("nvcc"):
            assert (art.save(tmp_path / name, cache=None) / "kernel.cubin").stat().st_size > 0, name
