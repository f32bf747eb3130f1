"""Norms that the GEMMs after them take as their prologue: ``q_proj(rmsnorm(h))`` as one kernel.

A pre-norm transformer normalises the residual stream and reads the result only through linears (LLaMA's
q/k/v and gate/up projections).  Fused as their prologue, the normalised rows are never written: each GEMM
reads ``h`` and computes its rows' sum of squares from the A tile it multiplies anyway, applying ``1/rms``
after the loop (``patterns.norm_prologue``; ``schedulers.spatial`` recomputes the statistics per block of
output columns).  The norm's weight is folded into each linear's weight once (``W[n, k] * (offset + g[k])``,
as a BatchNorm is folded into its conv), so the GEMM multiplies the staged rows themselves: wgmma's ss form,
row statistics beside it.  The weight stays [n, k] as ``nn.Linear`` stores it (a K-major B operand).

Taken where every reader of the norm is a linear of its output (a norm read by anything else is computed
anyway: nothing to save), the norm is an RMSNorm (a LayerNorm's bias term does not separate from its
statistics: ``warp_tile.gemm_with_statistics``), and its input is not a residual sum that only the norm's own
kernel could write: a ``residual + linear(..)`` is taken by that linear's epilogue instead
(``gemms._residual_after``), which writes the sum the norm's GEMMs and the next residual read.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from spacefusion.frontend.graph import ADD, dtype, is_function, linear_of, norm_of, shape, single_user
from spacefusion.frontend.guard import clamp_of, guard_of


@dataclass(frozen=True)
class Prologue:
    """A norm taken as the prologue of the linears reading it."""

    kind: str  # "rmsnorm"
    x: fx.Node  # the value normalised: what each GEMM reads as A
    weight: str | None  # folded into each linear's weight once, as ``offset + weight``
    offset: float
    eps: float
    readers: tuple[str, ...]  # the linears' nodes

    @property
    def label(self) -> str:
        return f"{self.kind}{f' ({self.offset:g} + w)' if self.offset else ''} + "


def prologues(gm: fx.GraphModule) -> dict[str, Prologue]:
    """The norms of ``gm`` taken as prologues, by their output node's name."""
    out = {}
    for node in gm.graph.nodes:
        nm = norm_of(node, gm) if node.op.startswith("call_") else None
        if nm is None or nm.kind != "rmsnorm" or nm.dims != 1 or not isinstance(nm.x, fx.Node):
            continue
        if dtype(node) is None or shape(nm.x) != shape(node) or not node.users:
            continue
        lins = [linear_of(u, gm) for u in node.users]
        if not all(lin is not None and lin.x is node and not lin.stored_kn for lin in lins):
            continue
        if guard_of(nm.x) is not None or clamp_of(nm.x) is not None or not _sum_written_elsewhere(nm.x, gm):
            continue
        out[node.name] = Prologue(nm.kind, nm.x, nm.weight, nm.offset, float(nm.eps),
                                  tuple(u.name for u in node.users))
    return out


def _sum_written_elsewhere(x: fx.Node, gm: fx.GraphModule) -> bool:
    """Whether ``x`` is written by something other than the norm's own kernel: any value but a residual
    add, or an add of a linear's output read by the add alone (that linear's epilogue takes the add)."""
    if not is_function(x, ADD) or len(x.args) != 2 or x.kwargs:
        return True
    return any(isinstance(a, fx.Node) and linear_of(a, gm) is not None and single_user(a) is x for a in x.args)
