"""A training step's GELU/SiLU backward after the input-gradient GEMM of the next linear (issue 58, item 1):
``gelu_backward(mm(grad, W).view(...), Z)`` as the one kernel derived from ``patterns.act_gemm`` (the GEMM with
``act'(Z)`` as its epilogue, ``derived_epilogues``); checked on its own against float64 autograd and in
training steps against eager.  What stays torch's says why, with a code."""

from __future__ import annotations

import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schedulers.passes import backward_passes
from smg import patterns
from smg.autodiff import derive_backward
from spacefusion.frontend.backends import get_backend
from spacefusion.frontend.derived_epilogues import derive_act_backwards
from spacefusion.frontend.refusals import DERIVED, META

aten = torch.ops.aten
FAST = settings(max_examples=4, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
#: (the ATen op, its approximate argument, the SMG's activation, float64 torch of it)
ACTS = {"gelu": (aten.gelu_backward.default, "none", lambda z: torch.nn.functional.gelu(z)),
        "gelu_tanh": (aten.gelu_backward.default, "tanh", lambda z: torch.nn.functional.gelu(z, approximate="tanh")),
        "silu": (aten.silu_backward.default, None, torch.nn.functional.silu)}


def weight_gemm_graph(w: torch.Tensor, vals: dict[str, torch.Tensor], view: tuple[int, ...]
                      ) -> tuple[torch.nn.Module, torch.fx.Graph, dict[str, torch.fx.Node], torch.fx.Node]:
    """A backward graph's start as aot writes it: placeholders for ``vals`` (``meta["val"]`` set), a parameter
    ``w`` and ``mm(g, w).view(view)``, the next linear's input gradient; (root, graph, placeholders, the view)."""
    root = torch.nn.Module()
    root.register_parameter("w", torch.nn.Parameter(w))
    g = torch.fx.Graph()
    ph = {}
    for name, v in vals.items():
        ph[name] = g.placeholder(name)
        ph[name].meta["val"] = v
    mm = g.call_function(aten.mm.default, (ph["g"], g.get_attr("w")))
    mm.meta["val"] = vals["g"] @ w
    grad = g.call_method("view", (mm, list(view)))
    grad.meta["val"] = mm.meta["val"].view(view)
    return root, g, ph, grad


def _graph(act: str, w: torch.Tensor, vals: dict[str, torch.Tensor], view: tuple[int, ...]) -> torch.fx.GraphModule:
    """``act_backward(mm(g, W).view(view), z)`` on placeholders (``meta["val"]`` from ``vals``) and a weight."""
    op, approximate, _ = ACTS[act]
    root, g, ph, grad = weight_gemm_graph(w, vals, view)
    out = g.call_function(op, (grad, ph["z"]), {"approximate": approximate} if approximate else {})
    out.meta["val"] = grad.meta["val"]
    g.output((out,))
    return torch.fx.GraphModule(root, g)


@pytest.mark.parametrize("target", ["reference", "llvm"])
@FAST
@given(act=st.sampled_from(sorted(ACTS)), b=st.integers(1, 3), s=st.integers(1, 9), n=st.integers(1, 24),
       k=st.integers(1, 40))
def test_act_backward_after_a_gemm_against_float64(target: str, act: str, b: int, s: int, n: int, k: int) -> None:
    """mm, view and the activation backward replaced by one derived call; dZ within 5e-6 of float64 autograd
    of ``act(z) @ W.T`` relative to its largest element, in z's shape."""
    gen = torch.Generator().manual_seed(b * 1000 + s * 100 + n * 10 + k)
    w, g, z = torch.randn(n, k, generator=gen), torch.randn(b * s, n, generator=gen), 2 * torch.randn(b, s, k,
                                                                                                      generator=gen)
    gm = _graph(act, w.clone(), {"g": g, "z": z}, (b, s, k))
    lines = derive_act_backwards(gm, get_backend(target), {})
    assert lines == [f"{act} backward as the epilogue of grad @ W {b * s}x{k}x{n} float32: 1 kernel (dZ)"], lines
    calls = [nd for nd in gm.graph.nodes if nd.op.startswith("call")]
    assert len(calls) == 1 and calls[0].meta.get(DERIVED), gm.graph  # the mm and its view gone with it
    (got,) = gm(g, z)
    z64 = z.double().requires_grad_()
    (ACTS[act][2](z64) @ w.double().T).backward(g.double().view(b, s, n))
    want = z64.grad
    assert got.shape == z.shape and got.is_contiguous()
    assert ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item() < 5e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", ["gelu", "silu"])
def test_a_half_precision_form_is_derived_in_its_dtype(act: str, dtype: torch.dtype) -> None:
    """fp16/bf16 grad, W and Z: one derived call in that dtype (float32 inside, dZ rounded once), within two
    roundings of float64 autograd of the same half inputs (torch's own half op: computed in float32 too)."""
    gen = torch.Generator().manual_seed(7)
    w, g, z = (torch.randn(24, 40, generator=gen).to(dtype), torch.randn(18, 24, generator=gen).to(dtype),
               (2 * torch.randn(3, 6, 40, generator=gen)).to(dtype))
    gm = _graph(act, w.clone(), {"g": g, "z": z}, (3, 6, 40))
    name = str(dtype).removeprefix("torch.")
    assert derive_act_backwards(gm, get_backend("llvm"), {}) == [
        f"{act} backward as the epilogue of grad @ W 18x40x24 {name}: 1 kernel (dZ)"]
    (got,) = gm(g, z)
    z64 = z.double().requires_grad_()
    (ACTS[act][2](z64) @ w.double().T).backward(g.double().view(3, 6, 24))
    want, eps = z64.grad, torch.finfo(dtype).eps
    assert got.dtype == dtype and got.shape == z.shape
    assert ((got.double() - want).abs() <= 2 * eps * want.abs() + 1e-3 * want.abs().max()).all()
    torch_own = ACTS[act][0]((g @ w).view(3, 6, 40), z, **({"approximate": "none"} if act == "gelu" else {}))
    assert (got.double() - want).abs().max() <= 2 * (torch_own.double() - want).abs().max() + eps


def test_a_mixed_dtype_form_stays_torch_s_with_a_code() -> None:
    w, g, z = torch.randn(8, 16).half(), torch.randn(6, 8).half(), torch.randn(6, 16).float()
    gm = _graph("gelu", w, {"g": g, "z": z}, (6, 16))
    assert derive_act_backwards(gm, get_backend("reference"), {}) == []
    (node,) = [nd for nd in gm.graph.nodes if nd.target is aten.gelu_backward.default]
    assert node.meta[META].code == "left.act_epilogue" and "one dtype" in node.meta[META].sentence, node.meta[META]


def _mlp(act: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(2)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), act, torch.nn.Linear(64, 32), torch.nn.LayerNorm(32))


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("act,target", [(torch.nn.GELU(approximate="tanh"), "reference"),
                                        (torch.nn.SiLU(), "llvm")])
def test_an_mlp_s_activation_backward_is_the_gemm_s_epilogue(act: torch.nn.Module, target: str) -> None:
    """``LayerNorm(fc2(act(fc1(x))))``, three SGD steps: every parameter within rtol 1e-5 / atol 1e-6 of eager's;
    the activation's backward is the epilogue of fc2's input gradient, the norm's backward derived too."""
    from test_training import train_beside_eager

    model = _mlp(act)
    backend = train_beside_eager(model, target)
    bw = backend.graphs[0].backward
    name = "gelu_tanh" if isinstance(act, torch.nn.GELU) else "silu"
    assert bw.derived == ["layernorm backward 32x32 float32, the forward's saved mean and rstd read: 2 kernels "
                          "(dX, dW_dB)", f"{name} backward as the epilogue of grad @ W 32x64x32 float32: 1 kernel "
                          "(dZ)"], str(backend)
    assert not bw.partition.left_codes()["left.backward_op"], str(backend)


def test_the_epilogue_kernel_lowers_to_cuda(tmp_path) -> None:
    """The derived dZ pass (a GEMM over the linear's outputs, GELU' after the loop) lowers for sm_90a; nvcc
    builds its cubin where it exists (compile only: no GPU here); its printout shows the derivation."""
    from spacefusion.api import build, schedule

    (p,) = backward_passes(derive_backward(patterns.act_gemm(256, 768, 3072, "gelu"), wrt=("Z",)))
    assert "backward derivation (smg.autodiff):" in str(schedule(p.smg)) and "dA[m, k] = sum_n Bw*dY" in str(
        schedule(p.smg))
    art = build(schedule(p.smg), "cuda:sm_90a")
    assert "__global__" in art.source
    if shutil.which("nvcc"):
        assert (art.save(tmp_path / "act_gemm", cache=None) / "kernel.cubin").stat().st_size > 0


def test_the_silu_epilogue_is_finite_where_exp_overflows() -> None:
    """Z of -100 and -90 (``exp(-Z)`` overflows float32): dZ on llvm is finite and within 5e-6 of float64 autograd
    relative to its largest element (sympy's ``Z*exp(-Z)/(1 + exp(-Z))**2`` was ``-inf/inf``: NaN there; the
    derivation's bodies take it as ``rewrite.bounded_logistic`` writes it)."""
    w, g = torch.randn(6, 5, generator=torch.Generator().manual_seed(3)), torch.ones(4, 6)
    z = torch.tensor([[-100.0, -90.0, -30.0, 0.5, 100.0]]).repeat(4, 1)
    gm = _graph("silu", w.clone(), {"g": g, "z": z}, (4, 5))
    assert len(derive_act_backwards(gm, get_backend("llvm"), {})) == 1
    (got,) = gm(g, z)
    z64 = z.double().requires_grad_()
    (torch.nn.functional.silu(z64) @ w.double().T).backward(g.double())
    assert torch.isfinite(got).all(), got
    assert ((got.double() - z64.grad).abs().max() / z64.grad.abs().max()).item() < 5e-6
