"""One CUDA graph per compiled Dynamo graph: the whole fused forward replayed with one host call.

A fused model is a chain of small kernels; launched one by one from Python, the host time per launch
(tens of µs) exceeds what most of them take on the GPU.  ``GraphReplay`` captures the compiled graph once
(after a warm-up on a side stream, which loads every kernel module and builds its tensor maps) and then
each call copies the inputs that change into the captured ones and replays.  Parameters are not copied:
their tensors are the ones the graph was compiled with (``dynamo._Compiled`` guards them).

Inputs the graph writes in place (a ``StaticCache``'s K and V, ``index_copy_``'d at the new positions, and
its length counters; ``mutated_inputs``) are the caller's state: a replay must leave its writes there. One
that ``torch._dynamo.mark_static_address`` marked (HF's static caches allocated outside a compiled region)
is captured as it is, so each replay writes it directly (a decode step's cache is 134 MB for four
LLaMA-2-7B layers at 2048 positions: copying it in and out would cost more than the step); a call passing
another tensor there needs a new capture (``captures``), as torch's CUDA graph trees re-record. Any other
is copied in before each replay and back out after it, so a caller's tensor is never written by a later
call with other inputs. The warm-up runs on the caller's tensors, so what it wrote there is restored
before the capture: each call writes them once.

``clone_outputs``: the captured outputs are rewritten by the next replay.  By default each call returns
copies (safe; one device copy per output); ``mode="reduce-overhead"`` returns the captured tensors
themselves, as ``torch.compile``'s CUDA graphs do (valid until the next call).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import fx
from torch.utils._pytree import tree_map

from spacefusion.runtime.tensormap import deferred_copies

#: in-place ops that are not spelled with a trailing underscore (``x[i] = y``, ``x += y``, ``x &= y``, ...)
_WRITES = {operator.setitem, *(getattr(operator, f"i{op}") for op in (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor", "lshift", "rshift"))}


def writes_in_place(node: fx.Node) -> bool:
    """Whether ``node`` writes its first argument in place (``x.index_copy_(...)``, ``x[i] = y``, ``x += y``,
    ``torch.Tensor.copy_(x, y)``)."""
    if node.op == "call_method":
        name = str(node.target)
    elif node.op == "call_function":
        if node.target in _WRITES:
            return True
        if getattr(node.target, "__module__", None) == "_operator":  # operator.and_ / or_: x & y, not in place
            return False
        name = getattr(node.target, "__name__", "") or str(node.target)
    else:
        return False
    if name.startswith("__") and name.endswith("__"):  # x.__setitem__(i, y), x.__iadd__(y)
        return getattr(operator, name.strip("_"), None) in _WRITES
    return name.endswith("_") and not name.startswith("_")


def mutated_inputs(gm: fx.GraphModule) -> set[int]:
    """Positions of the placeholders that ``gm`` may write in place, directly or through a value derived
    from them (a view; over-approximated: anything computed from the input counts, which costs a copy at
    most, never a lost write)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    derived: dict[fx.Node, set[int]] = {n: {i} for i, n in enumerate(placeholders)}
    out: set[int] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        first = node.args[0] if node.args else None
        base = derived.get(first, set()) if isinstance(first, fx.Node) else set()
        if base:
            derived[node] = base
        if writes_in_place(node):
            out |= base
    return out


def unwritten_copies(args: Sequence[Any], written: Iterable[int]) -> list[Any]:
    """``args`` with copies at the positions a graph writes in place (``mutated_inputs``): what a pass that
    runs the graph at compile time (shapes, specialisation) runs it on, so the caller's state (a buffer
    updated in ``forward``) is written by its calls alone."""
    written = set(written)
    return [a.clone() if i in written and isinstance(a, torch.Tensor) else a for i, a in enumerate(args)]


class GraphReplay:
    """``fn(*args)`` captured as one CUDA graph; ``static`` are the positions of ``args`` whose tensors
    stay the same objects on every call (baked parameters). Of ``mutated`` (written in place by ``fn``),
    those marked as static addresses are captured as they are; the others, like every other tensor, are
    copied in, and copied back out after the replay."""

    def __init__(self, fn: Callable[..., Any], args: list[Any], static: Iterable[int], clone_outputs: bool = True,
                 warmup: int = 2, mutated: Iterable[int] = ()) -> None:
        self.clone_outputs = clone_outputs
        tensor = [isinstance(a, torch.Tensor) for a in args]
        static = set(static)
        mutated = {i for i in mutated if tensor[i]}
        self.pinned = sorted(i for i in mutated - static if hasattr(args[i], "_dynamo_static_input_type"))
        static |= set(self.pinned)
        saved = {i: args[i].clone() for i in mutated}  # the warm-up writes them: put back before the capture
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(warmup):
                fn(*args)
        torch.cuda.current_stream().wait_stream(side)
        for i, t in saved.items():
            args[i].copy_(t)
        self.inputs = [a.clone() if tensor[i] and i not in static else a for i, a in enumerate(args)]
        self.copied = [i for i in range(len(args)) if tensor[i] and i not in static]
        self.copied_back = sorted(mutated - static)
        self.graph = torch.cuda.CUDAGraph()
        with deferred_copies(), torch.cuda.graph(self.graph), torch.no_grad():
            self.outputs = fn(*self.inputs)

    def captures(self, args: Sequence[Any]) -> bool:
        """Whether ``args`` pass the captured tensors at the pinned positions (else capture again)."""
        return all(args[i] is self.inputs[i] for i in self.pinned)

    def __call__(self, *args: Any) -> Any:
        for i in self.copied:
            self.inputs[i].copy_(args[i])
        self.graph.replay()
        for i in self.copied_back:
            args[i].copy_(self.inputs[i])
        if not self.clone_outputs:
            return self.outputs
        return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, self.outputs)
