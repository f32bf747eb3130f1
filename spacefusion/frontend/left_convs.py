"""A convolution left to torch whose output fused kernels read channels-last runs channels-last itself.

An NCHW model's RGB stem stays with cuDNN (three input channels: ``convs.conv_refusal``), and the fused
kernels after it bind images channels-last.  Left as it is, cuDNN converts the NCHW image to NHWC, convolves,
converts its output back to NCHW, and the next kernel's binding copies that to NHWC again: on the H200,
ResNet-50 at batch 32 spent 70.8 + 48.9 + 115.8 us on the three (``experiments/results/
dynamo_resnet_layouts_h200.json``, the run before this).  Given a channels-last image, torch's convolution
answers channels-last, which the binding then reads as it lies."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import fx

from spacefusion.frontend.graph import contiguous, contiguous_nhwc, conv_of
from spacefusion.frontend.records import Subgraph

#: the channels-last binding of an NCHW-shaped image ([n, c, h, w] viewed as [n, h, w, c])
NHWC = (0, 2, 3, 1)
#: said after such a conv's reason in the partition
CHANNELS_LAST = "run channels-last: the fused kernels read its output so"


def channels_last_left_convs(gm: fx.GraphModule, fused: Iterable[Subgraph]) -> set[str]:
    """Copy the NCHW image of each convolution left to torch whose output a fused kernel binds channels-last
    into channels-last memory before it (one copy of the conv's input instead of two of its output); the
    names of the convolutions changed.  Values are unchanged: only their memory order.  A convolution that
    is itself part of a fused subgraph (after the nearest upsampling it reads through: ``fold_upsample``) is
    not left to torch and is not touched: a copy before it would sit inside that subgraph and close a cycle
    through its kernel."""
    fused = list(fused)
    read_nhwc = {op.ref for s in fused for op in s.operands if op.source == "value" and op.permute == NHWC}
    inside = {name for s in fused for name in s.nodes}
    done: set[str] = set()
    for node in list(gm.graph.nodes):
        cv = conv_of(node, gm) if node.name in read_nhwc and node.name not in inside else None
        if cv is None or cv.dims != 2 or not contiguous(cv.x) or contiguous_nhwc(cv.x):
            continue
        with gm.graph.inserting_before(node):
            image = gm.graph.call_method("contiguous", (cv.x,), {"memory_format": torch.channels_last})
        node.replace_input_with(cv.x, image)
        done.add(node.name)
    if done:
        gm.recompile()
    return done
