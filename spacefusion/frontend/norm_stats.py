"""A training forward's LayerNorm whose statistics the backward reads (``match_norm_stats``): torch's
``native_layer_norm`` as one kernel that outputs the norm and the rows' mean and rstd, so the fused forward
still feeds torch's ``native_layer_norm_backward`` (as ``attention.match_attention_lse`` does for the LSE)."""

from __future__ import annotations

import operator

import torch
from torch import fx

from smg import patterns
from spacefusion.frontend.graph import dtype, is_function, param_ref, rows, shape
from spacefusion.frontend.matchers import Context, _build, _param, _value
from spacefusion.frontend.records import Result, Subgraph

#: torch's LayerNorm as a training step's ATen graph holds it: (out, mean, rstd)
NATIVE_LAYER_NORM = torch.ops.aten.native_layer_norm.default


def stats_result(space: str, node: fx.Node) -> Result:
    """``space`` standing for ``node`` in the node's shape and strides (a norm's saved statistics are
    [..., 1]: the SMG's {m} viewed back, a copy only where torch's strides differ, ``Result.strides``)."""
    meta = node.meta["tensor_meta"]
    return Result(space, node.name, tuple(meta.shape), strides=tuple(meta.stride))


def match_norm_stats(node: fx.Node, ctx: Context) -> Subgraph | None:
    """``native_layer_norm(x, [n], weight, bias, eps) -> (out, mean, rstd)`` over the last dim, with weight and
    bias parameters, on float32 -> ``patterns.layernorm_stats``: ``Y`` is the op's element 0, ``Mean`` element
    1, ``Rstd`` element 2 (float32 [..., 1], torch's own layout).  Only the norm: its input (a GEMM's
    epilogue with the residual add) and its readers are other rows'.  Where the op is read other than through
    all three of its elements, it is not this form (None); another form (several dims, no affine parameters, another
    dtype: on CPU torch returns fp16/bf16 statistics in the input's dtype, which the one-dtype SMG could hold,
    but they are not wired yet) is refused with ``norm.form``."""
    if not is_function(node, (NATIVE_LAYER_NORM,)) or node.kwargs or len(node.args) != 5:
        return None
    got = {u.args[1]: u for u in node.users if is_function(u, (operator.getitem,)) and u.args[0] is node}
    if set(got) != {0, 1, 2} or len(got) != len(node.users) or not ctx.free(node, *got.values()):
        return None
    x, normalized, w, b, eps = node.args
    xs, dt = shape(x), dtype(x) if isinstance(x, fx.Node) else None
    wref, bref = param_ref(w), param_ref(b)
    stats_dt = {dtype(u) for i, u in got.items() if i}
    if xs is None or len(normalized) != 1 or normalized[0] != xs[-1] or wref is None or bref is None \
            or dt != "float32" or stats_dt - {"float32"}:
        ctx.refuse(node, "norm.form",
                   f"a training LayerNorm over {list(normalized)} of a {xs} {dt} input, weight {wref}, bias {bref}:"
                   " the statistics-saving pattern normalises the last dim of float32 with weight and bias")
        return None
    m, n = rows(xs), xs[-1]
    smg = _build(ctx, node, lambda: patterns.layernorm_stats(m, n, dt, float(eps)))
    if smg is None:
        return None
    ops = (_value("X", x, (m, n)), _param("W", wref, (n,)), _param("B", bref, (n,)))
    results = tuple(stats_result(space, got[i]) for i, space in enumerate(("Y", "Mean", "Rstd")))
    label = f"layernorm + mean/rstd saved {m}x{n} {dt}"
    return Subgraph("norm", label, (node.name, *(u.name for u in got.values())), smg, ops, results)
