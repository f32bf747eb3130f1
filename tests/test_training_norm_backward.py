"""A training step's norm backwards derived from the SMG (issue 58, item 1): torch's ``native_layer_norm_backward``
as the kernels ``smg.autodiff`` derives from the LayerNorm SMG (``derived_norms``: dX, then dW and dB), reading
the mean and rstd the fused forward saved, and the RMSNorm backward aot writes as primitives as those derived from
the RMSNorm SMG (``derived_rmsnorm``: dX, then dW), reading the saved rsqrt; checked on its own against float64
autograd and in tiny BERT and LLaMA steps against eager.  What stays torch's says why, with a code."""

from __future__ import annotations

import copy
import operator
import shutil

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schedulers.passes import backward_passes
from smg import patterns
from smg.autodiff import derive_backward
from spacefusion.frontend.backends import get_backend
from spacefusion.frontend.derived_norms import LAYER_NORM_BACKWARD, derive_norm_backwards
from spacefusion.frontend.refusals import DERIVED, META
from tests.backward_helpers import layernorm_grads, rel_err

FAST = settings(max_examples=4, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
TOL = 5e-5  # float32 kernels against float64, relative to the gradient's largest element (``test_backward_norms``)


def _backward_graph(n: int, mask: list[bool], vals: dict[str, torch.Tensor]) -> torch.fx.GraphModule:
    """``native_layer_norm_backward(g, x, [n], mean, rstd, W, B, mask)`` on placeholders (``meta["val"]`` from
    ``vals``, as aot_autograd's graphs carry) and two parameters, its asked-for gradients returned."""
    root = torch.nn.Module()
    root.register_parameter("w", torch.nn.Parameter(vals.pop("w")))
    root.register_parameter("b", torch.nn.Parameter(vals.pop("b")))
    g = torch.fx.Graph()
    ph = {}
    for name, v in vals.items():
        ph[name] = g.placeholder(name)
        ph[name].meta["val"] = v
    w, b = g.get_attr("w"), g.get_attr("b")
    bw = g.call_function(LAYER_NORM_BACKWARD, (ph["g"], ph["x"], [n], ph["mean"], ph["rstd"], w, b, mask))
    g.output(tuple(g.call_function(operator.getitem, (bw, i)) for i in range(3) if mask[i]))
    return torch.fx.GraphModule(root, g)


def _inputs(rows: tuple[int, ...], n: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = 3 + 2 * torch.randn(*rows, n, generator=gen)
    w, b = 1 + 0.3 * torch.randn(n, generator=gen), 0.1 * torch.randn(n, generator=gen)
    _, mean, rstd = torch.native_layer_norm(x, [n], w, b, 1e-5)  # what the fused forward saves (float32 [..., 1])
    return {"g": torch.randn(*rows, n, generator=gen), "x": x, "mean": mean, "rstd": rstd, "w": w, "b": b}


@pytest.mark.parametrize("target", ["reference", "llvm"])
@FAST
@given(rows=st.sampled_from([(3,), (2, 5), (1, 7)]), n=st.integers(2, 48),
       mask=st.sampled_from([[True, True, True], [False, True, True], [True, False, False], [True, True, False]]))
def test_layernorm_backward_matcher_against_float64(target: str, rows: tuple[int, ...], n: int,
                                                    mask: list[bool]) -> None:
    """The op replaced by one derived call (its getitems with it: nothing left to torch), gradients within
    ``TOL`` of float64 autograd (dX relative to the size of the terms that cancel into it), only those
    ``output_mask`` asks for, dX in x's shape."""
    vals = _inputs(rows, n, n * 10 + len(rows))
    x, w, b, g = (vals[k].clone() for k in ("x", "w", "b", "g"))
    gm = _backward_graph(n, mask, dict(vals))
    lines = derive_norm_backwards(gm, get_backend(target), {})
    assert len(lines) == 1 and f"layernorm backward {int(np.prod(rows))}x{n} float32" in lines[0], lines
    calls = [nd for nd in gm.graph.nodes if nd.op.startswith("call")]
    assert not any(nd.target is LAYER_NORM_BACKWARD for nd in calls) and all(nd.meta.get(DERIVED) for nd in calls)
    got = gm(vals["g"], vals["x"], vals["mean"], vals["rstd"])
    flat = (x.reshape(-1, n).numpy(), w.numpy(), b.numpy(), g.reshape(-1, n).numpy())
    want = layernorm_grads(*flat[:3], flat[3], 1e-5)
    names = [name for name, m in zip(("dX", "dW", "dB"), mask) if m]
    assert len(got) == len(names)
    for name, t in zip(names, got):
        assert t.shape == (x.shape if name == "dX" else (n,)), (name, t.shape)
        err = rel_err(t.reshape(want[name].shape).numpy(), want[name], want["scale"] if name == "dX" else 0.0)
        assert err < TOL, (name, err)


@pytest.mark.parametrize("dtype,normalized", [(torch.float16, 1), (torch.float32, 2)])
def test_forms_the_derived_kernels_do_not_take_stay_torch_s_with_a_code(dtype: torch.dtype, normalized: int) -> None:
    """fp16 grad and input with float32 weights (mixed dtypes: no one SMG dtype; fp16 through is derived,
    ``test_training_half``) and a norm over two dims: ``left.norm_backward``, the op and its getitems kept,
    nothing derived."""
    shape = (4, 6, 8)
    vals = {k: v if k in ("w", "b") else v.to(dtype) for k, v in _inputs(shape[:1], 48, 3).items()}
    if normalized == 2:
        vals = _inputs(shape[:1], 48, 3)
        vals |= {k: vals[k].reshape(shape) for k in ("g", "x")}
    gm = _backward_graph(48, [True, True, True], vals)
    node = next(nd for nd in gm.graph.nodes if nd.target is LAYER_NORM_BACKWARD)
    if normalized == 2:
        node.args = (node.args[0], node.args[1], [6, 8], *node.args[3:])
    assert derive_norm_backwards(gm, get_backend("reference"), {}) == []
    assert node.meta[META].code == "left.norm_backward", node.meta[META]
    assert all(u.meta[META].code == "left.norm_backward" for u in node.users)


def _train_pair(name: str, target: str):
    from test_training import _compare, _model, _train

    from spacefusion.frontend.dynamo import SpaceFusionBackend

    model = _model(name)
    eager = copy.deepcopy(model)
    backend = SpaceFusionBackend(target)
    got = _train(model, torch.compile(model, backend=backend, dynamic=False))
    return backend, _compare(got, _train(eager, eager), rtol=1e-5, atol=1e-6)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("target", ["reference", "llvm"])
def test_bert_s_layernorm_backwards_are_derived(target: str) -> None:
    """Tiny BERT, three SGD steps: losses and every parameter's gradient within rtol 1e-5 / atol 1e-6 of eager;
    the backward's three LayerNorm backwards are each the two derived kernels (dX; dW and dB), none left, and
    the intermediate GELU's backward the epilogue of the output linear's input gradient (``derived_epilogues``)."""
    pytest.importorskip("transformers")
    backend, worst = _train_pair("bert", target)
    assert worst < 1e-6, worst
    bw = backend.graphs[0].backward
    norms = [line for line in bw.derived if line.startswith("layernorm backward")]
    assert norms == ["layernorm backward 32x64 float32, the forward's saved mean and rstd read: "
                     "2 kernels (dX, dW_dB)"] * 3, str(backend)
    assert not any("native_layer_norm_backward" in op.op for op in bw.partition.left), str(backend)
    assert "attention backward" in bw.derived[0], str(backend)
    assert [line for line in bw.derived if "epilogue" in line] == [
        "gelu backward as the epilogue of grad @ W 32x128x64 float32: 1 kernel (dZ)"], str(backend)
    assert not any(op.op.endswith("gelu_backward.default") for op in bw.partition.left), str(backend)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("target", ["reference", "llvm"])
def test_llama_s_rmsnorm_backwards_are_derived(target: str) -> None:
    """Tiny LLaMA, three SGD steps within rtol 1e-5 / atol 1e-6 of eager.  Its RMSNorm backwards are aot's
    primitives reading the saved rsqrt (``derived_rmsnorm``): all three read as such and replaced by the two
    derived kernels (dX; dW), the residual stream's gradient added to dX; none of their primitives left."""
    pytest.importorskip("transformers")
    backend, worst = _train_pair("llama", target)
    assert worst < 1e-6, worst
    bw = backend.graphs[0].backward
    norms = [line for line in bw.derived if "norm backward" in line]
    assert norms == ["rmsnorm backward 32x64 float32, the forward's saved rsqrt read: 2 kernels (dX, dW)"] * 3, \
        str(backend)
    assert not any(op.op.startswith(("torch.pow", "torch.detach", "torch.sum")) for op in bw.partition.left), \
        str(backend)


class _WrittenRms(torch.nn.Module):
    """``x * rsqrt(mean(x * x) + eps) * w``: an RMSNorm written with ``x * x``, whose backward aot writes in
    another form than ``pow``'s (two products, no ``pow(x, 1.0) * 2.0``)."""

    def __init__(self, n: int = 32) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(n, n)
        self.w = torch.nn.Parameter(1 + 0.1 * torch.randn(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h * torch.rsqrt((h * h).mean(-1, keepdim=True) + 1e-6) * self.w


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("form", ["pow", "frozen", "written"])
def test_an_rmsnorm_backward_in_another_form_stays_torch_s(form: str) -> None:
    """``F.rms_norm`` twice (the second on a residual sum; ``test_training_rmsnorm._Norms``): both backwards
    derived, the first's dW read beside the forward's recomputed x * rsqrt; the first's weight frozen, its
    backward is the dX pass alone (no dW in the graph).  Written with ``x * x``: not aot's
    ``pow`` form, nothing matched, torch's primitives run.  Gradients within 1e-6 of eager's relative to their
    largest element either way (as ``test_training_rmsnorm``: the GEMMs' float32 rounding alone is 1.3e-6 absolute
    here, unfused norms too)."""
    pytest.importorskip("transformers")
    from test_training_rmsnorm import _Norms

    from spacefusion.frontend.dynamo import SpaceFusionBackend

    torch.manual_seed(0)
    written = form == "written"
    model = _WrittenRms() if written else _Norms()
    if form == "frozen":
        model.w1.requires_grad_(False)
    eager = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    x, r = torch.randn(2, 8, 32, generator=gen), torch.randn(2, 8, 32, generator=gen)
    backend = SpaceFusionBackend("reference")
    (torch.compile(model, backend=backend, dynamic=False)(x) * r).sum().backward()
    (eager(x) * r).sum().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):  # gradients of order 10
        assert (p.grad is None) == (q.grad is None) == (form == "frozen" and name == "w1"), name
        assert p.grad is None or ((p.grad - q.grad).abs().max() / q.grad.abs().max()).item() < 1e-6, name
    head = "rmsnorm backward 16x32 float32, the forward's saved rsqrt read: "
    want = {"pow": [head + "2 kernels (dX, dW)"] * 2, "frozen": [head + "2 kernels (dX, dW)", head + "1 kernel (dX)"],
            "written": []}[form]
    assert backend.graphs[0].backward.derived == want, str(backend)


@pytest.mark.parametrize("norm,names", [("layernorm", ["dX", "dW_dB"]), ("rmsnorm", ["dX", "dW"])])
def test_the_schedule_printout_shows_the_norm_s_derivation(norm: str, names: list[str]) -> None:
    from spacefusion.api import schedule

    passes = backward_passes(derive_backward(getattr(patterns, norm)(32, 64, "float32")))
    assert [p.name for p in passes] == names
    text = str(schedule(passes[0].smg))
    assert "backward derivation (smg.autodiff):" in text and "dX[m, n] = " in text and f"{names[1]}: " in text, text


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_the_norm_backward_kernels_lower_to_cuda(norm: str, tmp_path) -> None:
    """Every pass lowers for sm_90a; nvcc builds their cubins where it exists (compile only: no GPU here)."""
    from spacefusion.api import build, schedule

    for p in backward_passes(derive_backward(getattr(patterns, norm)(256, 768, "float32"))):
        art = build(schedule(p.smg), "cuda:sm_90a")
        assert "__global__" in art.source, p.name
        if shutil.which("nvcc"):
            assert (art.save(tmp_path / p.name, cache=None) / "kernel.cubin").stat().st_size > 0, p.name
