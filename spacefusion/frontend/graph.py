"""Reading an fx graph: shapes and dtypes of values, and which torch call a node is."""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from spacefusion.frontend.canon import Param, canonical, is_op, op_of

#: torch dtypes the SMG patterns take, by their SMG (numpy / TVM) spelling
DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}

SDPA = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)
ADD = (operator.add, torch.add)
MUL = (operator.mul, torch.mul)


def shape(node: Any) -> tuple[int, ...] | None:
    """The tensor shape ShapeProp recorded for ``node`` (None: not an fx node or not one tensor)."""
    meta = node.meta.get("tensor_meta") if isinstance(node, fx.Node) else None
    return tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else None


def dtype(node: fx.Node) -> str | None:
    meta = node.meta.get("tensor_meta")
    return DTYPES.get(getattr(meta, "dtype", None))


def contiguous(node: Any) -> bool:
    """Whether ShapeProp saw ``node``'s value as a packed row-major tensor (a kernel may bind it as is)."""
    meta = node.meta.get("tensor_meta") if isinstance(node, fx.Node) else None
    if meta is None or not hasattr(meta, "stride"):
        return False
    want, acc = [], 1
    for n in reversed(tuple(meta.shape)):
        want.append(acc)
        acc *= n
    return all(n == 1 or s == w for n, s, w in zip(tuple(meta.shape)[::-1], tuple(meta.stride)[::-1], want))


def contiguous_nhwc(x: Any) -> bool:
    """Whether ShapeProp saw the image ``x`` packed channels-last (a 1-channel or 1x1 image is both)."""
    meta = x.meta.get("tensor_meta") if isinstance(x, fx.Node) else None
    if meta is None or len(meta.shape) != 4:
        return False
    n, c, h, w = tuple(meta.shape)
    return all(size == 1 or st == want for size, st, want in zip((n, c, h, w), tuple(meta.stride),
                                                                   (h * w * c, 1, w * c, c)))


def heads_interleaved(node: Any) -> bool:
    """Whether ShapeProp saw ``node``, a [b, h, s, d] value, lying in memory as a packed [b, s, h, d]
    tensor: HF's split_heads view, and what element-wise ops on it (RoPE) return, since torch gives their
    outputs their input's strides.  A bshd kernel reads it where it lies."""
    meta = node.meta.get("tensor_meta") if isinstance(node, fx.Node) else None
    if meta is None or not hasattr(meta, "stride") or len(meta.shape) != 4:
        return False
    (b, h, s, d), stride = tuple(meta.shape), tuple(meta.stride)
    want = (s * h * d, d, h * d, 1)
    return all(n == 1 or st == w for n, st, w in zip((b, h, s, d), stride, want))


def permutation(node: Any, rank: int | None = None) -> tuple[fx.Node, tuple[int, ...]] | None:
    """(input, dims) where ``node`` only reorders its input's dims: ``permute`` (method or function),
    ``transpose(a, b)`` (method or function), ``t()`` / ``torch.t`` / ``.T`` of a 2-d tensor; the dims
    normalised to ``0..rank-1`` (``rank``: the input's, read from its shape where not given).  None otherwise."""
    c = canonical(node)
    if c is None or c.kwargs or not c.args or not isinstance(c.args[0], fx.Node):
        return None
    src, rest, name = c.args[0], tuple(c.args[1:]), c.op
    if rank is None:
        rank = len(shape(src)) if shape(src) is not None else None
    if name not in ("permute", "transpose", "t") or rank is None:
        return None
    if len(rest) == 1 and isinstance(rest[0], tuple | list):
        rest = tuple(rest[0])
    if not all(isinstance(d, int) and -rank <= d < rank for d in rest):
        return None
    rest = tuple(d % rank for d in rest)
    if name == "t" and not rest and rank == 2:
        return src, (1, 0)
    if name == "transpose" and len(rest) == 2:
        dims = list(range(rank))
        dims[rest[0]], dims[rest[1]] = dims[rest[1]], dims[rest[0]]
        return src, tuple(dims)
    if name == "permute" and sorted(rest) == list(range(rank)):
        return src, rest
    return None


def swapped_dims_1_2(node: Any) -> fx.Node | None:
    """The input of ``node`` when ``node`` swaps dims 1 and 2 of a 4-d tensor (``transpose(1, 2)`` or
    ``permute(0, 2, 1, 3)``, as method or function): HF's split_heads / merge_heads transpose."""
    p = permutation(node)
    return p[0] if p is not None and p[1] == (0, 2, 1, 3) else None


def rows(shp: tuple[int, ...]) -> int:
    """Rows of a [..., n] tensor seen as a matrix [m, n]."""
    return math.prod(shp[:-1])


def is_function(node: fx.Node, fns: tuple[Any, ...]) -> bool:
    return node.op == "call_function" and node.target in fns


def call_name(node: fx.Node, gm: fx.GraphModule) -> str:
    """A readable name of what ``node`` calls: ``torch.cat``, ``Tensor.transpose``, ``Embedding``."""
    if node.op == "call_module":
        return type(gm.get_submodule(node.target)).__name__
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    t = node.target
    mod = getattr(t, "__module__", None) or ""
    name = getattr(t, "__name__", str(t))
    if mod == "builtins":
        return name
    if mod in ("_operator", "operator"):
        return f"operator.{name}"
    if mod.startswith(("torch.nn.functional", "torch._C._nn")):
        return f"F.{name}"
    return f"torch.{name}"


def users(node: fx.Node) -> list[fx.Node]:
    return list(node.users)


def row_view(node: fx.Node, src: fx.Node) -> bool:
    """``node`` is a view/reshape of ``src`` that keeps its last dim (rows regrouped: [m, n] as [b, s, n])."""
    return (node.op == "call_method" and node.target in ("view", "reshape") and shape(node) is not None
            and shape(src) is not None and shape(node)[-1] == shape(src)[-1])


def single_user(node: fx.Node) -> fx.Node | None:
    us = users(node)
    return us[0] if len(us) == 1 else None


def param_ref(node: Any) -> str | None:
    """The qualified name of a parameter read by a ``get_attr`` node or named by a module's ``canon.Param``
    (None otherwise)."""
    if isinstance(node, Param):
        return node.ref
    return node.target if isinstance(node, fx.Node) and node.op == "get_attr" else None


@dataclass(frozen=True)
class Linear:
    """``y = x @ W.T (+ b)`` found in a graph: an ``nn.Linear`` call or ``F.linear`` on parameters."""

    x: fx.Node
    weight: str
    bias: str | None
    k: int
    n: int
    stored_kn: bool = False  # the weight lies as [k, n] (GPT-2's Conv1D), not nn.Linear's [n, k]


def param_tensor(gm: fx.GraphModule, ref: str) -> torch.Tensor:
    """The parameter or buffer ``ref`` of ``gm`` (a lifted weight is either)."""
    return gm.get_parameter(ref) if ref in dict(gm.named_parameters()) else gm.get_buffer(ref)


def _param_shape(gm: fx.GraphModule, ref: str) -> tuple[int, ...]:
    return tuple(param_tensor(gm, ref).shape)


def linear_of(node: fx.Node, gm: fx.GraphModule) -> Linear | None:
    """The linear at ``node``: ``linear(x, W, b)`` on parameters, ``x @ W.T`` / ``x @ W`` on a 2-D parameter,
    ``addmm(b, x, W)`` (GPT-2's Conv1D), in any spelling (``canon``)."""
    c = canonical(node, gm)
    if c is None:
        return None
    if c.op == "linear":
        w = param_ref(c.arg(1, "weight"))
        b_node = c.arg(2, "bias")
        b = param_ref(b_node)
        if w is None or (b_node is not None and b is None):
            return None
        n, k = _param_shape(gm, w)
        return Linear(c.args[0], w, b, k, n)
    if c.op in MATMUL and len(c.args) == 2 and not c.kwargs and isinstance(c.args[0], fx.Node):
        # x @ W.T (W [n, k], as nn.Linear stores it) or x @ W (W [k, n]) on a 2-D parameter: a linear, no bias
        w, transposed = _weight_operand(c.args[1])
        if w is None or len(_param_shape(gm, w)) != 2 or c.args[0].op == "get_attr":
            return None
        a, b = _param_shape(gm, w)
        k, n = (b, a) if transposed else (a, b)
        xs = shape(c.args[0])
        return Linear(c.args[0], w, None, k, n, stored_kn=not transposed) if xs and xs[-1] == k else None
    if c.op == "addmm" and len(c.args) == 3 and not c.kwargs:
        # GPT-2's Conv1D: addmm(bias, x[m, k], W[k, n]) = x @ W + bias
        b, x, w = (param_ref(a) if i != 1 else a for i, a in enumerate(c.args))
        if b is None or w is None or not isinstance(x, fx.Node) or len(_param_shape(gm, w)) != 2:
            return None
        k, n = _param_shape(gm, w)
        return Linear(x, w, b, k, n, stored_kn=True) if _param_shape(gm, b) == (n,) else None
    return None


#: a product the frontend reads as a linear where one side is a parameter (``linear_of``)
MATMUL = ("matmul", "mm")


def _weight_operand(node: Any) -> tuple[str | None, bool]:
    """(the parameter, whether it is read transposed) of ``W``, ``W.T``, ``W.t()``, ``W.transpose(0, 1)`` or
    ``W.permute(1, 0)`` on a parameter ``W``; (None, False) for anything else."""
    ref = param_ref(node)
    if ref is not None:
        return ref, False
    p = permutation(node, rank=2)
    ref = param_ref(p[0]) if p is not None and p[1] == (1, 0) else None
    return (ref, True) if ref is not None else (None, False)


def _pair(v: Any) -> Any:
    return tuple(v) if isinstance(v, tuple | list) else (v, v) if isinstance(v, int) else v


@dataclass(frozen=True)
class Conv:
    """An ``nn.Conv2d`` / ``nn.Conv1d`` call or ``F.conv2d`` / ``F.conv1d`` on parameters: its input, weight and
    bias, and its geometry as torch gives it (``padding`` may be a string: "same" / "valid").  A 1-D
    convolution (``dims`` 1) is given as the 2-D one over an image one row high: kernel (1, k), stride (1, s),
    padding (0, p), dilation (1, d); its input stays the [batch, channels, length] node."""

    x: fx.Node
    weight: str
    bias: str | None
    c: int
    kh: int
    kw: int
    cout: int
    stride: tuple[int, int]
    padding: Any
    dilation: tuple[int, int]
    groups: int
    padding_mode: str = "zeros"
    dims: int = 2  # spatial dims: 1 for a conv1d (given as a 2-D conv one row high)


CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")


def _one(v: Any) -> Any:
    """A 1-D conv's stride / padding / dilation as its one value (a string padding as it is)."""
    if isinstance(v, tuple | list):
        return v[0] if len(v) == 1 else None
    return v


def _row(v: Any, first: int, kernel: int | None = None) -> Any:
    """A 1-D conv's ``v`` as the 2-D one's (``first``, v) over an image one row high.  A padding of "valid" is
    (0, 0), "same" of an odd ``kernel`` (0, (kernel - 1) / 2) (torch allows it at stride 1 only); other strings
    are kept (an even kernel's "same" pads one side more: refused later)."""
    one = _one(v)
    if one == "valid":
        return first, 0
    if one == "same" and kernel is not None and kernel % 2:
        return first, (kernel - 1) // 2
    return one if isinstance(one, str) or one is None else (first, one)


def conv_of(node: fx.Node, gm: fx.GraphModule) -> Conv | None:
    """The convolution at ``node`` on parameters (its weight and any bias ``get_attr`` nodes), 2-D or 1-D; None
    where it is not one (a weight computed in the graph, a 3-D conv)."""
    c = canonical(node, gm)
    if c is None or c.op not in ("conv1d", "conv2d"):
        return None
    a = c.bind(CONV_ARGS)
    w, b_node = param_ref(a.get("weight")), a.get("bias")
    b = param_ref(b_node)
    if w is None or (b_node is not None and b is None) or not isinstance(a.get("input"), fx.Node):
        return None
    groups, mode = a.get("groups", 1), a.get("padding_mode", "zeros")
    if c.op == "conv1d":
        cout, cg, k = _param_shape(gm, w)
        return Conv(a["input"], w, b, cg * groups, 1, k, cout, _row(a.get("stride", 1), 1),
                    _row(a.get("padding", 0), 0, k), _row(a.get("dilation", 1), 1), groups, mode, dims=1)
    cout, cg, kh, kw = _param_shape(gm, w)
    return Conv(a["input"], w, b, cg * groups, kh, kw, cout, _pair(a.get("stride", 1)),
                _square_padding(_pair(a.get("padding", 0)), (kh, kw)), _pair(a.get("dilation", 1)), groups, mode)


def _square_padding(padding: Any, kernel: tuple[int, int]) -> Any:
    """A 2-D conv's string padding as the numbers it means where they are symmetric: "valid" is (0, 0), "same"
    of odd kernels ((k - 1) / 2 each side; torch allows "same" at stride 1 only, and pads an even kernel's
    extra row and column after the image: kept as the string, refused later).  EfficientNet's 1x1 and
    depthwise convs are written this way."""
    if padding == "valid":
        return 0, 0
    if padding == "same" and all(k % 2 for k in kernel):
        return (kernel[0] - 1) // 2, (kernel[1] - 1) // 2
    return padding


def patch_conv_of(node: fx.Node, gm: fx.GraphModule) -> Conv | None:
    """The conv at ``node`` where its kernel is its stride, unpadded, undilated and ungrouped (ViT's patch
    embedding): its windows tile the image without overlap, so it is one GEMM of a row per patch,
    [b * nh * nw, c * kh * kw] @ W.T[c * kh * kw, c_out]."""
    cv = conv_of(node, gm)
    if cv is None or cv.dims != 2 or cv.stride != (cv.kh, cv.kw) or cv.dilation != (1, 1) or cv.groups != 1 \
            or cv.padding not in ((0, 0), "valid") or cv.padding_mode != "zeros":
        return None
    return cv


@dataclass(frozen=True)
class BatchNorm:
    """An inference ``BatchNorm2d`` / ``BatchNorm1d`` (running statistics, not training): ``(x - mean) / sqrt(var +
    eps) * w + b``."""

    x: fx.Node
    mean: str
    var: str
    weight: str | None
    bias: str | None
    eps: float


def batchnorm_of(node: fx.Node, gm: fx.GraphModule) -> BatchNorm | None:
    c = canonical(node, gm)
    if c is None or c.op != "batch_norm":
        return None
    names = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
    a = c.bind(names)
    refs = [param_ref(a.get(n)) for n in ("running_mean", "running_var", "weight", "bias")]
    if a.get("training", False) or refs[0] is None or refs[1] is None or not isinstance(a["input"], fx.Node):
        return None
    if (a.get("weight") is not None and refs[2] is None) or (a.get("bias") is not None and refs[3] is None):
        return None
    return BatchNorm(a["input"], refs[0], refs[1], refs[2], refs[3], float(a.get("eps", 1e-5)))


@dataclass(frozen=True)
class MaxPool:
    """``nn.MaxPool2d`` / ``F.max_pool2d``: a square window, one stride and one padding (what the SMG's pooling
    view takes); ``None`` from ``max_pool_of`` for what it does not (dilation, ceil mode, indices)."""

    x: fx.Node
    kernel: int
    stride: int
    pad: int


def is_max_pool(node: fx.Node, gm: fx.GraphModule) -> bool:
    """``node`` calls a max pool (2-d), supported or not."""
    return op_of(node, gm) == "max_pool2d"


def max_pool_of(node: fx.Node, gm: fx.GraphModule) -> MaxPool | None:
    c = canonical(node, gm)
    if c is None or c.op != "max_pool2d":
        return None
    a = c.bind(("input", "kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices"))
    k, s, p, d = (_pair(v) for v in (a.get("kernel_size"), a.get("stride") or a.get("kernel_size"),
                                     a.get("padding", 0), a.get("dilation", 1)))
    if not isinstance(a.get("input"), fx.Node) or a.get("ceil_mode") or a.get("return_indices") or d != (1, 1):
        return None
    if not all(isinstance(v, tuple) and len(v) == 2 and v[0] == v[1] and isinstance(v[0], int) for v in (k, s, p)):
        return None
    return MaxPool(a["input"], k[0], s[0], p[0])


@dataclass(frozen=True)
class GroupNorm:
    """``nn.GroupNorm`` / ``F.group_norm``: per (sample, group) statistics over the group's channels and pixels."""

    x: fx.Node
    groups: int
    weight: str | None
    bias: str | None
    eps: float


def groupnorm_of(node: fx.Node, gm: fx.GraphModule) -> GroupNorm | None:
    c = canonical(node, gm)
    if c is None or c.op != "group_norm":
        return None
    a = c.bind(("input", "num_groups", "weight", "bias", "eps"))
    w, b = param_ref(a.get("weight")), param_ref(a.get("bias"))
    if not isinstance(a.get("input"), fx.Node) or not isinstance(a.get("num_groups"), int):
        return None
    if (a.get("weight") is not None and w is None) or (a.get("bias") is not None and b is None):
        return None
    return GroupNorm(a["input"], a["num_groups"], w, b, float(a.get("eps", 1e-5)))


def nearest_upsample_of(node: fx.Node, gm: fx.GraphModule) -> tuple[fx.Node, int] | None:
    """(input, factor) of a whole-number nearest upsampling (``F.interpolate`` / ``nn.Upsample``)."""
    c = canonical(node, gm)
    if c is None or c.op != "interpolate":
        return None
    a = c.bind(("input", "size", "scale_factor", "mode"))
    x, f = a.get("input"), a.get("scale_factor")
    f = f[0] if isinstance(f, tuple | list) and len(set(f)) == 1 else f
    if a.get("mode", "nearest") != "nearest" or a.get("size") is not None or not isinstance(x, fx.Node) \
            or not isinstance(f, int | float) or f != int(f) or f < 2:
        return None
    return x, int(f)


#: canonical ops that are one SMG unary of their one input, as that unary
_ACTIVATIONS = {"tanh": "tanh", "silu": "silu", "relu": "relu", "sigmoid": "sigmoid"}


def activation_of(node: fx.Node, gm: fx.GraphModule) -> str | None:
    """The SMG unary (``smg.ops.UNARY``) that ``node`` applies to its one input, or None.

    GELU's exact (erf) form is ``gelu``, its tanh approximation ``gelu_tanh``: different functions.  A
    ``hardtanh`` clamping to [0, 6] (``nn.ReLU6``, ``F.relu6``: MobileNet's, which Dynamo records as
    ``F.hardtanh``) is ``relu6``; other bounds are no SMG unary."""
    c = canonical(node, gm)
    if c is None:
        return None
    if c.op == "hardtanh":
        return "relu6" if (c.arg(1, "min_val", -1.0), c.arg(2, "max_val", 1.0)) == (0.0, 6.0) else None
    if c.op == "gelu":
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(c.arg(1, "approximate", "none"))
    return _ACTIVATIONS.get(c.op)


@dataclass(frozen=True)
class Norm:
    """A LayerNorm or RMSNorm over the last dim, with its affine parameters."""

    kind: str  # "layernorm" | "rmsnorm"
    x: fx.Node
    weight: str | None
    bias: str | None
    eps: float
    dims: int  # how many trailing dims it normalises
    inner: tuple[fx.Node, ...] = ()  # the nodes of a norm written out in ops (HF's RMSNorm), ``node`` excluded
    offset: float = 0.0  # the affine weight is ``offset + weight`` (Gemma's ``1 + w``)


def norm_of(node: fx.Node, gm: fx.GraphModule) -> Norm | None:
    """The LayerNorm / RMSNorm at ``node``: a call of one (any spelling), or an RMSNorm written in ops."""
    c = canonical(node, gm)
    if c is not None and c.op == "layer_norm":
        a = c.bind(("input", "normalized_shape", "weight", "bias", "eps"))
        return Norm("layernorm", a["input"], param_ref(a.get("weight")), param_ref(a.get("bias")),
                    a.get("eps", 1e-5), len(a["normalized_shape"]))
    if c is not None and c.op == "rms_norm":
        a = c.bind(("input", "normalized_shape", "weight", "eps"))
        eps = a.get("eps")
        return Norm("rmsnorm", a["input"], param_ref(a.get("weight")), None,
                    eps if eps is not None else torch.finfo(torch.float32).eps, len(a["normalized_shape"]))
    if node.op == "call_module":
        return None
    if is_function(node, MUL):
        if len(node.users) == 1 and _cast_of(next(iter(node.users))) is node:
            return None  # the cast after it is the norm's end (Gemma's ``(x * w).type_as(x)``): matched there
        return _written_rms_norm(node)
    inner = _cast_of(node)
    if inner is not None and is_function(inner, MUL):
        nm = _written_rms_norm(inner)
        return None if nm is None else dataclasses.replace(nm, inner=(*nm.inner, inner))
    return None


def read_rstd(nm: Norm, node: fx.Node) -> fx.Node | None:
    """The rsqrt of an RMSNorm written in ops (``nm``, ending at ``node``) where a node outside the norm reads it,
    else None: a training forward's, whose rsqrt aot_autograd saves for the backward (``match_norm`` then
    outputs it, ``patterns.rmsnorm_stats``; a GEMM prologue, which outputs no statistic, does not take it)."""
    inside = {*nm.inner, node}
    return next((n for n in nm.inner if is_op(n, "rsqrt") and any(u not in inside for u in n.users)), None)


_TO_FLOAT = frozenset({"to", "float", "half", "bfloat16", "type_as"})


def _cast_of(node: Any) -> fx.Node | None:
    """The input of a dtype cast (``x.to(dtype)``, ``x.float()``, ``x.type_as(y)``), else None."""
    if isinstance(node, fx.Node) and node.op == "call_method" and node.target in _TO_FLOAT \
            and isinstance(node.args[0], fx.Node) and "device" not in node.kwargs:
        rest = node.args[1:] + tuple(node.kwargs.values())
        if node.target != "to" or all(isinstance(a, torch.dtype) for a in rest):
            return node.args[0]
    return None


def _uncast(node: Any) -> Any:
    return _cast_of(node) or node


def _written_rms_norm(node: fx.Node) -> Norm | None:
    """HF's RMSNorm written in ops (LLaMA's, Mistral's, T5's LayerNorm):
    ``w * (x * rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(dtype)``, the casts optional,
    x in the product and under the mean the same value up to casts (T5 multiplies the uncast x)."""
    for w_node, h in (node.args, node.args[::-1]):
        found = _norm_weight(w_node)
        if found is None or not isinstance(h, fx.Node) or len(node.args) != 2:
            continue
        w, offset, taken = found
        inner = [*taken, *([h] if _cast_of(h) is not None else [])]
        h = _uncast(h)
        if not is_function(h, MUL) or len(h.args) != 2:
            continue
        for xb, r in (h.args, h.args[::-1]):
            if not is_op(r, "rsqrt") or not is_function(r.args[0], ADD):
                continue
            var, eps = r.args[0].args if len(r.args[0].args) == 2 else (None, None)
            if isinstance(var, float | int) and isinstance(eps, fx.Node):
                var, eps = eps, var
            if not isinstance(eps, float | int) or not is_op(var, "mean"):
                continue
            margs = dict(zip(("dim", "keepdim"), var.args[1:])) | dict(var.kwargs)
            dim, keep = margs.get("dim"), margs.get("keepdim", False)
            dim = dim[0] if isinstance(dim, tuple | list) and len(dim) == 1 else dim
            sq = var.args[0]
            if dim not in (-1,) and not (isinstance(dim, int) and shape(sq) and dim == len(shape(sq)) - 1) \
                    or not keep:
                continue
            if not is_op(sq, "pow") or len(sq.args) != 2 or sq.args[1] != 2:
                continue
            x = _uncast(sq.args[0])
            if _uncast(xb) is not x or not isinstance(x, fx.Node):
                continue
            casts = [c for c in dict.fromkeys((sq.args[0], xb)) if c is not x]
            inner += [h, r, r.args[0], var, sq, *casts]
            return Norm("rmsnorm", x, w, None, float(eps), 1, tuple(dict.fromkeys(inner)), offset)
    return None


def _norm_weight(node: Any) -> tuple[str, float, tuple[fx.Node, ...]] | None:
    """(parameter, offset, nodes taken) of a written norm's weight: a parameter, cast or not, or Gemma's
    ``1.0 + w.float()`` (the weight stored as an offset from 1)."""
    if not isinstance(node, fx.Node):
        return None
    taken: list[fx.Node] = []
    offset = 0.0
    if is_function(node, ADD) and len(node.args) == 2 and not node.kwargs:
        a, b = node.args
        num, other = (a, b) if isinstance(a, float | int) else (b, a)
        if isinstance(num, float | int) and not isinstance(num, bool) and isinstance(other, fx.Node):
            taken.append(node)
            offset, node = float(num), other
    if _cast_of(node) is not None:
        taken.append(node)
        node = _cast_of(node)
    w = param_ref(node)
    return None if w is None else (w, offset, tuple(taken))
