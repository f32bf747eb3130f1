"""Recognising HF's rotate-half RoPE in an fx graph: ``x * cos_u + rotate_half(x) * sin_u``.

HF writes it (``apply_rotary_pos_emb``) as ``cos_u, sin_u = cos.unsqueeze(1), sin.unsqueeze(1)`` and
``rotate_half(x) = cat((-x2, x1), dim=-1)`` of ``x1, x2 = x[..., : d // 2], x[..., d // 2 :]`` (or
``x.chunk(2, dim=-1)``).  The match is exact and
conservative: those nodes in that structure, the halves of the last dim, the halves concatenated
as (-x2, x1), the tables unsqueezed at dim 1, one dtype throughout.  A graph that has the shape of it (a sum
of two products, one of them over a concatenation of a chunk's halves) but differs in a detail gets the
difference as its reason; anything else is not RoPE (None).  ``match_rope`` is the rope row's builder
(``frontend.table``): the RoPE found as ``patterns.rope``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from smg import patterns
from smg.ir import SMG
from smg.stores import IndexedStore, stores_of, with_stores
from spacefusion.frontend.attention import TO_BSHD, _heads_split
from spacefusion.frontend.graph import ADD, MUL, contiguous, dtype, heads_interleaved, is_function, shape
from spacefusion.frontend.kv_cache import KEYS, POSITIONS, VALUES, CacheWrite, counter_of, key_write, value_write
from spacefusion.frontend.matchers import Context, _build, _value
from spacefusion.frontend.records import Operand, Result, Subgraph

NEG = (operator.neg, torch.neg)


@dataclass(frozen=True)
class Rope:
    """A matched RoPE: the rotated value ``x`` [b, h, s, d], the tables ``cos``/``sin`` [1 or b, s, d]
    before their ``unsqueeze(1)``, the nodes computing it (the final add last) and the unsqueezes."""

    x: fx.Node
    cos: fx.Node
    sin: fx.Node
    nodes: tuple[fx.Node, ...]
    unsqueezes: tuple[fx.Node, fx.Node]


def _args(node: fx.Node, names: tuple[str, ...], skip: int = 0) -> dict[str, Any]:
    """A call's arguments by name (positional ones after the first ``skip``, then keywords)."""
    return dict(zip(names, node.args[skip:])) | dict(node.kwargs)


def _is_method(node: Any, name: str, fn: Any) -> bool:
    return isinstance(node, fx.Node) and ((node.op == "call_method" and node.target == name)
                                          or (node.op == "call_function" and node.target is fn))


def _last_dim(dim: Any, rank: int) -> bool:
    return isinstance(dim, int) and dim % rank == rank - 1


def _unsqueezed(node: Any) -> fx.Node | None:
    """``t`` where ``node`` is ``t.unsqueeze(1)`` (or ``torch.unsqueeze(t, 1)``) of a 3-d ``t``."""
    if not _is_method(node, "unsqueeze", torch.unsqueeze) or not isinstance(node.args[0], fx.Node):
        return None
    dim = _args(node, ("dim",), 1).get("dim")
    src = node.args[0]
    return src if isinstance(dim, int) and shape(src) is not None and len(shape(src)) == 3 and dim % 4 == 1 \
        else None


def _half(node: Any) -> tuple[fx.Node, int, fx.Node | None] | None:
    """(rotated value, half index, its chunk node or None) where ``node`` is ``x.chunk(2, -1)[i]`` or HF's
    slice of ``x``: ``x[..., : d // 2]`` (0) or ``x[..., d // 2 :]`` (1)."""
    if not (isinstance(node, fx.Node) and node.target is operator.getitem and isinstance(node.args[0], fx.Node)):
        return None
    src, index = node.args
    if _is_method(src, "chunk", torch.chunk) and isinstance(index, int):
        return (src.args[0], index, src) if isinstance(src.args[0], fx.Node) else None
    d = (shape(src) or (None,))[-1]
    if not isinstance(index, tuple) or len(index) != 2 or index[0] is not Ellipsis or not isinstance(d, int):
        return None
    sl = index[1]
    if not isinstance(sl, slice) or sl.step not in (None, 1) or d % 2:
        return None
    if sl.start in (None, 0) and sl.stop == d // 2:
        return src, 0, None
    if sl.start == d // 2 and (sl.stop is None or sl.stop >= d):
        return src, 1, None
    return None


def _part(node: Any) -> tuple[fx.Node, int, bool, fx.Node | None] | None:
    """(rotated value, half index, negated, chunk node) of a concatenated part ``half`` or ``-half``."""
    neg = isinstance(node, fx.Node) and is_function(node, NEG) and len(node.args) == 1
    half = _half(node.args[0] if neg else node)
    return None if half is None else (half[0], half[1], neg, half[2])


def _operands(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    if len(node.args) != 2 or node.kwargs or not all(isinstance(a, fx.Node) for a in node.args):
        return None
    return node.args[0], node.args[1]


def _rotation(mul: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, fx.Node, list[tuple[fx.Node, int, bool, Any]]] | None:
    """(mul, cat, other factor, rotated value, parts) where one factor of ``mul`` concatenates two halves of
    one value, each possibly negated (the shape of a rotate-half, whatever its order)."""
    for cat, other in (mul.args, mul.args[::-1]):
        if not is_function(cat, (torch.cat,)):
            continue
        parts = _args(cat, ("tensors", "dim")).get("tensors")
        if not isinstance(parts, tuple | list) or len(parts) != 2:
            continue
        got = [_part(p) for p in parts]
        if all(g is not None for g in got) and got[0][0] is got[1][0] and got[0][3] is got[1][3]:
            return mul, cat, other, got[0][0], got
    return None


def _only_users(node: fx.Node, *users: fx.Node) -> bool:
    return set(node.users) == set(users)


def rope_of(node: fx.Node) -> Rope | str | None:
    """The RoPE whose final add is ``node``; a reason (str) where ``node`` is a rotate-half RoPE in all
    but a detail; None where it is not one."""
    if not is_function(node, ADD) or (terms := _operands(node)) is None:
        return None
    muls = [t for t in terms if is_function(t, MUL) and _operands(t) is not None]
    rots = [r for m in muls if (r := _rotation(m)) is not None]
    if len(muls) != 2 or len(rots) != 1:
        return None
    rot_mul, cat, sin_u, x, got = rots[0]
    chunk = got[0][3]
    plain_mul = muls[1] if muls[0] is rot_mul else muls[0]
    cat_args = _args(cat, ("tensors", "dim"))
    parts = cat_args["tensors"]
    if x not in plain_mul.args:
        return None
    # from here on it is a rotate-half of x: what differs from HF's form is the reason
    xs = shape(x)
    if xs is None or len(xs) != 4 or shape(node) != xs:
        return f"RoPE on a {xs} value giving {shape(node)}: the pattern rotates [batch, heads, seq, head_dim]"
    ck = _args(chunk, ("chunks", "dim"), 1) if chunk is not None else {"chunks": 2, "dim": -1}
    if ck.get("chunks") != 2 or not _last_dim(ck.get("dim", 0), 4) or xs[3] % 2:
        return (f"rotate-half chunks {ck.get('chunks')} along dim {ck.get('dim', 0)} of head dim {xs[3]}: the pattern "
                f"takes two halves of an even last dim")
    if not _last_dim(cat_args.get("dim", 0), 4):
        return f"rotate-half concatenates along dim {cat_args.get('dim', 0)}: the pattern's halves are the last dim's"
    order = [("-" if neg else "") + f"x{i + 1}" for _, i, neg, _ in got]
    if order != ["-x2", "x1"]:
        return f"rotate-half concatenates ({', '.join(order)}): HF's rotate_half is (-x2, x1), the pattern's"
    cos_u = plain_mul.args[1] if plain_mul.args[0] is x else plain_mul.args[0]
    cos, sin = _unsqueezed(cos_u), _unsqueezed(sin_u)
    if cos is None or sin is None:
        return "RoPE's cos/sin are not unsqueeze(1) of [batch, seq, head_dim] tables: the pattern broadcasts those"
    b, _, s, d = xs
    if shape(cos) != shape(sin) or shape(cos) not in ((1, s, d), (b, s, d)):
        return f"RoPE tables cos {shape(cos)} / sin {shape(sin)} for x {xs}: the pattern takes [1 or {b}, {s}, {d}]"
    if len({dtype(n) for n in (x, cos, sin, node)}) != 1 or dtype(node) is None:
        types = [str(getattr(n.meta.get("tensor_meta"), "dtype", None)) for n in (x, cos, sin, node)]
        return f"RoPE with dtypes x/cos/sin/out {types}: the pattern takes one float32/float16/bfloat16 dtype"
    (g0, g1) = (p.args[0] if p.target in NEG else p for p in parts[::-1])  # x1, x2 (the order checked above)
    neg = parts[0]
    if not ((chunk is None or _only_users(chunk, g0, g1)) and _only_users(g0, cat) and _only_users(g1, neg)
            and _only_users(neg, cat) and _only_users(cat, rot_mul) and _only_users(rot_mul, node)
            and _only_users(plain_mul, node)):
        return "RoPE's intermediate values are read outside it: fused, they would not exist"
    halves = (chunk, g0, g1) if chunk is not None else (g0, g1)
    return Rope(x, cos, sin, (plain_mul, *halves, neg, cat, rot_mul, node), (cos_u, sin_u))


def _rope_input(x: fx.Node, inside: tuple[fx.Node, ...], ctx: Context
                ) -> tuple[fx.Node, tuple[int, ...] | None, str, tuple[fx.Node, ...]] | None:
    """(the node X is bound to, the permutation it is read through, the layout, nodes taken with it) for
    RoPE's input ``x`` [b, h, s, d]: HF's split_heads view of a packed [b, s, h, d] projection (the
    transpose is taken in and X is the projection), a value lying as [b, s, h, d] (read through
    ``TO_BSHD``), or a packed [b, h, s, d] value (bhsd).  None: strided otherwise (a copy to bind)."""
    src = _heads_split(x, inside, ctx)
    if src is not None:
        return src, None, "bshd", (x,)
    if heads_interleaved(x):
        return x, TO_BSHD, "bshd", ()
    if contiguous(x):
        return x, None, "bhsd", ()
    return None


def match_rope(node: fx.Node, ctx: Context) -> Subgraph | None:
    """HF's rotate-half RoPE ``x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)`` (``frontend.rope``)
    -> ``patterns.rope``: element-wise, rotate-half as two shifts along the head dim.

    On split_heads' [b, h, s, d] views (LLaMA's Q and K) the SMG's X and Y are [b, s, h, d], the memory the
    projection wrote, and Y goes back to the graph as a [b, h, s, d] view of it (``Result.permute``): the
    strides torch gives RoPE's output, which the attention after it binds as bshd without a copy.  The
    cos/sin tables are graph values shared by every layer, broadcast over the heads (and the batch where
    they are one table)."""
    r = rope_of(node)
    if r is None:
        return None
    if isinstance(r, str):
        ctx.refuse(node, "rope.form", r)
        return None
    if not ctx.free(*r.nodes):
        return None
    (b, h, s, d), dt = shape(r.x), dtype(node)
    bound = _rope_input(r.x, r.nodes, ctx)
    # the output must lie as the kernel writes it: later matchers bound its readers by its recorded strides
    if bound is None or not (heads_interleaved(node) if bound[2] == "bshd" else contiguous(node)):
        ctx.refuse(node, "rope.strided", f"RoPE on a value strided {r.x.meta['tensor_meta'].stride} giving "
                         f"{node.meta['tensor_meta'].stride}: the pattern binds packed [b, h, s, d] or [b, s, h, d] "
                         f"memory without a copy")
        return None
    src, permute, layout, taken = bound
    tables = "shared" if shape(r.cos)[0] == 1 else "per_batch"
    cw = _cache_writes(node, layout, ctx)
    smg = _build(ctx, node, lambda: with_stores(patterns.rope(b, s, h, d, tables, dt, layout, carry=cw.carry),
                                                cw.stores(layout)))
    if smg is None:
        return None
    ops = [_value("X", src, smg.shape("X"), permute), _value("Cos", r.cos, smg.shape("Cos")),
           _value("Sin", r.sin, smg.shape("Sin")), *cw.operands(smg)]
    inside = (*taken, *r.nodes, *cw.nodes)
    unsq = tuple(u for u in dict.fromkeys(r.unsqueezes) if ctx.free(u) and set(u.users) <= set(inside))
    nodes = (*unsq, *inside)
    out = () if cw.writes else (Result("Y", node.name, shape(node), TO_BSHD if layout == "bshd" else None),)
    label = f"rope b{b} h{h} s{s} d{d} {dt}{' bshd' if layout == 'bshd' else ''}{cw.label}"
    return Subgraph("rope", label, tuple(n.name for n in nodes), smg, tuple(ops), out,
                    writes=tuple(w.cache.name for w in cw.writes))


@dataclass(frozen=True)
class _Writes:
    """The KV-cache writes a RoPE kernel takes (``frontend.kv_cache``): K's, and V's with V carried
    through the kernel (``v``: (V's bound node, its permutation, nodes taken with it)); none, or K's alone."""

    writes: tuple[CacheWrite, ...] = ()
    v: tuple[fx.Node, tuple[int, ...] | None, tuple[fx.Node, ...]] | None = None
    #: the positions' counter where they are ``arange(s) + counter`` read by these writes alone
    counter: fx.Node | None = None

    @property
    def carry(self) -> bool:
        return self.v is not None

    @property
    def nodes(self) -> tuple[fx.Node, ...]:
        pos = (self.writes[0].positions,) if self.counter is not None else ()
        return (*(self.v[2] if self.v else ()), *pos, *(w.node for w in self.writes))

    @property
    def label(self) -> str:
        return {0: "", 1: " -> K cache", 2: " -> K, V caches"}[len(self.writes)]

    def stores(self, layout: str) -> tuple[IndexedStore, ...]:
        """Y into the key cache and Vo into the value cache, at the positions along ``s``."""
        order = ("b", "h", "s", "j")
        return tuple(IndexedStore(out, into, POSITIONS, "s", order, w.length, self.counter is not None)
                     for (out, into), w in zip((("Y", KEYS), ("Vo", VALUES)), self.writes))

    def operands(self, smg: SMG) -> list[Operand]:
        """The caches (bound as they lie: the kernel writes them), the positions and the carried V."""
        if not self.writes:
            return []
        st = {x.into: x for x in stores_of(smg)}
        ops = [_value(into, w.cache, st[into].shape(smg)) for into, w in zip((KEYS, VALUES), self.writes)]
        pos = self.counter if self.counter is not None else self.writes[0].positions
        ops.append(_value(POSITIONS, pos, stores_of(smg)[0].positions_shape(smg)))
        return ops + ([_value("V", self.v[0], smg.shape("V"), self.v[1])] if self.v else [])


def _cache_writes(node: fx.Node, layout: str, ctx: Context) -> _Writes:
    """The cache writes of RoPE's output ``node`` the kernel takes (``kv_cache.cache_write``), with V's
    where V lies as RoPE's X does (``layout``): read where it lies, its split_heads transpose taken in."""
    k = key_write(node, ctx)
    found = value_write(k, ctx) if k is not None else None
    if found is None:
        return _Writes((k,)) if k is not None else _Writes()
    v, vw = found
    bound = _rope_input(v, (vw.node,), ctx)
    if bound is None or bound[2] != layout:
        ctx.refuse(vw.node, "kv_cache.value", f"a V-cache write left to torch: V lies "
                                              f"{'strided' if bound is None else 'as ' + bound[2]}, RoPE's K as "
                                              f"{layout} (one kernel reads both over one iteration space)")
        return _Writes((k,))
    return _Writes((k, vw), (bound[0], bound[1], bound[3]), counter_of(k.positions, (k.node, vw.node), ctx.gm))
