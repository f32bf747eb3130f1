"""A training backward's gated-MLP SiLU or GELU backward after the down projection's input-gradient GEMM, as the one
kernel derived from the forward "gated activation then linear" SMG (LLaMA's, Qwen2's, Mistral's
``down(silu(gate(x)) * up(x))``; GeGLU's ``gelu`` (Gemma's tanh form) the same way).  aot_autograd (with the
min-cut partitioner, which recomputes the activation) writes its backward as

    dH = mm(grad, W_down).view(...);  dU = dH * silu(G);  dG = silu_backward(dH * U, G)

with G and U the gate's and the up projection's outputs the forward saved and silu(G) recomputed.  These four ops
(and the view) become ``smg.autodiff.derive_backward(patterns.gated_act_gemm, wrt=("G", "U"))``'s one pass: the
GEMM over the down projection's outputs with ``dG = dH * U * silu'(G)`` and ``dU = dH * silu(G)`` both written by
its epilogue (``schedulers.passes`` puts them in one pass: both read the reduction dH).  W is the weight the call
is given (live: an optimiser step is read the next call); nothing the forward did not save is read.

Why only this form: a gated product whose dH is no GEMM of a weight is element-wise ops in torch too; the
derived kernel would save nothing (``left.backward_op`` there, as before).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensor

from spacefusion.frontend.derived_calls import derived_kernels, mark
from spacefusion.frontend.refusals import DERIVED, META

aten = torch.ops.aten
_MULS = (operator.mul, aten.mul.Tensor)
_SILUS = (F.silu, aten.silu.default)
_GELUS = (F.gelu, aten.gelu.default)
#: the activation backwards taken as a gated product's (G's gradient), by the activation they differentiate
ANCHORS = {aten.silu_backward.default: "silu", aten.gelu_backward.default: "gelu"}


def _approximate(node: fx.Node, at: int) -> str:
    """A GELU's (or its backward's) ``approximate`` argument, keyword or positional ``at``: "none" or "tanh"."""
    return node.kwargs.get("approximate", node.args[at] if len(node.args) > at else "none")


def _activation(node: fx.Node) -> str:
    """The SMG activation (``smg.ops.UNARY``) an anchor differentiates: "silu", "gelu" or "gelu_tanh"."""
    if ANCHORS[node.target] == "silu":
        return "silu"
    return "gelu_tanh" if _approximate(node, 2) == "tanh" else "gelu"


def _recomputes(act: Any, name: str, gate: fx.Node) -> bool:
    """Whether ``act`` is ``name``'s activation of ``gate`` (aot's recomputation of the forward's ``act(G)``)."""
    if not (isinstance(act, fx.Node) and act.op == "call_function" and act.args[:1] == (gate,)
            and not act.kwargs.get("inplace", False)):
        return False
    if name == "silu":
        return act.target in _SILUS
    return act.target in _GELUS and (_approximate(act, 1) == "tanh") == (name == "gelu_tanh")
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
#: the dtypes the derived kernel takes (grad, weight, G, U and the gradients all of one; fp16/bf16 kernels compute
#: the GEMM and the epilogue in float32, rounding dG and dU once)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class DerivedGatedBackward(nn.Module):
    """``silu_backward(dH * U, G)`` and ``dH * silu(G)``, ``dH = mm(grad, W).view(shape)``, as the derived
    ``dG_dU`` pass built by the stage's kernel backend.  Called with (grad [m, n], W [n, k], G, U of m * k
    elements); returns (dG, dU) in G's and U's shapes, contiguous and fresh (torch's ops give theirs so)."""

    def __init__(self, bw: Any, passes: Sequence[Any], kernels: Sequence[Any], m: int, k: int) -> None:
        super().__init__()
        self.passes, self.kernels = tuple(passes), tuple(kernels)
        grads = dict(bw.grads)
        self.seed, self.dg, self.du = dict(bw.seeds)["Y"], grads["G"], grads["U"]
        self.m, self.k = m, k

    def forward(self, grad: torch.Tensor, weight: torch.Tensor, g: torch.Tensor,
                u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if any(isinstance(t, FakeTensor) for t in (grad, g, u)):  # shape propagation: no kernel runs
            return (torch.empty_like(g, memory_format=torch.contiguous_format),
                    torch.empty_like(u, memory_format=torch.contiguous_format))
        env = {self.seed: grad.contiguous(), "Bw": weight.contiguous(),
               "G": g.contiguous().reshape(self.m, self.k), "U": u.contiguous().reshape(self.m, self.k)}
        for p, kernel in zip(self.passes, self.kernels):
            env |= kernel({name: env[name] for name in p.smg.inputs})
        return env[self.dg].reshape(g.shape).clone(), env[self.du].reshape(u.shape).clone()


def _is_view(node: Any) -> bool:
    return isinstance(node, fx.Node) and (node.op == "call_method" and node.target in ("view", "reshape")
                                          or node.op == "call_function" and node.target in _VIEWS)


def _weight_gemm(node: Any) -> fx.Node | None:
    """The ``mm(grad, W)`` of a weight ``W`` (``get_attr``) that ``node`` is, or views (the mm read by that view
    alone); else None."""
    mm = node.args[0] if _is_view(node) else node
    if _is_view(node) and len(mm.users) != 1:
        return None
    if (isinstance(mm, fx.Node) and mm.op == "call_function" and mm.target is aten.mm.default
            and isinstance(mm.args[1], fx.Node) and mm.args[1].op == "get_attr"):
        return mm
    return None


def _other(mul: fx.Node, one: fx.Node) -> Any:
    a, b = mul.args[:2]
    return b if a is one else a


def _gated_form(node: fx.Node) -> tuple[tuple | None, str, dict[str, fx.Node]]:
    """(("gated_act_gemm", act, m, n, k, dtype), "", its nodes) where ``node`` is ``silu_backward(dH * U, G)``
    (or ``gelu_backward``, act "gelu" / "gelu_tanh" by its ``approximate``)
    of ``dH = mm(grad, W)`` (viewed) whose only other reader is ``dH * silu(G)``; (None, why, {}) where it is a
    gated product after a GEMM of a weight in a form the kernel does not take; (None, "", {}) where it is no
    gated product after such a GEMM (not this form)."""
    mul_a, gate, name = node.args[0], node.args[1], _activation(node)
    if not (isinstance(mul_a, fx.Node) and mul_a.op == "call_function" and mul_a.target in _MULS
            and len(mul_a.args) == 2 and len(mul_a.users) == 1 and not mul_a.kwargs):
        return None, "", {}
    dh = next((a for a in mul_a.args if isinstance(a, fx.Node) and _weight_gemm(a) is not None), None)
    if dh is None:
        return None, "", {}
    mm, up = _weight_gemm(dh), _other(mul_a, dh)
    rest = [r for r in dh.users if r is not mul_a]
    mul_u = rest[0] if len(rest) == 1 else None
    act = _other(mul_u, dh) if (mul_u is not None and mul_u.op == "call_function" and mul_u.target in _MULS
                                and len(mul_u.args) == 2 and not mul_u.kwargs) else None
    if not _recomputes(act, name, gate):
        return None, (f"a gated product's gradient after a GEMM whose dH has readers other than dH * U and "
                      f"dH * {name}(G) of the same G (the up projection's gradient is not dH * {name}(G) here)"), {}
    if not isinstance(up, fx.Node) or up is gate:
        return None, "a gated product's gradient after a GEMM whose other factor U is no graph value apart from G", {}
    parts = {"node": node, "mul_a": mul_a, "dh": dh, "mm": mm, "mul_u": mul_u, "act": act, "up": up, "gate": gate}
    vals = {k: v.meta.get("val") for k, v in (*parts.items(), ("grad", mm.args[0]))}
    if any(v is None for v in vals.values()):
        return None, f"a gated {name} backward after a GEMM, of untraced values", {}
    if {v.dtype for v in vals.values()} - set(DTYPES) or len({v.dtype for v in vals.values()}) != 1:
        return None, (f"a gated {name} backward after a GEMM in {sorted({str(v.dtype) for v in vals.values()})}: "
                      f"the derived epilogue takes one of {[str(d) for d in DTYPES]}"), {}
    (m, n), (_, k) = tuple(vals["grad"].shape), tuple(vals["mm"].shape)
    shape = tuple(vals["dh"].shape)
    if any(tuple(vals[x].shape) != shape for x in ("gate", "up", "node", "mul_u", "act")) or math.prod(shape) != m * k:
        return None, f"a gated {name} backward after a GEMM, of a G or U not the GEMM's [{m}, {k}] viewed", {}
    return ("gated_act_gemm", name, m, n, k, str(vals["node"].dtype).removeprefix("torch.")), "", parts


def _before(gm: fx.GraphModule, point: fx.Node, args: Sequence[fx.Node]) -> bool:
    """Make every node of ``args`` precede ``point``: one after it is moved before it where it is a view whose
    input precedes ``point`` (aot puts the saved U's view after the first gradient's multiply).  False where
    one cannot be moved so."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for a in args:
        if order[a] < order[point]:
            continue
        if not (_is_view(a) and all(order[x] < order[point] for x in a.all_input_nodes)):
            return False
        point.prepend(a)
    return True


def derive_gated_backwards(gm: fx.GraphModule, kernels: Any, cache: dict[tuple, Any]) -> list[str]:
    """Replace every gated SiLU or GELU backward of ``gm`` after a GEMM of a weight (``_gated_form``), with that GEMM,
    its view and both multiplies, by one ``DerivedGatedBackward`` built on ``kernels``.  Such a form the kernel
    does not take is marked ``left.act_epilogue``; one whose kernel cannot be derived or built,
    ``left.derived_backward`` (torch's ops run, said so); another ``silu_backward`` / ``gelu_backward`` is not
    touched.  ``cache``: per form, the derivation, its passes and their kernels (or the reason none), kept by the
    caller across rebuilds.  Returns one report line per replaced form."""
    from smg import patterns

    lines: list[str] = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in ANCHORS:
            continue
        op = node.target.overloadpacket.__name__
        key, why, parts = _gated_form(node)
        if key is None:
            if why:
                mark(node, "left.act_epilogue", f"torch's {op}: {why}")
            continue
        _, act, m, n, k, dtype = key
        found = derived_kernels(cache, key, kernels, patterns.gated_act_gemm, m, n, k, act, dtype, wrt=("G", "U"))
        mm = parts["mm"]
        args = (mm.args[0], mm.args[1], parts["gate"], parts["up"])
        point = min((parts["mul_u"], node), key=list(gm.graph.nodes).index)
        if not isinstance(found, str) and not _before(gm, point, args):
            mark(node, "left.act_epilogue", f"torch's {op} of a gated product: its G or U is computed "
                 "after the gradients it feeds (not a view to move before them)")
            continue
        if isinstance(found, str):
            mark(node, "left.derived_backward", f"torch's {op} of a gated product: its derived kernel could not "
                 f"be built: {found}")
            continue
        bw, passes, built = found
        _install(gm, point, f"derived_gated_backward_{len(lines)}", DerivedGatedBackward(bw, passes, built, m, k),
                 args, (node, parts["mul_u"]))
        # read by the replaced ops alone: now by none
        for dead in dict.fromkeys((parts["mul_a"], parts["act"], parts["dh"], mm)):
            if dead is not None and not dead.users:
                gm.graph.erase_node(dead)
        lines.append(f"gated {act} backward as the epilogue of grad @ W {m}x{k}x{n} {dtype}: {len(passes)} "
                     f"kernel{'s' if len(passes) > 1 else ''} ({', '.join(p.name for p in passes)})")
    gm.graph.lint()
    gm.recompile()
    return lines


def _install(gm: fx.GraphModule, point: fx.Node, name: str, module: nn.Module, args: Sequence[Any],
             replaced: Sequence[fx.Node]) -> None:
    """A call of ``module`` (submodule ``name``) on ``args`` before ``point``, its i-th result in place of
    ``replaced[i]``; the call and its getitems carry ``refusals.DERIVED`` (the kernels run them), as
    ``derived_calls.install``'s.  The replaced nodes are erased; the caller lints and recompiles."""
    gm.add_submodule(name, module)
    with gm.graph.inserting_before(point):
        call = gm.graph.call_module(name, tuple(args))
        outs = [gm.graph.call_function(operator.getitem, (call, i)) for i in range(len(replaced))]
    call.meta = {DERIVED: True, "val": tuple(r.meta.get("val") for r in replaced)}
    for out, old in zip(outs, replaced, strict=True):
        out.meta = dict(old.meta)
        out.meta.pop(META, None)
        out.meta[DERIVED] = True
        old.replace_all_uses_with(out)
        gm.graph.erase_node(old)
