"""One spelling per op: every fx call node read as one canonical function call before any pattern is matched.

A graph spells one op up to four ways: a module call (``nn.Linear``), a tensor method (``x.transpose(1, 2)``),
a torch function (``F.linear``, ``torch._C._nn.linear``, ``operator.add``) or an ATen overload
(``aten.linear.default``, which ``torch.export`` graphs hold).  ``canonical`` maps each to a ``Call``: the
op's canonical name (the torch function's, ``"linear"``), its arguments in the function's order, and a module's
own parameters as ``Param`` references (what a ``get_attr`` of them would read).  A pattern is then written
once per op, against ``Call``s (``graph.linear_of``, the table's anchors in ``frontend.table``), not once per
spelling.

Contract: ``canonical(node)`` is None for a node that is no call of a known op (a placeholder, an unknown
function or module); a method whose name is not listed keeps its own name as its op (``x.view`` is
``"view"``); an ATen overload is named by its packet (``aten.add.Tensor`` is ``"add"``).  Normalisation is of
the spelling only: argument values are as the node holds them, so ``Call.arg`` / ``Call.bind`` read them by
position or keyword.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn


@dataclass(frozen=True)
class Param:
    """A module's own parameter or buffer by qualified name: the module spelling's stand-in for a ``get_attr``."""

    ref: str


@dataclass(frozen=True, eq=False)
class Call:
    """An fx call node as its canonical function call: ``op(*args, **kwargs)``."""

    op: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)

    def arg(self, i: int, name: str, default: Any = None) -> Any:
        """The argument at position ``i`` or keyword ``name``, else ``default``."""
        return self.args[i] if len(self.args) > i else self.kwargs.get(name, default)

    def bind(self, names: Sequence[str]) -> dict[str, Any]:
        """The positional arguments named by ``names``, then the keywords."""
        return dict(zip(names, self.args)) | dict(self.kwargs)


#: torch function -> its canonical op: every function spelling the frontend reads
FUNCTIONS: dict[Any, str] = {
    F.linear: "linear", torch._C._nn.linear: "linear", operator.matmul: "matmul", torch.matmul: "matmul",
    torch.mm: "mm", torch.addmm: "addmm", torch.bmm: "bmm", torch.baddbmm: "baddbmm",
    F.conv1d: "conv1d", torch.conv1d: "conv1d", F.conv2d: "conv2d", torch.conv2d: "conv2d",
    F.conv3d: "conv3d", torch.conv3d: "conv3d", torch.einsum: "einsum",
    F.conv_transpose1d: "conv_transpose1d", F.conv_transpose2d: "conv_transpose2d",
    F.conv_transpose3d: "conv_transpose3d",
    F.batch_norm: "batch_norm", torch.batch_norm: "batch_norm", F.layer_norm: "layer_norm",
    F.rms_norm: "rms_norm", F.group_norm: "group_norm", torch.group_norm: "group_norm",
    F.max_pool2d: "max_pool2d", torch.max_pool2d: "max_pool2d", F.interpolate: "interpolate",
    F.gelu: "gelu", torch._C._nn.gelu: "gelu", torch.tanh: "tanh", F.tanh: "tanh", F.silu: "silu",
    F.relu: "relu", torch.relu: "relu", torch.sigmoid: "sigmoid", F.sigmoid: "sigmoid",
    F.hardtanh: "hardtanh", torch._C._nn.hardtanh: "hardtanh", F.hardtanh_: "hardtanh",
    F.scaled_dot_product_attention: "scaled_dot_product_attention",
    torch._C._nn.scaled_dot_product_attention: "scaled_dot_product_attention",
    F.softmax: "softmax", torch.softmax: "softmax", F.dropout: "dropout",
    operator.add: "add", torch.add: "add", operator.iadd: "iadd", operator.mul: "mul", torch.mul: "mul",
    operator.sub: "sub", torch.sub: "sub", operator.truediv: "div", torch.div: "div", operator.neg: "neg",
    torch.neg: "neg", torch.transpose: "transpose", torch.permute: "permute", torch.t: "t",
    torch.rsqrt: "rsqrt", torch.mean: "mean", torch.sum: "sum", torch.pow: "pow", torch.where: "where",
    torch.clamp: "clamp", torch.clip: "clamp", torch.cat: "cat", torch.concat: "cat", operator.getitem: "getitem",
}
#: a tensor method whose canonical op is not its own name
METHODS: dict[str, str] = {"clip": "clamp", "concat": "cat"}
#: ATen ops a pattern anchors on where no torch function spells them, named by their packet as ``canonical``
#: names every overload: a training step's ATen graph (``frontend.training``) holds torch's CPU flash attention
#: whole where the backward reads its logsumexp (``table``'s ``attention_lse`` row), and ``native_layer_norm``
#: whole where it reads the mean and rstd (``norm_stats``)
ATEN_ANCHORS: frozenset[str] = frozenset({"_scaled_dot_product_flash_attention_for_cpu", "native_layer_norm"})
#: custom ops of other libraries a pattern anchors on, named by their packet as ``canonical`` names them:
#: transformers' ``transformers::grouped_mm_fallback`` (MoE experts under ``torch.compile``: ``frontend.experts``)
CUSTOM_ANCHORS: frozenset[str] = frozenset({"grouped_mm_fallback"})


def _relu6(node: fx.Node) -> Call:
    return Call("hardtanh", (node.args[0], 0.0, 6.0))


#: function spellings whose arguments differ from the canonical op's (``F.relu6(x)`` is ``hardtanh(x, 0, 6)``)
ADAPTED: dict[Any, Callable[[fx.Node], Call]] = {F.relu6: _relu6}


def _p(t: str, name: str, present: bool = True) -> Param | None:
    return Param(f"{t}.{name}") if present else None


def _linear(m: nn.Linear, t: str, x: Any) -> Call:
    return Call("linear", (x, _p(t, "weight"), _p(t, "bias", m.bias is not None)))


def _conv(m: nn.Conv1d | nn.Conv2d | nn.Conv3d, t: str, x: Any) -> Call:
    op = f"conv{len(m.kernel_size)}d"
    return Call(op, (x, _p(t, "weight"), _p(t, "bias", m.bias is not None), m.stride, m.padding, m.dilation,
                     m.groups), {"padding_mode": m.padding_mode})


def _batch_norm(m: nn.BatchNorm1d | nn.BatchNorm2d, t: str, x: Any) -> Call:
    stats = m.running_mean is not None
    return Call("batch_norm", (x, _p(t, "running_mean", stats), _p(t, "running_var", stats),
                               _p(t, "weight", m.affine), _p(t, "bias", m.affine), m.training, m.momentum, m.eps))


def _layer_norm(m: nn.LayerNorm, t: str, x: Any) -> Call:
    return Call("layer_norm", (x, m.normalized_shape, _p(t, "weight", m.weight is not None),
                               _p(t, "bias", m.bias is not None), m.eps))


def _rms_norm(m: nn.RMSNorm, t: str, x: Any) -> Call:
    return Call("rms_norm", (x, m.normalized_shape, _p(t, "weight", m.weight is not None), m.eps))


def _group_norm(m: nn.GroupNorm, t: str, x: Any) -> Call:
    return Call("group_norm", (x, m.num_groups, _p(t, "weight", m.affine), _p(t, "bias", m.affine), m.eps))


def _max_pool(m: nn.MaxPool2d, t: str, x: Any) -> Call:
    return Call("max_pool2d", (x, m.kernel_size, m.stride, m.padding, m.dilation, m.ceil_mode, m.return_indices))


def _upsample(m: nn.Upsample, t: str, x: Any) -> Call:
    return Call("interpolate", (x,), {"size": m.size, "scale_factor": m.scale_factor, "mode": m.mode})


def _hardtanh(m: nn.Hardtanh, t: str, x: Any) -> Call:
    return Call("hardtanh", (x, m.min_val, m.max_val))


def _gelu(m: nn.GELU, t: str, x: Any) -> Call:
    return Call("gelu", (x,), {"approximate": m.approximate})


#: module class (and its subclasses) -> its function call; tried in order
MODULES: tuple[tuple[type[nn.Module] | tuple[type[nn.Module], ...], Callable[[Any, str, Any], Call]], ...] = (
    (nn.Linear, _linear), ((nn.Conv1d, nn.Conv2d, nn.Conv3d), _conv), ((nn.BatchNorm1d, nn.BatchNorm2d), _batch_norm),
    (nn.LayerNorm, _layer_norm), (nn.RMSNorm, _rms_norm), (nn.GroupNorm, _group_norm), (nn.MaxPool2d, _max_pool),
    (nn.Upsample, _upsample), (nn.Hardtanh, _hardtanh))
#: activation modules by exact class (a subclass may compute something else): their one-input function
ACTIVATIONS: dict[type[nn.Module], str] = {nn.Tanh: "tanh", nn.SiLU: "silu", nn.ReLU: "relu", nn.Sigmoid: "sigmoid"}


def _module_call(node: fx.Node, gm: fx.GraphModule) -> Call | None:
    mod = gm.get_submodule(node.target)
    x = node.args[0] if node.args else node.kwargs.get("input")
    if type(mod) is nn.GELU:
        return _gelu(mod, node.target, x)
    if type(mod) in ACTIVATIONS:
        return Call(ACTIVATIONS[type(mod)], (x,))
    for cls, make in MODULES:
        if isinstance(mod, cls):
            return make(mod, node.target, x)
    return None


def canonical(node: Any, gm: fx.GraphModule | None = None) -> Call | None:
    """``node`` as its canonical call (see the module's contract); ``gm`` resolves a module call (default: the
    node's owning module)."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_method":
        return Call(METHODS.get(node.target, node.target), tuple(node.args), dict(node.kwargs))
    if node.op == "call_module":
        gm = gm if gm is not None else node.graph.owning_module
        return _module_call(node, gm) if gm is not None else None
    if node.op != "call_function":
        return None
    t = node.target
    if t in ADAPTED:
        return ADAPTED[t](node)
    if t is getattr and len(node.args) == 2 and node.args[1] == "T":
        return Call("t", (node.args[0],))
    op = FUNCTIONS.get(t) if not isinstance(t, torch._ops.OpOverload | torch._ops.OpOverloadPacket) else None
    if op is None and isinstance(t, torch._ops.OpOverload):
        op = t.overloadpacket.__name__  # aten.add.Tensor -> "add"
    elif op is None and isinstance(t, torch._ops.OpOverloadPacket):
        op = t.__name__
    return Call(op, tuple(node.args), dict(node.kwargs)) if op is not None else None


def op_of(node: Any, gm: fx.GraphModule | None = None) -> str | None:
    """The canonical op name of ``node`` (None: no known op)."""
    c = canonical(node, gm)
    return c.op if c is not None else None


def is_op(node: Any, *ops: str) -> bool:
    """Whether ``node`` is a call of one of the canonical ``ops``, in any spelling."""
    return op_of(node) in ops
