"""The channel concatenation builder (``match_concat``)."""

from __future__ import annotations

import torch
from torch import fx

from smg import patterns
from spacefusion.frontend.graph import dtype, shape
from spacefusion.frontend.matchers import Context, _build, _value
from spacefusion.frontend.records import Result, Subgraph


def match_concat(node: fx.Node, ctx: Context) -> Subgraph | None:
    """``torch.cat`` of images along the channels (a diffusion UNet's skip connections) -> ``patterns.concat``:
    each part a One-to-One read at its channel offset, in 16-byte runs where the parts' channels are multiples
    of 8.  The parts are bound channels-last and the output goes back with channels-last strides, as a conv's
    and a GroupNorm's are: a part lying NCHW is copied by its binding (the layout is not checked here, because
    the export's meta tensors give a channels-last conv's output NCHW strides).  Other concatenations stay
    torch's (a KV-cache append, a CLS token, RoPE's rotate-half, which ``match_rope`` takes first)."""
    if node.op != "call_function" or node.target not in (torch.cat, torch.concat) or not ctx.free(node):
        return None
    parts = node.args[0] if node.args else node.kwargs.get("tensors")
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    out, dt = shape(node), dtype(node)
    if out is None or len(out) != 4 or dim not in (1, -3) or not isinstance(parts, list | tuple) or len(parts) < 2:
        return None
    n, _, h, w = out
    ok = all(isinstance(p, fx.Node) and shape(p) is not None and len(shape(p)) == 4 and shape(p)[0] == n
             and shape(p)[2:] == (h, w) and shape(p)[1] > 0 and dtype(p) == dt for p in parts)
    if not ok or dt is None:
        ctx.refuse(node, "concat.parts",
                   f"a concatenation of {[shape(p) if isinstance(p, fx.Node) else p for p in parts]} "
                   f"({dt}) along the channels: the pattern takes two or more non-empty images of one "
                   "dtype and size")
        return None
    chans = tuple(shape(p)[1] for p in parts)
    smg = _build(ctx, node, lambda: patterns.concat(n, h * w, chans, dt))
    if smg is None:
        return None
    ops = tuple(_value(f"X{i}", p, (n, h * w, c), (0, 2, 3, 1)) for i, (p, c) in enumerate(zip(parts, chans)))
    res = Result("Y", node.name, out, permute=(0, 3, 1, 2), split=(n, h, w, sum(chans)))
    label = f"concat {' + '.join(map(str, chans))} {n}x{h}x{w} {dt}"
    return Subgraph("concat", label, (node.name,), smg, ops, (res,))
