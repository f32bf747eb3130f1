"""What torch still runs of a fused graph, pruned: dead values removed, constants evaluated once.

Once the kernels have taken their ops, some of what torch would run is dead (HF's masks built from
aranges, which the attention now reads as index expressions) or constant (T5's
relative-position buckets: arithmetic on aranges alone).  An ``fx.GraphModule`` runs every node each call,
and on the GPU each is a kernel of a few µs: T5's buckets and masks were about 35 of them per forward.
Dead nodes are removed; nodes that read no input and no weight are evaluated once here and kept as
buffers (the values a call would compute, on the device the graph names).  Where the caller bakes the
weights (``weights=True``: the Dynamo backend, which rebuilds when a weight changes), nodes computed from
weights and constants alone are folded too: T5's position bias, an embedding of the constant buckets that
every layer's attention read through a copy (13 kernels a forward), BERT's position and token-type
embeddings.  Nothing that writes in place is removed; a constant written in place by an op that runs each
call, or returned, is not folded (each call needs a fresh one: a cache's lazily made zeros), and one
written by another constant op is folded only where every later reader sees it written.  No op that writes
in place is evaluated on a weight (that would change the model), views of a weight are left to run (they
cost no kernel, and a buffer would copy the weight), and a weight-derived value above ``WEIGHT_FOLD_BYTES``
is left to run (a buffer kept for the model's life, where torch frees it after each call).  Buffers are
contiguous, so a kernel binds them without a copy.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from spacefusion.frontend.replay import writes_in_place

#: a folded constant's buffer name prefix
PREFIX = "_sf_const"
#: the largest weight-derived value folded (bytes): larger ones are recomputed each call, as torch would
WEIGHT_FOLD_BYTES = 64 << 20
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


def _weights(gm: fx.GraphModule) -> dict[fx.Node, torch.Tensor]:
    """The tensors of ``gm``'s ``get_attr`` nodes."""
    out: dict[fx.Node, torch.Tensor] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value: Any = gm
            for part in str(node.target).split("."):
                value = getattr(value, part, None)
            if isinstance(value, torch.Tensor):
                out[node] = value
    return out


def _views_a_weight(value: torch.Tensor, weights: list[torch.Tensor]) -> bool:
    root = value._base if value._base is not None else value
    return any(root is w for w in weights)


def fold_constants(gm: fx.GraphModule, weights: bool = False) -> list[str]:
    """Evaluate the nodes that read no input (and, with ``weights``, only baked weights: ``gm``'s
    ``get_attr`` tensors) nor anything random, keep those that other nodes read as contiguous buffers of
    ``gm``, and remove what is then dead; the names of the nodes folded."""
    baked = _weights(gm) if weights else {}
    values: dict[fx.Node, Any] = dict(baked)
    derived: set[fx.Node] = set(baked)  # computed from a weight
    written_at: dict[fx.Node, int] = {}  # a constant written in place: where (the last time)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method") or not all(i in values for i in node.all_input_nodes):
            continue
        if node.op == "call_function" and node.is_impure():  # random ops, asserts, prints
            continue
        from_weight = any(i in derived for i in node.all_input_nodes)
        if from_weight and writes_in_place(node):  # evaluating it here would write the model's weight
            continue
        try:
            with torch.no_grad():
                values[node] = _evaluate(node, values)
        except Exception:  # not evaluable here (e.g. needs a value only a call has): torch runs it
            continue
        if from_weight:
            derived.add(node)
        if writes_in_place(node) and isinstance(node.args[0], fx.Node):
            written_at[node.args[0]] = order[node]
    fresh = _written_at_run_time(values)
    tensors = list(baked.values())
    for node, value in list(values.items()):
        readers = [u for u in node.users if u not in values]
        if node in baked or not readers or not isinstance(value, torch.Tensor):
            continue
        if node in written_at and any(order[u] < written_at[node] for u in readers):
            continue  # a reader before the write sees another value than the one computed here
        if node in fresh or any(u.op == "output" for u in readers):
            continue  # written by a call, or returned: a fresh tensor each call, not one buffer for all calls
        if node in derived and (_views_a_weight(value, tensors)
                                or value.numel() * value.element_size() > WEIGHT_FOLD_BYTES):
            continue
        name = f"{PREFIX}_{len([b for b, _ in gm.named_buffers() if b.startswith(PREFIX)])}"
        buffer = value.detach().clone(memory_format=torch.contiguous_format)
        gm.register_buffer(name, buffer)
        with gm.graph.inserting_before(node):
            attr = gm.graph.get_attr(name)
        attr.meta = {k: v for k, v in node.meta.items() if k != ORIGIN}
        attr.meta["tensor_meta"] = _extract_tensor_metadata(buffer)
        for u in readers:
            u.replace_input_with(node, attr)
    names = [_name(v) for v in values if v not in baked]
    gone = set(remove_dead(gm, set(values) - set(baked)))
    return [n for n in names if n in gone]


__all__ = ["ORIGIN", "PREFIX", "WEIGHT_FOLD_BYTES", "fold_constants", "remove_dead"]
