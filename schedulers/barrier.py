"""Barrier cut: a graph whose every dim some reduction forbids cutting runs as two graphs, cut after it.

A reduction over every dim of its input (``any(isinf(x))``, T5's fp16 guard) read back along those dims
(``clamp(x, -c, c)`` with ``c`` from the flag) leaves the spatial slicer nothing to cut: no block can
finish before every block has read its part.  Where the temporal slicer derives update functions for what
follows (softmax: ``exp(x - max)`` rescales), one kernel still streams it; where it does not (a norm of the
clamped rows: no carry moves a sum of squares across a changed clamp bound), the graph is partitioned, as
the paper partitions what cannot be scheduled: the reduction and what it needs (``head``) are materialised
in device memory, and the rest (``tail``) reads the result as an input.  The head, a reduction with no
dim left for blocks, then runs as a split reduction (``schedulers.split``); the tail is sliced afresh.
"""

from __future__ import annotations

from dataclasses import dataclass

from schedulers.errors import TemporalSliceError
from schedulers.spatial import cuttable
from schedulers.split import split_reduction
from smg.fold import fold_all
from smg.ir import SMG
from smg.subgraph import joined, sub_smg

#: the most partial totals a head is split into when the tail re-reduces them: each of the tail's threads
#: reads them all, one after another, before its loop (a separate kernel for the total would cost a launch)
TAIL_PARTS = 32


@dataclass(frozen=True)
class Barrier:
    """``smg`` as ``head`` (up to the reduction ``state``, its dims folded where the memory allows) then
    ``tail`` (which reads ``state`` as an input); ``reason`` says why."""

    smg: SMG
    state: str
    head: SMG
    tail: SMG
    reason: str


def find_barrier(smg: SMG) -> Barrier | str:
    """The first reduction that ``smg``'s later ops read back along a dim it reduces (directly or through
    ops of fewer dims), when no dim of ``smg`` can be cut and the ops after it can; else why there is none."""
    cut = cuttable(smg)
    if cut:
        return f"{smg.name}: dims {', '.join(cut)} can be cut into blocks: no barrier is needed"
    ops = list(smg.ops)
    for k, op in enumerate(ops):
        if not op.reduce:
            continue
        after = {op.out}  # what depends on the reduction, through ops of fewer dims too (a bound from it)
        for o in ops[k + 1:]:
            if any(a.space in after for a in o.inputs):
                after.add(o.out)
        back = [o.out for o in ops[k + 1:] if o.out in after and set(op.reduce) & set(o.iter_dims)
                and any(a.space in after and not set(op.reduce) & set(smg.space(a.space).dims) for a in o.inputs)]
        if not back:
            continue
        tail = sub_smg(smg, ops[k + 1:], f"{smg.name}.tail")
        tail_cut = cuttable(tail)
        if not tail_cut:
            continue
        # folded (``smg.fold``): the head's chunks are then slabs of the flat tensor, not rows of one dim
        # with the others kept per chunk
        head = fold_all(sub_smg(smg, ops[:k + 1], f"{smg.name}.head"))
        dims = ", ".join(op.reduce)
        reason = (f"{op.out} reduces over {dims} and {', '.join(back)} read{'s' if len(back) == 1 else ''} it back "
                  f"along them: no dim of {smg.name} can be cut into blocks, so {op.out} is materialised first "
                  f"({head.name}) and {tail.name} reads it (blocks over {', '.join(tail_cut)})")
        return Barrier(smg, op.out, head, tail, reason)
    return f"{smg.name}: no reduction is read back along the dims it reduces with the rest cuttable"


def stages(b: Barrier) -> tuple[tuple[SMG, dict[str, str]], ...]:
    """The kernels ``b`` runs, each with its outputs' names for the later ones.  A head with a dim to cut
    runs as it is; one without (a reduction over every dim) is split (``schedulers.split``) into at most
    ``TAIL_PARTS`` chunks, whose partial totals the tail reduces before its own ops: two kernels."""
    if cuttable(b.head):
        return ((b.head, {}), (b.tail, {}))
    sizes = b.head.dim_sizes
    dim = max((d for op in b.head.ops for d in op.reduce), key=lambda d: sizes[d])
    for parts in range(TAIL_PARTS, 1, -1):  # the most chunks whose totals the tail's blocks still re-reduce
        if sizes[dim] % parts:  # cheaply (the spatial slicer's rule: a small graph takes fewer)
            continue
        split = split_reduction(b.head, dim, parts, f"{dim!r} ({sizes[dim]}) in {parts} chunks, totalled by the tail")
        tail = joined(split.combine, b.tail, f"{b.smg.name}.tail")
        if cuttable(tail):
            return ((fold_all(split.partial), {o: f"{o}_p" for o in split.partial.outputs}), (tail, {}))
    raise TemporalSliceError(f"{b.head.name}: no split of {dim!r} ({sizes[dim]}) into 2 to {TAIL_PARTS} equal chunks "
                             f"leaves {b.tail.name} a dim to cut once it totals them", code="split.tail_uncut")


__all__ = ["TAIL_PARTS", "Barrier", "find_barrier", "stages"]
