"""The fused model: the captured graph with each fused subgraph replaced by one kernel call."""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn

from smg.ops import upsample_fold
from spacefusion.frontend.backends import Kernel, get_backend
from spacefusion.frontend.bn_fold import fold_batchnorm, fold_bn_into_left_convs
from spacefusion.frontend.capture import Captured, capture
from spacefusion.frontend.constants import ORIGIN, fold_constants, remove_dead
from spacefusion.frontend.errors import FrontendError
from spacefusion.frontend.in_place import order_in_place
from spacefusion.frontend.left_convs import CHANNELS_LAST, channels_last_left_convs
from spacefusion.frontend.partition import partition
from spacefusion.frontend.records import DEAD, FOLDED, LeftOp, Operand, Partition, Result, Subgraph
from spacefusion.frontend.scale_fold import fold_layer_scales
from spacefusion.frontend.sequence import launches
from spacefusion.frontend.weights import state


class FusedKernel(nn.Module):
    """One fused subgraph: views its graph inputs with the SMG's shapes, adds the parameter operands
    (kept as buffers, W transposed once), runs the kernel and views the outputs back.

    A parameter operand is derived from weights (transposed, stacked, a norm folded in); ``refresh`` derives
    again those whose weights moved, into the same buffers, so a training graph, whose weights an optimiser
    writes every step, pays one copy per changed operand and never a new partition."""

    def __init__(self, sub: Subgraph, kernel: Kernel, root: nn.Module) -> None:
        super().__init__()
        self.sub, self.kernel = sub, kernel
        self.values = tuple(_unique(op for op in sub.operands if op.source == "value"))
        self.consts = tuple(op.space for op in sub.operands if op.source == "param")
        #: per parameter operand: (the operand, its weights' references, their ``weights.state`` when derived,
        #: whether its buffer is a view of a weight rather than a copy)
        self.derived: dict[str, tuple[Operand, tuple[str, ...], tuple, bool]] = {}
        get = self._own = functools.partial(_attr, root)  # the tensors it was built on
        for op in sub.operands:
            if op.source != "param" or op.space in self.derived:
                continue
            refs = _sources(op)
            tensors = [get(r) for r in refs]
            value = _param_value(get, op)
            self.register_buffer(op.space, value, persistent=False)
            self.derived[op.space] = (op, refs, tuple(state(t) for t in tensors), _aliases(value, tensors))

        self._fast: Any = None

    def refresh(self, weights: Mapping[str, torch.Tensor]) -> tuple[int, bool]:
        """Derive again each parameter operand whose weights moved since it was derived (another tensor, an
        in-place write, a write through ``.data``: ``weights.state``), reading them from ``weights`` (by
        qualified name; a name not there: the tensor it was built on, a constant of the graph's own).  A copy
        goes into the buffer it had (its address kept: a captured CUDA graph reads it there); a buffer that views
        its weight is
        viewed again only where the weight's storage moved.  Returns (operands derived again, whether a
        buffer now lies at another address).  Raises ``ValueError`` where an operand would change its
        shape, dtype or device: that is another graph, to partition again."""
        done, moved = 0, False
        for space, (op, refs, was, alias) in self.derived.items():
            old = self._buffers[space]
            tensors = [weights[r] if r in weights else self._own(r) for r in refs]
            now = tuple(state(t) for t in tensors)
            if now == was:
                continue
            value = _param_value(dict(zip(refs, tensors)).__getitem__, op)
            if value.shape != old.shape or value.dtype != old.dtype or value.device != old.device:
                raise ValueError(f"operand {space} of {self.sub.label} would be {tuple(value.shape)} "
                                 f"{value.dtype} on {value.device}, was {tuple(old.shape)} {old.dtype} "
                                 f"on {old.device}")
            viewed = _aliases(value, tensors)
            if viewed or alias:  # a view of the weight: never written into (it would write the weight)
                if value.data_ptr() != old.data_ptr():
                    self._buffers[space], moved = value, True
            else:
                old.copy_(value)
            self.derived[space] = (op, refs, now, viewed)
            done += 1
        if moved:
            self._fast = None  # a GPU lean call holds no buffers, but its plan is cheap to make again
        return done, moved

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self._fast is None:
            self._fast = self._plan()
        return self._fast(*args)

    def prebound(self, spaces: set[str]) -> None:
        """These value operands arrive already bound (``_Bind``, shared with other kernels): taken as
        they are."""
        self.values = tuple(dataclasses.replace(op, select=(), cast=None, split=None, permute=None, ends=False)
                            if op.space in spaces else op for op in self.values)
        self._fast = None

    def _plan(self) -> Any:
        """The call, planned once: each kernel input taken from an argument (viewed as its space) or a
        buffer, in the kernel's order, and each result viewed from its output.  A kernel without a
        positional form (llvm, reference) gets its inputs by name."""
        kernel, results = self.kernel, self.sub.results
        if not hasattr(kernel, "positional"):
            def by_name(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
                inputs = {op.space: _bind(a, op) for op, a in zip(self.values, args)}
                inputs |= {name: self._buffers[name] for name in self.consts}
                out = self.kernel(inputs)
                return tuple(_seen(out[r.space], r) for r in results)

            return by_name

        arg_of = {op.space: (i, op) for i, op in enumerate(self.values)}
        take = [arg_of.get(name, (None, name)) for name in kernel.inputs]
        plain = [not isinstance(op, str) and not (op.split or op.permute or op.select or op.cast or op.ends)
                 for _, op in take]
        out_at = {name: j for j, name in enumerate(kernel.outputs)}
        views = [(out_at[r.space], r) for r in results]
        buffers, launch = self._buffers, kernel.positional

        def positional(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
            xs = [buffers[op] if i is None else args[i].reshape(op.shape) if p else _bind(args[i], op)
                  for (i, op), p in zip(take, plain)]
            out = launch(*xs)
            if hasattr(kernel, "lean") and xs[0].is_cuda:  # checked once: later calls take the lean path
                self._fast = self._lean(take, plain, views, xs[0].device.index)
            return tuple(_seen(out[j], r) for j, r in views)

        return positional

    def _lean(self, take: list, plain: list[bool], views: list, device: int) -> Any:
        """The GPU call after the first: plain operands passed as they are (only their addresses are read),
        and each output the one result reads as a whole allocated in that result's shape (no view on the
        way out).  Why: every torch view or reshape costs about a microsecond of host time, which adds up
        to more than the launch itself in a model run kernel by kernel."""
        uses: dict[int, int] = {}
        for j, _ in views:
            uses[j] = uses.get(j, 0) + 1
        whole = [uses[j] == 1 and not (r.permute or r.split or r.strides) and r.index is None for j, r in views]
        shapes: list[tuple[int, ...] | None] = [None] * len(self.kernel.outputs)
        for (j, r), w in zip(views, whole):
            if w:
                shapes[j] = tuple(r.shape)
        call, buffers = self.kernel.lean(device, shapes), self._buffers
        ready = [(j, r, w) for (j, r), w in zip(views, whole)]

        def lean(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
            out = call(*[buffers[op] if i is None else args[i] if p else _bind(args[i], op)
                         for (i, op), p in zip(take, plain)])
            return tuple(out[j] if w else _seen(out[j], r) for j, r, w in ready)

        return lean


def _sources(op: Operand) -> tuple[str, ...]:
    """The references of the weights a parameter operand is derived from (in a fixed order)."""
    refs = list(op.stack or (op.ref,))
    if op.fold_norm:
        refs.append(op.fold_norm[0])
    if op.fold_bn:
        refs += [r for r in op.fold_bn[:4] if isinstance(r, str)]
    return tuple(dict.fromkeys(r for r in refs if r))


def _aliases(value: torch.Tensor, weights: Sequence[torch.Tensor]) -> bool:
    """Whether ``value`` lies in one of ``weights``' storage (a view of it, not a copy)."""
    ptr = value.untyped_storage().data_ptr()
    return any(w.untyped_storage().data_ptr() == ptr for w in weights)


def _param_value(get: Callable[[str], torch.Tensor], op: Operand) -> torch.Tensor:
    """A parameter operand's tensor derived from its weights (``get``: a reference's tensor): a conv's
    implicit-GEMM B (``_conv_param``), else the rows taken, each transposed, stacked, a norm folded in, laid
    out contiguous in the space's shape (a view of the weight where that is one already)."""
    if op.conv or op.fold_bn:
        return _conv_param(get, op)
    ts = [get(ref).detach() for ref in (op.stack or (op.ref,))]
    ts = [t[op.rows[0]:op.rows[1]] for t in ts] if op.rows else ts
    ts = [t.reshape(t.shape[0], -1).t() if op.transpose else t for t in ts]
    t = torch.stack(ts) if op.stack else ts[0]
    t = _fold_norm(get, t, op.fold_norm) if op.fold_norm else t
    return t.contiguous().reshape(op.shape)


def _fold_norm(get: Callable[[str], torch.Tensor], w: torch.Tensor, fold: tuple[str, float]) -> torch.Tensor:
    """A linear weight [.., n, k] times its norm's ``offset + g[k]`` (in float32, then back to its dtype): the
    norm's affine part folded into the GEMM that takes the norm as its prologue."""
    ref, offset = fold
    g = get(ref).detach().float() + offset
    return (w.float() * g).to(w.dtype)


def _conv_param(get: Callable[[str], torch.Tensor], op: Operand) -> torch.Tensor:
    """A convolution's weight as the implicit GEMM's B [kh * kw * c, co] (a conv1d's [co, c, k] as [k * c, co];
    where K is padded, ``convs.k_align``, zero rows after them;
    after an upsampling: merged per output parity, ``fold_upsample``), or its bias, with an inference BatchNorm
    folded in (in float32, then back to the weight's dtype); the bias of a conv without one, under a BatchNorm
    (``ref`` ""), starts from zeros."""
    ref = op.ref or op.fold_bn[0]
    like = get(ref).detach()
    t = get(op.ref).detach().float() if op.ref else torch.zeros(op.shape, device=like.device)
    if op.conv and t.dim() == 3:  # a conv1d's [co, c, k]: the 2-D conv's weight one row high
        t = t.unsqueeze(2)
    if op.fold_bn:
        mean, var, w, b, eps = op.fold_bn
        scale, shift = fold_batchnorm(get, mean, var, w, b, float(eps))
        t = t * scale[:, None, None, None] if op.conv else t * scale + shift
    if op.conv:
        t = t.permute(2, 3, 1, 0)
        if not op.fold_upsample and math.prod(t.shape[:3]) < op.shape[0]:  # K padded (``convs.k_align``): zero rows
            t = torch.cat([t.reshape(-1, t.shape[3]), t.new_zeros(op.shape[0] - math.prod(t.shape[:3]), t.shape[3])])
    if op.fold_upsample:
        fold = torch.tensor(upsample_fold(*op.fold_upsample), dtype=t.dtype, device=t.device)
        t = torch.einsum("aty,bux,yxco->abtuco", fold, fold, t)
    dt = get(op.ref).dtype if op.ref else like.dtype
    return t.contiguous().reshape(op.shape).to(dt)


#: characters of a build failure kept in a partition's reason: a failed sympy derivation prints whole update
#: functions (a large GroupNorm's ran to thousands of characters per reason)
REASON_CHARS = 400


def _short(text: str) -> str:
    """``text`` cut to REASON_CHARS, saying how much was left out (the exception itself is not lost: the next
    build of that SMG raises it again)."""
    return text if len(text) <= REASON_CHARS else f"{text[:REASON_CHARS]}... ({len(text) - REASON_CHARS} more chars)"


def _bind(a: torch.Tensor, op: Operand) -> torch.Tensor:
    """A graph value as the operand's space: broadcast dims dropped, cast, split, permuted, then reshaped (a
    copy where not a view); group ends (``Operand.ends``) as each row's group."""
    if op.ends:
        rows = torch.arange(op.shape[0], device=a.device, dtype=a.dtype)
        return torch.searchsorted(a.contiguous(), rows, right=True).to(torch.int64)
    for d in sorted(op.select, reverse=True):
        a = a.select(d, 0)
    if op.cast is not None:
        a = a.to(getattr(torch, op.cast))
    a = a.reshape(op.split) if op.split else a
    return (a.permute(op.permute) if op.permute else a).reshape(op.shape).contiguous()  # (NCHW as NHWC: a copy)


def _view(t: torch.Tensor, permute: tuple[int, ...] | None, shape: tuple[int, ...], index: int | None = None,
          split: tuple[int, ...] | None = None, strides: tuple[int, ...] | None = None) -> torch.Tensor:
    """A kernel output seen as its node: sliced (one linear of a stacked GEMM), split (a patch GEMM's rows
    as [b, nh, nw]), permuted (RoPE's [b, s, h, d] as [b, h, s, d]), then reshaped where the shape differs (a
    reshape to the same shape could restride its unit dims); copied into ``strides`` where given and the
    view's differ (``Result.strides``)."""
    t = t[index] if index is not None else t
    t = t.reshape(split) if split else t
    t = t.permute(permute) if permute else t
    t = t if tuple(t.shape) == tuple(shape) else t.reshape(shape)
    if strides is not None and t.stride() != strides and t.numel() > 1:
        t = torch.empty_strided(shape, strides, dtype=t.dtype, device=t.device).copy_(t)
    return t


def _seen(t: torch.Tensor, r: Result) -> torch.Tensor:
    """Kernel output ``t`` as result ``r``'s node (``_view``)."""
    return _view(t, r.permute, r.shape, r.index, r.split, r.strides)


def _unique(ops: Any) -> list[Operand]:
    seen: dict[str, Operand] = {}
    for op in ops:
        seen.setdefault(op.space, op)
    return list(seen.values())


def _attr(root: nn.Module, qualified: str) -> torch.Tensor:
    mod, _, name = qualified.rpartition(".")
    return getattr(root.get_submodule(mod) if mod else root, name)


def _closed(sub: Subgraph, by_name: dict[str, fx.Node]) -> bool:
    """Whether only the subgraph's results are read outside it (else it cannot be one call)."""
    inside, results = set(sub.nodes), {r.node for r in sub.results}
    return all(n in results or all(u.name in inside for u in by_name[n].users) for n in sub.nodes)


class _Bind(nn.Module):
    """A graph value bound as an operand once (a cast, a broadcast dim dropped, a permuted copy), for every
    kernel that reads it so: BERT's boolean padding mask cast to the scores' dtype was 12 copies a forward,
    one per layer's attention, where one does."""

    def __init__(self, op: Operand) -> None:
        super().__init__()
        self.op = op

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return _bind(a, self.op)


def _bind_key(op: Operand) -> tuple | None:
    """What makes two kernels' bindings of a value the same tensor; None where the binding is a view."""
    if not (op.select or op.cast or op.split or op.permute or op.ends):
        return None
    return op.ref, op.select, op.cast, op.split, op.permute, op.shape, op.ends


def _shared_binds(kernels: list[FusedKernel]) -> set[tuple]:
    """The bindings that more than one kernel makes (each then made once, by a ``_Bind``)."""
    seen: dict[tuple, int] = {}
    for fk in kernels:
        for key in {_bind_key(op) for op in fk.values} - {None}:
            seen[key] = seen.get(key, 0) + 1
    return {k for k, n in seen.items() if n > 1}


def rewrite(gm: fx.GraphModule, kernels: list[FusedKernel]) -> fx.GraphModule:
    """A new graph module where each kernel's nodes are one ``call_module``; units are emitted in a
    topological order that keeps the original order where it can (Kahn's algorithm on a heap).  A value that
    several kernels bind the same way (a copy) is bound once, before the first of them."""
    nodes = list(gm.graph.nodes)
    index = {n.name: i for i, n in enumerate(nodes)}
    by_name = {n.name: n for n in nodes}
    owner = {name: k for k, fk in enumerate(kernels) for name in fk.sub.nodes}
    unit = {n.name: (("k", owner[n.name]) if n.name in owner else ("n", n.name)) for n in nodes}
    members: dict[tuple, list[fx.Node]] = {}
    for n in nodes:
        members.setdefault(unit[n.name], []).append(n)
    deps = {u: {unit[i.name] for m in ms for i in m.all_input_nodes} - {u} for u, ms in members.items()}
    order_in_place([fk.sub for fk in kernels], by_name, unit, index, deps)
    prio = {u: max(index[m.name] for m in ms) for u, ms in members.items()}
    users: dict[tuple, set] = {u: set() for u in members}
    for u, ds in deps.items():
        for d in ds:
            users[d].add(u)
    ready = [(prio[u], u) for u, ds in deps.items() if not ds]
    heapq.heapify(ready)
    graph, env = fx.Graph(), {}
    shared, bound = _shared_binds(kernels), {}
    binds = [[(op, key) if (key := _bind_key(op)) in shared else None for op in fk.values] for fk in kernels]
    for fk, pairs in zip(kernels, binds):  # (the operands as they bound, before prebound makes them plain)
        fk.prebound({p[0].space for p in pairs if p is not None})
    root = nn.Module()
    for name, child in gm.named_children():
        root.add_module(name, child)
    emitted = 0
    while ready:
        _, u = heapq.heappop(ready)
        emitted += 1
        if u[0] == "n":
            env[by_name[u[1]]] = graph.node_copy(by_name[u[1]], lambda x: env[x])
        else:
            fk, args = kernels[u[1]], []
            root.add_module(f"fused_{u[1]}", fk)
            for op, pair in zip(fk.values, binds[u[1]]):
                if pair is None:
                    args.append(env[by_name[op.ref]])
                    continue
                was, key = pair
                if key not in bound:
                    name = f"bind_{len(bound)}"
                    root.add_module(name, _Bind(was))
                    bound[key] = graph.call_module(name, (env[by_name[op.ref]],))
                args.append(bound[key])
            call = graph.call_module(f"fused_{u[1]}", tuple(args))
            for j, r in enumerate(fk.sub.results):
                env[by_name[r.node]] = graph.call_function(operator.getitem, (call, j))
        for v in users[u]:
            deps[v].discard(u)
            if not deps[v]:
                heapq.heappush(ready, (prio[v], v))
    if emitted < len(members):  # a cycle: an in-place effect ordered against its own data edges
        raise FrontendError(f"{gm.__class__.__name__}: the fused graph's order has a cycle (an in-place write "
                            f"ordered both ways): {len(members) - emitted} of {len(members)} units not emitted")
    for n in nodes:  # parameters read by get_attr nodes that torch still runs
        if n.op == "get_attr" and n in env:
            _copy_attr(gm, root, n.target)
    return fx.GraphModule(root, graph, gm.__class__.__name__ + "Fused")


def _copy_attr(src: nn.Module, dst: nn.Module, qualified: str) -> None:
    *path, name = qualified.split(".")
    for p in path:
        if not hasattr(dst, p):
            dst.add_module(p, nn.Module())
        src, dst = getattr(src, p), getattr(dst, p)
    if not hasattr(dst, name):
        value = getattr(src, name)
        if isinstance(value, nn.Parameter):
            dst.register_parameter(name, value)
        else:
            dst.register_buffer(name, value)


class FusedModel(nn.Module):
    """``model`` with its fusable subgraphs running as SMG kernels; ``partition`` says what was fused,
    what torch runs and why (including subgraphs whose kernel could not be built)."""

    def __init__(self, graph_module: fx.GraphModule, partition: Partition, backend: str) -> None:
        super().__init__()
        self.graph_module, self.partition, self.backend = graph_module, partition, backend

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.graph_module(*args, **kwargs)


def fuse(model: nn.Module, *args: Any, backend: Any = "llvm", verbose: bool = False, **kwargs: Any) -> FusedModel:
    """Capture ``model`` on the example inputs (``torch.fx``), partition it, build one kernel per distinct
    subgraph on ``backend`` ("llvm", "reference", or a backend object) and return the fused model;
    ``verbose`` prints the partition (what is fused, what torch runs and why).  ``torch.compile(model,
    backend="spacefusion")`` (``frontend.dynamo``) captures through TorchDynamo instead."""
    return fuse_captured(capture(model, *args, **kwargs), backend, verbose)


def fuse_captured(cap: Captured, backend: Any = "llvm", verbose: bool = False,
                  baked_weights: bool = False, live_weights: bool = False) -> FusedModel:
    """Partition a captured graph (its nodes carry ``tensor_meta``, its parameters are ``get_attr`` nodes),
    build its kernels on ``backend`` and return it rewritten with one call per fused subgraph.  A subgraph
    whose kernel cannot be built stays with torch, with the reason in the partition.  ``baked_weights``:
    the caller rebuilds when a weight changes, so what torch computes from weights alone is folded too.
    ``live_weights`` (a training graph: the weights change every step, and the caller refreshes the kernels'
    operands, ``FusedKernel.refresh``, rather than rebuild): nothing derived from weights is made a constant
    of the graph (a BatchNorm or a layer scale folded into a weight, what torch computes from weights
    alone); it would be derived again every step, which is what running it costs."""
    be = get_backend(backend)
    if not live_weights:
        fold_bn_into_left_convs(cap.module, getattr(be, "library_first", None))
        fold_layer_scales(cap.module)
    part = partition(cap.module, getattr(be, "layout_of", None), getattr(be, "library_first", None))
    by_name = {n.name: n for n in cap.module.graph.nodes}
    if hasattr(be, "prefetch"):  # the distinct SMGs' artefacts exported side by side (``parallel_build``)
        be.prefetch([sub.smg for sub in part.subgraphs if _closed(sub, by_name)])
    kernels, kept, left = [], [], list(part.left)
    for sub in part.subgraphs:
        why = None if _closed(sub, by_name) else "its internal values are read outside it"
        if why is None:
            try:
                kernels.append(FusedKernel(sub, be.compile(sub.smg), cap.module))
                kept.append(sub)
                continue
            except Exception as exc:  # a schedule or build failure leaves the subgraph to torch, reported
                why = f"kernel build failed: {type(exc).__name__}: {_short(str(exc))}"
        left += [LeftOp(n, sub.label, f"fused {sub.kind} not built ({why})", "left.kernel_build") for n in sub.nodes]
    relaid = channels_last_left_convs(cap.module, kept)
    left = [dataclasses.replace(op, reason=f"{op.reason} ({CHANNELS_LAST})") if op.node in relaid else op
            for op in left]
    for n in cap.module.graph.nodes:  # the names the report gives, kept through the rewrite's copies
        n.meta[ORIGIN] = n.name
    module = rewrite(cap.module, kernels)
    dead, folded = set(remove_dead(module)), set(fold_constants(module, weights=baked_weights and not live_weights))
    left = [dataclasses.replace(op, reason=DEAD, code="left.dead") if op.node in dead else
            dataclasses.replace(op, reason=FOLDED, code="left.folded") if op.node in folded else op for op in left]
    splits = getattr(be, "splits", {})
    said = {s.key: f"as {launches(be.compile(s.smg))} kernels: {splits[s.key]}" for s in kept
            if s.key in splits and hasattr(be.compile(s.smg), "split")}
    part = dataclasses.replace(part, subgraphs=tuple(kept), left=tuple(left), splits=tuple(said.items()))
    if verbose:
        print(part)
    return FusedModel(module, part, getattr(be, "name", type(be).__name__))
