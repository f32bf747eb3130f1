"""A per-channel scale after a linear (ConvNeXt's layer scale, CaiT's and DeiT-III's LayerScale), folded into
that linear's weight and bias.

``gamma * linear(x)`` with ``gamma`` a parameter that scales each output feature is ``x @ (gamma * W).T + gamma *
b``: a linear of its own, whose GEMM then takes what follows it (a residual add, through the permute back to
NCHW: ``gemms.match_linear``).  Left as it was, the scale was an element-wise kernel of torch's over the
whole activation, in every block (ConvNeXt-T: 18 of them, each reading and writing 2-19 MB at batch 32), and it
stood between the GEMM and the residual add, so that add was a second one.  The folded weights are computed
in float32 and stored in the weight's dtype, as a BatchNorm folded into a convolution is (``bn_fold``); a weight
or the scale written later rebuilds the graph, as any baked weight does (``weights.Stamp``).
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from spacefusion.frontend.graph import (
    dtype,
    is_function,
    linear_of,
    param_ref,
    param_tensor,
    permutation,
    shape,
    single_user,
)

#: the meta key of a linear node whose weight carries a folded scale (the partition report says it)
SCALE_FOLDED = "sf_scale_folded"
#: the folded weights' buffer name prefix
PREFIX = "_sf_scalefold"
MUL = (operator.mul, torch.mul, torch.Tensor.mul)


def _channel_scale(scale: torch.Tensor, out_rank: int, channel: int, n: int) -> torch.Tensor | None:
    """``scale`` as a vector of ``n`` where it multiplies only along dim ``channel`` of an ``out_rank``-dim value
    (or is one number), else None."""
    shp = (1,) * (out_rank - scale.dim()) + tuple(scale.shape)
    if scale.dim() > out_rank:
        return None
    if scale.numel() == 1:
        return scale.reshape(1).expand(n)
    if shp[channel] != n or any(s != 1 for i, s in enumerate(shp) if i != channel):
        return None
    return scale.reshape(n)


def _fold_site(mul: fx.Node, gm: fx.GraphModule):
    """(linear node, its Linear, the scale vector, the value the mul reads) where ``mul`` scales a linear's
    output per output feature, through at most one permute, each step read by the next alone."""
    if not is_function(mul, MUL) or len(mul.args) != 2 or mul.kwargs:
        return None
    a, b = mul.args
    ref, y = (param_ref(a), b) if param_ref(a) is not None else (param_ref(b), a)
    if ref is None or not isinstance(y, fx.Node) or single_user(y) is not mul:
        return None
    perm = permutation(y)
    lin_node = perm[0] if perm else y
    if perm and single_user(lin_node) is not y:
        return None
    lin = linear_of(lin_node, gm)
    out = shape(mul)
    if lin is None or out is None or shape(y) != out or dtype(mul) != dtype(y):
        return None
    scale = param_tensor(gm, ref)
    if not scale.is_floating_point() or scale.dtype != param_tensor(gm, lin.weight).dtype:
        return None
    last = len(out) - 1
    channel = perm[1].index(last) if perm else last
    vec = _channel_scale(scale.detach(), len(out), channel, lin.n)
    return None if vec is None else (lin_node, lin, vec, y)


def fold_layer_scales(gm: fx.GraphModule) -> list[str]:
    """Fold each per-feature scale after a linear (see the module's doc) into a new ``F.linear`` on folded
    buffers; the mul's readers read the (permuted) linear directly.  Returns the folded muls' names."""
    folded: list[str] = []
    for mul in list(gm.graph.nodes):
        site = _fold_site(mul, gm)
        if site is None:
            continue
        lin_node, lin, vec, y = site
        with torch.no_grad():
            w = param_tensor(gm, lin.weight)
            s = vec.float()
            wf = (w.float() * (s[None, :] if lin.stored_kn else s[:, None])).to(w.dtype)
            wf = (wf.t() if lin.stored_kn else wf).contiguous()  # F.linear's [n, k]
            bf = (param_tensor(gm, lin.bias).float() * s).to(w.dtype).contiguous() if lin.bias else None
        nodes = []
        for part, t in (("weight", wf), ("bias", bf)):
            if t is None:
                continue
            name = f"{PREFIX}_{lin_node.name}_{part}"
            gm.register_buffer(name, t, persistent=False)
            with gm.graph.inserting_before(lin_node):
                a = gm.graph.get_attr(name)
            a.meta = {"tensor_meta": _extract_tensor_metadata(t)}
            nodes.append(a)
        with gm.graph.inserting_before(lin_node):
            new = gm.graph.call_function(F.linear, (lin.x, nodes[0], nodes[1] if bf is not None else None))
        new.meta = {**lin_node.meta, SCALE_FOLDED: f"the scale {mul.name} folded into its weight and bias"}
        lin_node.replace_all_uses_with(new)
        gm.graph.erase_node(lin_node)
        mul.replace_all_uses_with(new if y is lin_node else y)
        gm.graph.erase_node(mul)
        folded.append(mul.name)
    if folded:
        gm.graph.lint()
        gm.recompile()
    return folded


__all__ = ["PREFIX", "SCALE_FOLDED", "fold_layer_scales"]
