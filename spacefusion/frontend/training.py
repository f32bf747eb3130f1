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
residual add), torch's CPU flash attention as ``patterns.attention(..., save_lse=True)`` (O and the LSE the
backward reads from one kernel: ``attention.match_attention_lse``, which ``read_aten`` leaves the op whole for)
and what the inference table matches where its intermediates are not saved; in the backward, the
GEMMs of a gradient with a weight (``grad @ W``: the input gradients of every linear), the weight gradients
(``grad.T @ x``, GEMMs of two values, with the bias gradient ``grad.sum(0)``: ``gemms.match_weight_gradient``),
and torch's CPU attention backward, replaced by the kernels derived from the attention SMG
(``derive_attention_backwards``: fed the O and logsumexp the forward saved, which is the derived forward's LSE;
masked, the mask as a score mod and the row statistics recomputed in two parts: ``derived_masks``), the LayerNorm
and RMSNorm backwards, replaced by the kernels derived from the norm SMGs (``derived_norms``, ``derived_rmsnorm``:
reading the mean and rstd, or the rsqrt, the forward saved), and a GELU/SiLU backward of a linear's input
gradient, replaced by that GEMM with the activation's derivative as its derived epilogue (``derived_epilogues``).
A forward's LayerNorm whose mean and rstd the backward reads is ``patterns.layernorm_stats``
(``native_layer_norm`` left whole, its three elements the kernel's outputs: ``norm_stats.match_norm_stats``),
which ``native_layer_norm_backward`` reads; an RMSNorm (its ATen form is primitives) whose rsqrt the backward
reads is ``patterns.rmsnorm_stats``, that rsqrt a kernel output (``norms.match_norm``, ``graph.read_rstd``).  Both,
and the derived norm backwards, in float32, fp16 or bf16, the statistics stored in the dtype torch saves them in
(float32 for HF's upcast RMSNorm and torch's CUDA LayerNorm; ``norm_stats.saved_stats_dtypes``), computed in
float32 inside.  What does not: a norm of mixed dtypes (``norm.saved_stats``, ``norm.form``,
``left.norm_backward``), a GPU attention forward whose statistics it reads, GEMMs of two graph values in another
form than ``grad.T @ x``, the other ATen backward ops (``tanh_backward``, ``embedding_dense_backward``, a GELU
backward after no GEMM, ...), and random ops (dropout), each with that reason in the report.  A fused subgraph
whose intermediate value the backward reads stays with torch (``fused._closed``: only a subgraph's results may be
read outside it), so every saved activation is still produced.

Weights are live (``CompiledGraph(live_weights=True)``): an optimiser step writes every one of them in place,
so a training graph is partitioned and its kernels built once, on the first call, and never again for a
weight's value.  What torch runs reads each weight as the call's argument; a kernel operand derived from
weights (W transposed for a GEMM, Q/K/V stacked, a norm's weight folded in) is derived again into its buffer
on the first call after its weights moved (version, ``.data``, storage or identity: ``weights.state``), a copy
per operand, no partition.  Nothing else is derived from weights (no BatchNorm or layer scale folded into a
weight, no weight-only value evaluated once): it would be derived again every step, which is what running it
costs.  The report counts the calls that read moved weights ("weights read again") apart from rebuilds.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensor

from spacefusion.frontend.compiled import CompiledGraph, GraphReport
from spacefusion.frontend.derived_calls import install, mark
from spacefusion.frontend.errors import FrontendError, first_line
from spacefusion.frontend.export import canonicalize
from spacefusion.frontend.refusals import META, refusal

aten = torch.ops.aten

#: the ATen backward ops the table has no pattern for (left to torch, said so; ``Stage._prepare``'s derived
#: kernels then take the norm, GELU/SiLU and CPU attention backwards they can, clearing the mark)
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
        self.derived: dict[tuple, Any] = {}  # (form and sizes) -> its derived passes and kernels, or why none
        # on the instance: Dynamo wraps the backward with ``functools.wraps``, which copies the instance's
        # ``__dict__`` (not its class's attributes) onto the wrapper aot_autograd then calls
        self._boxed_call = True

    def _prepare(self, gm: fx.GraphModule) -> None:
        """Each build's pass: the ATen graph read as torch forms, its attention, LayerNorm and RMSNorm backwards and its
        GELU/SiLU backwards after a GEMM of a weight (plain or a gated MLP's) run as derived kernels (kept across
        rebuilds in ``self.derived``: a weight change re-derives nothing of them)."""
        from spacefusion.frontend.derived_epilogues import derive_act_backwards
        from spacefusion.frontend.derived_gated import derive_gated_backwards
        from spacefusion.frontend.derived_norms import derive_norm_backwards
        from spacefusion.frontend.derived_rmsnorm import derive_rms_backwards

        read_aten(gm)
        kernels = self.owner.kernels
        self.report.derived = (derive_attention_backwards(gm, kernels, self.derived)
                               + derive_norm_backwards(gm, kernels, self.derived)
                               + derive_rms_backwards(gm, kernels, self.derived)
                               + derive_gated_backwards(gm, kernels, self.derived)
                               + derive_act_backwards(gm, kernels, self.derived))

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
            compiled = CompiledGraph(self.owner, self.gm, args, self.report, self.names, prepare=self._prepare,
                                     live_weights=True)
        except FrontendError as exc:
            self.report.skipped = str(exc)
            return self.gm.forward
        except Exception as exc:  # a graph we could not fuse runs as aot_autograd traced it, reported
            self.report.skipped = f"{type(exc).__name__}: {first_line(exc)}"
            return self.gm.forward
        self.owner.compiled.append(compiled)
        # export_only: the stage's kernels are written (``dynamo.export_cuda_training``), torch runs its graph
        return self.gm.forward if compiled.plain or self.owner.export_only else compiled

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


def _stats_form(node: fx.Node) -> bool:
    """Whether ``native_layer_norm`` ``node`` may be the form ``norm_stats.match_norm_stats`` builds: over one
    dim, weight and bias parameters (``get_attr``), of a float input where the traced value says (float32,
    fp16 or bf16: which dtypes of input, parameters and statistics go together the row checks, ``norm.form``)."""
    x, shape, w, b = node.args[:4]
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    return (len(shape) == 1 and all(isinstance(p, fx.Node) and p.op == "get_attr" for p in (w, b))
            and (val is None or val.dtype in (torch.float32, torch.float16, torch.bfloat16)))


def _take_first(g: fx.Graph, node: fx.Node) -> None:
    """``node``, a call returning a tuple of which only element 0 is read, made to return that element."""
    for u in list(node.users):
        if u.args[1] == 0:
            u.replace_all_uses_with(node)
        g.erase_node(u)


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
            elif not _stats_form(node):
                mark(node, "left.saved_stats", "a LayerNorm whose mean and rstd the backward reads, in a form the "
                     "statistics-saving norm does not take (a float input over the last dim, weight and bias "
                     "parameters)")
            # else: the LayerNorm whose mean and rstd the backward reads stays whole, for the table's
            # ``norm_stats`` row (``patterns.layernorm_stats``: out, mean and rstd from one kernel)
        elif t in ATTENTION_LSE:
            if t is aten._scaled_dot_product_flash_attention_for_cpu.default and _unused(node, 1):
                q, k, v, *rest = node.args
                drop, causal = (list(rest) + [0.0, False])[:2]
                _take_first(g, node)
                node.target, node.args = torch._C._nn.scaled_dot_product_attention, (q, k, v)
                node.kwargs = {"attn_mask": node.kwargs.get("attn_mask"), "dropout_p": drop, "is_causal": causal,
                               "scale": node.kwargs.get("scale")}
                changed += 1
            elif t is not aten._scaled_dot_product_flash_attention_for_cpu.default:
                mark(node, "left.saved_lse", "GPU attention whose log-sum-exp (and RNG state) the backward reads "
                      "in its own layout: torch's forward runs it, no derived forward outputs that")
            # else: the CPU flash attention whose logsumexp the backward reads stays whole, for the table's
            # ``attention_lse`` row (``patterns.attention(..., save_lse=True)``: O and LSE from one kernel)
        elif t in BACKWARD_OPS:
            mark(node, "left.backward_op", f"{t.overloadpacket.__name__}: an ATen backward op no pattern covers")
        elif t in RANDOM_OPS:
            mark(node, "left.random", "random (dropout in training): torch draws it from its generator, as eager")
        elif t is aten.t.default:  # a transpose (of a weight gradient): the layout method the report knows
            node.op, node.target = "call_method", "t"
            changed += 1
        elif t is aten.mm.default and all(isinstance(a, fx.Node) and a.op != "get_attr" for a in node.args[:2]):
            node.meta[META] = refusal("left.value_gemm", "a GEMM of two graph values: the weight-gradient row "
                                      "takes grad.T @ x, no row this form")
    g.lint()
    gm.recompile()
    return changed + canonicalize(gm)


#: the attention backward whose derived kernels replace it: torch's CPU flash attention's, whose saved
#: logsumexp is the derived forward's ``LSE`` (the row max plus the log of the row sum of exp of the scaled
#: scores, float32 [b, h, m]); the GPU forms save theirs with other layouts and RNG state (not wired yet)
CPU_FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


class DerivedAttentionBackward(nn.Module):
    """torch's CPU flash attention backward as the kernels ``smg.autodiff.derive_backward`` derives from the
    attention SMG and ``schedulers.passes.backward_passes`` cuts (Delta, dQ, dK_dV), each built by the
    stage's kernel backend.  Takes the backward op's (grad_out, q, k, v, out, logsumexp) and, masked, its
    ``attn_mask``, and returns (dQ, dK, dV) in q's, k's and v's shapes, strides and dtypes: O and LSE are those
    torch's forward saved.  Masked (``mask``: the ``Mask`` operand's binding, ``stats``: the derived forward's
    kernel), the passes read the row max and log-sum apart, which the derived forward recomputes first
    (``derived_masks`` says why)."""

    def __init__(self, bw: Any, passes: Sequence[Any], kernels: Sequence[Any], mask: Any = None,
                 stats: Any = None) -> None:
        super().__init__()
        self.passes, self.kernels = tuple(passes), tuple(kernels)
        self.mask, self.stats = mask, (stats,) if stats is not None else ()  # a tuple: not a submodule
        self.seed = dict(bw.seeds)["O"]
        self.grads = dict(bw.grads)
        sizes = bw.graph.dim_sizes
        spaces = {sp.name: sp for g in (bw.forward, bw.graph) for sp in g.spaces}
        self.shapes = {n: tuple(sizes[d] for d in spaces[n].dims) for p in self.passes for n in p.smg.inputs}
        self.shapes |= {n: tuple(sizes[d] for d in spaces[n].dims) for n in bw.forward.inputs}
        self.recomputed = tuple(n for n in bw.forward.outputs if n not in ("O", "LSE"))

    def forward(self, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                out: torch.Tensor, lse: torch.Tensor, mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if any(isinstance(x, FakeTensor) for x in (grad_out, q, k, v)):  # shape propagation: no kernel runs
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        env = {"Q": q, "K": k, "V": v, "O": out, "LSE": lse, self.seed: grad_out}
        if self.mask is not None:
            from spacefusion.frontend.derived_masks import bind_mask

            env["Mask"] = bind_mask(mask, self.mask)
        for stats in self.stats:  # the row statistics in two parts (O and LSE stay the forward's)
            got = stats({n: env[n].contiguous().reshape(self.shapes[n]) for n in self.stats_inputs})
            env |= {n: got[n] for n in self.recomputed}
        for p, kernel in zip(self.passes, self.kernels):
            env |= kernel({n: env[n].contiguous().reshape(self.shapes[n]) for n in p.smg.inputs})
        # each gradient laid out as its input (torch's op does so, and the graph's views after it rely on it)
        return tuple(torch.empty_like(x).copy_(env[self.grads[n]].reshape(x.shape))
                     for n, x in (("Q", q), ("K", k), ("V", v)))

    @property
    def stats_inputs(self) -> tuple[str, ...]:
        return tuple(n for n in self.shapes if n in ("Q", "K", "V", "Mask"))


def _derived_form(node: fx.Node) -> tuple[tuple | None, str]:
    """(the derived attention's key: batch, heads, kv heads, m, l, d, causal, scale, dtype, and the mask's
    score mod and operand or None; or None, why not)."""
    grad_out, q, k, v, out, lse, *rest = node.args
    dropout, causal = (list(rest) + [0.0, False])[:2]
    vals = [x.meta.get("val") if isinstance(x, fx.Node) else None for x in (q, k, v)]
    if dropout:
        return None, "attention with dropout: random, the derived backward does not take it"
    if any(x is None or x.dim() != 4 for x in vals):
        return None, "attention on tensors that are not [batch, heads, seq, head_dim]"
    (b, h, m, d), (_, hk, n, dk), (_, hv, nv, dv) = (tuple(x.shape) for x in vals)
    from spacefusion.frontend.graph import DTYPES

    dtype = DTYPES.get(vals[0].dtype)
    if dtype is None or not all(isinstance(z, int) for z in (b, h, m, d, hk, n)) or dk != d or dv != d \
            or hv != hk or nv != n or h % hk:
        return None, "attention of unequal head dims, symbolic sizes or an unsupported dtype"
    masked = None
    if node.kwargs.get("attn_mask") is not None:
        from spacefusion.frontend.derived_masks import backward_mask

        masked = backward_mask(node.kwargs["attn_mask"], (b, h, m, n), hk, dtype)
        if isinstance(masked, str):
            return None, masked
        mod, operand = masked
        masked = (mod, dataclasses.replace(operand, ref=""))  # the form, not the node: a cache key
    scale = node.kwargs.get("scale")
    return (b, h, hk, m, n, d, bool(causal), 1.0 / d**0.5 if scale is None else float(scale), dtype, masked), ""


def derive_attention_backwards(gm: fx.GraphModule, kernels: Any, cache: dict[tuple, Any]) -> list[str]:
    """Replace every CPU flash attention backward of ``gm`` by a ``DerivedAttentionBackward`` built on
    ``kernels`` (a kernel backend); one that cannot be derived or built for its shape stays torch's op,
    marked with why (``left.derived_backward``).  ``cache``: per form, the derived passes and their kernels
    (or the reason none), kept by the caller across rebuilds.  Returns one line per replaced op."""
    from schedulers.passes import backward_passes
    from smg.autodiff import derive_backward
    from smg.patterns import attention

    lines: list[str] = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not CPU_FLASH_BACKWARD:
            continue
        key, why = _derived_form(node)
        if key is not None and key not in cache:
            b, h, hk, m, n, d, causal, scale, dtype, masked = key
            try:
                g = attention(b, h, m, n, d, kv_heads=hk, causal=causal, dtype=dtype, scale=scale,
                              mods=(masked[0],) if masked else ())
                bw = derive_backward(g, wrt=("Q", "K", "V"))
                passes = backward_passes(bw)
                stats = kernels.compile(bw.forward) if masked else None
                cache[key] = (bw, passes, [kernels.compile(p.smg) for p in passes], stats)
            except Exception as exc:  # not derivable or not schedulable for this shape: torch's op, said so
                cache[key] = f"its derived kernels could not be built: {type(exc).__name__}: {first_line(exc)}"
        found = cache.get(key) if key is not None else why
        if isinstance(found, str):
            mark(node, "left.derived_backward", f"torch's attention backward: {found}")
            continue
        bw, passes, built, stats = found
        masked = key[-1]
        install(gm, node, f"derived_attention_backward_{len(lines)}",
                DerivedAttentionBackward(bw, passes, built, masked[1] if masked else None, stats),
                (*node.args[:6], *((node.kwargs["attn_mask"],) if masked else ())))
        b, h, hk, m, n, d, causal, _, dtype, _ = key
        heads = f"h{h}" + (f" (kv {hk})" if hk != h else "")
        what = f"{' causal' if causal else ''}{' masked' if masked else ''}"
        first = "the derived forward for the row max and log-sum apart, then " if masked else ""
        lines.append(f"attention backward b{b} {heads} m{m} l{n} d{d} {dtype}{what}: "
                     f"{first}{len(passes)} kernels ({', '.join(p.name for p in passes)})")
    gm.graph.lint()
    gm.recompile()
    return lines
