"""A training forward's LayerNorm whose statistics the backward reads (``match_norm_stats``): torch's
``native_layer_norm`` as one kernel that outputs the norm and the rows' mean and rstd, so the fused forward
still feeds torch's ``native_layer_norm_backward`` (as ``attention.match_attention_lse`` does for the LSE)."""

from __future__ import annotations

import operator

import torch
from torch import fx

from smg import patterns
from spacefusion.frontend.graph import DTYPES, dtype, is_function, param_ref, param_tensor, rows, shape
from spacefusion.frontend.matchers import Context, _build, _param, _value
from spacefusion.frontend.records import Result, Subgraph

#: torch's LayerNorm as a training step's ATen graph holds it: (out, mean, rstd)
NATIVE_LAYER_NORM = torch.ops.aten.native_layer_norm.default
#: the dtypes a statistics-saving norm's input, weight and output may have (one of them for all three)
NORM_DTYPES = ("float32", "float16", "bfloat16")


def saved_stats_dtypes(x: str | None, out: str | None, stats: str | None, weight: str | None) -> bool:
    """Whether a training norm's dtypes are a form the statistics-saving patterns build: input, output and
    weight of one float dtype, the saved statistics in it or in float32.  torch saves fp16/bf16 statistics in
    float32 on CUDA (its ``acc_type``) and on CPU where the weight is float32, in the input's dtype on CPU with
    a weight of the input's dtype; HF's RMSNorm upcasts and saves a float32 rsqrt.  The kernels compute in
    float32 whatever their spaces store, so each is exact to its storage's rounding; mixed input, weight and
    output dtypes are not one SMG dtype the derived backwards take."""
    return x in NORM_DTYPES and x == out == weight and stats in (x, "float32")


def param_dtype(gm: fx.GraphModule, ref: str | None) -> str | None:
    """The dtype name of parameter (or buffer) ``ref`` of ``gm``, None where there is none or another type."""
    return DTYPES.get(param_tensor(gm, ref).dtype) if ref is not None else None


def stats_result(space: str, node: fx.Node) -> Result:
    """``space`` standing for ``node`` in the node's shape and strides (a norm's saved statistics are
    [..., 1]: the SMG's {m} viewed back, a copy only where torch's strides differ, ``Result.strides``)."""
    meta = node.meta["tensor_meta"]
    return Result(space, node.name, tuple(meta.shape), strides=tuple(meta.stride))


def match_norm_stats(node: fx.Node, ctx: Context) -> Subgraph | None:
    """``native_layer_norm(x, [n], weight, bias, eps) -> (out, mean, rstd)`` over the last dim, with weight and
    bias parameters -> ``patterns.layernorm_stats``: ``Y`` is the op's element 0, ``Mean`` element 1, ``Rstd``
    element 2 (torch's layout, [..., 1]).  fp16/bf16 as ``saved_stats_dtypes`` takes it (input, weight, bias and
    output of one dtype; the statistics in it, as torch's CPU op saves them, or float32, as its CUDA op does):
    ``layernorm_stats`` in that dtype, the statistics stored in theirs, computed in float32.  Only the norm: its
    input (a GEMM's epilogue with the residual add) and its readers are other rows'.  Where the op is read other
    than through all three of its elements, it is not this form (None); another form (several dims, no affine
    parameters, mixed dtypes) is refused with ``norm.form``."""
    if not is_function(node, (NATIVE_LAYER_NORM,)) or node.kwargs or len(node.args) != 5:
        return None
    got = {u.args[1]: u for u in node.users if is_function(u, (operator.getitem,)) and u.args[0] is node}
    if set(got) != {0, 1, 2} or len(got) != len(node.users) or not ctx.free(node, *got.values()):
        return None
    x, normalized, w, b, eps = node.args
    xs, dt = shape(x), dtype(x) if isinstance(x, fx.Node) else None
    wref, bref = param_ref(w), param_ref(b)
    stats_dt = {dtype(u) for i, u in got.items() if i}
    sdt = next(iter(stats_dt)) if len(stats_dt) == 1 else None
    wdt = {param_dtype(ctx.gm, r) for r in (wref, bref)}
    if xs is None or len(normalized) != 1 or normalized[0] != xs[-1] or wref is None or bref is None \
            or len(wdt) != 1 or not saved_stats_dtypes(dt, dtype(got[0]), sdt, next(iter(wdt))):
        ctx.refuse(node, "norm.form",
                   f"a training LayerNorm over {list(normalized)} of a {xs} {dt} input, weight {wref}, bias {bref}"
                   f" ({sorted(map(str, wdt))}), statistics {sorted(map(str, stats_dt))}: the statistics-saving"
                   " pattern normalises the last dim with weight and bias, input, parameters and output of one"
                   " dtype, the statistics in it or float32")
        return None
    m, n = rows(xs), xs[-1]
    smg = _build(ctx, node, lambda: patterns.layernorm_stats(m, n, dt, float(eps), None if sdt == dt else sdt))
    if smg is None:
        return None
    ops = (_value("X", x, (m, n)), _param("W", wref, (n,)), _param("B", bref, (n,)))
    results = tuple(stats_result(space, got[i]) for i, space in enumerate(("Y", "Mean", "Rstd")))
    label = f"layernorm + mean/rstd saved {m}x{n} {dt}{f' ({sdt} statistics)' if sdt != dt else ''}"
    return Subgraph("norm", label, (node.name, *(u.name for u in got.values())), smg, ops, results)
