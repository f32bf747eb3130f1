"""An inference BatchNorm after a convolution that torch keeps, folded into that convolution's weight and bias.

``convs.match_conv`` folds a BatchNorm into the implicit GEMM it builds.  A convolution it refuses, or that the
backend leaves to its library (ResNet's RGB stem on the GPU: ``CudaBackend.library_first``), stays with cuDNN,
and its BatchNorm used to stay with torch as a kernel of its own (67 us for ResNet-50's stem at batch 32 on the
H100, as much as the conv).  Folded here, torch runs one conv with a bias,
and the ReLU and max pool after it become one fused kernel (``match_max_pool``), which also takes the shift
where a pool follows (the conv then runs without a bias).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import fx
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from spacefusion.frontend.convs import conv_refusal, library_stem
from spacefusion.frontend.graph import (
    activation_of,
    batchnorm_of,
    conv_of,
    dtype,
    is_max_pool,
    param_tensor,
    shape,
    single_user,
)

#: the meta key of a conv node that carries a folded BatchNorm: what was folded where (the partition report says it)
BN_FOLDED = "sf_bn_folded"
#: the folded weights' buffer name prefix
PREFIX = "_sf_bnfold"


def fold_batchnorm(get: Callable[[str], torch.Tensor], mean: str, var: str, weight: str | None, bias: str | None,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """An inference BatchNorm as ``y = x * scale + shift`` per channel, in float32 (``get``: a reference's
    tensor): ``scale = gamma / sqrt(var + eps)``, ``shift = beta - mean * scale``.  A conv before it folds as
    ``W * scale`` and ``b * scale + shift``; ``fused._conv_param`` folds our convs' weights the same way."""
    scale = torch.rsqrt(get(var).detach().float() + float(eps))
    if weight:
        scale = scale * get(weight).detach().float()
    shift = -get(mean).detach().float() * scale
    if bias:
        shift = shift + get(bias).detach().float()
    return scale, shift


def fold_bn_into_left_convs(gm: fx.GraphModule, library: Mapping[str, str] | None = None) -> list[str]:
    """Rewrite each ``conv -> BatchNorm`` (eval mode, the BatchNorm the conv's only reader) where ``match_conv``
    refuses the conv (``conv_refusal``, or the backend's ``library`` takes it: ``convs.library_stem``; it stays
    with torch) as one ``F.conv2d`` with the folded weight
    ``W * gamma / sqrt(var + eps)`` and bias ``(b - mean) * gamma / sqrt(var + eps) + beta``, computed in float32
    and stored in the weight's dtype; returns the BatchNorms' node names.  Only zero padding folds this way
    (``F.conv2d`` has no other), and only 2-D convolutions (a 1-D one's BatchNorm stays with torch)."""
    folded: list[str] = []
    for node in list(gm.graph.nodes):
        cv = conv_of(node, gm)
        if cv is None or cv.dims != 2 or cv.padding_mode != "zeros" \
                or (conv_refusal(cv, shape(cv.x), dtype(node)) is None and library_stem(cv, library or {}) is None):
            continue
        u = single_user(node)
        bn = batchnorm_of(u, gm) if u is not None else None
        if bn is None or bn.x is not node:
            continue
        with torch.no_grad():
            w = param_tensor(gm, cv.weight)
            b = param_tensor(gm, cv.bias).float() if cv.bias else torch.zeros(cv.cout, device=w.device)
            scale, shift = fold_batchnorm(lambda ref: param_tensor(gm, ref), bn.mean, bn.var, bn.weight, bn.bias,
                                          bn.eps)
            wf = (w.float() * scale[:, None, None, None]).to(w.dtype).contiguous()
            bf = (b * scale + shift).to(w.dtype).contiguous()
        pooled = _relu_then_max_pool(u, gm)
        if pooled:  # the shift after the conv, where the pool's kernel takes it (after its max)
            bf = bf.reshape(1, -1, 1, 1)
        names = []
        for part, t in (("weight", wf), ("bias", bf)):
            name = f"{PREFIX}_{node.name}_{part}"
            gm.register_buffer(name, t, persistent=False)
            names.append(name)
        with gm.graph.inserting_before(u):
            wn, bnode = gm.graph.get_attr(names[0]), gm.graph.get_attr(names[1])
            conv = gm.graph.call_function(F.conv2d, (cv.x, wn, None if pooled else bnode, cv.stride, cv.padding,
                                                     cv.dilation, cv.groups))
            out = gm.graph.call_function(operator.add, (conv, bnode)) if pooled else conv
        out.meta = dict(u.meta)
        conv.meta = {**u.meta, BN_FOLDED: "its inference BatchNorm's scale folded into its weight, the shift into "
                     "the pool's kernel" if pooled else "its inference BatchNorm folded into its weight and bias"}
        for a, t in ((wn, wf), (bnode, bf)):
            a.meta = {"tensor_meta": _extract_tensor_metadata(t)}
        u.replace_all_uses_with(out)
        folded.append(u.name)
        gm.graph.erase_node(u)
        gm.graph.erase_node(node)
    if folded:
        gm.graph.lint()
        gm.recompile()
    return folded


def _relu_then_max_pool(node: fx.Node, gm: fx.GraphModule) -> bool:
    """``node`` is read by a ReLU alone, which a max pool alone reads (ResNet's stem): the pool's fused kernel
    then adds the BatchNorm's shift after its max, and cuDNN's conv runs without a bias (with one, torch
    added it in a pass of its own over the 51 MB image: 77 us on the H100)."""
    r = single_user(node)
    return r is not None and activation_of(r, gm) == "relu" and (p := single_user(r)) is not None \
        and is_max_pool(p, gm)


__all__ = ["BN_FOLDED", "fold_batchnorm", "fold_bn_into_left_convs"]
