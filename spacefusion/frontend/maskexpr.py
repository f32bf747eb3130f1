"""An attention mask's construction read back as an index expression (FlexAttention's ``mask_mod``).

``transformers`` builds its masks from index grids: ``arange`` vectors viewed along the batch, query and key
dims of [b, h, m, l] (``q_idx[None, None, :, None]``), compared (``kv_idx <= q_idx``, ``q_idx - kv_idx <
window``) and combined with ``&``, and the user's padding mask gathered at ``[batch_idx, kv_idx]``.  On CUDA
(and whenever a padding mask is passed) that mask is materialised as a [b, 1, m, l] boolean tensor.  Read back
as a sympy predicate over the dims ``b, h, m, l`` (and a padding row ``Keep[b, l]``), it becomes a score mod
with no [m, l] tensor to read, an all-true mask becomes no mask at all, and an exactly causal one the
attention's own causal mask (whose masked tiles the kernels skip).
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import sympy as sp
import torch
from torch import fx

from spacefusion.frontend.graph import shape

#: the dims of SDPA's [b, h, m, l] score grid, by position, and their symbols (indices: integers >= 0)
GRID = ("b", "h", "m", "l")
SYMBOLS = {d: sp.Symbol(d, integer=True, nonnegative=True) for d in GRID}
KEEP = sp.Symbol("Keep")
#: the predicate of the padding row alone (its 0/1 values, kept where 1)
PADDING = sp.Gt(KEEP, sp.Rational(1, 2))
_CMP = {operator.ge: sp.Ge, operator.gt: sp.Gt, operator.le: sp.Le, operator.lt: sp.Lt, operator.eq: sp.Eq,
        torch.ge: sp.Ge, torch.gt: sp.Gt, torch.le: sp.Le, torch.lt: sp.Lt, torch.eq: sp.Eq}
_ARITH = {operator.add: operator.add, operator.sub: operator.sub, operator.mul: operator.mul,
          torch.add: operator.add, torch.sub: operator.sub}
_LOGIC = {operator.and_: sp.And, operator.or_: sp.Or, torch.logical_and: sp.And, torch.logical_or: sp.Or}
#: what ``view``-like steps keep: the value, its positions unchanged
_SAME = frozenset({"to", "expand", "contiguous", "bool"})


@dataclass(frozen=True)
class MaskExpr:
    """A mask as ``keep``, a sympy predicate over ``GRID`` and ``Keep`` (the padding row, when ``padding``)."""

    keep: sp.Basic
    padding: fx.Node | None  # the user's [b, l] mask that ``Keep[b, l]`` reads (0/1, any dtype)


class _NotIndexExpr(Exception):
    pass


def mask_expr(mask: fx.Node) -> MaskExpr | None:
    """The predicate ``mask`` computes over the [b, h, m, l] grid, or None where its construction is not
    index arithmetic on ``arange`` grids and one gathered padding row."""
    state: dict[str, fx.Node] = {}
    try:
        keep = _walk(mask, {}, state)
    except _NotIndexExpr:
        return None
    if not isinstance(keep, sp.Basic) or keep.free_symbols - set(SYMBOLS.values()) - {KEEP}:
        return None
    return MaskExpr(_simplified(keep) if keep not in (sp.true, sp.false) else keep, state.get("padding"))


@functools.lru_cache(maxsize=256)
def _simplified(keep: sp.Basic) -> sp.Basic:
    """``sp.simplify(keep)``, once per expression: every layer's attention reads the same mask (BERT-base: 12
    calls of 42 ms, 0.5 s of its 1.3 s of frontend on a warm compile)."""
    return sp.simplify(keep)


def _axis(index: object, rank_out: int = 4) -> int | None:
    """The grid position a 1-d vector lands on through ``v[(None, None, :, None)]``-style indexing."""
    if not isinstance(index, tuple) or len(index) != rank_out:
        return None
    full = [i for i, x in enumerate(index) if isinstance(x, slice) and x == slice(None)]
    if len(full) != 1 or any(x is not None for i, x in enumerate(index) if i != full[0]):
        return None
    return full[0]


def _walk(node: object, memo: dict, state: dict) -> sp.Basic:
    """``node``'s value as an expression of the grid symbols; a 1-d ``arange`` is the symbol ``_v<name>``
    until an indexing places it on a grid position."""
    if isinstance(node, bool):
        return sp.true if node else sp.false
    if isinstance(node, int | float):
        return sp.Integer(node) if isinstance(node, int) else sp.Float(node)
    if not isinstance(node, fx.Node):
        raise _NotIndexExpr
    if node in memo:
        return memo[node]
    t, args = node.target, node.args
    if node.op == "call_function" and t is torch.arange and len(args) == 1 and not node.kwargs.get("start"):
        out = sp.Symbol(f"_v{node.name}")
    elif node.op == "call_function" and t is operator.getitem and isinstance(args[0], fx.Node):
        out = _getitem(node, memo, state)
    elif node.op == "call_method" and t == "unsqueeze":  # (torch.export's way) a vector placed by unsqueezes
        out = _placed(_walk(args[0], memo, state), node)
    elif node.op == "call_method" and t in _SAME or node.op == "call_function" and t is operator.pos:
        out = _walk(args[0], memo, state)
    elif node.op == "call_method" and t == "new_ones" and node.kwargs.get("dtype") is torch.bool:
        out = sp.true
    elif node.op == "call_function" and t in _CMP and len(args) == 2:
        out = _CMP[t](_walk(args[0], memo, state), _walk(args[1], memo, state))
    elif node.op == "call_function" and t in _ARITH and len(args) == 2:
        out = _ARITH[t](_walk(args[0], memo, state), _walk(args[1], memo, state))
    elif node.op == "call_function" and t in _LOGIC and len(args) == 2:
        out = _LOGIC[t](_walk(args[0], memo, state), _walk(args[1], memo, state))
    elif node.op == "call_function" and t in (operator.invert, torch.logical_not) and len(args) == 1:
        out = sp.Not(_walk(args[0], memo, state))
    else:
        raise _NotIndexExpr
    memo[node] = out
    return out


def _placed(inner: sp.Basic, node: fx.Node) -> sp.Basic:
    """``inner``'s grid vector put on the one grid position ``node``'s 4-d shape does not broadcast (a
    shorter shape: unsqueezes still to come, nothing placed yet)."""
    shp = shape(node)
    vs = [s for s in inner.free_symbols if s.name.startswith("_v")]
    if not vs or shp is None or len(shp) < 4:
        return inner
    big = [i for i, n in enumerate(shp) if n != 1]
    if len(vs) != 1 or len(shp) != 4 or len(big) > 1:
        raise _NotIndexExpr
    return inner.xreplace({vs[0]: SYMBOLS[GRID[big[0]]] if big else sp.Integer(0)})


def _getitem(node: fx.Node, memo: dict, state: dict) -> sp.Basic:
    src, index = node.args
    axis = _axis(index)
    if axis is not None:  # a 1-d grid vector placed on a grid position
        inner = _walk(src, memo, state)
        vs = [s for s in inner.free_symbols if s.name.startswith("_v")]
        if len(vs) != 1:
            raise _NotIndexExpr
        return inner.xreplace({vs[0]: SYMBOLS[GRID[axis]]})
    # the padding row gathered on the grid: mask[batch_idx, kv_idx]
    if not isinstance(index, tuple) or len(index) != 2 or not all(isinstance(i, fx.Node) for i in index):
        raise _NotIndexExpr
    b_idx, l_idx = (_walk(i, memo, state) for i in index)
    if (b_idx, l_idx) != (SYMBOLS["b"], SYMBOLS["l"]):
        raise _NotIndexExpr
    row = src
    while row.op == "call_method" and row.target in _SAME:  # the .to(bool) of the user's mask
        row = row.args[0]
    if shape(row) is None or len(shape(row)) != 2 or state.get("padding") not in (None, row):
        raise _NotIndexExpr
    state["padding"] = row
    return PADDING
