"""What torch still runs of a fused graph, pruned: dead values removed, constants evaluated once.

Once the kernels have taken their ops, some of what torch would run is dead (HF's masks built from
aranges, which the attention now reads as index expressions) or constant (T5's
relative-position buckets: arithmetic on aranges alone).  An ``fx.GraphModule`` runs every node each call,
and on the GPU each is a kernel of a few µs: T5's buckets and masks were about 35 of them per forward.
Dead nodes are removed; nodes that read no input and no weight are evaluated once here and kept as
buffers (the values a call would compute, on the device the graph names).  Nothing that writes in place
is removed; a constant written in place by an op that runs each call, or returned, is not folded (each call
needs a fresh one: a cache's lazily made zeros), and one written by another constant op is folded only
where every later reader sees it written.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from spacefusion.frontend.replay import writes_in_place

#: a folded constant's buffer name prefix
PREFIX = "_sf_const"
#: the meta key of a node's name in the graph a rewrite copied it from (the partition report names those)
ORIGIN = "sf_origin"


def _removable(node: fx.Node, local: set[fx.Node]) -> bool:
    """Unread and without effect; an in-place write counts as none where it writes a constant of the graph's
    own (``local``: computed from no input, so no caller's tensor)."""
    if node.users or node.op not in ("call_function", "call_method", "get_attr"):
        return False
    if node in local:  # a write to a constant nothing else reads any more (else that reader needs it)
        target = node.args[0] if writes_in_place(node) and node.args else None
        return not isinstance(target, fx.Node) or set(target.users) <= {node}
    return not (writes_in_place(node) or node.op == "call_function" and node.is_impure())


def _name(node: fx.Node) -> str:
    """The node's name in the graph it was copied from (``ORIGIN`` in its meta), else its own."""
    return node.meta.get(ORIGIN, node.name)


def remove_dead(gm: fx.GraphModule, local: set[fx.Node] = frozenset()) -> list[str]:
    """Remove the nodes whose values nothing reads (last first, so chains go too); their names."""
    gone: list[str] = []
    for node in reversed(list(gm.graph.nodes)):
        if _removable(node, local):
            gone.append(_name(node))
            gm.graph.erase_node(node)
    gm.recompile()
    return gone


def _evaluate(node: fx.Node, values: dict[fx.Node, Any]) -> Any:
    args = fx.node.map_arg(node.args, lambda n: values[n])
    kwargs = fx.node.map_arg(node.kwargs, lambda n: values[n])
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    self_, *rest = args
    return getattr(self_, node.target)(*rest, **kwargs)


def _written_at_run_time(values: dict[fx.Node, Any]) -> set[fx.Node]:
    """The constants a call writes in place (an op that runs each call: ``keys.index_copy_(2, pos, k)`` into
    a cache's lazily made zeros) and every constant connected to one (views of it, what it views, what is
    computed from them: over-approximated): each call needs fresh ones, and a view sees its base's writes."""
    hit = [u.args[0] for n in values for u in n.users
           if u not in values and writes_in_place(u) and u.args and u.args[0] is n]
    seen: set[fx.Node] = set()
    while hit:
        n = hit.pop()
        if n in seen:
            continue
        seen.add(n)
        hit += [m for m in (*n.all_input_nodes, *n.users) if m in values]
    return seen


def fold_constants(gm: fx.GraphModule) -> list[str]:
    """Evaluate the nodes that read no input and no weight (nor anything random), keep those that other
    nodes read as buffers of ``gm``, and remove what is then dead; the names of the nodes folded."""
    values: dict[fx.Node, Any] = {}
    written_at: dict[fx.Node, int] = {}  # a constant written in place: where (the last time)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method") or not all(i in values for i in node.all_input_nodes):
            continue
        if node.op == "call_function" and node.is_impure():  # random ops, asserts, prints
            continue
        try:
            with torch.no_grad():
                values[node] = _evaluate(node, values)
        except Exception:  # not evaluable here (e.g. needs a value only a call has): torch runs it
            continue
        if writes_in_place(node) and isinstance(node.args[0], fx.Node):
            written_at[node.args[0]] = order[node]
    fresh = _written_at_run_time(values)
    for node, value in list(values.items()):
        readers = [u for u in node.users if u not in values]
        if not readers or not isinstance(value, torch.Tensor):
            continue
        if node in written_at and any(order[u] < written_at[node] for u in readers):
            continue  # a reader before the write sees another value than the one computed here
        if node in fresh or any(u.op == "output" for u in readers):
            continue  # written by a call, or returned: a fresh tensor each call, not one buffer for all calls
        name = f"{PREFIX}_{len([b for b, _ in gm.named_buffers() if b.startswith(PREFIX)])}"
        gm.register_buffer(name, value.detach().clone())
        with gm.graph.inserting_before(node):
            attr = gm.graph.get_attr(name)
        attr.meta = {k: v for k, v in node.meta.items() if k != ORIGIN}
        for u in readers:
            u.replace_input_with(node, attr)
    names = [_name(v) for v in values]
    gone = set(remove_dead(gm, set(values)))
    return [n for n in names if n in gone]


__all__ = ["ORIGIN", "PREFIX", "fold_constants", "remove_dead"]
