"""The reverse sweep: adjoints of a forward SMG's spaces, op by op, with the duals of the mappings.

For an op ``y[I] = sum_R body(x_1, ...)`` and a space ``x`` it reads, the contribution to ``x``'s adjoint
is ``dy * d body / d x`` over the op's iteration space, reduced over the iteration dims ``x`` lacks:
``x``'s One-to-All (broadcast) dims become All-to-One (a reduction: a bias's gradient sums its rows, a
GEMM's ``dB`` sums over ``m``), the op's All-to-One dims ``R`` become One-to-All (``dy`` is read broadcast
along them), One-to-One stays One-to-One.  A contribution with a reduction is a new node (a backward
reduction); one without is an element-wise term of the adjoint.  A max that is a stabiliser
(``smg.autodiff.stabiliser``) gets no adjoint; any other max, a gathered or windowed access, or a
renamed one is refused with a ``BackwardError`` naming the op and the access.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy as sp

from smg.autodiff.local import in_terms_of_output, partial
from smg.autodiff.stabiliser import shift_trace
from smg.errors import BackwardError
from smg.expr import symbol
from smg.ir import SMG, Kind


@dataclass
class Node:
    """A space of the backward graph: a reduction (``reduce`` non-empty) or an element-wise value."""

    name: str
    dims: tuple[str, ...]
    reduce: tuple[str, ...]
    body: sp.Expr
    origin: str


@dataclass
class Sweep:
    adjoints: dict[str, sp.Expr]
    nodes: dict[str, Node]
    stabilisers: dict[str, tuple[str, ...]]
    notes: list[str] = field(default_factory=list)
    seeds: dict[str, str] = field(default_factory=dict)  # forward output -> its adjoint input's name


def _check_access(fwd: SMG, op) -> None:
    if op.out_index != fwd.space(op.out).dims:  # pragma: no cover - the Builder writes spaces in order
        raise BackwardError(f"op {op.out!r} ({op.kind}) writes its space in the order {op.out_index}")
    for a in op.inputs:
        if not a.plain:
            raise BackwardError(f"op {op.out!r} ({op.kind}) reads {a.space!r} at {a.index} (a gathered or "
                                f"windowed mapping): its dual is a scatter, which the backward does not derive "
                                f"yet")
        if a.index != fwd.space(a.space).dims:
            raise BackwardError(f"op {op.out!r} ({op.kind}) reads {a.space!r} at {a.index}, a renamed or permuted "
                                f"mapping of its dims {fwd.space(a.space).dims}: not derived yet")


def reverse_sweep(fwd: SMG, wrt: tuple[str, ...], taken: set[str]) -> Sweep:
    """Adjoints of every space on a path from ``wrt`` to the outputs."""
    needs = set(wrt)
    for op in fwd.ops:
        if any(a.space in needs for a in op.inputs):
            needs.add(op.out)
    stab: dict[str, tuple[str, ...]] = {}
    for op in fwd.ops:
        if op.combiner == "max" and op.out in needs:
            ok, steps = shift_trace(fwd, op.out)
            if not ok:
                raise BackwardError(f"op {op.out!r} ({op.kind}) is an All-to-One max over {op.reduce}: its "
                                    f"derivative is an argmax indicator, and it is no stabiliser ({steps[-1]})")
            stab[op.out] = steps
    names = set(taken)

    def fresh(base: str) -> str:
        n, name = 0, base
        while name in names:
            n += 1
            name = f"{base}{n}"
        names.add(name)
        return name

    sw = Sweep({}, {}, stab)
    for o in fwd.outputs:
        sw.seeds[o] = fresh(f"d{o}")
        sw.adjoints[o] = symbol(sw.seeds[o])
    for op in reversed(fwd.ops):
        if op.out not in sw.adjoints or op.out in stab:
            continue
        _check_access(fwd, op)
        ybar = sw.adjoints[op.out]
        targets = [a.space for a in op.inputs if a.space in needs and a.space not in stab]
        if len(targets) > 1 and not isinstance(ybar, sp.Symbol):
            # an adjoint that feeds several contributions: materialised once (dS of attention, dCb of a GEMM)
            node = Node(fresh(f"d{op.out}"), fwd.space(op.out).dims, (), ybar, f"adjoint of {op.out}")
            sw.nodes[node.name] = node
            ybar = symbol(node.name)
        for x in dict.fromkeys(targets):
            d = in_terms_of_output(op, x, partial(op, x))
            if d == 0:
                continue
            term = ybar * d
            kinds = dict(next(e for e in fwd.edges if e.src == x and e.dst == op.iteration_space).kinds)
            red = tuple(dim for dim in op.iter_dims if kinds[dim] is Kind.ONE_TO_ALL)
            duals = [f"{dim}: One-to-All -> All-to-One" for dim in red]
            duals += [f"{dim}: All-to-One -> One-to-All" for dim in op.reduce if dim in fwd.space(x).dims]
            if red:
                node = Node(fresh(f"d{x}"), fwd.space(x).dims, red, term, f"{op.out} -> {x}")
                sw.nodes[node.name] = node
                term = symbol(node.name)
            sw.notes.append(f"{op.out} -> {x}: d{op.out} * ({d})" + (f"  [{'; '.join(duals)}]" if duals else ""))
            sw.adjoints[x] = sw.adjoints.get(x, sp.Integer(0)) + term
    missing = [w for w in wrt if w not in sw.adjoints]
    if missing:
        raise BackwardError(f"no output of {fwd.name!r} depends on {missing}: nothing to differentiate")
    return sw
