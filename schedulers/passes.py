"""The cut of a derived backward (``smg.autodiff``) into kernels, one SMG per pass, each for the slicers.

A gradient that reduces over a dim is a running state over it; gradients that reduce over the same dims
share a pass (attention's dK and dV, both sums over the queries: blocked over keys, serial over queries;
dQ, a sum over keys: blocked over queries, serial over keys).  A gradient that reduces nothing (a norm's dX)
is a pass of its own, with the row reductions it reads inside it; gradients that reduce nothing over the same
dims and read the same backward reduction share one (a gated activation's dG and dU after the GEMM dH: the
GEMM computed once, both in its epilogue).  A backward reduction in a pass whose output lacks a dim of
every output of the pass that nothing in the pass reduces would be recomputed by every block along that dim
(the spatial slicer's One-to-All from an intermediate): it is cut into a pass of its own that runs first,
and every pass reads it (FlashAttention's preprocess: ``Delta = rowsum(dO * O)``).
dQ's reduction across key blocks is therefore a separate pass blocked over queries, which recomputes S and
P; FlashAttention-3's alternative, atomics of partial dQ tiles from the key-blocked pass, is not offered yet.
"""

from __future__ import annotations

from dataclasses import dataclass

from smg.autodiff import Backward
from smg.ir import SMG
from smg.subgraph import sub_smg


@dataclass(frozen=True)
class Pass:
    """One kernel of a backward: its SMG (with the derivation in its attrs) and why it is cut so."""

    name: str
    smg: SMG
    why: str


def _needed(g: SMG, outs: list[str], stop: set[str]) -> list:
    want, stack = set(), list(outs)
    while stack:
        s = stack.pop()
        op = g.producer(s)
        if op is None or s in want or s in stop:
            continue
        want.add(s)
        stack.extend(a.space for a in op.inputs)
    return [op for op in g.ops if op.out in want]


def _reductions(g: SMG, out: str) -> set[str]:
    return {op.out for op in _needed(g, [out], set()) if op.kind == "backward" and op.reduce}


def _sharing(g: SMG, groups: dict[tuple[str, ...], list[str]], out: str) -> tuple[str, ...] | None:
    """The key of a pass of gradients that reduce nothing, over ``out``'s dims, reading a backward reduction
    ``out`` reads too: ``out`` joins it (a gated activation's dG and dU, both epilogues of the GEMM dH), so the
    reduction is computed once for both instead of once per gradient.  None where no such pass exists."""
    mine = _reductions(g, out)
    for key, outs in groups.items():
        if key[0].startswith("=") and g.space(outs[0]).dims == g.space(out).dims and mine & _reductions(g, outs[0]):
            return key
    return None


def backward_passes(bw: Backward) -> tuple[Pass, ...]:
    """The kernels of ``bw.graph`` in launch order."""
    g = bw.graph
    groups: dict[tuple[str, ...], list[str]] = {}
    for out in g.outputs:
        op = g.producer(out)
        key = op.reduce if op.reduce else _sharing(g, groups, out) or (f"={out}",)
        groups.setdefault(key, []).append(out)
    pre: list[str] = []
    for outs in groups.values():
        ops = _needed(g, outs, set())
        common = set.intersection(*(set(g.space(o).dims) for o in outs))
        reduced = {d for op in ops for d in op.reduce}
        for op in ops:
            if op.kind == "backward" and op.reduce and op.out not in outs:
                lacks = sorted(d for d in common if d not in g.space(op.out).dims and d not in reduced)
                if lacks and op.out not in pre:
                    pre.append(op.out)
    plan = []
    for p in pre:
        plan.append((p, _needed(g, [p], set(pre) - {p}), (p,),
                     f"{p} is read by every block along a dim it lacks: computed once, first"))
    for key, outs in groups.items():
        why = (f"{', '.join(outs)} reduce over {', '.join(key)}: running states of a serial walk over it"
               if not key[0].startswith("=") else f"{outs[0]} reduces nothing: its row reductions inside"
               if len(outs) == 1 else f"{', '.join(outs)} reduce nothing and read the same backward reductions "
               f"({', '.join(sorted(_reductions(g, outs[0])))}): one pass, each reduction computed once, the "
               "gradients its epilogue")
        plan.append(("_".join(outs), _needed(g, outs, set(pre)), tuple(outs), why))
    kernels = ["kernels (schedulers.passes), in launch order:"]
    kernels += [f"  {name}: {why}" for name, _, _, why in plan]
    derivation = (("derivation", "\n".join((*bw.derivation, *kernels))),)
    passes = []
    for name, ops, outs, why in plan:
        sm = sub_smg(g, ops, f"{g.name}_{name}")
        passes.append(Pass(name, SMG(sm.name, sm.dims, sm.spaces, sm.ops, outs, derivation), why))
    return tuple(passes)
