"""Partition a captured graph into fused SMG subgraphs and the ops left to torch (each with a reason)."""

from __future__ import annotations

from collections.abc import Mapping

from torch import fx

from spacefusion.frontend.bn_fold import BN_FOLDED
from spacefusion.frontend.canon import canonical
from spacefusion.frontend.graph import call_name
from spacefusion.frontend.matchers import Context, LayoutOf, default_layout_of
from spacefusion.frontend.reasons import classify
from spacefusion.frontend.records import HEAVY_OPS, LeftOp, Partition, Subgraph
from spacefusion.frontend.refusals import DERIVED, Refusal
from spacefusion.frontend.refusals import META as REFUSAL_META
from spacefusion.frontend.table import ROWS


def partition(gm: fx.GraphModule, layout_of: LayoutOf | None = None,
              library: Mapping[str, str] | None = None) -> Partition:
    """Walk the pattern table (``table.ROWS``) in priority order over the graph, each row offered the nodes
    whose canonical op (``canon``) it anchors on (each node joins at most one subgraph); every other call
    node is left to torch, with the refusal (code and sentence) a builder recorded or its kind's.
    A builder that fails unexpectedly leaves its node to torch with the error: never a crash.
    ``layout_of`` decides a convolution's image layout (a backend's, which an export records); ``library``
    names the forms the backend leaves to torch's library kernels, each with why (the reason reported)."""
    ctx = Context(gm, layout_of=layout_of or default_layout_of, library=dict(library or {}))
    found: list[Subgraph] = []
    calls = [n for n in gm.graph.nodes if n.op.startswith("call_")]
    canon = {n.name: canonical(n, gm) for n in calls}  # each op in its one spelling, read once
    for row in ROWS:
        for node in calls:
            if node.name in ctx.claimed or not row.offered(canon[node.name]):
                continue
            try:
                sub = row.build(node, ctx)
            except Exception as exc:  # an op a builder did not foresee: left to torch, reported
                ctx.refuse(node, "build.crashed", f"{row.build.__name__} failed on it: {type(exc).__name__}: {exc}")
                continue
            if sub is not None:
                found.append(sub)
                ctx.claimed.update(sub.nodes)
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    found.sort(key=lambda s: max(order[n] for n in s.nodes))
    left = []
    for n in calls:
        if n.name not in ctx.claimed and not n.meta.get(DERIVED):
            why = ctx.refused.get(n.name) or n.meta.get(REFUSAL_META) or _classify(n, gm)
            folded = f" ({n.meta[BN_FOLDED]})" if n.meta.get(BN_FOLDED) else ""
            left.append(LeftOp(n.name, call_name(n, gm), why.sentence + folded, why.code))
    heavy = tuple(n.name for n in calls if canon[n.name] is not None and canon[n.name].op in HEAVY_OPS)
    return Partition(tuple(found), tuple(left), layouts=tuple(ctx.layouts.items()), heavy=heavy)


def _classify(node: fx.Node, gm: fx.GraphModule) -> Refusal:
    try:
        return classify(node, gm)
    except Exception as exc:  # the report must not be what crashes
        return Refusal("left.unclassified", f"unclassified op ({type(exc).__name__}: {exc})")
