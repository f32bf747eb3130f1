"""What every pattern builder shares: the partition's ``Context`` (what is claimed, what is refused and why, the
layout decisions) and the helpers that turn an SMG and its bindings into a ``Subgraph``.

A builder (a row of ``frontend.table``) returns a ``Subgraph``, or ``None`` when the node is not its pattern.
A node that is its pattern but cannot be fused (an attention mask, an unsupported dtype) is recorded with
``Context.refuse`` as a code and a sentence (``frontend.refusals``), which the partition report gives for it.
The builders live by concern: ``attention``, ``eager_attention``, ``alibi``, ``gemms``, ``convs``, ``norms``,
``rope``, ``concat``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property

from torch import fx

from smg.errors import SpaceFusionError
from smg.ir import SMG
from spacefusion.frontend.graph import norm_of, shape
from spacefusion.frontend.layouts import LayoutChoice, decide
from spacefusion.frontend.prologue import Prologue, prologues
from spacefusion.frontend.records import Operand, Result, Subgraph
from spacefusion.frontend.refusals import Refusal, refusal

#: how a partition decides a convolution's image layout: the backend's ``layout_of``, which an export records
#: and the GPU machine reads back (``default_layout_of`` where no backend is given)
LayoutOf = Callable[[SMG, SMG], LayoutChoice]


def default_layout_of(nchw: SMG, nhwc: SMG) -> LayoutChoice:
    """``layouts.decide`` for the machine the CUDA path ranks for here (``machine.ranking_hardware``: the GPU in
    hand's preset, else the reported default), for a partition made without a backend."""
    from spacefusion.frontend.machine import ranking_hardware

    return decide(nchw, nhwc, ranking_hardware().model)


@dataclass
class Context:
    gm: fx.GraphModule
    claimed: set[str] = field(default_factory=set)
    refused: dict[str, Refusal] = field(default_factory=dict)
    layout_of: LayoutOf = default_layout_of
    layouts: dict[str, str] = field(default_factory=dict)  # chosen conv SMG key -> why that layout
    #: forms the backend leaves to torch's library kernels, with why (``CudaBackend.library_first``)
    library: Mapping[str, str] = field(default_factory=dict)

    def free(self, *nodes: fx.Node) -> bool:
        return all(n.name not in self.claimed for n in nodes)

    def refuse(self, node: fx.Node, code: str, sentence: str) -> None:
        """Record why ``node`` is left to torch (the first reason given stands): a code declared in
        ``refusals.CODES`` and the sentence the report gives."""
        self.refused.setdefault(node.name, refusal(code, sentence))

    @cached_property
    def norm_inputs(self) -> set[str]:
        """The values a LayerNorm/RMSNorm normalises: an add among them is ``match_norm``'s to fuse (not a
        prologue's: the linear before it takes that add)."""
        found = (norm_of(n, self.gm) for n in self.gm.graph.nodes
                 if n.op.startswith("call_") and n.name not in self.prologues)
        return {nm.x.name for nm in found if nm is not None and isinstance(nm.x, fx.Node)}

    @cached_property
    def prologues(self) -> dict[str, Prologue]:
        """The norms the linears reading them take as their GEMMs' prologue (``frontend.prologue``)."""
        return prologues(self.gm)

    def prologue(self, x: object) -> Prologue | None:
        """The prologue a linear of ``x`` takes: ``x`` is such a norm's output."""
        return self.prologues.get(x.name) if isinstance(x, fx.Node) else None


def _value(space: str, node: fx.Node, shp: tuple[int, ...], permute: tuple[int, ...] | None = None) -> Operand:
    return Operand(space, "value", node.name, tuple(shp), permute=permute)


def _param(space: str, ref: str, shp: tuple[int, ...], transpose: bool = False) -> Operand:
    return Operand(space, "param", ref, tuple(shp), transpose)


def _subgraph(kind: str, label: str, nodes: tuple[fx.Node, ...], smg: SMG, operands: list[Operand],
              outs: dict[str, fx.Node]) -> Subgraph:
    results = tuple(Result(sp, outs[sp].name, shape(outs[sp])) for sp in smg.outputs)
    return Subgraph(kind, label, tuple(n.name for n in nodes), smg, tuple(operands), results)


def _build(ctx: Context, node: fx.Node, make: Callable[[], SMG]) -> SMG | None:
    try:
        return make()
    except SpaceFusionError as exc:
        ctx.refuse(node, "build.smg", f"its SMG cannot be built: {exc}")
        return None
