"""Kernels built once for a range of row counts, served to every size of a graph with symbolic sizes.

Issue 55: a graph compiled with symbolic sizes (``compiled.PerShape``) is specialised to each new input
length, and each specialisation built its kernels anew, though a GEMM's (or a norm's) only size that follows
the length is its row count ``m`` (batch x sequence, flattened by the frontend's builders).  Where the
schedule allows it (``lower.symbolic.check``: ``m`` cut into blocks, neither serial nor reduced, plain reads,
the CUDA-core / llvm lowering), the kernel is built with ``m`` a run-time size over ``NEAR`` times the size it
was picked at (``lower.symbolic.around``: the range the family transfer trusts a ranking over,
``families.NEAR``), and a later specialisation whose SMG is of the same family (``families.family_key``: the
graph up to dim sizes, sizes written into ops included) with every other dim's size equal and ``m`` in that
range reuses it: no schedule, no TVM build.

The embeddings' gathered norm (``frontend.embeddings``) keeps its rows as the ids' dims (``[batch, seq]``: a
position term broadcasts over the batch): its run-time size is the ids' last dim, the sequence (``rows``),
read from the ids as from the other row buffers, the gathered table (the vocabulary) static
(``lower.symbolic``).

Contract: ``find`` returns a kernel only for such an SMG, and that kernel computes the SMG at its own sizes
(the kernel reads ``m`` from its inputs' shapes and checks the rest, ``SymbolicCpuKernel``).  ``build``
returns None where the schedule cannot take ``m`` at run time; the caller then builds the static kernel, as
before.
"""

from __future__ import annotations

from typing import Any

from schedulers.errors import ScheduleError
from schedulers.schedule import Schedule
from smg.ir import SMG
from smg.loads import loads_of
from spacefusion.frontend.families import NEAR, family_key

#: the dim a symbolic kernel takes at run time: the rows every GEMM / norm builder of the frontend names ``m``
ROWS = "m"


def rows(smg: SMG) -> str | None:
    """The dim of ``smg`` a symbolic kernel takes at run time: ``ROWS``; else, in a graph reading gathered rows
    (``smg.loads``: the embeddings' norm, its rows ``[batch, seq]``), the last dim of its first load's ids,
    the tokens' position (what a new length changes); None where there is neither."""
    if ROWS in smg.dim_sizes:
        return ROWS
    loads = loads_of(smg)
    return loads[0].dims[-1] if loads else None


def others(smg: SMG) -> dict[str, int]:
    """``smg``'s dim sizes but its rows: what must be equal for two graphs of a family to share a kernel."""
    return {d: n for d, n in sorted(smg.dim_sizes.items()) if d != rows(smg)}


def symbolic_dim(s: Schedule, smg: SMG) -> Any | None:
    """The ``SymbolicDim`` (``rows`` over ``NEAR`` times their size) ``s`` can be built with for ``smg``, or None:
    where the lowering refuses it (``lower.symbolic.check``) or ``s`` cuts another graph than ``smg`` (a fold,
    whose dims are not ``smg``'s: the runtime views tensors at ``smg``'s sizes)."""
    from spacefusion.lower.symbolic import around, check

    dim = rows(smg)
    if dim is None or s.smg.key != smg.key:
        return None
    try:
        sym = around(s, dim, NEAR)
        check(s, sym)
    except ScheduleError:
        return None
    return sym


class SymbolicKernels:
    """The symbolic kernels built so far, by family; ``reused`` names the SMGs served without a build."""

    def __init__(self) -> None:
        self._by_family: dict[str, list[tuple[dict[str, int], Any]]] = {}
        self.reused: list[str] = []

    def find(self, smg: SMG) -> Any | None:
        """A kernel built for ``smg``'s family whose range holds ``smg``'s rows, every other size equal; else None."""
        dim = rows(smg)
        if dim is None:
            return None
        rest, size = others(smg), smg.dim_sizes[dim]
        for got, kernel in self._by_family.get(family_key(smg), []):
            if got == rest and kernel.symbolic.dim == dim and kernel.symbolic.contains(size):
                self.reused.append(smg.name)
                return kernel
        return None

    def build(self, s: Schedule, target: str = "llvm") -> Any | None:
        """``s`` built with its rows a run-time size around its SMG's (kept for ``find``), or None where the
        schedule cannot take them at run time (``symbolic_dim``)."""
        from spacefusion.api import build

        sym = symbolic_dim(s, s.smg)
        if sym is None:
            return None
        kernel = build(s, target, symbolic=sym)
        self._by_family.setdefault(family_key(s.smg), []).append((others(s.smg), kernel))
        return kernel


__all__ = ["ROWS", "SymbolicKernels", "others", "rows", "symbolic_dim"]
