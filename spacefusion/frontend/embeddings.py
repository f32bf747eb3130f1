"""A model's embeddings taken into the norm that follows them: ``norm(emb(ids) + .. + c)`` as one kernel.

Every transformer starts with ``F.embedding`` (rows of a weight table picked by token ids), which no index
expression states: it is an indexed load (``smg.loads``: ``E[r, n] = Table[Ids[r], n]``), the table and the ids
the kernel's inputs in place of E.  BERT's embeddings are ``word(ids) + token_type(tt) + position(pos)`` then a
LayerNorm (at inference the token-type and position lookups read buffers: the folded ones are plain terms, a
position table's rows [1, s, n] broadcast over the batch); ``match_embedding_norm`` takes the gathers, the adds
and the norm into ``builders.embedding_norm``, one kernel where torch ran four ops (and the gather left the
first fused kernel waiting on torch).

Taken only where the norm is a kernel of its own: a norm read only by linears is their GEMMs' prologue
(``frontend.prologue``: LLaMA's and Qwen2's first RMSNorm at 16 rows or more), whose kernels stage contiguous
tiles of X (warp tile, tensor cores: ``lower.loads`` refuses a gather there), so the embedding stays with torch
(``embedding.prologue``).  A sum read elsewhere too (LLaMA's embedding is the residual stream as well) is the
kernel's second output ``T``, the gathered rows written once, as the residual norms keep their sums.

Out-of-range ids: torch raises ``IndexError``; the kernel reads zeros there (never past the table), and the CPU
backends check the ids before a launch and raise as torch does (``smg.loads.check_ids``).  A ``max_norm``
embedding (which renormalises its table in place) is not taken.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import fx

from smg.loads import IndexedLoad, with_loads
from spacefusion.frontend import builders
from spacefusion.frontend.graph import (
    ADD,
    dtype,
    is_function,
    norm_of,
    param_ref,
    param_tensor,
    read_rstd,
    shape,
    single_user,
)
from spacefusion.frontend.matchers import Context, _build, _param, _subgraph, _value
from spacefusion.frontend.records import Operand, Subgraph

#: ``CudaBackend.library_first``'s key of the gathers: a backend that names it leaves every embedding to torch
LIBRARY_KEY = "embedding_gather"


def _embedding(node: object) -> tuple[fx.Node, str] | None:
    """(the ids, the table's qualified name) where ``node`` is ``F.embedding(ids, table)`` of a parameter table
    without ``max_norm``; None otherwise."""
    if not isinstance(node, fx.Node) or not is_function(node, (F.embedding,)):
        return None
    a = dict(zip(("input", "weight", "padding_idx", "max_norm"), node.args)) | dict(node.kwargs)
    ids, table = a.get("input"), param_ref(a.get("weight"))
    if not isinstance(ids, fx.Node) or table is None or a.get("max_norm") is not None:
        return None
    return ids, table


def _int64(node: fx.Node) -> bool:
    return getattr(node.meta.get("tensor_meta"), "dtype", None) == torch.int64


def _terms(x: fx.Node, ctx: Context) -> tuple[list[fx.Node], list[fx.Node]]:
    """(the leaves, the adds) of the sum tree at ``x``: an add of two values whose operand adds are read by it
    alone (each add free), flattened; ``x`` itself a leaf where it is no such add."""
    if not (is_function(x, ADD) and len(x.args) == 2 and not x.kwargs and ctx.free(x)
            and all(isinstance(a, fx.Node) for a in x.args)):
        return [x], []
    leaves, adds = [], [x]
    for a in x.args:
        if single_user(a) is x:
            more, inner = _terms(a, ctx)
            leaves += more
            adds += inner
        else:
            leaves.append(a)
    return leaves, adds


def _broadcast(leaf: fx.Node, xs: tuple[int, ...]) -> int | None:
    """How many leading dims of ``leaf`` are size-1 broadcasts over ``xs``'s (its shape ``xs`` but for them);
    None where it is not of that form."""
    ls = shape(leaf)
    if ls is None or len(ls) != len(xs):
        return None
    lead = next((i for i, d in enumerate(ls) if d != 1), len(ls))
    return lead if lead < len(xs) and ls[lead:] == xs[lead:] else None


def match_embedding_norm(node: fx.Node, ctx: Context) -> Subgraph | None:
    """``norm(E0 + .. + C0 + ..)`` with at least one ``E`` an ``F.embedding`` of ids of the rows' shape (see the
    module's docstring) -> ``embedding_norm``; None where there is no embedding under the norm."""
    nm = norm_of(node, ctx.gm)
    if nm is None or not ctx.free(node, *nm.inner) or not isinstance(nm.x, fx.Node) \
            or read_rstd(nm, node) is not None:
        return None  # a training forward's norm whose rsqrt the backward reads: ``norms.match_norm`` saves it
    xs, dt = shape(nm.x), dtype(node)
    leaves, adds = _terms(nm.x, ctx)
    rowshape = xs[:-1] if xs else None
    gathers = [(leaf, _embedding(leaf)) for leaf in leaves]
    gathers = [(leaf, e) for leaf, e in gathers if e is not None and shape(e[0]) == rowshape and ctx.free(leaf)
               and (leaf is nm.x or single_user(leaf) is not None) and _int64(e[0])
               and shape(leaf) == xs]
    if not gathers or xs is None or dt is None:
        return None
    first = gathers[0][0]
    if node.name in ctx.prologues:
        ctx.refuse(first, "embedding.prologue",
                   f"an embedding whose rows an {nm.kind} read only by linears normalises: that norm is the "
                   f"prologue of their GEMMs, whose kernels stage contiguous tiles of X (no gather), so no norm "
                   f"kernel of its own writes the gathered rows; torch gathers them")
        return None
    if ctx.library.get(LIBRARY_KEY):  # the backend keeps them with torch (the GPU's)
        ctx.refuse(first, "library.first", ctx.library[LIBRARY_KEY])
        return None
    plain = [leaf for leaf in leaves if all(leaf is not g for g, _ in gathers)]
    leads = [_broadcast(leaf, xs) for leaf in plain]
    if (nm.dims != 1 or nm.weight is None or (nm.kind == "layernorm" and nm.bias is None) or None in leads
            or any(dtype(leaf) != dt or dtype(g) != dt for leaf in plain for g, _ in gathers)):
        ctx.refuse(first, "embedding.form",
                   f"an embedding under an {nm.kind} over {nm.dims} dims beside terms of shapes "
                   f"{[shape(leaf) for leaf in plain]} and dtypes {[dtype(leaf) for leaf in plain]}: the pattern "
                   f"takes a sum of gathers and terms of the rows' shape (size-1 leading dims broadcast), one "
                   f"dtype, normalised over the last dim with an affine weight")
        return None
    rows = {f"r{i}": s for i, s in enumerate(rowshape)}
    names = tuple(rows)
    n, keep_sum = xs[-1], any(u is not node and u not in nm.inner for u in nm.x.users)
    added = tuple(names[lead:] for lead in leads)
    loads = tuple(IndexedLoad(f"E{i}", f"Table{i}", f"Ids{i}", names, int(param_tensor(ctx.gm, t).shape[0]))
                  for i, (_, (_, t)) in enumerate(gathers))
    smg = _build(ctx, node, lambda: with_loads(builders.embedding_norm(
        nm.kind, rows, n, len(gathers), added, keep_sum, dt, float(nm.eps), nm.offset), loads))
    if smg is None:
        return None
    ops = []
    for ld, (_, (ids, table)) in zip(loads, gathers):
        ops += [_param(ld.table, table, (ld.length, n)), _value(ld.ids, ids, rowshape)]
    for j, (leaf, lead) in enumerate(zip(plain, leads)):
        op = _value(f"C{j}", leaf, tuple(xs[lead:]))
        ops.append(op if not lead else _select(op, lead))
    ops.append(_param("W", nm.weight, (n,)))
    if nm.kind == "layernorm":
        ops.append(_param("B", nm.bias, (n,)))
    kept = " (sum kept)" if keep_sum else ""
    terms = f" + {len(plain)} term{'s' if len(plain) > 1 else ''}" if plain else ""
    label = (f"{len(gathers)} embedding{'s' if len(gathers) > 1 else ''}{terms}"
             f" + {nm.kind}{kept} {'x'.join(map(str, xs))} {dt}")
    nodes = (*(g for g, _ in gathers), *adds, *nm.inner, node)
    return _subgraph("embedding_norm", label, nodes, smg, ops, {"Y": node, "T": nm.x})


def _select(op: Operand, lead: int) -> Operand:
    """``op`` read with its ``lead`` size-1 leading dims at index 0 (a [1, s, n] table broadcast over the batch)."""
    return dataclasses.replace(op, select=tuple(range(lead)))
