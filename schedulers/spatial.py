"""Spatial slicer: which dims can be cut into independent parallel blocks, and why.

A dim can be cut only if the cut creates no dependency between blocks (paper,
Sec. 4.2): no op reduces over it (All-to-One), and no intermediate space is
broadcast along it (One-to-All from a computed space), which would make every
block recompute that intermediate.  Inputs broadcast along the dim are fine:
each block re-reads them from device memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from smg.ir import SMG, Kind


@dataclass(frozen=True)
class DimDecision:
    """Whether ``dim`` may be cut, and why.  ``recomputes`` lists the
    intermediates a cut would recompute per block (a cut the scheduler may
    still choose when keeping the dim whole does not fit on chip)."""

    dim: str
    cut: bool
    reason: str
    recomputes: tuple[str, ...] = ()


#: analyse_spatial's decisions by SMG content key: the search builds tens of thousands of schedules of
#: one SMG, each asking again (7 of the 42 s that ranking a causal LLaMA attention took)
_DECISIONS: dict[str, tuple[DimDecision, ...]] = {}


def analyse_spatial(smg: SMG) -> tuple[DimDecision, ...]:
    """Decide for every dim of ``smg`` whether the spatial slicer may cut it (memoised per content key)."""
    if smg.key not in _DECISIONS:
        if len(_DECISIONS) > 4096:
            _DECISIONS.clear()
        _DECISIONS[smg.key] = _analyse_spatial(smg)
    return _DECISIONS[smg.key]


def elementwise_serial(smg: SMG) -> str | None:
    """The serial dim of an element-wise graph (no op reduces): the innermost dim of every output, which a
    block streams whole in contiguous runs (16-byte vector accesses along the row).  None where some op
    reduces (the temporal slicer's serial dim is then a reduced one) or the outputs end in different dims.

    A graph without reductions could be cut along every dim; keeping the rows' dim whole gives the
    CUDA-core lowering its serial loop (and reads at ``j +- c`` along it, RoPE's rotate-half, stay in the
    block's own rows)."""
    if not smg.ops or any(op.reduce for op in smg.ops):
        return None
    lasts = {smg.space(o).dims[-1] if smg.space(o).dims else None for o in smg.outputs}
    return lasts.pop() if len(lasts) == 1 and None not in lasts else None


def input_views(smg: SMG) -> set[str]:
    """Intermediates that only re-index an input (an op whose body is its one input, read through index
    expressions: a convolution's im2col view, an upsampling): cutting a dim they are broadcast along
    re-reads that input per block, as for the input itself; nothing is recomputed."""
    return {op.out for op in smg.ops if not op.reduce and len(op.inputs) == 1 and op.body == op.inputs[0].space
            and op.inputs[0].space in smg.inputs}


def _analyse_spatial(smg: SMG) -> tuple[DimDecision, ...]:
    produced = {op.out for op in smg.ops}
    out_dims = {d for o in smg.outputs for d in smg.space(o).dims}
    row = elementwise_serial(smg)
    views = input_views(smg)
    decisions = []
    for dim in (d.name for d in smg.dims):
        if dim == row:
            decisions.append(DimDecision(dim, False, f"element-wise graph: {dim}, the outputs' innermost dim, is "
                                                     f"the serial dim a block streams whole (contiguous runs)"))
            continue
        reducers = [op.out for op in smg.ops if dim in op.reduce]
        recompute = sorted({
            e.src for e in smg.edges
            if e.src in produced and e.src not in views and e.kind(dim) is Kind.ONE_TO_ALL
        })
        if reducers:
            why = f"All-to-One along {dim} in {', '.join(reducers)}: blocks would need each other's partial results"
            decisions.append(DimDecision(dim, False, why))
        elif dim not in out_dims:
            decisions.append(DimDecision(dim, False, f"{dim} is not a dimension of any output"))
        elif recompute and _cheap(smg, recompute):
            why = (f"One-to-All along {dim} from intermediate {', '.join(recompute)}, cheap to recompute per block "
                   f"({_upstream_work(smg, recompute)} elements of work, under 1/{CHEAP_RECOMPUTE} of the output)")
            decisions.append(DimDecision(dim, True, why, tuple(recompute)))
        elif recompute and (gemms := _prologue_of(smg, dim, recompute)):
            why = (f"One-to-All along {dim} from intermediate {', '.join(recompute)}, the prologue of "
                   f"{', '.join(gemms)}: recomputed per block on the operand tile the GEMM re-reads there anyway "
                   f"({_upstream_work(smg, recompute)} elements of work, under 1/{CHEAP_RECOMPUTE} of the GEMM's)")
            decisions.append(DimDecision(dim, True, why, tuple(recompute)))
        elif recompute:
            why = (f"One-to-All along {dim} from intermediate {', '.join(recompute)}: every block "
                   f"would recompute it")
            decisions.append(DimDecision(dim, False, why, tuple(recompute)))
        else:
            bcast = sorted({e.src for e in smg.edges if e.kind(dim) is Kind.ONE_TO_ALL})
            extra = f"; inputs {', '.join(bcast)} are re-read per block" if bcast else ""
            decisions.append(DimDecision(dim, True, f"no All-to-One along {dim}{extra}"))
    return tuple(decisions)


#: an intermediate whose whole computation is under 1/this of the largest output is recomputed per block
#: rather than keeping its broadcast dim whole: a split reduction's combine (a sum over a few partials per
#: group, read by every pixel) or a norm's ``W + 1``; a GEMM's hidden tile (the MLP) is never this cheap
CHEAP_RECOMPUTE = 64


def _upstream_work(smg: SMG, spaces: list[str]) -> int:
    """Elements iterated by every op that ``spaces`` depend on (themselves included), inputs excluded."""
    seen: set[str] = set()
    todo = list(spaces)
    while todo:
        s = todo.pop()
        op = smg.producer(s)
        if op is None or s in seen:
            continue
        seen.add(s)
        todo += [a.space for a in op.inputs]
    sizes = smg.dim_sizes
    return sum(math.prod(sizes[d] for d in smg.producer(s).iter_dims) for s in seen)


def _prologue_of(smg: SMG, dim: str, spaces: list[str]) -> tuple[str, ...]:
    """The GEMMs that ``spaces`` are the prologue of along ``dim`` (empty: they are not one): every op reading
    one of them broadcast along ``dim`` is a sum over a dim the op does not keep (a GEMM whose output columns
    ``dim`` indexes), and all that ``spaces`` depend on is under 1/``CHEAP_RECOMPUTE`` of those GEMMs' work.
    A norm before a projection (``rmsnorm(X) @ W``): a block of output columns re-reads the rows of X that
    the GEMM multiplies, and their statistics cost a few operations an element against ``dim``'s
    multiply-adds.  An MLP's hidden tile or attention's scores are GEMMs of their own, never this cheap."""
    readers = {op.out: op for op in smg.ops if dim in op.iter_dims
               and any(a.space in spaces and dim not in a.dims_in(" ".join(a.index)) for a in op.inputs)}
    if not readers or any(op.combiner != "sum" or not op.reduce for op in readers.values()):
        return ()
    sizes = smg.dim_sizes
    work = sum(math.prod(sizes[d] for d in op.iter_dims) for op in readers.values())
    return tuple(readers) if _upstream_work(smg, spaces) * CHEAP_RECOMPUTE <= work else ()


def _cheap(smg: SMG, spaces: list[str]) -> bool:
    sizes = smg.dim_sizes
    biggest = max(math.prod(sizes[d] for d in smg.space(o).dims) for o in smg.outputs)
    return _upstream_work(smg, spaces) * CHEAP_RECOMPUTE <= biggest


def cuttable(smg: SMG) -> tuple[str, ...]:
    return tuple(d.dim for d in analyse_spatial(smg) if d.cut)
