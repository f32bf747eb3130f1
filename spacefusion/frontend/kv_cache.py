"""A decoder's KV-cache writes taken into the kernel that computes what they write.

HF's ``StaticCache`` layer (``StaticLayer.update``) writes each step's K and V into caches the caller holds:
``keys.index_copy_(2, cache_position, key_states)`` and the same for the values, ``cache_position`` an int64
vector of the new positions.  Left to torch these are two tiny kernels a layer (48 of Qwen2.5-0.5B's ~100
per decode step, and 24 more for the positions' adds).  K is RoPE's output and V the projection's, laid out
over the same [b, s, h_kv, d] iteration space, so RoPE's kernel stores K straight into the key cache and
carries V into the value cache
(``patterns.rope(carry=True)``), both through ``smg.stores`` (``Cache[b, h, Pos[s], d] = value``).

Taken only where that is the same computation: an ``index_copy_`` along dim 2 (of -2) of a 4-d cache that
is a graph input (a caller's tensor, written in place: a cache made inside the graph, a lazy initialisation,
is a constant the graph's pruning could fold), packed, of the value's dtype and shape but for the positions,
by int64 positions of the value's sequence length, whose result nothing reads; and the written value read by
nothing else (it is not computed anywhere else).  What differs is said (``kv_cache.write`` for K,
``kv_cache.value`` for V: K taken, V left to torch) and that write stays with torch.

Where the positions are ``torch.arange(s) + counter`` (HF's ``cache_position``, the counter the layer's
``cumulative_length``, an int64 of one element) read by the taken writes alone, the kernel reads the counter
and stores at ``counter + s`` (``IndexedStore.offset``): the add is taken in too, and the arange is dead.  The
counter is bumped in place (``cumulative_length.add_``) after the add and before the writes in the graph, so
the kernel must read it before that bump: ``frontend.in_place`` orders the bump after the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from spacefusion.frontend.graph import ADD, contiguous, dtype, is_function, shape
from spacefusion.frontend.matchers import Context

#: ``CudaBackend.library_first``'s key of the cache writes: a backend that names it leaves every write to torch
LIBRARY_KEY = "kv_cache_write"
#: the cache spaces' and the positions' parameter names in a kernel that writes the caches
KEYS, VALUES, POSITIONS = "Kc", "Vc", "Pos"


@dataclass(frozen=True)
class CacheWrite:
    """``cache.index_copy_(2, positions, value)`` as matched: the ``index_copy_`` node, the cache (a graph
    input [b, h, length, d]) and the positions (int64 [s])."""

    node: fx.Node
    cache: fx.Node
    positions: fx.Node

    @property
    def length(self) -> int:
        return shape(self.cache)[2]


def _index_copy(node: fx.Node) -> bool:
    return (node.op == "call_method" and node.target == "index_copy_") or (
        node.op == "call_function" and node.target is torch.Tensor.index_copy_)


def _why_not(write: fx.Node, value: fx.Node) -> str | None:
    """Why ``write`` (an ``index_copy_`` of ``value``) is not a cache write a kernel can take; None if it is."""
    args = dict(zip(("self", "dim", "index", "source"), write.args)) | dict(write.kwargs)
    cache, dim, pos = args.get("self"), args.get("dim"), args.get("index")
    if args.get("source") is not value or not isinstance(cache, fx.Node) or not isinstance(pos, fx.Node):
        return "the value is not the index_copy_'s source"
    vs, cs, ps = shape(value), shape(cache), shape(pos)
    if vs is None or cs is None or len(cs) != 4 or dim not in (2, -2):
        return (f"index_copy_ along dim {dim} of a {cs} cache: the kernel writes along the sequence dim 2 of "
                f"[b, h, s, d]")
    if cache.op != "placeholder":
        return "the cache is made inside the graph (not a caller's tensor): torch writes it"
    if not contiguous(cache) or dtype(cache) != dtype(value) or dtype(value) is None:
        return (f"the cache ({dtype(cache)}, strides {getattr(cache.meta.get('tensor_meta'), 'stride', None)}) is "
                f"not a packed tensor of the value's dtype {dtype(value)}")
    if cs[:2] != vs[:2] or cs[3] != vs[3] or vs[2] > cs[2]:
        return f"a {vs} value into a {cs} cache: the shapes differ beyond the positions"
    meta = pos.meta.get("tensor_meta")
    if ps != (vs[2],) or getattr(meta, "dtype", None) != torch.int64:
        return f"positions {ps} of {getattr(meta, 'dtype', None)}: the kernel reads int64 [{vs[2]}]"
    if write.users:
        return "the index_copy_'s result is read: the kernel returns nothing for it"
    return None


def cache_write(value: fx.Node, ctx: Context) -> CacheWrite | tuple[fx.Node, str] | None:
    """The cache write of ``value`` where ``value`` is read only by an ``index_copy_`` into a cache that the
    kernel computing ``value`` can take (``_why_not``); (that ``index_copy_``, the sentence its refusal gives)
    where there is one and it cannot be taken; None where ``value`` has no such write."""
    writes = [u for u in value.users if _index_copy(u)]
    if len(writes) != 1 or not ctx.free(writes[0]):
        return None
    write = writes[0]
    why = "the written value is read outside the cache write" if len(value.users) > 1 else _why_not(write, value)
    if why is not None:
        return write, f"a KV-cache write left to torch: {why}"
    return CacheWrite(write, write.args[0], write.args[2])


def key_write(value: fx.Node, ctx: Context) -> CacheWrite | None:
    """``cache_write`` of RoPE's K, a refusal recorded as ``kv_cache.write``."""
    found = cache_write(value, ctx)
    if isinstance(found, tuple):
        ctx.refuse(found[0], "kv_cache.write", found[1])
        return None
    if found is not None and ctx.library.get(LIBRARY_KEY):  # the backend keeps them with torch (the GPU's)
        ctx.refuse(found.node, "library.first", ctx.library[LIBRARY_KEY])
        return None
    return found


def _int64(node: object, shapes: tuple[tuple[int, ...], ...]) -> bool:
    meta = node.meta.get("tensor_meta") if isinstance(node, fx.Node) else None
    return getattr(meta, "dtype", None) == torch.int64 and tuple(getattr(meta, "shape", ())) in shapes


def _arange(node: object, n: int, gm: fx.GraphModule) -> bool:
    """Whether ``node`` is ``torch.arange(n)`` (or ``arange(0, n[, 1])``) of int64, or a constant of the graph
    equal to it (``torch.fx`` evaluates an arange of constants while tracing)."""
    if not isinstance(node, fx.Node) or not _int64(node, ((n,),)):
        return False
    if node.op == "get_attr":
        value = getattr(gm, str(node.target), None)
        return isinstance(value, torch.Tensor) and torch.equal(value.cpu(), torch.arange(n))
    return (node.op == "call_function" and node.target is torch.arange and set(node.kwargs) <= {"device", "dtype"}
            and tuple(node.args) in ((n,), (0, n), (0, n, 1)))


def counter_of(positions: fx.Node, writes: tuple[fx.Node, ...], gm: fx.GraphModule) -> fx.Node | None:
    """The counter ``c`` where ``positions`` is ``torch.arange(s) + c`` (either order; ``c`` int64 of one
    element) and only ``writes`` read it, so a kernel taking them all reads ``c`` and stores at ``c + s``; None
    otherwise (the kernel reads the positions vector)."""
    added = is_function(positions, ADD) or (positions.op == "call_method" and positions.target == "add")
    if not added or len(positions.args) != 2 or positions.kwargs:
        return None
    n = (shape(positions) or (0,))[0]
    if set(positions.users) != set(writes) or not _int64(positions, ((n,),)):
        return None
    for a, c in (positions.args, positions.args[::-1]):
        if _arange(a, n, gm) and _int64(c, ((), (1,))):
            return c
    return None


def value_write(key: CacheWrite, ctx: Context) -> tuple[fx.Node, CacheWrite] | None:
    """(the value V, its cache write) of the other ``index_copy_`` at ``key``'s positions (HF writes V right
    after K, at the same ``cache_position``), where a kernel can take it (``cache_write``); None otherwise."""
    for u in key.positions.users:
        if u is key.node or not _index_copy(u) or len(u.args) < 4 or not isinstance(u.args[3], fx.Node):
            continue
        v = u.args[3]
        if shape(v) != shape(key.node.args[3]):
            ctx.refuse(u, "kv_cache.value", f"a V-cache write left to torch: V {shape(v)} is not K's shape "
                                            f"{shape(key.node.args[3])}, the RoPE kernel's iteration space")
            return None
        found = cache_write(v, ctx)
        if isinstance(found, tuple):
            ctx.refuse(found[0], "kv_cache.value", found[1])
            return None
        return None if found is None else (v, found)
    return None
