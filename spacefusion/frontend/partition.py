"""Partition a captured graph into fused SMG subgraphs and the ops left to torch (each with a reason)."""

from __future__ import annotations

from collections.abc import Mapping

from torch import fx

from spacefusion.frontend.bn_fold import BN_FOLDED
from spacefusion.frontend.eager_attention import match_eager_attention
from spacefusion.frontend.graph import call_name
from spacefusion.frontend.matchers import MATCHERS, Context, LayoutOf, default_layout_of
from spacefusion.frontend.reasons import reason
from spacefusion.frontend.records import LeftOp, Partition, Subgraph


def partition(gm: fx.GraphModule, layout_of: LayoutOf | None = None,
              library: Mapping[str, str] | None = None) -> Partition:
    """Run the matchers in priority order over the graph (each node joins at most one subgraph); every
    other call node is left to torch, with the reason a matcher refused it or the reason for its kind.
    A matcher that fails unexpectedly leaves its node to torch with the error: never a crash.
    ``layout_of`` decides a convolution's image layout (a backend's, which an export records); ``library``
    names the forms the backend leaves to torch's library kernels, each with why (the reason reported)."""
    ctx = Context(gm, layout_of=layout_of or default_layout_of, library=dict(library or {}))
    found: list[Subgraph] = []
    calls = [n for n in gm.graph.nodes if n.op.startswith("call_")]
    for matcher in (match_eager_attention, *MATCHERS):
        for node in calls:
            if node.name in ctx.claimed:
                continue
            try:
                sub = matcher(node, ctx)
            except Exception as exc:  # an op a matcher did not foresee: left to torch, reported
                ctx.refuse(node, f"{matcher.__name__} failed on it: {type(exc).__name__}: {exc}")
                continue
            if sub is not None:
                found.append(sub)
                ctx.claimed.update(sub.nodes)
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    found.sort(key=lambda s: max(order[n] for n in s.nodes))
    left = tuple(LeftOp(n.name, call_name(n, gm), (ctx.refused.get(n.name) or _reason(n, gm)) + (
        f" ({n.meta[BN_FOLDED]})" if n.meta.get(BN_FOLDED) else "")) for n in calls if n.name not in ctx.claimed)
    return Partition(tuple(found), left, layouts=tuple(ctx.layouts.items()))


def _reason(node: fx.Node, gm: fx.GraphModule) -> str:
    try:
        return reason(node, gm)
    except Exception as exc:  # the report must not be what crashes
        return f"unclassified op ({type(exc).__name__}: {exc})"
