"""One projection split into Q, K and V (GPT-2's ``c_attn(x).split(n, dim=2)``) rewritten as ``t`` projections.

The split's chunks are strided views of one [m, t * n] output: an attention reading them would copy each
(its spaces are packed).  Written as ``t`` projections on the weight's column slices (cut once, kept as
constants of the graph) each chunk is a packed tensor of its own, the ``t`` projections of one input stack
into one GEMM (``gemms.match_stacked_linears``, whose output slices are contiguous), and the attention
binds the [b, s, h, d] views of them as they lie.  The same arithmetic: each output column is the same dot
product of the same row and weight column.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx

from spacefusion.frontend.graph import is_function, linear_of, param_tensor, row_view, shape, single_user


def split_columns(node: fx.Node) -> tuple[fx.Node | None, fx.Node, list[fx.Node]] | None:
    """``node``'s output (through a view that keeps its rows) split into equal chunks of its last dim, each
    chunk read through ``getitem`` only: (the view or None, the split, the chunks in order); else None."""
    view, src = None, node
    user = single_user(node)
    if user is not None and row_view(user, node):
        view, src = user, user
    sp, shp = single_user(src), shape(src)
    if sp is None or shp is None or not (sp.op == "call_method" and sp.target == "split"):
        return None
    args = dict(zip(("self", "split_size", "dim"), sp.args)) | sp.kwargs
    size, dim = args.get("split_size"), args.get("dim", 0)
    if not isinstance(size, int) or dim not in (-1, len(shp) - 1) or shp[-1] % size or shp[-1] // size < 2:
        return None
    items = {u.args[1]: u for u in sp.users if u.op == "call_function" and u.target is operator.getitem
             and isinstance(u.args[1], int)}
    if len(items) != len(sp.users) or sorted(items) != list(range(shp[-1] // size)):
        return None
    return view, sp, [items[i] for i in sorted(items)]


def split_projections(gm: fx.GraphModule) -> int:
    """Rewrite each ``addmm`` (Conv1D) or ``F.linear`` on parameters whose output is split into equal column
    chunks as one projection per chunk on the weight's (and bias's) slices, registered on ``gm`` as
    constants; run after ShapeProp (the chunks' sizes come from it; run it again after).  Returns how many
    projections were split."""
    done = 0
    for node in list(gm.graph.nodes):
        lin = linear_of(node, gm)
        addmm = is_function(node, (torch.addmm,))
        if lin is None or not (addmm or is_function(node, (F.linear, torch._C._nn.linear))):
            continue
        found = split_columns(node)
        if found is None:
            continue
        view, sp, items = found
        t = len(items)
        w = param_tensor(gm, lin.weight)
        b = None if lin.bias is None else param_tensor(gm, lin.bias)
        with gm.graph.inserting_before(node):
            for i, item in enumerate(items):
                w_i = _constant(gm, f"{lin.weight}__cols{i}of{t}", w.detach().chunk(t, dim=1 if addmm else 0)[i])
                b_i = None if b is None else _constant(gm, f"{lin.bias}__cols{i}of{t}", b.detach().chunk(t)[i])
                if addmm:
                    out = gm.graph.call_function(torch.addmm, (b_i, lin.x, w_i))
                else:
                    out = gm.graph.call_function(F.linear, (lin.x, w_i, b_i))
                if view is not None:
                    out = gm.graph.call_method("view", (out, tuple(shape(item))))
                item.replace_all_uses_with(out)
        for dead in (*items, sp, *([view] if view is not None else []), node):
            gm.graph.erase_node(dead)
        done += 1
    if done:
        gm.recompile()
    return done


def _constant(gm: fx.GraphModule, ref: str, value: torch.Tensor) -> fx.Node:
    """A ``get_attr`` of ``value`` (made contiguous) registered on ``gm`` under ``ref`` with dots flattened."""
    name = ref.replace(".", "_")
    gm.register_buffer(name, value.contiguous(), persistent=False)
    return gm.graph.get_attr(name)
