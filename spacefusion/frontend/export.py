"""``torch.export`` programs: their ATen graph read as the torch-level graph the matchers know.

``torch.export.export(model, args)`` gives an ATen graph (``aten.linear.default``, ``aten.view.default``,
...) whose ``module()`` holds the parameters as ``get_attr`` nodes under their qualified names.  Rather than
a second set of matchers, ``canonicalize`` rewrites each ATen call into the torch function or tensor method
Dynamo's graphs use (``torch._C._nn.linear``, ``Tensor.view``, ``operator.add``): the same partition then
serves both.  An ATen op with no entry here stays as it is and is left to torch with its reason.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx
from torch.fx.passes.shape_prop import ShapeProp
from torch.utils import _pytree as pytree

from spacefusion.frontend.capture import Captured
from spacefusion.frontend.errors import FrontendError
from spacefusion.frontend.fused import FusedModel, fuse_captured

aten = torch.ops.aten

#: ATen overload -> the torch function it is called as (same arguments, or ``_ARGS`` adapts them)
FUNCTIONS: dict[Any, Any] = {
    aten.linear.default: torch._C._nn.linear, aten.layer_norm.default: F.layer_norm,
    aten.gelu.default: torch._C._nn.gelu, aten.silu.default: F.silu, aten.relu.default: torch.relu,
    aten.sigmoid.default: torch.sigmoid, aten.tanh.default: torch.tanh, aten.rsqrt.default: torch.rsqrt,
    aten.scaled_dot_product_attention.default: torch._C._nn.scaled_dot_product_attention,
    aten.dropout.default: F.dropout, aten.addmm.default: torch.addmm, aten.conv2d.default: torch.conv2d,
    aten.cat.default: torch.cat, aten.pow.Tensor_Scalar: torch.pow, aten.embedding.default: F.embedding,
    aten.add.Tensor: operator.add, aten.add.Scalar: operator.add, aten.mul.Tensor: operator.mul,
    aten.sub.Tensor: operator.sub,
    aten.div.Tensor: operator.truediv, aten.neg.default: operator.neg, aten.rms_norm.default: F.rms_norm,
    # what attention masks are built from (``maskexpr`` reads them back as index expressions)
    aten.arange.default: torch.arange, aten.ge.Scalar: operator.ge, aten.ge.Tensor: operator.ge,
    aten.le.Scalar: operator.le, aten.le.Tensor: operator.le, aten.lt.Scalar: operator.lt,
    aten.lt.Tensor: operator.lt, aten.gt.Scalar: operator.gt, aten.gt.Tensor: operator.gt,
    aten.eq.Scalar: operator.eq, aten.eq.Tensor: operator.eq, aten.bitwise_and.Tensor: operator.and_,
    aten.bitwise_or.Tensor: operator.or_, aten.bitwise_not.default: operator.invert,
}
#: ATen overload -> the tensor method it is
METHODS: dict[Any, str] = {
    aten.view.default: "view", aten.reshape.default: "reshape", aten.transpose.int: "transpose",
    aten.permute.default: "permute", aten.unsqueeze.default: "unsqueeze", aten.expand.default: "expand",
    aten.mean.dim: "mean", aten.contiguous.default: "contiguous", aten.flatten.using_ints: "flatten",
}


def _layer_norm(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return args[:5], {k: v for k, v in kwargs.items() if k != "cudnn_enable"}  # no cudnn_enable in F.layer_norm


def _embedding(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return (args[1], args[0]), {}  # aten.embedding(weight, indices) is F.embedding(indices, weight)


def _arange(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return args, {k: v for k, v in kwargs.items() if k in ("dtype", "device")}  # no pin_memory in torch.arange


#: argument adapters where the ATen schema differs from the torch function's
_ARGS: dict[Any, Callable[[tuple, dict], tuple[tuple, dict]]] = {
    aten.layer_norm.default: _layer_norm, aten.embedding.default: _embedding, aten.arange.default: _arange}


def canonicalize(gm: fx.GraphModule) -> int:
    """Rewrite ``gm``'s ATen calls in place as torch functions and tensor methods; returns how many.  An add
    or sub with an ``alpha``, a ``_to_copy`` with more than a dtype, and ops missing from the tables stay."""
    done = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        t = node.target
        if t in (aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor) and node.kwargs.get("alpha", 1) != 1:
            continue
        if t in FUNCTIONS:
            node.args, node.kwargs = _ARGS[t](node.args, dict(node.kwargs)) if t in _ARGS else (node.args, node.kwargs)
            node.target = FUNCTIONS[t]
        elif t in METHODS:
            node.op, node.target = "call_method", METHODS[t]
        elif t is aten._to_copy.default and set(node.kwargs) <= {"dtype"} and "dtype" in node.kwargs:
            node.op, node.target, node.args, node.kwargs = "call_method", "to", (node.args[0], node.kwargs["dtype"]), {}
        elif t is aten.slice.Tensor and len(node.args) >= 2:  # x[..., start:end] along one dim
            x, dim = node.args[0], node.args[1]
            start = node.args[2] if len(node.args) > 2 else None
            end = node.args[3] if len(node.args) > 3 else None
            rank = len(x.meta["val"].shape) if isinstance(x, fx.Node) and "val" in x.meta else None
            if rank is None or len(node.args) > 4:
                continue
            dim = dim % rank
            index = (Ellipsis, slice(start, end)) if dim == rank - 1 else \
                tuple([slice(None)] * dim + [slice(start, end)])
            node.target, node.args, node.kwargs = operator.getitem, (x, index), {}
        else:
            continue
        done += 1
    gm.graph.lint()
    gm.recompile()
    return done


class FusedExport(torch.nn.Module):
    """A fused ``torch.export`` program, called like the model it was exported from (same argument and
    output structure)."""

    def __init__(self, fused: FusedModel, in_spec: Any, out_spec: Any) -> None:
        super().__init__()
        self.fused, self.in_spec, self.out_spec = fused, in_spec, out_spec
        self.partition = fused.partition

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        flat = pytree.tree_leaves((args, kwargs))
        with torch.no_grad():
            out = self.fused.graph_module(*flat)
        return pytree.tree_unflatten(list(out) if isinstance(out, tuple | list) else [out], self.out_spec)


def fuse_exported(ep: torch.export.ExportedProgram, *args: Any, backend: Any = "llvm", verbose: bool = False,
                  **kwargs: Any) -> FusedExport:
    """Fuse an exported program: its module's ATen graph canonicalised, shapes propagated on the example
    inputs (the ones it was exported with will do), partitioned and built on ``backend``."""
    gm = ep.module()
    canonicalize(gm)
    flat = pytree.tree_leaves((args, kwargs))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(flat) != len(placeholders):
        raise FrontendError(f"the exported program takes {len(placeholders)} inputs, got {len(flat)}")
    try:
        with torch.no_grad():
            ShapeProp(gm).propagate(*flat)
    except Exception as exc:  # the inputs do not fit the program: say so in our terms
        raise FrontendError(f"running the exported program on the example inputs failed: {exc}") from exc
    from spacefusion.frontend.noops import drop_noops

    drop_noops(gm)
    fused = fuse_captured(Captured(gm, tuple(flat)), backend, verbose)
    return FusedExport(fused, ep.call_spec.in_spec, ep.call_spec.out_spec)
