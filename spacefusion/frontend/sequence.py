"""Kernels run as one: a split reduction's ``partial``, ``stats`` and ``apply`` (``schedulers.split``), and a
barrier's ``head`` and ``tail`` (``schedulers.barrier``).

A sequence is a ``Kernel`` like any other: by name on every backend, and on the GPU with the positional
and lean calls ``FusedKernel`` plans (so it replays in a CUDA graph).  Each kernel takes its inputs by name
from the graph's inputs and the earlier kernels' outputs (the partial's as ``<name>_p``, the names the
combine reads them by); the kernels' input views (a split's ``s`` as ``(s_part, s2)``, a folded head's flat
tensor) are the kernels' own shapes, taken as views of the same memory.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from schedulers.barrier import Barrier
from schedulers.split import SplitReduction
from smg.ir import SMG

Kernel = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def links(split: SplitReduction) -> dict[str, str]:
    """The combine's inputs that are the partial's outputs: ``{combine input: partial output}``."""
    outs = set(split.partial.outputs)
    return {name: name[:-2] for name in split.combine.inputs if name.endswith("_p") and name[:-2] in outs}


def sequence(split: SplitReduction, kernels: list[Kernel]) -> Kernel:
    """``kernels`` (``split.kernels``' compiled by one backend) as one kernel of ``split.smg``."""
    stages = [(g, {o: f"{o}_p" for o in g.outputs} if i == 0 else {}) for i, g in enumerate(split.kernels)]
    run = chain(split.smg, stages, kernels)
    run.split = split  # type: ignore[attr-defined]
    return run


def barrier_sequence(barrier: Barrier, stages: tuple[tuple[SMG, dict[str, str]], ...], kernels: list[Kernel]
                     ) -> Kernel:
    """The barrier's kernels (``schedulers.barrier.stages``, compiled by one backend) as one kernel of
    ``barrier.smg``."""
    run = chain(barrier.smg, list(stages), kernels)
    run.split = barrier  # type: ignore[attr-defined]
    return run


def chain(whole: SMG, stages: list[tuple[SMG, dict[str, str]]], kernels: list[Kernel]) -> Kernel:
    """``kernels`` run in order as one kernel of ``whole``: stage ``i`` is (its graph, its outputs renamed
    for the later stages), its kernel ``kernels[i]``."""
    names = tuple(n for n in whole.inputs if any(n in g.inputs for g, _ in stages))

    def run(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        env = dict(inputs)
        for (g, rename), kernel in zip(stages, kernels):
            out = kernel({k: env[k].reshape(g.shape(k)) for k in g.inputs})
            env |= {rename.get(k, k): v for k, v in out.items()}
        return {k: env[k] for k in whole.outputs}

    run.kernels = tuple(kernels)  # type: ignore[attr-defined]
    if not all(hasattr(k, "positional") for k in kernels):
        return run

    # positions in one flat list: the graph's inputs, then each kernel's outputs in its order
    slot = {n: i for i, n in enumerate(names)}
    for (_, rename), kernel in zip(stages, kernels):
        for k in kernel.outputs:
            slot[rename.get(k, k)] = len(slot)
    takes = [[slot[k] for k in kernel.inputs] for kernel in kernels]
    outs = tuple(o for o in whole.outputs)
    give = [slot[o] for o in outs]

    def positional(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        env = list(xs)
        for kernel, take in zip(kernels, takes):
            env += kernel.positional(*(env[j] for j in take))
        return tuple(env[j] for j in give)

    def lean(device: int, out_shapes: list[tuple[int, ...] | None]) -> Callable[..., tuple[torch.Tensor, ...]]:
        want = dict(zip(outs, out_shapes))  # each shape asked of the stage that writes that output
        calls = [k.lean(device, [want.get(rename.get(o, o)) for o in k.outputs])
                 for (_, rename), k in zip(stages, kernels)]

        def call(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            env = list(xs)
            for c, take in zip(calls, takes):
                env += c(*(env[j] for j in take))
            return tuple(env[j] for j in give)

        return call

    run.positional = positional  # type: ignore[attr-defined]
    run.lean = lean  # type: ignore[attr-defined]
    run.inputs = names  # type: ignore[attr-defined]
    run.outputs = outs  # type: ignore[attr-defined]
    return run


def launches(kernel: Kernel) -> int:
    """How many kernels a (possibly nested) sequence launches."""
    return sum(launches(k) for k in kernel.kernels) if hasattr(kernel, "kernels") else 1


__all__ = ["barrier_sequence", "chain", "launches", "links", "sequence"]
