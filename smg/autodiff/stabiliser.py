"""Which max-reductions are stabilisers: their adjoint is zero because no output depends on them.

A max over ``l`` (softmax's row max) has no useful derivative (an indicator of the argmax).  It needs none
when the graph's outputs are invariant under a shift of it: shift it by ``t`` and carry the shift forward,
op by op, with sympy.  An element-wise op whose shifted body differs from its body by a factor (or a term)
free of its inputs carries that factor (``P_exp -> P_exp e^{-t}``); a sum over ``l`` of a body scaled by a
factor free of ``l`` carries it (``P_sum -> P_sum e^{-t}``); an op whose shifted body equals its body ends
the shift (``P = P_exp / P_sum``).  The max is a stabiliser when every output ends unshifted.
"""

from __future__ import annotations

import sympy as sp

from smg.expr import symbol
from smg.ir import SMG

_T = sp.Symbol("t__shift", real=True)


def shift_trace(smg: SMG, space: str) -> tuple[bool, tuple[str, ...]]:
    """(whether shifting ``space`` by ``t`` leaves every output unchanged, the steps of the argument)."""
    shifted: dict[str, sp.Expr] = {space: symbol(space) + _T}
    steps: list[str] = []
    for op in smg.ops:
        touched = [a.space for a in op.inputs if a.space in shifted]
        if not touched or op.out == space:
            continue
        body = op.expr
        new = body.xreplace({symbol(s): shifted[s] for s in touched})
        y = symbol(op.out)
        if sp.simplify(new - body) == 0:
            steps.append(f"{op.out} unchanged")
            continue
        if op.combiner == "max":
            return False, (*steps, f"{op.out} is a max of a shifted body")
        ratio = sp.simplify(sp.powsimp(sp.expand(new / body, power_exp=True), force=True))
        ins = {symbol(a.space) for a in op.inputs} | {symbol(d) for d in op.iter_dims}
        if ratio.free_symbols & ins == set():
            shifted[op.out] = y * ratio
            steps.append(f"{op.out} -> {op.out}*{ratio}".replace("t__shift", "t"))
            continue
        diff = sp.simplify(new - body)
        if diff.free_symbols & ins == set() and not op.reduce:
            shifted[op.out] = y + diff
            steps.append(f"{op.out} -> {op.out} + {diff}".replace("t__shift", "t"))
            continue
        return False, (*steps, f"{op.out} changes with the shift ({op.body})")
    moved = [o for o in smg.outputs if o in shifted]
    if moved:
        return False, (*steps, f"output(s) {moved} change with the shift")
    return True, tuple(steps)
