"""A training backward's activation backward after the input-gradient GEMM of the next linear, as the one kernel
derived from the forward "activation then linear" SMG (issue 58): ``mm(grad, W)`` (viewed) then
``gelu_backward(., Z)`` / ``silu_backward(., Z)`` become ``smg.autodiff.derive_backward(patterns.act_gemm)``'s
``dZ`` pass: the GEMM over the linear's outputs with ``act'(Z)`` as its epilogue (``dZ = act'(Z) * (grad @ W)``).
Z is the pre-activation the forward saved (aot saves it for the activation's backward), read as it is; W is the
weight the call is given (live: an optimiser step is read the next call).  Nothing is recomputed.

Why only after a GEMM: alone, an activation backward is one element-wise kernel in torch too; a derived one
would save nothing.  Its sentence stays ``left.backward_op`` there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensor

from spacefusion.frontend.derived_calls import derived_kernels, install, mark

aten = torch.ops.aten
#: the dtypes the derived kernel takes (grad, weight, Z and dZ all of one): an fp16/bf16 kernel accumulates the
#: GEMM and evaluates act'(Z) in float32 and rounds dZ once, as torch's ``gelu_backward`` computes in float32
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: the activation backwards taken, as (grad, input) -> the activation the SMG names (``smg.ops.UNARY``)
ACT_BACKWARDS = {aten.gelu_backward.default: "gelu", aten.silu_backward.default: "silu"}
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


class DerivedActGemmBackward(nn.Module):
    """``act_backward(mm(grad, W).view(shape), Z)`` as the derived ``dZ`` pass built by the stage's kernel
    backend.  Called with (grad [m, n], W [n, k], Z of m * k elements); returns dZ in Z's shape, contiguous and
    fresh (torch's op gives its result so; a kernel's outputs are its own)."""

    def __init__(self, bw: Any, passes: Sequence[Any], kernels: Sequence[Any], m: int, k: int) -> None:
        super().__init__()
        self.passes, self.kernels = tuple(passes), tuple(kernels)
        self.seed, self.grad = dict(bw.seeds)["Y"], dict(bw.grads)["Z"]
        self.m, self.k = m, k

    def forward(self, grad: torch.Tensor, weight: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if any(isinstance(t, FakeTensor) for t in (grad, z)):  # shape propagation: no kernel runs
            return torch.empty_like(z, memory_format=torch.contiguous_format)
        env = {self.seed: grad.contiguous(), "Bw": weight.contiguous(), "Z": z.contiguous().reshape(self.m, self.k)}
        for p, kernel in zip(self.passes, self.kernels):
            env |= kernel({name: env[name] for name in p.smg.inputs})
        return env[self.grad].reshape(z.shape).clone()


def _through_view(node: Any) -> Any:
    """The node a single-reader view ``node`` views, else ``node`` itself."""
    if isinstance(node, fx.Node) and len(node.users) == 1 and (
            node.op == "call_method" and node.target in ("view", "reshape")
            or node.op == "call_function" and node.target in _VIEWS):
        return node.args[0]
    return node


def _epilogue_form(node: fx.Node) -> tuple[tuple | None, str, fx.Node | None]:
    """(("act_gemm", act, m, n, k, dtype), "", the mm) where ``node`` is an activation backward whose gradient is
    ``mm(grad, W)`` of a weight ``W`` (``get_attr``) read by it alone; (None, why, None) where it is such a form
    the kernel does not take; (None, "", None) where its gradient is no GEMM of a weight (not this form)."""
    act = ACT_BACKWARDS[node.target]
    approximate = node.kwargs.get("approximate", node.args[2] if len(node.args) > 2 else "none")
    if act == "gelu" and approximate == "tanh":
        act = "gelu_tanh"
    mm = _through_view(node.args[0])
    if not (isinstance(mm, fx.Node) and mm.op == "call_function" and mm.target is aten.mm.default
            and len(mm.users) == 1 and isinstance(mm.args[1], fx.Node) and mm.args[1].op == "get_attr"):
        return None, "", None
    vals = [t.meta.get("val") if isinstance(t, fx.Node) else None for t in (mm.args[0], mm, node.args[1], node)]
    if any(v is None for v in vals) or approximate not in ("none", "tanh"):
        return None, f"{act} backward after a GEMM, of untraced values or approximate={approximate!r}", None
    if {v.dtype for v in vals} - set(DTYPES) or len({v.dtype for v in vals}) != 1:
        return None, (f"{act} backward after a GEMM in {sorted({str(v.dtype) for v in vals})}: the derived "
                      "epilogue takes one dtype of float32, bfloat16 or float16"), None
    (m, n), (_, k) = tuple(vals[0].shape), tuple(vals[1].shape)
    if math.prod(vals[2].shape) != m * k or tuple(vals[2].shape) != tuple(vals[3].shape):
        return None, f"{act} backward after a GEMM, of an input not the GEMM's [{m}, {k}] viewed", None
    return ("act_gemm", act, m, n, k, str(vals[3].dtype).removeprefix("torch.")), "", mm


def derive_act_backwards(gm: fx.GraphModule, kernels: Any, cache: dict[tuple, Any]) -> list[str]:
    """Replace every ``gelu_backward`` / ``silu_backward`` of ``gm`` whose gradient is a GEMM of a weight
    (``_epilogue_form``) and that GEMM by one ``DerivedActGemmBackward`` built on ``kernels``.  Such a form the
    kernel does not take is marked ``left.act_epilogue``; one whose kernel cannot be derived or built,
    ``left.derived_backward`` (torch's ops run, said so); another activation backward is not touched.
    ``cache``: per form, the derivation, its passes and their kernels (or the reason none), kept by the caller
    across rebuilds.  Returns one report line per replaced op."""
    from smg import patterns

    lines: list[str] = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in ACT_BACKWARDS:
            continue
        key, why, mm = _epilogue_form(node)
        if key is None:
            if why:
                mark(node, "left.act_epilogue", f"torch's {node.target.overloadpacket.__name__}: {why}")
            continue
        _, act, m, n, k, dtype = key
        found = derived_kernels(cache, key, kernels, patterns.act_gemm, m, n, k, act, dtype, wrt=("Z",))
        if isinstance(found, str):
            mark(node, "left.derived_backward", f"torch's {node.target.overloadpacket.__name__}: its derived "
                 f"kernel could not be built: {found}")
            continue
        bw, passes, built = found
        view = node.args[0] if node.args[0] is not mm else None
        install(gm, node, f"derived_act_backward_{len(lines)}", DerivedActGemmBackward(bw, passes, built, m, k),
                (mm.args[0], mm.args[1], node.args[1]))
        for dead in (view, mm):  # read by the replaced op alone: now by no one
            if dead is not None and not dead.users:
                gm.graph.erase_node(dead)
        lines.append(f"{act} backward as the epilogue of grad @ W {m}x{k}x{n} {dtype}: "
                     f"{len(passes)} kernel{'s' if len(passes) > 1 else ''} ({', '.join(p.name for p in passes)})")
    gm.graph.lint()
    gm.recompile()
    return lines
