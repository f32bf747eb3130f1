"""The order a fused graph keeps around in-place writes, which no data edge carries.

A kernel that writes a graph value in place (``Subgraph.writes``: a decoder's KV caches, ``smg.stores``)
returns nothing for it: the attention after it reads the cache input itself.  A kernel that reads a value
some op of torch writes in place (a cache's length counter, ``cumulative_length.add_``, read by the kernel
that folds ``arange + counter`` into its positions) must read it where the graph read it.  The rewrite
(``fused.rewrite``) emits units in a topological order of their data edges; ``order_in_place`` adds these:

- a unit reading a value the kernel writes waits for the kernel where the graph read it after the kernel's
  last node, and is waited for where before;
- a unit writing in place a value the kernel reads waits for the kernel where the graph wrote it after the
  kernel's first read of it, and is waited for where before.
"""

from __future__ import annotations

from torch import fx

from spacefusion.frontend.records import Subgraph
from spacefusion.frontend.replay import writes_in_place

Unit = tuple[str, object]


def order_in_place(subs: list[Subgraph], by_name: dict[str, fx.Node], unit: dict[str, Unit],
                   index: dict[str, int], deps: dict[Unit, set[Unit]]) -> None:
    """Add to ``deps`` (unit -> the units it waits for) the order of each subgraph's in-place effects;
    ``unit`` maps a node's name to its unit (a subgraph's nodes share one), ``index`` to its place in the
    graph."""
    for sub in subs:
        me, members = unit[sub.nodes[0]], set(sub.nodes)
        last = max(index[n] for n in sub.nodes)
        for name in sub.writes:
            for reader in by_name[name].users:
                _order(deps, me, unit[reader.name], after=index[reader.name] > last)
        for name in {op.ref for op in sub.operands if op.source == "value"} - set(sub.writes):
            node = by_name[name]
            read = min((index[u.name] for u in node.users if u.name in members), default=last)
            for writer in node.users:
                if writes_in_place(writer) and writer.args and writer.args[0] is node:
                    _order(deps, me, unit[writer.name], after=index[writer.name] > read)


def _order(deps: dict[Unit, set[Unit]], me: Unit, other: Unit, after: bool) -> None:
    """``other`` waits for ``me`` (``after``) or ``me`` for ``other``; nothing where they are one unit."""
    if other != me:
        deps[other if after else me].add(me if after else other)
