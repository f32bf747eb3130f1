"""Graph passes that remove what an inference graph computes for nothing, run after shape propagation.

Dynamo keeps no-ops at inference in the graph (``F.dropout(..., training=False)``, ``.contiguous()`` of a
contiguous value, ``x / 1``); ``drop_noops`` removes them so they do not sit between a producer and its
consumer.  ``merge_repeated_activations`` lets one node stand for repeated pure activations of one value.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from spacefusion.frontend.graph import activation_of, contiguous, conv_of


def _is_inference_dropout(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target not in (F.dropout, torch.dropout, torch.nn.functional.dropout1d,
                                                         torch.nn.functional.dropout2d):
        return False
    args = dict(zip(("input", "p", "training", "inplace"), node.args)) | dict(node.kwargs)
    return args.get("training", True) is False or args.get("p", 0.5) == 0.0


def _same_view(node: fx.Node) -> bool:
    """A ``view``/``reshape`` to the shape its input already has (HF's ``reshape(b, -1, s, d)`` of an
    attention output): the same tensor, strides included."""
    if node.op != "call_method" or node.target not in ("view", "reshape") or not isinstance(node.args[0], fx.Node):
        return False
    src, out = node.args[0].meta.get("tensor_meta"), node.meta.get("tensor_meta")
    return (src is not None and out is not None and hasattr(src, "shape") and hasattr(out, "shape")
            and tuple(src.shape) == tuple(out.shape) and tuple(src.stride) == tuple(out.stride))


def _lone_operand_of_cat(node: fx.Node) -> fx.Node | None:
    """The one operand of a ``torch.cat`` whose others ShapeProp saw empty (a KV cache's first append,
    ``cat([empty, k])``: a copy of ``k`` that an inference graph may read in place), else None."""
    if node.op != "call_function" or node.target not in (torch.cat, torch.concat):
        return None
    parts = node.args[0] if node.args else node.kwargs.get("tensors")
    out = node.meta.get("tensor_meta")
    if not isinstance(parts, list | tuple) or not hasattr(out, "shape"):
        return None

    def empty(x: Any) -> bool:
        meta = x.meta.get("tensor_meta") if isinstance(x, fx.Node) else None
        return hasattr(meta, "shape") and math.prod(meta.shape) == 0

    kept = [x for x in parts if not empty(x)]
    meta = kept[0].meta.get("tensor_meta") if len(kept) == 1 and isinstance(kept[0], fx.Node) else None
    same = hasattr(meta, "shape") and tuple(meta.shape) == tuple(out.shape) and meta.dtype == out.dtype
    return kept[0] if same else None


def _same_value(src: Any, node: fx.Node) -> bool:
    """Whether ShapeProp saw ``node``'s value with ``src``'s shape, dtype and strides."""
    a = src.meta.get("tensor_meta") if isinstance(src, fx.Node) else None
    b = node.meta.get("tensor_meta")
    return all(hasattr(m, "shape") for m in (a, b)) and (tuple(a.shape), a.dtype, tuple(a.stride)) == (
        tuple(b.shape), b.dtype, tuple(b.stride))


def _identity_arith(node: fx.Node) -> fx.Node | None:
    """The tensor of ``x / 1`` or ``x * 1`` (either side) where the result keeps its dtype, else None:
    diffusers divides every ResNet block's and attention's output by an ``output_scale_factor`` /
    ``rescale_output_factor`` that is 1.0 in SD 1.5, a full read and write of the feature map each (Dynamo
    keeps them)."""
    if node.op != "call_function" or len(node.args) != 2 or node.kwargs:
        return None
    x, c = node.args
    if node.target in (operator.mul, torch.mul) and not isinstance(x, fx.Node):
        x, c = c, x
    ok = (node.target in (operator.truediv, torch.div, operator.mul, torch.mul) and isinstance(x, fx.Node)
          and isinstance(c, int | float) and not isinstance(c, bool) and c == 1 and _same_value(x, node))
    return x if ok else None


def _same_dtype_cast(node: fx.Node) -> bool:
    """``x.to(dtype)`` / ``x.float()`` / ``x.half()`` to the dtype ``x`` has: torch returns ``x`` itself."""
    if node.op != "call_method" or not node.args or not _same_value(node.args[0], node):
        return False
    if node.target in ("float", "half", "bfloat16"):
        return len(node.args) == 1 and not node.kwargs
    return node.target == "to" and len(node.args) + len(node.kwargs) >= 2 and all(
        isinstance(a, torch.dtype) for a in (*node.args[1:], *node.kwargs.values()))


def _channels_last_for_convs(node: fx.Node, gm: fx.GraphModule) -> bool:
    """``.contiguous()`` of a channels-last image read only by convolutions (diffusers' Transformer2D
    ``reshape(b, h, w, c).permute(0, 3, 1, 2).contiguous()`` before its 1x1 ``proj_out``): a copy into NCHW
    that a conv does not need, since it reads either layout (the fused implicit GEMM binds channels-last)."""
    if node.op != "call_method" or node.target != "contiguous" or len(node.args) != 1 or node.kwargs:
        return False
    meta = node.args[0].meta.get("tensor_meta") if isinstance(node.args[0], fx.Node) else None
    if not hasattr(meta, "shape") or len(meta.shape) != 4 or not node.users:
        return False
    _, c, h, w = meta.shape
    cl = tuple(s for s, n in zip(meta.stride[1:], (c, h, w)) if n > 1) == tuple(
        s for s, n in zip((1, w * c, c), (c, h, w)) if n > 1)
    return cl and all(conv_of(u, gm) is not None and conv_of(u, gm).x is node for u in node.users)


def drop_noops(gm: fx.GraphModule) -> int:
    """Remove inference dropouts, views to the same shape, ``.contiguous()`` of values ShapeProp saw
    contiguous (or channels-last, read only by convs), casts to the dtype a value has, ``x / 1`` and
    ``x * 1``, and concatenations with empty tensors (run after shape propagation); returns how many
    nodes went."""
    gone = 0
    for node in list(gm.graph.nodes):
        noop = _is_inference_dropout(node) or _same_view(node) or (
            node.op == "call_method" and node.target == "contiguous" and len(node.args) == 1
            and contiguous(node.args[0])) or _same_dtype_cast(node) or _channels_last_for_convs(node, gm)
        src = node.args[0] if noop else _identity_arith(node) or _lone_operand_of_cat(node)
        if isinstance(src, fx.Node):
            node.replace_all_uses_with(src)
            gm.graph.erase_node(node)
            gone += 1
    gm.recompile()
    return gone


def merge_repeated_activations(gm: fx.GraphModule) -> int:
    """Let one node stand for every later call of the same activation function on the same value
    (diffusers' UNet applies ``silu`` to the time embedding in each of its 22 ResNet blocks; Dynamo keeps
    all 22).  The linears reading that one value then stack into a GEMM per shape (``match_stacked_linears``)
    instead of 22 launches.  Only pure activations (``graph.activation_of``) merge; returns how many went."""
    seen: dict[tuple, fx.Node] = {}
    gone = 0
    for node in list(gm.graph.nodes):
        if node.op not in ("call_function", "call_method") or activation_of(node, gm) is None:
            continue
        try:
            key = (node.op, node.target, tuple(node.args), tuple(sorted(node.kwargs.items())))
            first = seen.setdefault(key, node)
        except TypeError:  # an unhashable argument: left alone
            continue
        if first is not node:
            node.replace_all_uses_with(first)
            gm.graph.erase_node(node)
            gone += 1
    gm.recompile()
    return gone

