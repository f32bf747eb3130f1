"""Training steps: a Dynamo graph whose inputs require grad, split by torch's ``aot_autograd`` into a forward
and a backward ATen graph, each fused like an inference graph.

``aot_autograd`` (torch's own machinery: the joint graph traced through autograd, split by
``min_cut_rematerialization_partition``, the partitioner Inductor uses) hands the forward compiler an ATen graph
that returns the model's outputs and then every value the backward reads (saved activations, statistics,
weights), and the backward compiler a graph taking those saved values and the outputs' gradients, returning the
inputs' gradients.  Each is compiled by ``Stage``: on its first call (aot hands the compilers fake tensors: the
weights to bake are only known then) a ``CompiledGraph`` of it, with ``read_aten`` as its ``prepare`` pass.
``read_aten`` turns the ATen spellings into the torch forms the matchers know (``export.canonicalize`` plus what
autograd's tracing writes: ``addmm(b, x, t(W))`` is a linear, ``t(t(W))`` is ``W``, a ``clone`` only a copy),
and marks the ops it knows no pattern takes with their reason (``refusals.META``).

What fuses: in the forward, the GEMMs of parameters with their epilogues (stacked Q/K/V, bias, activation,
residual add) and what the inference table matches where its intermediates are not saved; in the backward, the
GEMMs of a gradient with a weight (``grad @ W``: the input gradients of every linear).  What does not: a norm
whose mean and rstd the backward reads, attention whose log-sum-exp it reads, GEMMs of two graph values (the
weight gradients), the ATen backward ops (``gelu_backward``, ``native_layer_norm_backward``, ...), and random
ops (dropout), each with that reason in the report.  A fused subgraph whose intermediate value the backward
reads stays with torch (``fused._closed``: only a subgraph's results may be read outside it), so every saved
activation is still produced.  Weights are baked and guarded as at inference (``weights.Stamp``): an optimiser
step changes them in place, and the next call derives the constants again (said in the report).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

from spacefusion.frontend.compiled import CompiledGraph, GraphReport
from spacefusion.frontend.errors import FrontendError
from spacefusion.frontend.export import canonicalize
from spacefusion.frontend.refusals import META, refusal

aten = torch.ops.aten

#: the ATen backward ops the table has no pattern for (left to torch, said so)
BACKWARD_OPS = frozenset({
    aten.native_layer_norm_backward.default, aten.gelu_backward.default, aten.tanh_backward.default,
    aten.threshold_backward.default, aten.silu_backward.default, aten.sigmoid_backward.default,
    aten.embedding_dense_backward.default, aten.select_backward.default, aten.slice_backward.default,
    aten._softmax_backward_data.default, aten.native_dropout_backward.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten._scaled_dot_product_efficient_attention_backward.default,
    aten._scaled_dot_product_flash_attention_backward.default,
    aten._scaled_dot_product_cudnn_attention_backward.default,
})
#: random ops a training step may hold
RANDOM_OPS = frozenset({aten.native_dropout.default, aten.bernoulli.default, aten.bernoulli.p, aten.rand.default,
                        aten.rand_like.default, aten.randn.default, aten.randn_like.default})
#: attention forwards that also return the rows' log-sum-exp (and, on the GPU, RNG state), out first
ATTENTION_LSE = frozenset({
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
})


def compile_training(owner: Any, gm: fx.GraphModule, example_inputs: Sequence[Any], report: GraphReport,
                     names: dict[int, str]) -> Callable[..., Any]:
    """The callable Dynamo runs for ``gm``, a graph whose inputs require grad: ``aot_autograd`` with a forward
    and a backward compiler that each return a ``Stage`` (reported as ``report.forward`` and
    ``report.backward``).  ``names``: the Dynamo graph's parameter placeholders ({position: qualified name});
    the forward's placeholders are the Dynamo graph's inputs in order, the backward's weights are forward
    placeholders it saved (matched by name, ``backward_names``)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    shapes = [tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in example_inputs]
    forward: list[fx.GraphModule] = []

    def fw_compiler(fgm: fx.GraphModule, _fake: Sequence[Any]) -> Stage:
        placeholders = [n for n in fgm.graph.nodes if n.op == "placeholder"]
        fw_names = names if len(placeholders) == len(shapes) else {}
        report.forward = GraphReport(report.index, _calls(fgm))
        if names and not fw_names:
            report.forward.skipped = (f"its {len(placeholders)} inputs are not the Dynamo graph's {len(shapes)}: "
                                      f"which are weights is unknown")
        forward.append(fgm)
        return Stage(owner, fgm, report.forward, fw_names, expect={i: shapes[i] for i in fw_names})

    def bw_compiler(bgm: fx.GraphModule, _fake: Sequence[Any]) -> Stage:
        report.backward = GraphReport(report.index, _calls(bgm))
        bw_names = backward_names(forward[-1], bgm, names) if forward else {}
        return Stage(owner, bgm, report.backward, bw_names)

    return aot_autograd(fw_compiler=fw_compiler, bw_compiler=bw_compiler,
                        partition_fn=min_cut_rematerialization_partition)(gm, list(example_inputs))


def backward_names(fw: fx.GraphModule, bw: fx.GraphModule, names: dict[int, str]) -> dict[int, str]:
    """{backward placeholder position: qualified name} of the backward's inputs that are weights: a forward
    placeholder (a Dynamo input named in ``names``) that the forward returns as a saved value, which the
    partitioner hands the backward as a placeholder of the same name."""
    fw_inputs = {n.name: i for i, n in enumerate(n for n in fw.graph.nodes if n.op == "placeholder")}
    out_node = next(n for n in fw.graph.nodes if n.op == "output")
    saved = {n.name for n in _leaves(out_node.args)}
    found: dict[int, str] = {}
    for j, n in enumerate(n for n in bw.graph.nodes if n.op == "placeholder"):
        i = fw_inputs.get(n.name)
        if i is not None and i in names and n.name in saved:
            found[j] = names[i]
    return found


def _leaves(x: Any) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg(x, lambda n: out.append(n) or n)
    return out


def _calls(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op.startswith("call_"))


class Stage:
    """The forward or the backward graph of a training step, fused on its first call: aot_autograd compiles
    them on fake tensors, and the weights to bake are the real ones (``CompiledGraph`` guards them after).
    Boxed (``_boxed_call``): aot_autograd calls it with one list of arguments (the backward, through Dynamo's
    wrapper, with the arguments unpacked: both are taken).  A graph that cannot be fused
    (symbolic sizes, a build failure) runs as aot_autograd's ATen graph, in torch, with the reason in its
    report: never Inductor, never slower than eager (the same ATen ops eager runs)."""

    def __init__(self, owner: Any, gm: fx.GraphModule, report: GraphReport, names: dict[int, str],
                 expect: dict[int, tuple[int, ...] | None] | None = None) -> None:
        self.owner, self.gm, self.report, self.names = owner, gm, report, names
        self.expect = expect or {}
        self.run: Callable[..., Any] | None = None
        # on the instance: Dynamo wraps the backward with ``functools.wraps``, which copies the instance's
        # ``__dict__`` (not its class's attributes) onto the wrapper aot_autograd then calls
        self._boxed_call = True

    def _build(self, args: list[Any]) -> Callable[..., Any]:
        if self.report.skipped:
            return self.gm.forward
        if any(not isinstance(a, torch.Tensor) and a is not None for a in args):  # sizes passed: traced symbolic
            self.report.skipped = "symbolic sizes (dynamic shapes) in a training graph: compile with dynamic=False"
            return self.gm.forward
        for i, want in self.expect.items():  # the forward's weights are the Dynamo graph's, at its positions
            if i >= len(args) or not isinstance(args[i], torch.Tensor) or tuple(args[i].shape) != want:
                self.report.skipped = f"input {i} is not the weight Dynamo gave at that position: weights unknown"
                return self.gm.forward
        try:
            compiled = CompiledGraph(self.owner, self.gm, args, self.report, self.names, prepare=read_aten)
        except FrontendError as exc:
            self.report.skipped = str(exc)
            return self.gm.forward
        except Exception as exc:  # a graph we could not fuse runs as aot_autograd traced it, reported
            self.report.skipped = f"{type(exc).__name__}: {exc}"
            return self.gm.forward
        self.owner.compiled.append(compiled)
        return self.gm.forward if compiled.plain else compiled

    def __call__(self, *args: Any) -> Any:
        if len(args) == 1 and isinstance(args[0], list):  # boxed: one list (a graph's inputs are never lists)
            args = tuple(args[0])
        if self.run is None:
            self.run = self._build(list(args))
        return self.run(*args)


def _output_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return set(_leaves(out.args))


def _is_t(node: Any) -> bool:
    return isinstance(node, fx.Node) and (node.op == "call_function" and node.target is aten.t.default
                                          or node.op == "call_method" and node.target == "t")


def _unused(node: fx.Node, *indices: int) -> bool:
    """Whether ``node``'s tuple results at ``indices`` are read by no one."""
    for u in node.users:
        if u.op != "call_function" or u.target is not operator.getitem:
            return False
        if u.args[1] in indices and u.users:
            return False
    return True


def _take_first(g: fx.Graph, node: fx.Node) -> None:
    """``node``, a call returning a tuple of which only element 0 is read, made to return that element."""
    for u in list(node.users):
        if u.args[1] == 0:
            u.replace_all_uses_with(node)
        g.erase_node(u)


def _mark(node: fx.Node, code: str, sentence: str) -> None:
    node.meta[META] = refusal(code, sentence)
    for u in node.users:  # its tuple results: the same reason
        if u.op == "call_function" and u.target is operator.getitem:
            u.meta[META] = refusal(code, sentence)


def read_aten(gm: fx.GraphModule) -> int:
    """Rewrite a training step's ATen graph (weights already ``get_attr`` nodes) in place into the torch forms
    the matchers read, and mark what no pattern will take with its reason; returns how many nodes changed.

    Contract: the graph computes the same values after (each rewrite is an identity of ATen semantics on this
    functional graph), and no node the graph returns is removed: a clone that is an output stays a copy (an
    output must not alias another one the caller may write)."""
    outputs = _output_nodes(gm)
    changed = 0
    g = gm.graph
    for node in list(g.nodes):
        if node.op != "call_function":
            continue
        t = node.target
        if t is aten.t.default and _is_t(node.args[0]):  # t(t(W)): W (the backward's grad @ W)
            node.replace_all_uses_with(node.args[0].args[0])
            g.erase_node(node)
            changed += 1
        elif t is aten.addmm.default and len(node.args) == 3 and not node.kwargs and _is_t(node.args[2]) \
                and node.args[2].args[0].op == "get_attr" and node.args[0].op == "get_attr":
            node.target, node.args = torch._C._nn.linear, (node.args[1], node.args[2].args[0], node.args[0])
            changed += 1
        elif t is aten.mm.default and _is_t(node.args[1]) and node.args[1].args[0].op == "get_attr":
            node.target, node.args = torch._C._nn.linear, (node.args[0], node.args[1].args[0])
            changed += 1
        elif t is aten.clone.default and node not in outputs and set(node.kwargs) <= {"memory_format"} \
                and node.kwargs.get("memory_format", torch.contiguous_format) in (torch.contiguous_format,
                                                                                 torch.preserve_format):
            node.op, node.target, node.kwargs = "call_method", "contiguous", {}  # a copy torch need not make
            changed += 1
        elif t is aten.native_layer_norm.default:
            if _unused(node, 1, 2):
                x, shape, w, b, eps = node.args
                _take_first(g, node)
                node.target, node.args = torch.nn.functional.layer_norm, (x, shape, w, b, eps)
                changed += 1
            else:
                _mark(node, "left.saved_stats", "a LayerNorm whose mean and rstd the backward reads (the fused "
                      "norm does not output them)")
        elif t in ATTENTION_LSE:
            if t is aten._scaled_dot_product_flash_attention_for_cpu.default and _unused(node, 1):
                q, k, v, *rest = node.args
                drop, causal = (list(rest) + [0.0, False])[:2]
                _take_first(g, node)
                node.target, node.args = torch._C._nn.scaled_dot_product_attention, (q, k, v)
                node.kwargs = {"attn_mask": node.kwargs.get("attn_mask"), "dropout_p": drop, "is_causal": causal,
                               "scale": node.kwargs.get("scale")}
                changed += 1
            else:
                _mark(node, "left.saved_lse", "attention whose log-sum-exp the backward reads: torch's forward "
                      "saves it for its backward")
        elif t in BACKWARD_OPS:
            _mark(node, "left.backward_op", f"{t.overloadpacket.__name__}: an ATen backward op no pattern covers")
        elif t in RANDOM_OPS:
            _mark(node, "left.random", "random (dropout in training): torch draws it from its generator, as eager")
        elif t is aten.t.default:  # a transpose (of a weight gradient): the layout method the report knows
            node.op, node.target = "call_method", "t"
            changed += 1
        elif t is aten.mm.default and all(isinstance(a, fx.Node) and a.op != "get_attr" for a in node.args[:2]):
            node.meta[META] = refusal("left.value_gemm", "a GEMM of two graph values (a weight gradient): no "
                                      "pattern takes a GEMM without a weight")
    g.lint()
    gm.recompile()
    return changed + canonicalize(gm)
