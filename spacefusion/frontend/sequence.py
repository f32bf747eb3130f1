"""Kernels run as one: a split reduction's ``partial``, ``stats`` and ``apply`` (``schedulers.split``).

The sequence is a ``Kernel`` like any other: by name on every backend, and on the GPU with the positional
and lean calls ``FusedKernel`` plans (so it replays in a CUDA graph).  Each kernel takes its inputs by name
from the graph's inputs and the earlier kernels' outputs (the partial's as ``<name>_p``, the names the
combine reads them by); the split's input views (``s`` as ``(s_part, s2)``) are the kernels' own shapes,
taken as views of the same memory.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from schedulers.split import SplitReduction

Kernel = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def links(split: SplitReduction) -> dict[str, str]:
    """The combine's inputs that are the partial's outputs: ``{combine input: partial output}``."""
    outs = set(split.partial.outputs)
    return {name: name[:-2] for name in split.combine.inputs if name.endswith("_p") and name[:-2] in outs}


def _produced(i: int, name: str) -> str:
    return f"{name}_p" if i == 0 else name


def sequence(split: SplitReduction, kernels: list[Kernel]) -> Kernel:
    """``kernels`` (``split.kernels``' compiled by one backend) as one kernel of ``split.smg``."""
    smgs = split.kernels
    names = tuple(n for n in split.smg.inputs if any(n in k.inputs for k in smgs))

    def run(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        env = dict(inputs)
        for i, (smg, kernel) in enumerate(zip(smgs, kernels)):
            out = kernel({k: env[k].reshape(smg.shape(k)) for k in smg.inputs})
            env |= {_produced(i, k): v for k, v in out.items()}
        return {k: env[k] for k in split.smg.outputs}

    run.split = split  # type: ignore[attr-defined]
    if not all(hasattr(k, "positional") for k in kernels):
        return run

    # positions in one flat list: the graph's inputs, then each kernel's outputs in its order
    slot = {n: i for i, n in enumerate(names)}
    for i, kernel in enumerate(kernels):
        for k in kernel.outputs:
            slot[_produced(i, k)] = len(slot)
    takes = [[slot[k] for k in kernel.inputs] for kernel in kernels]
    last = kernels[-1]

    def positional(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        env = list(xs)
        for kernel, take in zip(kernels, takes):
            env += kernel.positional(*(env[j] for j in take))
        return tuple(env[-len(last.outputs):])

    def lean(device: int, out_shapes: list[tuple[int, ...] | None]) -> Callable[..., tuple[torch.Tensor, ...]]:
        calls = [k.lean(device, [None] * len(k.outputs)) for k in kernels[:-1]] + [last.lean(device, out_shapes)]

        def call(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            env = list(xs)
            for c, take in zip(calls, takes):
                env += c(*(env[j] for j in take))
            return tuple(env[-len(last.outputs):])

        return call

    run.positional = positional  # type: ignore[attr-defined]
    run.lean = lean  # type: ignore[attr-defined]
    run.inputs = names  # type: ignore[attr-defined]
    run.outputs = last.outputs  # type: ignore[attr-defined]
    run.kernels = tuple(kernels)  # type: ignore[attr-defined]
    return run


__all__ = ["links", "sequence"]
