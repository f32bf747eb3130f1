"""A training step's gated-MLP SiLU backward (LLaMA's, Qwen2's ``down(silu(gate(x)) * up(x))``) after the down
projection's input-gradient GEMM: ``mm(grad, W)``, ``dH * silu(G)``, ``silu_backward(dH * U, G)`` as the one
kernel derived from ``patterns.gated_act_gemm`` (the GEMM writing dG and dU from its epilogue,
``derived_gated``); checked on its own against float64 autograd and in training steps against eager."""

from __future__ import annotations

import operator
import shutil

import pytest
import torch

from schedulers.passes import backward_passes
from smg import patterns
from smg.autodiff import derive_backward
from spacefusion.frontend.backends import get_backend
from spacefusion.frontend.derived_gated import derive_gated_backwards
from spacefusion.frontend.refusals import DERIVED, META

transformers = pytest.importorskip("transformers")

aten = torch.ops.aten
#: seeded odd sizes (b, s, n, k): rows b * s, the down projection's n outputs from k intermediate features
SIZES = [(1, 1, 1, 1), (1, 3, 5, 7), (2, 5, 9, 13), (3, 7, 24, 40), (2, 9, 17, 33)]


def _graph(w: torch.Tensor, vals: dict[str, torch.Tensor], view: tuple[int, ...], silu_of_gate: bool = True,
           swap: bool = False, late_up: bool = False) -> torch.fx.GraphModule:
    """aot's gated backward on placeholders (``meta["val"]`` from ``vals``) and a weight: ``dh = mm(g, W).view``,
    ``du = dh * silu(gate)`` (``silu_of_gate`` False: ``dh * up``, not that form), ``dg = silu_backward(dh * up,
    gate)``; ``swap`` puts the multiplies' operands the other way round; ``late_up`` reads ``-up`` computed after
    ``du`` (no view the derivation may move)."""
    from test_training_act_epilogue import weight_gemm_graph

    root, g, ph, dh = weight_gemm_graph(w, vals, view)

    def mul(a: torch.fx.Node, b: torch.fx.Node) -> torch.fx.Node:
        out = g.call_function(operator.mul, (b, a) if swap else (a, b))
        out.meta["val"] = a.meta["val"] * b.meta["val"]
        return out

    act = g.call_function(torch.nn.functional.silu, (ph["gate"] if silu_of_gate else ph["up"],))
    act.meta["val"] = torch.nn.functional.silu(vals["gate"])
    du = mul(dh, act)
    up = ph["up"]
    if late_up:
        up = g.call_function(torch.neg, (up,))
        up.meta["val"] = -vals["up"]
    dg = g.call_function(aten.silu_backward.default, (mul(dh, up), ph["gate"]))
    dg.meta["val"] = vals["gate"].clone()
    g.output((dg, du))
    return torch.fx.GraphModule(root, g)


def _inputs(b: int, s: int, n: int, k: int, dtype: torch.dtype = torch.float32) -> tuple:
    gen = torch.Generator().manual_seed(b * 1000 + s * 100 + n * 10 + k)
    w, g = torch.randn(n, k, generator=gen), torch.randn(b * s, n, generator=gen)
    gate, up = 3 * torch.randn(b, s, k, generator=gen), torch.randn(b, s, k, generator=gen)
    gate.view(-1)[:3] = torch.tensor([-100.0, -90.0, 100.0])[: gate.numel()]  # exp(-G) overflows in float32
    return tuple(t.to(dtype) for t in (w, g, gate, up))


def _float64(w: torch.Tensor, g: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple:
    g64, u64 = gate.double().requires_grad_(), up.double().requires_grad_()
    ((torch.nn.functional.silu(g64) * u64) @ w.double().T).backward(g.double().view(*gate.shape[:-1], -1))
    return g64.grad, u64.grad


@pytest.mark.parametrize("target", ["reference", "llvm"])
@pytest.mark.parametrize("b,s,n,k", SIZES)
def test_gated_backward_after_a_gemm_against_float64(target: str, b: int, s: int, n: int, k: int) -> None:
    """mm, view, both multiplies, silu and silu_backward replaced by one derived call of one kernel; dG and dU
    within 5e-6 of float64 autograd of ``(silu(G) * U) @ W.T`` relative to their largest elements (finite where
    ``exp(-G)`` overflows: G = -100, -90), in G's and U's shapes."""
    w, g, gate, up = _inputs(b, s, n, k)
    gm = _graph(w.clone(), {"g": g, "gate": gate, "up": up}, (b, s, k), swap=(b + k) % 2 == 1)
    lines = derive_gated_backwards(gm, get_backend(target), {})
    assert lines == [f"gated silu backward as the epilogue of grad @ W {b * s}x{k}x{n} float32: 1 kernel (dG_dU)"]
    calls = [nd for nd in gm.graph.nodes if nd.op.startswith("call")]
    assert [nd.op for nd in calls] == ["call_module", "call_function", "call_function"], gm.graph  # + 2 getitems
    assert all(nd.meta.get(DERIVED) for nd in calls), gm.graph
    dg, du = gm(g, gate, up)
    for got, want in zip((dg, du), _float64(w, g, gate, up), strict=True):
        assert got.shape == want.shape and got.is_contiguous() and torch.isfinite(got).all()
        assert ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item() < 5e-6


@pytest.mark.parametrize("dtype,eps", [(torch.bfloat16, 2.0**-7), (torch.float16, 2.0**-10)])
def test_half_gated_backward_within_two_roundings(dtype: torch.dtype, eps: float) -> None:
    """fp16 / bf16 grad, weight, G and U: dG and dU in that dtype, within two roundings of it (relative to the
    float64 gradient's largest element) of the float64 gradients of the same rounded values (llvm)."""
    w, g, gate, up = _inputs(2, 5, 24, 40, dtype)
    gm = _graph(w.clone(), {"g": g, "gate": gate, "up": up}, (2, 5, 40))
    (line,) = derive_gated_backwards(gm, get_backend("llvm"), {})
    assert f"{str(dtype)[6:]}: 1 kernel (dG_dU)" in line, line
    for got, want in zip(gm(g, gate, up), _float64(w, g, gate, up), strict=True):
        assert got.dtype == dtype
        assert ((got.double() - want).abs().max() / want.abs().max()).item() < 2 * eps


def test_another_reader_of_dh_stays_torch_s_with_a_code() -> None:
    """``dh * U`` for both products (not ``dh * silu(G)``): the gated form's other gradient is not SiLU's, so
    nothing is replaced and ``silu_backward`` says why, as ``left.act_epilogue``."""
    w, g, gate, up = _inputs(1, 3, 5, 7)
    gm = _graph(w, {"g": g, "gate": gate, "up": up}, (1, 3, 7), silu_of_gate=False)
    assert derive_gated_backwards(gm, get_backend("reference"), {}) == []
    (node,) = [nd for nd in gm.graph.nodes if nd.target is aten.silu_backward.default]
    assert node.meta[META].code == "left.act_epilogue" and "silu(G)" in node.meta[META].sentence, node.meta[META]


def test_a_g_or_u_computed_after_the_gradients_stays_torch_s_with_a_code() -> None:
    """U computed (not viewed) after the multiply that reads silu(G): the call cannot precede both gradients
    without moving that computation, so nothing is replaced and ``silu_backward`` says why."""
    w, g, gate, up = _inputs(1, 3, 5, 7)
    gm = _graph(w, {"g": g, "gate": gate, "up": up}, (1, 3, 7), late_up=True)
    assert derive_gated_backwards(gm, get_backend("reference"), {}) == []
    (node,) = [nd for nd in gm.graph.nodes if nd.target is aten.silu_backward.default]
    assert node.meta[META].code == "left.act_epilogue" and "computed after" in node.meta[META].sentence
    assert not any(nd.op == "call_module" for nd in gm.graph.nodes), gm.graph


class _Decoder(torch.nn.Module):
    """One LLaMA or Qwen2 decoder layer (hidden 32, 4 query heads over 2 KV heads, intermediate 64), read from
    ``inputs_embeds``: ``train_beside_eager``'s [4, 8, 32] input."""

    def __init__(self, name: str) -> None:
        super().__init__()
        torch.manual_seed(3)
        sizes = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=64, vocab_size=16)
        cfg = (transformers.LlamaConfig if name == "llama" else transformers.Qwen2Config)(**sizes)
        self.model = (transformers.LlamaModel if name == "llama" else transformers.Qwen2Model)(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(inputs_embeds=x).last_hidden_state


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.mark.parametrize("name,target", [("llama", "llvm"), ("qwen2", "reference")])
def test_a_decoder_s_gated_silu_backward_is_the_down_projection_s_epilogue(name: str, target: str) -> None:
    """Three SGD steps beside eager: every parameter within rtol 1e-5 / atol 1e-6; the gated MLP's backward is one
    derived kernel, no silu_backward, silu or multiply of it left to torch."""
    from test_training import train_beside_eager

    backend = train_beside_eager(_Decoder(name), target)
    bw = backend.graphs[0].backward
    assert [line for line in bw.derived if line.startswith("gated")] == [
        "gated silu backward as the epilogue of grad @ W 32x64x32 float32: 1 kernel (dG_dU)"], str(backend)
    assert not any("silu" in op.op for op in bw.partition.left), str(backend)
    assert not bw.partition.left_codes()["left.act_epilogue"], str(backend)


class _GeGLU(torch.nn.Module):
    """``down(gelu(gate(x)) * up(x))`` then a LayerNorm: GeGLU's MLP (T5 v1.1's; Gemma's with the tanh GELU)."""

    def __init__(self, approximate: str) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.gate, self.up = torch.nn.Linear(32, 64, bias=False), torch.nn.Linear(32, 64, bias=False)
        self.down, self.norm = torch.nn.Linear(64, 32, bias=False), torch.nn.LayerNorm(32)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.down(torch.nn.functional.gelu(self.gate(x), approximate=self.approximate)
                                   * self.up(x)))


@pytest.mark.parametrize("approximate,target", [("tanh", "llvm"), ("none", "reference")])
def test_a_geglu_mlp_s_gated_gelu_backward_is_the_down_projection_s_epilogue(approximate: str, target: str) -> None:
    """The same derivation with GELU for SiLU (``gelu_backward(dH * U, G)`` and ``dH * gelu(G)``, the GELU's
    ``approximate`` kept): three SGD steps beside eager within rtol 1e-5 / atol 1e-6, one derived kernel, no
    gelu_backward or gelu left to torch."""
    from test_training import train_beside_eager

    backend = train_beside_eager(_GeGLU(approximate), target)
    bw = backend.graphs[0].backward
    act = "gelu_tanh" if approximate == "tanh" else "gelu"
    assert [line for line in bw.derived if line.startswith("gated")] == [
        f"gated {act} backward as the epilogue of grad @ W 32x64x32 float32: 1 kernel (dG_dU)"], str(backend)
    assert not any("gelu" in op.op for op in bw.partition.left), str(backend)


def test_the_gated_epilogue_kernel_lowers_to_cuda(tmp_path) -> None:
    """The derived dG_dU pass (a GEMM over the down projection's outputs, both gradients after the loop) lowers
    for sm_90a; nvcc builds its cubin where it exists (compile only: no GPU here); its printout shows the
    derivation."""
    from spacefusion.api import build, schedule

    (p,) = backward_passes(derive_backward(patterns.gated_act_gemm(256, 768, 2048), wrt=("G", "U")))
    text = str(schedule(p.smg))
    assert "dH[m, k] = sum_n Bw*dY" in text and "finalize: dG" in text and "finalize: dU" in text, text
    art = build(schedule(p.smg), "cuda:sm_90a")
    assert "__global__" in art.source
    if shutil.which("nvcc"):
        assert (art.save(tmp_path / "gated_act_gemm", cache=None) / "kernel.cubin").stat().st_size > 0


@pytest.mark.cuda
def test_gated_backward_kernel_on_the_gpu_against_float64(tmp_path) -> None:
    """The derived dG_dU pass built for the GPU and launched by the runtime (``CudaKernel``) on CUDA tensors: dG
    and dU within 1e-5 of float64 autograd relative to their largest elements."""
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    from spacefusion.api import build, schedule
    from spacefusion.runtime.gpu import CudaKernel

    b, s, n, k = 4, 64, 256, 512
    w, g, gate, up = _inputs(b, s, n, k)
    bw = derive_backward(patterns.gated_act_gemm(b * s, n, k), wrt=("G", "U"))
    (p,) = backward_passes(bw)
    env = {"Bw": w, dict(bw.seeds)["Y"]: g, "G": gate.reshape(b * s, k), "U": up.reshape(b * s, k)}
    kernel = CudaKernel(build(schedule(p.smg), "cuda").save(tmp_path / p.name))
    out = kernel(**{name: env[name].cuda().contiguous() for name in p.smg.inputs})
    for name, want in zip(("dG", "dU"), _float64(w, g, gate, up), strict=True):
        got = out[name].double().cpu().reshape(want.shape)
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5, name
