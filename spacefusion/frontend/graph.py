"""Reading an fx graph: shapes and dtypes of values, and which torch call a node is."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

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


def swapped_dims_1_2(node: Any) -> fx.Node | None:
    """The input of ``node`` when ``node`` swaps dims 1 and 2 of a 4-d tensor (``transpose(1, 2)`` or
    ``permute(0, 2, 1, 3)``, as method or function): HF's split_heads / merge_heads transpose."""
    if not isinstance(node, fx.Node) or len(node.args) < 1 or not isinstance(node.args[0], fx.Node):
        return None
    src, name = node.args[0], node.target if node.op == "call_method" else None
    if node.op == "call_function" and node.target in (torch.transpose, torch.permute):
        name = node.target.__name__
    if name is None or node.kwargs or shape(src) is None or len(shape(src)) != 4:
        return None
    rest = node.args[1:]
    if len(rest) == 1 and isinstance(rest[0], tuple | list):
        rest = tuple(rest[0])
    if not all(isinstance(d, int) for d in rest):
        return None
    if name == "transpose" and len(rest) == 2 and {d % 4 for d in rest} == {1, 2}:
        return src
    if name == "permute" and [d % 4 for d in rest] == [0, 2, 1, 3]:
        return src
    return None


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


def single_user(node: fx.Node) -> fx.Node | None:
    us = users(node)
    return us[0] if len(us) == 1 else None


def param_ref(node: Any) -> str | None:
    """The qualified name of a parameter read by a ``get_attr`` node (None otherwise)."""
    return node.target if isinstance(node, fx.Node) and node.op == "get_attr" else None


@dataclass(frozen=True)
class Linear:
    """``y = x @ W.T (+ b)`` found in a graph: an ``nn.Linear`` call or ``F.linear`` on parameters."""

    x: fx.Node
    weight: str
    bias: str | None
    k: int
    n: int


def linear_of(node: fx.Node, gm: fx.GraphModule) -> Linear | None:
    if node.op == "call_module" and isinstance(mod := gm.get_submodule(node.target), nn.Linear):
        bias = f"{node.target}.bias" if mod.bias is not None else None
        return Linear(node.args[0], f"{node.target}.weight", bias, mod.in_features, mod.out_features)
    if is_function(node, (F.linear, torch._C._nn.linear)):
        w = param_ref(node.args[1] if len(node.args) > 1 else node.kwargs.get("weight"))
        b_node = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        b = param_ref(b_node)
        if w is None or (b_node is not None and b is None):
            return None
        n, k = gm.get_parameter(w).shape if w in dict(gm.named_parameters()) else gm.get_buffer(w).shape
        return Linear(node.args[0], w, b, k, n)
    return None


@dataclass(frozen=True)
class PatchConv:
    """An ``nn.Conv2d`` whose kernel is its stride, unpadded, undilated and ungrouped (ViT's patch
    embedding): its windows tile the image without overlap, so it is one GEMM of a row per patch,
    [b * nh * nw, c * kh * kw] @ W.T[c * kh * kw, c_out]."""

    x: fx.Node
    weight: str
    bias: str | None
    c: int
    kh: int
    kw: int
    cout: int


def patch_conv_of(node: fx.Node, gm: fx.GraphModule) -> PatchConv | None:
    if node.op != "call_module" or not isinstance(mod := gm.get_submodule(node.target), nn.Conv2d):
        return None
    if (mod.kernel_size != mod.stride or mod.dilation != (1, 1) or mod.groups != 1
            or mod.padding not in ((0, 0), "valid") or not isinstance(node.args[0], fx.Node)):
        return None
    bias = f"{node.target}.bias" if mod.bias is not None else None
    (kh, kw) = mod.kernel_size
    return PatchConv(node.args[0], f"{node.target}.weight", bias, mod.in_channels, kh, kw, mod.out_channels)


_ACT_FUNCTIONS = {F.gelu: "gelu", torch.tanh: "tanh", F.silu: "silu", F.relu: "relu", torch.relu: "relu",
                  torch.sigmoid: "sigmoid", F.sigmoid: "sigmoid", F.tanh: "tanh"}
_ACT_METHODS = {"tanh": "tanh", "sigmoid": "sigmoid", "relu": "relu"}
_ACT_MODULES = {nn.GELU: "gelu", nn.Tanh: "tanh", nn.SiLU: "silu", nn.ReLU: "relu", nn.Sigmoid: "sigmoid"}


def activation_of(node: fx.Node, gm: fx.GraphModule) -> str | None:
    """The SMG unary (``smg.ops.UNARY``) that ``node`` applies to its one input, or None.

    GELU must be the exact (erf) form: the tanh approximation is a different function."""
    if node.op == "call_function" and node.target in _ACT_FUNCTIONS:
        if node.target is F.gelu and node.kwargs.get("approximate", "none") != "none":
            return None
        return _ACT_FUNCTIONS[node.target]
    if node.op == "call_method" and node.target in _ACT_METHODS:
        return _ACT_METHODS[node.target]
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        act = _ACT_MODULES.get(type(mod))
        return None if act == "gelu" and mod.approximate != "none" else act
    return None


@dataclass(frozen=True)
class Norm:
    """A LayerNorm or RMSNorm over the last dim, with its affine parameters."""

    kind: str  # "layernorm" | "rmsnorm"
    x: fx.Node
    weight: str | None
    bias: str | None
    eps: float
    dims: int  # how many trailing dims it normalises


def norm_of(node: fx.Node, gm: fx.GraphModule) -> Norm | None:
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        if isinstance(mod, nn.LayerNorm):
            w = f"{node.target}.weight" if mod.weight is not None else None
            b = f"{node.target}.bias" if mod.bias is not None else None
            return Norm("layernorm", node.args[0], w, b, mod.eps, len(mod.normalized_shape))
        if isinstance(mod, nn.RMSNorm):
            w = f"{node.target}.weight" if mod.weight is not None else None
            eps = mod.eps if mod.eps is not None else torch.finfo(torch.float32).eps
            return Norm("rmsnorm", node.args[0], w, None, eps, len(mod.normalized_shape))
        return None
    if is_function(node, (F.layer_norm,)):
        a = dict(zip(("input", "normalized_shape", "weight", "bias", "eps"), node.args)) | node.kwargs
        return Norm("layernorm", a["input"], param_ref(a.get("weight")), param_ref(a.get("bias")),
                    a.get("eps", 1e-5), len(a["normalized_shape"]))
    if is_function(node, (F.rms_norm,)):
        a = dict(zip(("input", "normalized_shape", "weight", "eps"), node.args)) | node.kwargs
        eps = a.get("eps")
        return Norm("rmsnorm", a["input"], param_ref(a.get("weight")), None,
                    eps if eps is not None else torch.finfo(torch.float32).eps, len(a["normalized_shape"]))
    return None
