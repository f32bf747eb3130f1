"""Exact element footprints with islpy (Presburger sets, symbolic in dim sizes).

islpy is imported inside the functions that use it: ``smg`` installs with numpy and sympy only (islpy comes
with the compiler extra), so importing this module must not need it.

``dependency_footprint`` answers the paper's question "which elements of which
tensors does one output element depend on" exactly, as polynomials in the
dimension sizes, by pulling the output element back through every mapping.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import sympy as sp

from smg.expr import Role
from smg.ir import SMG, Op

if TYPE_CHECKING:
    import islpy as isl


def _param(dim: str) -> str:
    return f"N_{dim}"


def _params(smg: SMG) -> str:
    return ", ".join(_param(d.name) for d in smg.dims)


def _bounds(dims: tuple[str, ...]) -> str:
    return " and ".join(f"0 <= {d} < {_param(d)}" for d in dims) or "true"


def _space_tuple(name: str, dims: tuple[str, ...]) -> str:
    return f"{name}[{', '.join(dims)}]"


def _access_map(smg: SMG, op: Op, space: str, index: tuple[str, ...]) -> isl.Map:
    import islpy as isl

    it = _space_tuple("IT_" + op.out, op.iter_dims)
    return isl.Map(f"[{_params(smg)}] -> {{ {it} -> {_space_tuple(space, index)} : {_bounds(op.iter_dims)} }}")


def _fit_multilinear(sample, dims: list[str]) -> sp.Expr:
    """Fit a polynomial of degree <= 1 per size from exact counts, then verify it.

    islpy here has no barvinok (no symbolic ``card``), so counts at concrete
    sizes (``count_val``) are interpolated; projections and windows give
    footprints that are products of per-dim affine terms, hence multilinear.
    """
    syms = [size_symbol(d) for d in dims]
    monos = [sp.Mul(*[s for s, e in zip(syms, es) if e]) for es in itertools.product((0, 1), repeat=len(dims))]
    pts = list(itertools.product((2, 3), repeat=len(dims)))
    rows = [[m.subs(dict(zip(syms, p))) for m in monos] for p in pts]
    vals = [sample(dict(zip(dims, p))) for p in pts]
    coef = sp.Matrix(rows).solve(sp.Matrix(vals))
    poly = sp.expand(sum(c * m for c, m in zip(coef, monos)))
    check = {d: 5 + 2 * i for i, d in enumerate(dims)}
    if poly.subs({size_symbol(d): v for d, v in check.items()}) != sample(check):
        raise ValueError("footprint is not multilinear in the dimension sizes")
    return poly


@dataclass(frozen=True)
class Footprint:
    """Per-space element counts (sympy, in ``N_<dim>`` symbols) for one output element."""

    counts: tuple[tuple[str, sp.Expr], ...]

    def as_dict(self) -> dict[str, sp.Expr]:
        return dict(self.counts)

    def total(self, exclude: tuple[str, ...] = ()) -> sp.Expr:
        return sp.expand(sum((c for n, c in self.counts if n not in exclude), sp.Integer(0)))


def _footprint_sets(smg: SMG, output: str, sizes: dict[str, int]) -> dict[str, isl.Set]:
    """Pull one element of ``output`` back through every mapping (concrete sizes)."""
    import islpy as isl

    fix = " and ".join(f"{_param(d)} = {v}" for d, v in sizes.items())
    out_dims = smg.space(output).dims
    origin = " and ".join(f"{d} = 0" for d in out_dims) or "true"
    need = {output: isl.Set(f"[{_params(smg)}] -> {{ {_space_tuple(output, out_dims)} : {origin} and {fix} }}")}
    for op in reversed(smg.ops):
        if op.out not in need:
            continue
        points = need[op.out].apply(_access_map(smg, op, op.out, op.out_index).reverse())
        for acc in op.inputs:
            got = points.apply(_access_map(smg, op, acc.space, acc.index))
            need[acc.space] = need[acc.space].union(got).coalesce() if acc.space in need else got
    return need


def dependency_footprint(smg: SMG, output: str | None = None) -> Footprint:
    """Elements of each space that one element of ``output`` depends on (exact),
    as polynomials in the dimension sizes ``N_<dim>``."""
    output = output or smg.outputs[0]
    names = [s.name for s in smg.spaces if s.name != output]
    dims = [d.name for d in smg.dims]
    cache: dict[tuple, dict[str, isl.Set]] = {}

    def sets(sz: dict[str, int]) -> dict[str, isl.Set]:
        k = tuple(sorted(sz.items()))
        if k not in cache:
            cache[k] = _footprint_sets(smg, output, sz)
        return cache[k]

    counts = []
    for name in names:
        if name not in sets({d: 2 for d in dims}):
            continue

        def sample(sz: dict[str, int], name: str = name) -> int:
            s = sets(sz).get(name)
            return 0 if s is None else int(s.count_val().to_python())

        counts.append((name, _fit_multilinear(sample, dims)))
    return Footprint(tuple(counts))


def size_symbol(dim: str) -> sp.Symbol:
    """The sympy symbol used for the size of ``dim`` in footprint polynomials (``smg.expr.Role.SIZE``)."""
    return Role.SIZE.symbol(_param(dim))
