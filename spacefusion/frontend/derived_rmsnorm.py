"""A training backward's RMSNorm backward as the kernels derived from the RMSNorm SMG (issue 58).

There is no ATen RMSNorm backward op: aot_autograd traces LLaMA's / Qwen2's ``x * rsqrt(x.pow(2).mean(-1,
keepdim=True) + eps) * w`` as primitives, and its backward graph holds their derivatives, reading the rsqrt
``r`` the forward saved (the fused forward's ``Rstd``: ``patterns.rmsnorm_stats``) and x (saved, or recomputed
by the partitioner: the residual sum)::

    gW = g * W                                       t1 = gW * r
    t2 = (-0.5 * sum(gW * x, [-1], keepdim) * detach(r)**3).expand(x.shape) / n * (x**1.0 * 2.0)
    dX = t1 + t2            (or (R + t1) + t2: the residual stream's gradient R accumulated in between)
    dW = sum(g * (x * r), [0, .., -2], keepdim).view(n)

``rms_backward_of`` reads exactly that form, anchored on ``pow(detach(r), 3)``, every constant checked (-0.5, 3,
n, 1.0, 2.0, the reduced dims) and every inner node read inside the form alone; anything else is not matched
and stays torch's primitives (never a wrong gradient: only this computation is replaced).  The matched nodes
become one ``DerivedNormBackward`` of ``derive_backward(patterns.rmsnorm)``: ``dX`` (a row pass, the row sum
``sum_n X W dY`` inside it) and ``dW`` (a column reduction over the rows), reading torch's ``r`` as the
derivation's saved ``Y_rstd`` (``1 / sqrt(mean(x^2) + eps)``: the same value; eps enters no backward body).
Where the form differs (another torch's decomposition, ``F.rms_norm``'s, a model that writes ``x * x``) nothing
is matched; the forms aot writes are pinned by ``tests/test_training_norm_backward.py``.

fp16/bf16 (LLaMA cast to bf16: HF's norm upcasts x): the same form on ``gW = (g * W).float()`` and x's float32
cast, with the float32 ``r``; dX is ``t1 + t2`` cast back to x's dtype (a residual gradient is added after that
cast, in x's dtype, and stays torch's add) and dW ``sum(g * (x * r).to(dtype))`` (``_operands``,
``_weight_gradient``).  The derivation is then of ``rmsnorm`` in x's dtype reading a float32 ``Y_rstd``
(``derived_norms.half_derivation``): g, x and W bound uncast, dX and dW in x's dtype as aot's graph has them.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from spacefusion.frontend.derived_calls import derived_kernels
from spacefusion.frontend.derived_norms import (
    DerivedNormBackward,
    attr_tensor,
    half_derivation,
    norm_line,
    stats_text,
)
from spacefusion.frontend.graph import DTYPES
from spacefusion.frontend.refusals import DERIVED

aten = torch.ops.aten
_MUL = (operator.mul, torch.mul, aten.mul.Tensor, aten.mul.Scalar)
_ADD = (operator.add, torch.add, aten.add.Tensor)
_DIV = (operator.truediv, torch.div, aten.div.Scalar, aten.div.Tensor)
_POW = (operator.pow, torch.pow, aten.pow.Tensor_Scalar)
_SUM = (torch.sum, aten.sum.dim_IntList)
_DETACH = (aten.detach.default, torch.detach)
_EXPAND = (aten.expand.default,)
_VIEW = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_TO_COPY = aten._to_copy.default
_HALF = (torch.float16, torch.bfloat16)


def _is(node: Any, fns: tuple[Any, ...], methods: tuple[str, ...] = ()) -> bool:
    return isinstance(node, fx.Node) and not node.kwargs and (
        node.op == "call_function" and node.target in fns or node.op == "call_method" and node.target in methods)


def _other(node: Any, arg: Any) -> Any:
    """The other operand of a two-operand multiplication ``node`` where one is ``arg``, else None."""
    if not _is(node, _MUL) or len(node.args) != 2:
        return None
    a, b = node.args
    return b if a is arg else a if b is arg else None


def _times(node: Any, c: float) -> Any:
    """x where ``node`` is ``x * c`` (either order) of the number ``c``, else None."""
    if not _is(node, _MUL) or len(node.args) != 2:
        return None
    a, b = node.args
    for x, k in ((a, b), (b, a)):
        if isinstance(k, (int, float)) and not isinstance(k, bool) and k == c and isinstance(x, fx.Node):
            return x
    return None


def _cast(node: Any) -> tuple[fx.Node, torch.dtype] | None:
    """(input, dtype) where ``node`` is a dtype cast as a training graph spells it after ``read_aten``:
    ``x.to(dtype)`` or ``aten._to_copy(x, dtype=, layout=strided, device=x's)``; else None."""
    if not isinstance(node, fx.Node) or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    if node.op == "call_method" and node.target == "to" and len(node.args) == 2 and not node.kwargs \
            and isinstance(node.args[1], torch.dtype):
        return node.args[0], node.args[1]
    if node.op != "call_function" or node.target is not _TO_COPY or len(node.args) != 1 \
            or set(node.kwargs) - {"dtype", "layout", "device"} or node.kwargs.get("layout", torch.strided) \
            is not torch.strided or not isinstance(node.kwargs.get("dtype"), torch.dtype):
        return None
    val = _val(node.args[0])
    device = node.kwargs.get("device")
    if device is not None and (val is None or torch.device(device) != val.device):
        return None
    return node.args[0], node.kwargs["dtype"]


def _upcast(node: Any) -> tuple[fx.Node, fx.Node | None]:
    """(the value, the cast) where ``node`` is a fp16/bf16 value cast to float32, else (node, None)."""
    got = _cast(node)
    if got is None or got[1] is not torch.float32 or _val(got[0]) is None or _val(got[0]).dtype not in _HALF:
        return node, None
    return got[0], node


def _only_user(node: Any) -> Any:
    return next(iter(node.users)) if isinstance(node, fx.Node) and len(node.users) == 1 else None


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


@dataclass(frozen=True)
class RmsBackward:
    """A matched RMSNorm backward: its operands (grad, x, weight, saved rsqrt), the node giving dX (``final``;
    with the residual gradient ``residual`` added, or None), dW's view (or None: W takes no gradient) and every
    node of the form (removed once the derived call reads its operands)."""

    grad: fx.Node
    x: fx.Node
    weight: fx.Node
    rstd: fx.Node
    final: fx.Node
    residual: fx.Node | None
    dw: fx.Node | None
    nodes: frozenset[fx.Node]


def rms_backward_of(pow3: fx.Node) -> RmsBackward | None:
    """The RMSNorm backward (the module docstring's form) whose ``rstd**3`` is ``pow3``, else None."""
    if not _is(pow3, _POW) or len(pow3.args) != 2 or pow3.args[1] != 3:
        return None
    r, chain = pow3.args[0], [pow3]
    while _is(r, _DETACH, ("detach",)) and len(r.users) == 1:
        chain.append(r)
        r = r.args[0]
    cubed = _only_user(pow3)
    half_sum = _other(cubed, pow3)
    row_sum = _times(half_sum, -0.5)
    if row_sum is None or not _is(row_sum, _SUM) or len(row_sum.args) != 3 or row_sum.args[2] is not True:
        return None
    gwx = row_sum.args[0]
    found = _operands(gwx, r)
    if found is None:
        return None
    gw, x, g, w, xin, upcasts = found
    xs, n = tuple(x.meta["val"].shape), x.meta["val"].shape[-1]
    half = _val(xin).dtype if upcasts else None
    if list(row_sum.args[1]) not in ([-1], [len(xs) - 1]):
        return None
    expand = _only_user(cubed)
    div = _only_user(expand)
    if not _is(expand, _EXPAND, ("expand",)) or tuple(expand.args[1]) != xs or not _is(div, _DIV) \
            or len(div.args) != 2 or div.args[0] is not expand or div.args[1] != n:
        return None
    t2 = _only_user(div)
    two_x = _other(t2, div)
    x_pow1 = _times(two_x, 2.0)
    if x_pow1 is None or not _is(x_pow1, _POW) or x_pow1.args != (x, 1.0):
        return None
    t1 = next((u for u in gw.users if _other(u, gw) is r), None)
    final = _only_user(t2)
    if t1 is None or not _is(final, _ADD) or len(final.args) != 2 or t2 not in final.args:
        return None
    inner = final.args[0] if final.args[1] is t2 else final.args[1]
    residual, nodes = None, [*chain, cubed, half_sum, row_sum, gwx, gw, expand, div, t2, two_x, x_pow1, t1, final,
                             *upcasts]
    if inner is not t1:
        if not _is(inner, _ADD) or len(inner.args) != 2 or t1 not in inner.args or _only_user(inner) is not final:
            return None
        residual = inner.args[0] if inner.args[1] is t1 else inner.args[1]
        nodes.append(inner)
    if half is not None:  # dX is the float32 sum cast back to x's dtype (a residual gradient is added after it)
        down = _only_user(final)
        if residual is not None or _cast(down) != (final, half):
            return None
        final = down
        nodes.append(final)
    dw = _weight_gradient(g, x, r, xs, half)
    if dw is not None:
        nodes += dw
    if x is not xin and set(x.users) <= set(nodes):  # x's float32 cast, read inside the form alone
        nodes.append(x)
    if not _closed(nodes, {final, dw[2] if dw else final}):
        return None
    return RmsBackward(g, xin, w, r, final, residual, dw[2] if dw else None, frozenset(nodes))


def _operands(gwx: Any, r: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, fx.Node, fx.Node, tuple[fx.Node, ...]] | None:
    """(gW, x, g, W, x's value, the upcast nodes) where ``gwx`` is ``gW * x`` (either order), ``gW = g * W`` of a
    weight [n] (``get_attr``), g and x of one shape and ``r`` float32 x's shape with its last dim 1: all float32
    (x's value is x, no upcasts), or g, W and x of one fp16/bf16 dtype, ``gW`` and ``x`` their float32 casts
    (LLaMA's RMSNorm upcasts x; the upcasts: ``gW``'s cast and the product it casts, both the form's)."""
    if not _is(gwx, _MUL) or len(gwx.args) != 2:
        return None
    for gw, x in (gwx.args, gwx.args[::-1]):
        gw16, gcast = _upcast(gw)
        xin, xcast = _upcast(x)
        if (gcast is None) != (xcast is None) or not _is(gw16, _MUL) or len(gw16.args) != 2:
            continue
        want = {torch.float32} if gcast is None else {_val(xin).dtype}
        for g, w in (gw16.args, gw16.args[::-1]):
            vals = [_val(t) for t in (g, xin, r)]
            if not (isinstance(w, fx.Node) and w.op == "get_attr") or any(v is None for v in vals):
                continue
            gv, xv, rv = vals
            wv = attr_tensor(w)
            if wv is None or {gv.dtype, xv.dtype, wv.dtype} != want or rv.dtype != torch.float32:
                continue
            if tuple(gv.shape) == tuple(xv.shape) and tuple(rv.shape) == (*xv.shape[:-1], 1) \
                    and tuple(wv.shape) == (xv.shape[-1],) and all(isinstance(s, int) for s in xv.shape):
                return gw, x, g, w, xin, (gw16,) if gcast is not None else ()
    return None


def _weight_gradient(g: fx.Node, x: fx.Node, r: fx.Node, xs: tuple[int, ...],
                     half: torch.dtype | None) -> list[fx.Node] | None:
    """[g * xhat, its sum over the rows, the view to [n]] (then ``xhat = x * r`` itself, and its cast to
    ``half`` where the norm is fp16/bf16, where nothing else reads them: a recomputed forward may, the next norm's
    residual input) where those nodes compute dW, else None."""
    for xhat in r.users:
        if _other(xhat, r) is not x:
            continue
        cast = next((c for c in xhat.users if _cast(c) == (xhat, half)), None) if half is not None else xhat
        if cast is None:
            continue
        for dwmul in cast.users:
            total = _only_user(dwmul)
            view = _only_user(total)
            if _other(dwmul, cast) is g and _is(total, _SUM) and len(total.args) == 3 and total.args[2] is True \
                    and list(total.args[1]) == list(range(len(xs) - 1)) and _is(view, _VIEW, ("view", "reshape")) \
                    and tuple(view.args[1]) == (xs[-1],):
                chain = [cast, xhat] if cast is not xhat else [xhat]
                read_once = [c for i, c in enumerate(chain) if all(len(d.users) == 1 for d in chain[:i + 1])]
                return [dwmul, total, view, *read_once]
    return None


def _closed(nodes: list[fx.Node], outs: set[fx.Node]) -> bool:
    """Whether every node of the form but its results ``outs`` is read inside the form alone."""
    inside = set(nodes)
    return all(n in outs or set(n.users) <= inside for n in nodes)


def _rmsnorm_forward(rows: int, n: int, dt: str) -> Any:
    """The RMSNorm SMG whose backward is derived: in ``dt``, its saved rsqrt float32 (``_operands``), a fp16/bf16
    norm's too."""
    from smg import patterns

    return half_derivation(patterns.rmsnorm(rows, n, dt), {"Y_rstd": "float32"})


def derive_rms_backwards(gm: fx.GraphModule, kernels: Any, cache: dict[tuple, Any]) -> list[str]:
    """Replace every RMSNorm backward of ``gm`` in aot's form (``rms_backward_of``) by one ``DerivedNormBackward``
    of ``patterns.rmsnorm``'s derived passes built on ``kernels``; one whose kernels cannot be built stays
    torch's primitives (nothing marked: they are primitives, each reported by its own code).  ``cache``: per
    size, the derivation, passes and kernels (or why none), kept by the caller.  Returns one line per one."""

    lines: list[str] = []
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    gone: set[fx.Node] = set()  # nodes of forms already replaced (erased)
    for node in list(gm.graph.nodes):
        found = rms_backward_of(node) if node not in gone else None
        if found is None or (found.dw is not None and any(order[u] < order[found.final] for u in found.dw.users)):
            continue
        xs, dt = tuple(found.x.meta["val"].shape), DTYPES[found.x.meta["val"].dtype]
        rows, n = math.prod(xs[:-1]), xs[-1]
        key = ("rmsnorm", rows, n, dt)
        found_kernels = derived_kernels(cache, key, kernels, _rmsnorm_forward, rows, n, dt)
        if isinstance(found_kernels, str):  # not derivable or not schedulable at this size: torch's primitives
            continue
        bw, passes, built = found_kernels
        module = DerivedNormBackward(bw, passes, built, rows, n, (True, found.dw is not None), ("Y_rstd",))
        _replace(gm, found, f"derived_rms_backward_{len(lines)}", module)
        gone |= found.nodes
        lines.append(norm_line(f"rmsnorm backward {rows}x{n} {dt}, the forward's saved "
                               f"{stats_text('float32', dt)}rsqrt read", module))
    gm.graph.lint()
    gm.recompile()
    return lines


def _replace(gm: fx.GraphModule, found: RmsBackward, name: str, module: DerivedNormBackward) -> None:
    """The derived call before ``found.final``, its dX (plus the residual gradient) and dW read where the
    form's were, the form's nodes removed (each is read inside the form alone: ``rms_backward_of``)."""
    g = gm.graph
    gm.add_submodule(name, module)
    with g.inserting_before(found.final):
        call = g.call_module(name, (found.grad, found.x, found.weight, found.rstd))
        dx = g.call_function(operator.getitem, (call, 0))
        total = g.call_function(operator.add, (found.residual, dx)) if found.residual is not None else dx
        dw = g.call_function(operator.getitem, (call, 1)) if found.dw is not None else None
    for new, old in ((dx, found.final), (total, found.final), (dw, found.dw)):
        if new is not None:
            new.meta["val"] = old.meta.get("val")
    for n in (call, dx, dw):
        if n is not None:
            n.meta[DERIVED] = True
    found.final.replace_all_uses_with(total)
    if found.dw is not None:
        found.dw.replace_all_uses_with(dw)
    for n in reversed(list(g.nodes)):
        if n in found.nodes and not n.users:
            g.erase_node(n)
