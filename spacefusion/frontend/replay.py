"""One CUDA graph per compiled Dynamo graph: the whole fused forward replayed with one host call.

A fused model is a chain of small kernels; launched one by one from Python, the host time per launch
(tens of µs) exceeds what most of them take on the GPU.  ``GraphReplay`` captures the compiled graph once
(after a warm-up on a side stream, which loads every kernel module and builds its tensor maps) and then
each call copies the inputs that change into the captured ones and replays.  Parameters are not copied:
their tensors are the ones the graph was compiled with (``dynamo._Compiled`` guards them).

``clone_outputs``: the captured outputs are rewritten by the next replay.  By default each call returns
copies (safe; one device copy per output); ``mode="reduce-overhead"`` returns the captured tensors
themselves, as ``torch.compile``'s CUDA graphs do (valid until the next call).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._pytree import tree_map


class GraphReplay:
    """``fn(*args)`` captured as one CUDA graph; ``static`` are the positions of ``args`` whose tensors
    stay the same objects on every call (baked parameters): every other tensor is copied in."""

    def __init__(self, fn: Callable[..., Any], args: list[Any], static: Iterable[int], clone_outputs: bool = True,
                 warmup: int = 2) -> None:
        self.clone_outputs = clone_outputs
        static = set(static)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(warmup):
                fn(*args)
        torch.cuda.current_stream().wait_stream(side)
        self.inputs = [a.clone() if isinstance(a, torch.Tensor) and i not in static else a for i, a in enumerate(args)]
        self.copied = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and i not in static]
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.no_grad():
            self.outputs = fn(*self.inputs)

    def __call__(self, *args: Any) -> Any:
        for i in self.copied:
            self.inputs[i].copy_(args[i])
        self.graph.replay()
        if not self.clone_outputs:
            return self.outputs
        return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, self.outputs)
