"""Norm builders: LayerNorm / RMSNorm with their residual add or fp16 guard (``match_norm``), GroupNorm
(``match_group_norm``) and the fp16 inf guard alone (``match_guard``)."""

from __future__ import annotations

import dataclasses

from torch import fx

from smg import patterns
from smg.ir import SMG
from smg.ops import Builder
from spacefusion.frontend import builders
from spacefusion.frontend.convs import CONV_ACTIVATIONS
from spacefusion.frontend.gemms import _activation_after
from spacefusion.frontend.graph import (
    ADD,
    contiguous,
    dtype,
    groupnorm_of,
    is_function,
    norm_of,
    read_rstd,
    rows,
    shape,
    single_user,
)
from spacefusion.frontend.guard import clamp_of, guard_of, guarded
from spacefusion.frontend.matchers import Context, _build, _param, _subgraph, _value
from spacefusion.frontend.norm_stats import param_dtype, saved_stats_dtypes, stats_result
from spacefusion.frontend.records import Result, Subgraph


def match_group_norm(node: fx.Node, ctx: Context) -> Subgraph | None:
    """``nn.GroupNorm`` / ``F.group_norm`` on an image (and the SiLU after it, the VAE's and UNet's pair) ->
    ``patterns.group_norm`` over the image seen channels-last [n, h * w, groups, channels / groups].  The
    output goes back as NCHW shapes with channels-last strides, as a conv's does; the backend splits the
    reduction when the groups alone leave the SMs idle (``schedulers.split``)."""
    gn = groupnorm_of(node, ctx.gm)
    if gn is None or not ctx.free(node):
        return None
    xs, dt = shape(gn.x), dtype(node)
    if xs is None or len(xs) not in (3, 4) or dt is None or (gn.weight is None) != (gn.bias is None):
        ctx.refuse(node, "group_norm.form",
                   f"GroupNorm of a {xs} input, weight {gn.weight}, bias {gn.bias}: the pattern takes a 3-d or "
                   "4-d image with both or neither of the affine parameters")
        return None
    n, c, h, w = xs if len(xs) == 4 else (*xs, 1)  # [n, c, L] (an attention block's flattened image) as L x 1
    nchw = (0, 3, 1, 2) if len(xs) == 4 else (0, 2, 1)
    taken, y, act = [node], node, None
    x, shift = gn.x, _per_channel_shift(gn.x, node, ctx)
    if shift is not None:
        taken, x = [gn.x, node], shift[0]
    got = _activation_after(node, ctx)
    if got is not None and got.name in CONV_ACTIVATIONS and len(got.nodes) == 1:
        act, y = got, got.out
        taken.extend(got.nodes)
    affine = gn.weight is not None
    smg = _build(ctx, node, lambda: patterns.group_norm(n, h * w, gn.groups, c, act.name if act else "none",
                                                        affine, dt, gn.eps, shift=shift is not None))
    if smg is None:
        return None
    g, cg = gn.groups, c // gn.groups
    ops = [_value("X", x, (n, h * w, g, cg), tuple(nchw.index(i) for i in range(len(xs))))]
    if shift is not None:
        ops.append(_value("E", shift[1], (n, g, cg)))
    if affine:
        ops += [_param("W", gn.weight, (g, cg)), _param("B", gn.bias, (g, cg))]
    out = Result("Y", y.name, shape(y), permute=nchw, split=(n, h, w, c) if len(xs) == 4 else (n, h, c))
    size = "x".join(map(str, xs))
    label = f"{'add + ' if shift else ''}group_norm{' + ' + act.name if act else ''} {size} /{g} {dt}"
    return Subgraph("group_norm", label, tuple(t.name for t in taken), smg, tuple(ops), (out,))


def _per_channel_shift(x: fx.Node, norm: fx.Node, ctx: Context) -> tuple[fx.Node, fx.Node] | None:
    """(image, shift) where the GroupNorm's input ``x`` is ``image + shift[:, :, None, None]`` read by the
    norm alone (diffusers' ResNet block: ``conv1(h) + time_emb_proj(temb)[:, :, None, None]``)."""
    if not is_function(x, ADD) or len(x.args) != 2 or x.kwargs or single_user(x) is not norm or not ctx.free(x):
        return None
    xs = shape(x)
    for img, e in (x.args, x.args[::-1]):
        if isinstance(img, fx.Node) and isinstance(e, fx.Node) and shape(img) == xs and dtype(img) == dtype(x) \
                and shape(e) == (xs[0], xs[1], 1, 1) and dtype(e) == dtype(x) and contiguous(e):
            return img, e
    return None


def match_norm(node: fx.Node, ctx: Context) -> Subgraph | None:
    """LayerNorm / RMSNorm over the last dim -> ``norm``; when its input is ``a + b`` of one shape the add
    is fused too (``residual_norm``), and the sum is a second output where something else reads it.

    An RMSNorm written in ops whose rsqrt is read outside it (a training forward's: aot_autograd saves it for
    the backward, ``graph.read_rstd``) outputs it too, ``Rstd`` bound to the rsqrt node in torch's shape and
    strides ([..., 1]), so the backward reads it unchanged (``patterns.rmsnorm_stats``, residual add and kept
    sum as above).  A fp16/bf16 norm (LLaMA's upcasts x to float32 for the statistics and saves a float32 rsqrt)
    is ``rmsnorm_stats`` in the input's dtype with ``Rstd`` stored in the rsqrt's, computed in float32 inside as the
    kernels compute every op (``norm_stats.saved_stats_dtypes``: x, weight and output of one dtype).  One of mixed
    dtypes, with an offset weight, a guard or a clamp is refused with ``norm.saved_stats`` (fused, it would not be
    closed: its saved rsqrt an intermediate)."""
    nm = norm_of(node, ctx.gm)
    if nm is None or not ctx.free(node, *nm.inner):
        return None
    if node.name in ctx.prologues:  # each linear reading it recomputes it from its input
        ctx.refuse(node, "norm.prologue",
                   f"an {nm.kind} read only by linears: the prologue of their GEMMs, each normalising the "
                   f"rows it multiplies (gone once they are fused)")
        return None
    xs, dt = shape(nm.x), dtype(node)
    if nm.dims != 1 or nm.weight is None or (nm.kind == "layernorm" and nm.bias is None) or xs is None or dt is None:
        ctx.refuse(node, "norm.form",
                   f"{nm.kind} over {nm.dims} dims, weight {nm.weight}, bias {nm.bias}: the patterns "
                   f"normalise the last dim with an affine weight (and LayerNorm bias)")
        return None
    x = nm.x
    guard = guard_of(x) if isinstance(x, fx.Node) else None
    guard = guard if guard is not None and ctx.free(*guard.nodes) and shape(guard.x) == xs else None
    clip = _clamped_sum(x, ctx) if guard is None else None
    add = clip[0] if clip else x
    residual = (guard is None and is_function(add, ADD) and len(add.args) == 2 and not add.kwargs and ctx.free(add)
                and all(shape(a) == xs for a in add.args))
    clip = clip if residual else None
    keep_sum = (residual or guard is not None) and any(u is not node and u not in nm.inner for u in x.users)
    rstd = read_rstd(nm, node)
    if rstd is not None and (not saved_stats_dtypes(dtype(x), dt, dtype(rstd), param_dtype(ctx.gm, nm.weight))
                             or nm.offset or guard or clip):
        ctx.refuse(node, "norm.saved_stats",
                   f"an RMSNorm whose rstd the backward reads, of {dtype(x)} to {dt} with a {dtype(rstd)} rstd"
                   f" and a {param_dtype(ctx.gm, nm.weight)} weight"
                   f"{', an offset weight' if nm.offset else ''}"
                   f"{' after a guard or clamp' if guard or clip else ''}:"
                   " the statistics-saving pattern takes an input, weight and output of one dtype with the rstd in it"
                   " or float32, a plain weight, no guard or clamp")
        return None
    m, n = rows(xs), xs[-1]
    smg = _build(ctx, node, lambda: builders.norm(nm.kind, m, n, residual, keep_sum, dt, float(nm.eps), nm.offset,
                                                  guard, clip[1:] if clip else None,
                                                  stats=dtype(rstd) if rstd is not None else None))
    if smg is None:
        return None
    if residual:
        ops = [_value("X", add.args[0], (m, n)), _value("R", add.args[1], (m, n))]
    else:
        ops = [_value("X", guard.x if guard else x, (m, n))]
    ops.append(_param("W", nm.weight, (n,)))
    if nm.kind == "layernorm":
        ops.append(_param("B", nm.bias, (n,)))
    kind = "residual_norm" if residual else "norm"
    weight = f" ({nm.offset:g} + w)" if nm.offset else ""
    kept = " (clamped kept)" if (guard or clip) and keep_sum else " (sum kept)" if keep_sum else ""
    first = "add + clamp + " if clip else "add + " if residual else "inf guard + " if guard else ""
    saved = f" + {dtype(rstd) + ' ' if dtype(rstd) != dt else ''}rstd saved" if rstd is not None else ""
    label = f"{first}{nm.kind}{weight}{kept}{saved} {m}x{n} {dt}"
    nodes = (*((add, x) if clip else (x,) if residual else guard.nodes if guard else ()), *nm.inner, node)
    sub = _subgraph(kind, label, nodes, smg, ops, {"Y": node, "T": x, "Rstd": rstd})
    if rstd is None:
        return sub
    return dataclasses.replace(sub, results=tuple(stats_result(r.space, rstd) if r.space == "Rstd" else r
                                                  for r in sub.results))


def _clamped_sum(x: object, ctx: Context) -> tuple[fx.Node, float, float] | None:
    """(the add, lo, hi) where a norm's input ``x`` is ``clamp(a + b, lo, hi)`` with number bounds and the add read
    by the clamp alone (Whisper's fp16 guard after its residual add): the norm's kernel then takes the add and
    the clamp, and the clamped sum is its second output where something else reads it (the next residual)."""
    got = clamp_of(x) if isinstance(x, fx.Node) and ctx.free(x) else None
    if got is None or single_user(got[0]) is not x or not ctx.free(got[0]):
        return None
    return got


def match_guard(node: fx.Node, ctx: Context) -> Subgraph | None:
    """T5's fp16 clamp (``guard.guard_of``) that no norm took (one reads it after ``match_norm`` has run):
    the flag, then the clamp as an element-wise pass."""
    guard = guard_of(node)
    if guard is None or not ctx.free(*guard.nodes) or shape(node) is None:
        return None
    xs, dt = shape(node), dtype(node)
    dims = {f"d{i}": s for i, s in enumerate(xs)}

    def make() -> SMG:
        g = Builder("inf_guard", dt)
        return g.build(guarded(g, g.input("X", dims), guard, dt))

    smg = _build(ctx, node, make)
    if smg is None:
        return None
    label = f"inf guard {'x'.join(map(str, xs))} {dt}"
    return _subgraph("guard", label, guard.nodes, smg, [_value("X", guard.x, xs)], {"T": node})
