"""GEMM builders: a linear with its epilogue (``match_linear``), linears of one input stacked into one GEMM
(``match_stacked_linears``), the gated MLP input (``match_gated_gemm``), the patch embedding as a GEMM
(``match_patch_conv``) and a training backward's weight gradient, a GEMM of two graph values
(``match_weight_gradient``)."""

from __future__ import annotations

import operator

from torch import fx

from smg import patterns
from spacefusion.frontend import builders
from spacefusion.frontend.activations import Activation, activation_after
from spacefusion.frontend.canon import canonical
from spacefusion.frontend.gated import gated_of
from spacefusion.frontend.graph import (
    ADD,
    Linear,
    contiguous,
    contiguous_nhwc,
    dtype,
    is_function,
    linear_of,
    param_ref,
    patch_conv_of,
    permutation,
    row_view,
    rows,
    shape,
    single_user,
)
from spacefusion.frontend.matchers import Context, _build, _param, _subgraph, _value
from spacefusion.frontend.prologue import Prologue
from spacefusion.frontend.records import Operand, Result, Subgraph

#: rows below one tensor-core tile (16): the GEMM is a GEMV (decoding), bound by reading W, whose kernel
#: reads W's rows as ``nn.Linear`` stores them ([n, k]) in 16-byte runs along k; from 16 rows on, B = W.T
#: [k, n], the layout the tensor-core (mma / wgmma) GEMMs stream
GEMV_ROWS = 16


def b_layout(m: int) -> str:
    """The B layout a linear of ``m`` rows is fused with (``GEMV_ROWS``)."""
    return "nk" if m < GEMV_ROWS else "kn"


def _weight(space: str, ref: str, m: int, k: int, n: int, stored_kn: bool = False) -> Operand:
    """B of a GEMM of ``m`` rows from a weight stored [n, k] (``nn.Linear``) or [k, n] (GPT-2's ``Conv1D``):
    transposed once at build time where the layout ``b_layout`` picks is not the stored one."""
    nk = b_layout(m) == "nk"
    return _param(space, ref, (n, k) if nk else (k, n), transpose=nk == stored_kn)


def match_gated_gemm(node: fx.Node, ctx: Context) -> Subgraph | None:
    """``act(linear_g(x)) * linear_u(x)`` (two linears sharing x, or one linear's two chunked halves: GEGLU)
    -> ``builders.gated_gemm``; the halves of a chunked projection are slices of its weight's rows."""
    gu = gated_of(node, ctx.gm)
    if gu is None or not ctx.free(*gu.nodes) or dtype(node) is None:
        return None
    m, n, k, dt = rows(shape(gu.x)), gu.n, gu.gate.k, dtype(node)
    pro = ctx.prologue(gu.x)
    nk = b_layout(m) == "nk" or pro is not None  # a prologue's weights are folded copies as stored
    smg = _build(ctx, node, lambda: builders.gated_gemm(m, n, k, gu.act, dt, "nk" if nk else "kn", bias=gu.bias,
                                                        norm=pro.kind if pro else "none",
                                                        eps=pro.eps if pro else None))
    if smg is None:
        return None
    w_shape = (n, k) if nk else (k, n)
    fold = _fold(pro)
    ops = [_value("X", pro.x if pro else gu.x, (m, k)),
           Operand("Wg", "param", gu.gate.weight, w_shape, transpose=not nk, rows=gu.gate_rows, fold_norm=fold),
           Operand("Wu", "param", gu.up.weight, w_shape, transpose=not nk, rows=gu.up_rows, fold_norm=fold)]
    if gu.bias:
        ops += [Operand("bg", "param", gu.gate.bias, (n,), rows=gu.gate_rows),
                Operand("bu", "param", gu.up.bias, (n,), rows=gu.up_rows)]
    form = f"{gu.act}(X@Wg + bg)*(X@Wu + bu)" if gu.bias else f"{gu.act}(X@Wg)*(X@Wu)"
    label = f"{pro.label if pro else ''}gated gemm {form}{' (one chunked linear)' if gu.gate_rows else ''} " \
            f"{m}x{n}x{k} {dt}"
    return _subgraph("norm_gated_gemm" if pro else "gated_gemm", label, gu.nodes, smg, ops, {"Y": node})


def _fold(pro: Prologue | None) -> tuple[str, float] | None:
    """How a linear weight takes its prologue norm's weight (``Operand.fold_norm``); None without one."""
    return (pro.weight, pro.offset) if pro is not None and pro.weight is not None else None


def match_linear(node: fx.Node, ctx: Context) -> Subgraph | None:
    """``nn.Linear`` (+ bias) and a following activation -> ``patterns.gemm_epilogue`` with B = W.T (below
    ``GEMV_ROWS`` rows B = W as stored: ``b_layout``)."""
    lin = linear_of(node, ctx.gm)
    if lin is None or not ctx.free(node):
        return None
    xs, dt = shape(lin.x), dtype(node)
    if xs is None or dt is None:
        ctx.refuse(node, "linear.input", f"linear on a non-float or unshaped input ({node.meta.get('tensor_meta')})")
        return None
    act = _activation_after(node, ctx)
    out, name = (act.out, act.name) if act else (node, None)
    res = None if act else _residual_after(node, ctx)
    back = None if act or res else _residual_through_permute(node, ctx)
    if back is not None:
        res = back[1], back[2]
    out = res[0] if res else out
    m = rows(xs)
    pro = ctx.prologue(lin.x)
    smg = _build(ctx, node, lambda: patterns.gemm_epilogue(
        m, lin.n, lin.k, name or "none", lin.bias is not None, dtype=dt, b_layout="nk" if pro else b_layout(m),
        residual=res is not None, norm=pro.kind if pro else "none", eps=pro.eps if pro else None))
    if smg is None:
        return None
    weight = (Operand("Bw", "param", lin.weight, (lin.n, lin.k), fold_norm=_fold(pro)) if pro
              else _weight("Bw", lin.weight, m, lin.k, lin.n, lin.stored_kn))
    ops = [_value("A", pro.x if pro else lin.x, (m, lin.k)), weight]
    if lin.bias:
        ops.append(_param("bias", lin.bias, (lin.n,)))
    if back is not None:  # the residual and the sum in NCHW, channels-last: both bind as [m, n] views
        ops.append(_value("R", res[1], (m, lin.n), permute=(0, 2, 3, 1)))
        label = f"gemm{' + bias' if lin.bias else ''} + permute + add {m}x{lin.n}x{lin.k} {dt}"
        b, h, w, n = shape(node)
        result = Result("Y", res[0].name, shape(res[0]), permute=(0, 3, 1, 2), split=(b, h, w, n))
        return Subgraph("gemm", label, (node.name, back[0].name, res[0].name), smg, tuple(ops), (result,))
    if res:
        ops.append(_value("R", res[1], (m, lin.n)))
    label = (f"{pro.label if pro else ''}gemm{' + bias' if lin.bias else ''}{f' + {name}' if act else ''}"
             f"{' + add' if res else ''} {m}x{lin.n}x{lin.k} {dt}")
    nodes = (node, *act.nodes) if act else (node, res[0]) if res else (node,)
    return _subgraph("norm_gemm" if pro else "gemm", label, nodes, smg, ops, {"Y": out})


def _residual_through_permute(node: fx.Node, ctx: Context) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """(the permute, the add, the other operand) of ``linear(x).permute(0, 3, 1, 2) + r`` over images stored
    channels-last (ConvNeXt's block: its MLP runs on [b, h, w, c], the block's input is NCHW): the sum's rows
    are the GEMM's rows, so the add is its epilogue, the residual and the sum bound as [m, n] views (never a
    copy: a residual not stored channels-last is left to torch's add)."""
    p = single_user(node)
    pv = permutation(p) if p is not None else None
    if pv is None or pv[1] != (0, 3, 1, 2) or len(shape(node) or ()) != 4 or not ctx.free(p):
        return None
    added = _add_after(p, ctx)
    if added is None or added[0].name in ctx.norm_inputs or not contiguous_nhwc(added[1]) \
            or not contiguous_nhwc(added[0]):
        return None
    return p, added[0], added[1]


def _add_after(y: fx.Node, ctx: Context) -> tuple[fx.Node, fx.Node] | None:
    """(the add, the other operand) of ``y + r``, the add ``y``'s only reader and ``r`` a value of ``y``'s
    shape and dtype: a residual an epilogue takes (torchvision's ``out += identity`` is ``operator.iadd``
    on the BatchNorm's output, read by nothing else)."""
    u = single_user(y)
    if u is None or not is_function(u, (*ADD, operator.iadd)) or len(u.args) != 2 or u.kwargs or not ctx.free(u):
        return None
    other = u.args[1] if u.args[0] is y else u.args[0]
    ok = isinstance(other, fx.Node) and other is not y and shape(other) == shape(y) and dtype(other) == dtype(y)
    return (u, other) if ok else None


def _residual_after(node: fx.Node, ctx: Context) -> tuple[fx.Node, fx.Node] | None:
    """``_add_after`` a linear where no norm reads the sum (BERT's and LLaMA's residual adds are their norms'
    to fuse: ``match_norm``) and the other operand binds as [m, n] without a copy."""
    added = _add_after(node, ctx)
    return added if added is not None and added[0].name not in ctx.norm_inputs and contiguous(added[1]) else None


def match_patch_conv(node: fx.Node, ctx: Context) -> Subgraph | None:
    """A ``nn.Conv2d`` with kernel = stride (ViT's patch embedding, ``graph.patch_conv_of``) -> the GEMM of its
    patches, ``patterns.gemm_epilogue``: A is the image split into patches (torch's copy, im2col without
    overlap), B the weight as a linear's, and Y[b * nh * nw, c_out] goes back as the conv's [b, c_out, nh, nw]
    with channels-last strides, which the usual ``flatten(2).transpose(1, 2)`` after it reads as a view."""
    pc = patch_conv_of(node, ctx.gm)
    if pc is None or not ctx.free(node):
        return None
    xs, dt = shape(pc.x), dtype(node)
    if xs is None or dt is None or len(xs) != 4:
        ctx.refuse(node, "patch_conv.input",
                   f"patch conv on a non-float or non-4D input ({node.meta.get('tensor_meta')})")
        return None
    b, c, h, w = xs
    if h % pc.kh or w % pc.kw:
        ctx.refuse(node, "patch_conv.remainder",
                   f"a {h}x{w} image is not a whole number of {pc.kh}x{pc.kw} patches (the conv drops the "
                   f"rest; the patch GEMM reads whole patches)")
        return None
    nh, nw = h // pc.kh, w // pc.kw
    m, k, n = b * nh * nw, c * pc.kh * pc.kw, pc.cout
    smg = _build(ctx, node, lambda: patterns.gemm_epilogue(m, n, k, "none", pc.bias is not None, dtype=dt,
                                                           b_layout=b_layout(m)))
    if smg is None:
        return None
    ops = [Operand("A", "value", pc.x.name, (m, k), permute=(0, 2, 4, 1, 3, 5), split=(b, c, nh, pc.kh, nw, pc.kw)),
           _weight("Bw", pc.weight, m, k, n)]
    if pc.bias:
        ops.append(_param("bias", pc.bias, (n,)))
    out = Result("Y", node.name, shape(node), permute=(0, 3, 1, 2), split=(b, nh, nw, n))
    label = f"patch conv {pc.kh}x{pc.kw} as gemm{' + bias' if pc.bias else ''} {m}x{n}x{k} {dt}"
    return Subgraph("gemm", label, (node.name,), smg, tuple(ops), (out,))


def _activation_after(node: fx.Node, ctx: Context) -> Activation | None:
    """The activation applied to a linear's output (``activations.activation_after``), fused into its
    epilogue when none of its nodes is claimed; a view between them that keeps the rows (GPT-2's
    ``addmm(...).view(b, s, n)``) is taken in too."""
    via: tuple[fx.Node, ...] = ()
    user = single_user(node)
    if user is not None and row_view(user, node):
        via, y = (user,), user
    else:
        y = node
    act = activation_after(y, ctx.gm)
    if act is None:
        return None
    nodes = (*via, *act.nodes)
    return Activation(act.name, nodes, act.out) if ctx.free(*nodes) else None


def _stack_key(lin: Linear, node: fx.Node, ctx: Context) -> tuple | None:
    """What linears must share to be one stacked GEMM (None: this one cannot join): a written-out
    activation or a view before it would need per-slice results, so only a one-op activation joins."""
    act = _activation_after(node, ctx)
    if not ctx.free(node) or dtype(node) is None or shape(lin.x) is None or (act and len(act.nodes) > 1):
        return None
    return lin.k, lin.n, lin.bias is not None, lin.stored_kn, act.name if act else None, dtype(node)


def match_stacked_linears(node: fx.Node, ctx: Context) -> Subgraph | None:
    """``node`` and the other ``nn.Linear`` of its input with equal shapes, bias use and activation (Q/K/V
    projections; GQA's K/V) -> one stacked ``patterns.gemm_epilogue`` (``stack``): the weights stacked once,
    each linear's output a contiguous slice of Y[t, m, n], so the attention or RoPE reading it binds it
    without a copy.
    Horizontal fusion: one launch instead of ``t``, and ``t`` times the blocks of a small GEMM."""
    first = linear_of(node, ctx.gm)
    if first is None or not isinstance(first.x, fx.Node) or (key := _stack_key(first, node, ctx)) is None:
        return None
    group = [(u, lin) for u in first.x.users if (lin := linear_of(u, ctx.gm)) is not None and lin.x is first.x
             and _stack_key(lin, u, ctx) == key]
    if len(group) < 2:
        return None
    (k, n, bias, stored_kn, act, dt), t, m = key, len(group), rows(shape(first.x))
    pro = ctx.prologue(first.x)
    nk = b_layout(m) == "nk" or pro is not None  # a prologue's weights are folded copies as stored
    smg = _build(ctx, group[0][0],
                 lambda: patterns.gemm_epilogue(m, n, k, act or "none", bias, dt, "nk" if nk else "kn", stack=t,
                                                norm=pro.kind if pro else "none", eps=pro.eps if pro else None))
    if smg is None:
        return None
    lins = [lin for _, lin in group]
    ops = [_value("A", pro.x if pro else first.x, (m, k)),
           Operand("Bw", "param", lins[0].weight, (t, n, k) if nk else (t, k, n), nk == stored_kn,
                   stack=tuple(lin.weight for lin in lins), fold_norm=_fold(pro))]
    if bias:
        ops.append(Operand("bias", "param", lins[0].bias, (t, n), stack=tuple(lin.bias for lin in lins)))
    outs = [single_user(u) if act else u for u, _ in group]
    results = tuple(Result("Y", o.name, shape(o), index=i) for i, o in enumerate(outs))
    nodes = [u.name for u, _ in group] + ([o.name for o in outs] if act else [])
    label = (f"{pro.label if pro else ''}{t} stacked gemms{' + bias' if bias else ''}{f' + {act}' if act else ''} "
             f"{m}x{n}x{k} {dt}")
    return Subgraph("norm_stacked_gemm" if pro else "stacked_gemm", label, tuple(nodes), smg, tuple(ops), results)


#: ``CudaBackend.library_first``'s key of the weight gradient (``match_weight_gradient``)
WEIGHT_GRADIENT = "weight_gradient"


def _is_value(node: object) -> bool:
    """A graph value: an fx node that is neither a parameter (``get_attr``) nor a view of one."""
    if not isinstance(node, fx.Node) or param_ref(node) is not None:
        return False
    p = permutation(node)
    return p is None or param_ref(p[0]) is None


def _bias_gradient(g: fx.Node, ctx: Context) -> fx.Node | None:
    """The node summing ``g`` [k, m] over its rows, ``g.sum(0)`` (autograd writes ``sum(grad, [0], True)``:
    a linear's bias gradient), where no row took it; None where there is none."""
    for u in g.users:
        c = canonical(u, ctx.gm)
        if c is None or c.op != "sum" or not ctx.free(u) or c.arg(0, "input") is not g or c.arg(3, "dtype"):
            continue
        dims = c.arg(1, "dim")
        dims = tuple(dims) if isinstance(dims, list | tuple) else (dims,)
        if dims in ((0,), (-2,)) and len(c.args) <= 3 and set(c.kwargs) <= {"dim", "keepdim"}:
            return u
    return None


def match_weight_gradient(node: fx.Node, ctx: Context) -> Subgraph | None:
    """``mm(t(grad), x)``, a 2-D GEMM of two graph values whose A is a transposed view: the weight gradient of
    a linear as autograd's backward writes it (``dW = grad.T @ x``) -> ``patterns.weight_gradient``, both
    operands read where they lie ([tokens, out] and [tokens, in]; one not packed row-major is copied), with
    the bias gradient ``grad.sum(0)`` as a second output where the backward takes one.  GEMMs with a weight
    operand are ``match_linear``'s (an earlier row); two-value matmuls of attention are the attention rows'
    (earlier too, and 4-D).  Refused on a backend that leaves it to its library (``WEIGHT_GRADIENT``: the GPU,
    where no tensor-core schedule takes an A stored [k, m])."""
    c = canonical(node, ctx.gm)
    if c is None or len(c.args) != 2 or c.kwargs or not ctx.free(node):
        return None
    a, x = c.args
    pa = permutation(a, rank=2) if isinstance(a, fx.Node) else None
    if pa is None or pa[1] != (1, 0) or not _is_value(pa[0]) or not _is_value(x):
        return None
    g = pa[0]
    gs, xs, dt = shape(g), shape(x), dtype(node)
    if gs is None or xs is None or len(gs) != 2 or len(xs) != 2 or gs[0] != xs[0] or dt is None \
            or dtype(g) != dt or dtype(x) != dt:
        ctx.refuse(node, "weight_gradient.form", f"a GEMM of two values of shapes {gs} and {xs}, dtypes "
                   f"{dtype(g)} and {dtype(x)}: not a float weight gradient grad.T @ x")
        return None
    if ctx.library.get(WEIGHT_GRADIENT):
        ctx.refuse(node, "library.first", ctx.library[WEIGHT_GRADIENT])
        return None
    (k, m), n = gs, xs[1]
    db = _bias_gradient(g, ctx)
    smg = _build(ctx, node, lambda: patterns.weight_gradient(m, n, k, bias=db is not None, dtype=dt))
    if smg is None:
        return None
    # an operand not packed row-major (the pooler's x[:, 0]) is bound as a packed copy: an identity permute
    # sends it through ``fused._bind``, which makes it contiguous (k x n elements against the GEMM's k x m x n)
    ops = [_value(sp, v, shp, permute=None if contiguous(v) else (0, 1))
           for sp, v, shp in (("G", g, (k, m)), ("X", x, (k, n)))]
    results = [Result("Y", node.name, shape(node))]
    if db is not None:
        results.append(Result("Db", db.name, shape(db)))
    label = f"weight gradient grad.T @ x{' + bias gradient' if db is not None else ''} {m}x{n}x{k} {dt}"
    nodes = (node.name, db.name) if db is not None else (node.name,)
    return Subgraph("weight_gradient", label, nodes, smg, tuple(ops), tuple(results))
