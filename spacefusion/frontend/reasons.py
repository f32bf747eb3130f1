"""Why an fx node is left to torch: one sentence per kind of op, for the partition report."""

from __future__ import annotations

import operator

import torch
from torch import fx, nn

from spacefusion.frontend.canon import Param, canonical
from spacefusion.frontend.refusals import Refusal

LAYOUT_METHODS = frozenset({"view", "reshape", "transpose", "permute", "flatten", "unflatten", "contiguous",
                            "expand", "unsqueeze", "squeeze", "chunk", "split", "narrow", "t"})
SHAPE_QUERIES = frozenset({"size", "dim", "shape"})
ELEMENTWISE = frozenset({"add", "sub", "mul", "truediv", "neg", "sin", "cos", "exp", "float", "half", "to",
                         "pow", "rsqrt", "sqrt", "tanh", "sigmoid", "relu", "gelu", "silu"})
ROPE_FUNCTIONS = ("rotate_half", "apply_rotary_pos_emb")

LAYOUT = "layout op (view/reshape/permute/index): no compute; kernels bind views of its input"
SHAPE = "shape/device query: no tensor compute"
CONCAT = ("concatenation/stack: a copy into a new buffer (KV-cache append, CLS token), no index mapping to fuse "
          "(images along the channels are matched: patterns.concat)")
GATHER = "a data-dependent gather (rows picked by token ids) is not a globally ranged mapping"
ROPE = ("RoPE not in HF's rotate-half form x * cos.unsqueeze(1) + cat(-x2, x1) * sin.unsqueeze(1), which the rope "
        "pattern fuses: torch runs it")
ROPE_TABLES = ("RoPE's cos/sin tables: computed once per forward from the positions (outer product, cos, sin) and "
               "read by every layer's RoPE; no pattern covers them")
GROUPED_MM = ("a grouped GEMM of MoE experts (rows sorted by expert, offs[e] their ends): which expert's weight a row "
              "multiplies is read from the routing at run time, a data-dependent weight gather no index expression "
              "of the SMG states; the router's GEMM before it and the attention are fused")
#: canonical ops of a product of two tensors
PRODUCTS = frozenset({"matmul", "mm", "bmm", "baddbmm", "einsum"})
CREATION = "tensor creation (arange/zeros): no input to fuse with"
GUARD = "trace guard on an argument specialised to None: no compute"
ELEMENT = "element-wise op with no fusable producer or consumer pattern next to it: torch runs it"


CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")


def _all_one(v: object) -> bool:
    return all(x == 1 for x in (v if isinstance(v, tuple | list) else (v,)))


def weight_kind(w: object) -> str:
    """What a weight argument is in the graph: "param" (a ``get_attr``: a parameter or buffer, laid out once at
    build time), "input" (a graph input: a parameter the backend did not lift, or a caller's tensor), "computed"
    (an op's output: weight norm, a reparametrisation), "none" (absent) or "other"."""
    if w is None:
        return "none"
    if not isinstance(w, fx.Node):
        return "other"
    return {"get_attr": "param", "placeholder": "input"}.get(w.op, "computed" if w.op.startswith("call_") else "other")


def conv_reason(stride: object, padding: object, dilation: object, groups: object, weight: object = None,
                bias: object = None, spatial: int = 2) -> str:
    """Why a convolution runs in torch (cuDNN): what of it the implicit-GEMM convolution
    (``smg.ops.Builder.window2d``: 1-D and 2-D, any stride and padding, dilation 1, one group) cannot express,
    or, for one it can, what its weight (or bias) is where that is not a parameter the kernel can bind: a
    graph input or a value computed in the graph (``weight_kind``; a module's own weight is a parameter).
    Said only where the matcher recorded no reason of its own."""
    why = []
    if not _all_one(groups):
        why.append(f"groups {groups}: a grouped convolution (groups neither 1 nor every channel, or a channel "
                   f"multiplier) is a block-diagonal GEMM the SMG convolution does not take; depthwise ones "
                   f"(groups = in = out channels) are fused")
    if not _all_one(dilation):
        why.append(f"dilation {dilation}: the SMG window is s*y + ky, not s*y + d*ky")
    if spatial not in (1, 2):
        why.append(f"a {spatial}-D convolution: the SMG convolutions are windows over 1-D and 2-D images")
    if why:
        return "; ".join(why)
    kinds = {part: weight_kind(t) for part, t in (("weight", weight), ("bias", bias))}
    what = f"a convolution (stride {stride}, padding {padding})"
    for part, kind in kinds.items():
        if kind == "computed":
            return (f"{what} whose {part} is computed in the graph, not a parameter: the implicit GEMM lays its "
                    f"weight out once at build time; torch runs it (cuDNN on the GPU)")
        if kind == "input":
            return (f"{what} whose {part} is a graph input, not a parameter the backend lifted (a parameter whose "
                    f"Dynamo source was not read as a module's, or a caller's tensor): the implicit GEMM lays its "
                    f"weight out once at build time; torch runs it (cuDNN on the GPU)")
    return f"{what} on parameters that no SMG pattern took: torch runs it (cuDNN on the GPU)"


def _short(node: fx.Node) -> str:
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def _in_rotary_module(node: fx.Node) -> bool:
    """Whether the op comes from a ``*Rotary*`` module (HF's rotary embedding: the cos/sin tables)."""
    modules = node.meta.get("nn_module_stack") or {}
    return any("Rotary" in getattr(t, "__name__", str(t)) for _, t in modules.values())


def _in_rope(node: fx.Node) -> bool:
    """Whether the op comes from HF's RoPE functions (their names in its stack trace)."""
    trace = node.stack_trace or ""
    return any(f"in {fn}" in trace for fn in ROPE_FUNCTIONS)


def reason(node: fx.Node, gm: fx.GraphModule) -> str:
    """The sentence of ``classify``."""
    return classify(node, gm).sentence


def classify(node: fx.Node, gm: fx.GraphModule) -> Refusal:
    """Why ``node`` (a call the patterns did not take) runs in torch: its kind's code and sentence.  RoPE's
    ops left over are the tables' (the rotary module's) and, where the rope pattern did not take a RoPE, its
    compute ops; its views (the tables' ``unsqueeze(1)``, shared by a layer's two RoPEs) are layout ops like
    any other."""
    name = _short(node)
    if name.startswith("_assert"):
        return Refusal("left.guard", GUARD)
    if name in SHAPE_QUERIES or node.op == "call_function" and node.target is getattr:
        return Refusal("left.shape", SHAPE)
    if _in_rotary_module(node):
        return Refusal("left.rope_tables", ROPE_TABLES)
    if _in_rope(node) and name not in LAYOUT_METHODS and node.target is not operator.getitem:
        return Refusal("left.rope", ROPE)
    call = canonical(node, gm)
    if call is not None and call.op in ("conv1d", "conv2d", "conv3d"):
        a = call.bind(CONV_ARGS)
        w, b = a.get("weight"), a.get("bias")
        if isinstance(w, Param):  # a module's own parameters: no graph value whose kind to say
            w = b = None
        return Refusal("left.conv", conv_reason(a.get("stride", 1), a.get("padding", 0), a.get("dilation", 1),
                                                a.get("groups", 1), w, b, int(call.op[4])))
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        if isinstance(mod, nn.Embedding):
            return Refusal("left.gather", GATHER)
        if isinstance(mod, nn.Dropout | nn.Identity):
            return Refusal("left.identity", "identity at inference")
        return Refusal("left.module", "no SMG pattern covers this module")
    if node.target is operator.getitem:
        return Refusal("left.layout", LAYOUT)
    if call is not None and call.op == "linear":
        kind = weight_kind(call.arg(1, "weight"))
        if kind in ("input", "computed"):
            return Refusal("left.linear_weight",
                           f"a linear whose weight is {'a graph input' if kind == 'input' else 'computed in the graph'}"
                           f", not a parameter the backend lifted: the GEMM patterns lay their weight out once at "
                           f"build time; torch runs it")
    if call is not None and call.op in ("grouped_mm", "_grouped_mm", "grouped_mm_fallback"):
        return Refusal("left.grouped_mm", GROUPED_MM)
    if call is not None and call.op in PRODUCTS and call.op != "einsum":
        operands = [a for a in call.args if isinstance(a, fx.Node)][-2:]
        if len(operands) == 2 and all(weight_kind(a) == "computed" for a in operands):
            shapes = " x ".join(str(tuple(a.meta["tensor_meta"].shape)) if a.meta.get("tensor_meta") is not None
                                else "?" for a in operands)
            return Refusal("left.value_gemm",
                           f"a {call.op} of two graph values {shapes} that no attention pattern reads as its "
                           f"scores and the value-GEMM row did not take (a form of ``frontend.value_gemm`` "
                           f"it does not state); torch runs it")
    if node.target in (torch.nn.functional.embedding, torch.gather, torch.index_select):
        return Refusal("left.gather", GATHER)
    if name in LAYOUT_METHODS:
        return Refusal("left.layout", LAYOUT)
    if node.target in (torch.cat, torch.stack) or name in ("cat", "stack"):
        return Refusal("left.concat", CONCAT)
    if name in ("arange", "zeros", "ones", "full", "empty"):
        return Refusal("left.creation", CREATION)
    if name in ELEMENTWISE:
        return Refusal("left.elementwise", ELEMENT)
    return Refusal("left.no_pattern", "no SMG pattern covers this op")
