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

Not taken below ``PROLOGUE_MIN_ROWS`` rows (a decoding step's GEMVs): there the normalised rows are a few KB,
so the prologue saves next to nothing, and on the H100 it cost much more than that (LLaMA-2-7B's decode step,
one token: the gate/up GEMV with the norm as its prologue 283 us a call, the plain GEMV after the norm's own
kernel 62 us; the stacked q/k/v 57 us against 44), a SIMT GEMV with the row statistics recomputed per block
being ranked no better than a plain one.

Nor is it taken by a gated GEMM's pair of linears (``act(x @ Wg) * (x @ Wu)``, LLaMA's gate/up): on the H100
LLaMA-2-7B's 2048x11008x4096 gated GEMM with the norm as its prologue ran 947 us a call against 517 without
(its first pick, a persistent wgmma kernel, estimated 525 us: the model does not see what costs it the
difference), which undid the rest of the prologues' gain (the 4-layer prefill 7718 us against 6307).  The
q/k/v projections keep it (the stacked GEMM 285 us against 279; Qwen2's and LLaMA's plain GEMMs 1.05-1.08x
torch's norm + cuBLAS in ``experiments/results/norm_gemm_h100.json``).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from spacefusion.frontend.gated import gated_of
from spacefusion.frontend.graph import (
    ADD,
    dtype,
    is_function,
    linear_of,
    norm_of,
    read_rstd,
    rows,
    shape,
    single_user,
)
from spacefusion.frontend.guard import clamp_of, guard_of

#: the fewest rows a norm's GEMMs take it as their prologue (the module's docstring says why)
PROLOGUE_MIN_ROWS = 16


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
        if dtype(node) is None or shape(nm.x) != shape(node) or not node.users or read_rstd(nm, node) is not None:
            continue
        if shape(node) is None or rows(shape(node)) < PROLOGUE_MIN_ROWS:
            continue
        lins = [linear_of(u, gm) for u in node.users]
        if not all(lin is not None and lin.x is node and not lin.stored_kn for lin in lins):
            continue
        if any(_gated(u, gm) for u in node.users):
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


def _gated(lin: fx.Node, gm: fx.GraphModule) -> bool:
    """Whether the linear ``lin`` is one of a gated GEMM's pair: its output, or its activation's, is a factor
    of a gated product (``gated.gated_of``)."""
    seen = [lin, *(u for u in lin.users if len(u.args) >= 1 and u.args[0] is lin)]
    return any(gated_of(w, gm) is not None for v in seen for w in v.users)
