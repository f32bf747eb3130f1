"""What the Dynamo backend returns for one graph: its fused form, guarded on the weights it baked, and, for
a graph with symbolic sizes, one fused form per distinct set of sizes it is called with.

A Dynamo graph's parameters are inputs (modules are inlined).  ``lift_parameters`` turns every placeholder
that Dynamo sourced from a module's ``_parameters`` or ``_buffers`` into a ``get_attr`` of that tensor under
its qualified name (``encoder.layer.0.attention.self.query.weight``), which the matchers bind as constant
operands (weights transposed or stacked once, at build time).  Dynamo drops the placeholders' sources
(``grapharg``) once the backend returns, so the names are read then and kept (``parameter_names``): a
rebuild after a weight change, or a new size, bakes the same weights as the first build.  A buffer the graph
writes (a step counter, train-mode BatchNorm's running stats) is state, not a constant: it stays an input.

``CompiledGraph`` rebuilds its constants when a baked weight changed in any way (``weights.Stamp``); a
training graph's (``live_weights``) reads changed weights again without a new partition (``_refresh``).
``PerShape`` serves a graph with symbolic sizes (torch.compile's automatic dynamic shapes after a
recompile): each call's sizes pick a ``CompiledGraph`` of the graph specialised to them
(``specialize.concrete``), built on the first call with those sizes; kernels of SMGs already built (the
same layer at another batch, a shape seen before) come from the kernel cache.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import re
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp, _extract_tensor_metadata

from spacefusion.frontend.capture import Captured
from spacefusion.frontend.errors import FrontendError
from spacefusion.frontend.fused import FusedKernel, FusedModel, fuse_captured
from spacefusion.frontend.measure import FUSED, KEPT, TORCH, Choice
from spacefusion.frontend.noops import drop_noops, merge_repeated_activations
from spacefusion.frontend.projections import split_projections
from spacefusion.frontend.records import Coverage, LeftOp, Partition
from spacefusion.frontend.replay import GraphReplay, mutated_inputs, unwritten_copies
from spacefusion.frontend.specialize import SizeKey, concrete
from spacefusion.frontend.weights import Stamp, own_reads

_ATTR = re.compile(r"\._(?:modules|parameters|buffers)\['([^']+)'\]")


def _qualified(node: fx.Node) -> str | None:
    """The module path of a placeholder Dynamo sourced from a module's parameter or buffer, else None."""
    arg = node.meta.get("grapharg")
    source = getattr(getattr(arg, "source", None), "name", None)
    source = source() if callable(source) else source
    if not isinstance(source, str) or not re.search(r"\._(?:parameters|buffers)\[", source):
        return None
    return ".".join(_ATTR.findall(source)) or None


def parameter_names(gm: fx.GraphModule) -> dict[int, str]:
    """{placeholder position: qualified name} of the placeholders Dynamo sourced from module parameters
    and buffers (read while the backend is called: Dynamo drops the sources after it returns)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return {i: name for i, n in enumerate(placeholders) if (name := _qualified(n)) is not None}


def _set_attr(root: nn.Module, qualified: str, value: torch.Tensor) -> None:
    *path, name = qualified.split(".")
    mod = root
    for p in path:
        if not hasattr(mod, p):
            mod.add_module(p, nn.Module())
        mod = getattr(mod, p)
    if isinstance(value, nn.Parameter):
        mod.register_parameter(name, value)
    else:
        mod.register_buffer(name, value, persistent=False)


def lift_parameters(gm: fx.GraphModule, example_inputs: Sequence[Any], names: dict[int, str] | None = None,
                    keep: set[int] = frozenset()) -> dict[int, torch.Tensor]:
    """Replace the uses of every parameter/buffer placeholder (``names``, else the placeholders' Dynamo
    sources) but those at ``keep`` by a ``get_attr`` of that tensor (registered on ``gm`` under its qualified
    name).  The placeholders stay, unused, so the graph keeps Dynamo's calling convention.  Returns {input
    position: the tensor baked in}."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = parameter_names(gm) if names is None else names
    baked: dict[int, torch.Tensor] = {}
    taken: set[str] = set()
    anchor = placeholders[-1] if placeholders else None
    for i, node in enumerate(placeholders):
        name, value = names.get(i), example_inputs[i] if i < len(example_inputs) else None
        if name is None or i in keep or not isinstance(value, torch.Tensor):
            continue
        while name in taken:  # two sources with one path (a module reached twice): keep both
            name += "_"
        taken.add(name)
        _set_attr(gm, name, value)
        with gm.graph.inserting_after(anchor):
            attr = gm.graph.get_attr(name)
        attr.meta = dict(node.meta)
        node.replace_all_uses_with(attr)
        anchor = attr
        baked[i] = value
    gm.graph.lint()
    gm.recompile()
    return baked


def _weight_refs(gm: fx.GraphModule, baked: dict[int, torch.Tensor]) -> dict[str, int]:
    """{a ``get_attr`` target of ``gm``: the argument position of the weight it reads} for the weights
    ``lift_parameters`` baked (by identity: a name may carry a suffix where two sources shared one path)."""
    at = {id(t): i for i, t in baked.items()}
    refs: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value: Any = gm
            for part in str(node.target).split("."):
                value = getattr(value, part, None)
            if isinstance(value, torch.Tensor) and id(value) in at:
                refs[str(node.target)] = at[id(value)]
    return refs


def _read_weights_as_arguments(gm: fx.GraphModule, refs: dict[str, int]) -> int:
    """Each ``get_attr`` of a weight in ``refs`` that torch still runs replaced by the placeholder of its
    argument position: what torch computes reads the call's weight, whatever tensor or values it now has
    (the placeholders are Dynamo's calling convention, kept through the rewrite).  Returns how many."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    done = 0
    for node in list(gm.graph.nodes):
        i = refs.get(str(node.target)) if node.op == "get_attr" else None
        if i is None or i >= len(placeholders):
            continue
        node.replace_all_uses_with(placeholders[i])
        gm.graph.erase_node(node)
        done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def propagate_shapes(gm: fx.GraphModule, args: Sequence[Any]) -> None:
    """Every node's ``tensor_meta``: from Dynamo's own fake values where each node has one of whole-number
    sizes (``dynamo_shapes``), else ``ShapeProp`` on fake tensors of a static fake mode of our own.  Why not
    ShapeProp's default: inside Dynamo's call it finds Dynamo's fake mode and fakes the inputs there, and
    under automatic dynamic shapes that mode gives each new fake's sizes symbols with no source, which fail
    Dynamo's guards after the backend returns ("sources must not be empty for symbol s15")."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if dynamo_shapes(gm):
        return
    ShapeProp(gm, fake_mode=FakeTensorMode(allow_non_fake_inputs=True)).propagate(*args)


def dynamo_shapes(gm: fx.GraphModule) -> bool:
    """Set each node's ``tensor_meta`` (and ``type``) as ``ShapeProp`` would, from the fake value Dynamo
    traced it with (``example_value``), where every node but the output has one and no size or stride is
    symbolic; False (nothing set) otherwise: a node a pass added, a symbolic graph.  Why: Dynamo has already
    run every op on fake tensors of these very inputs; running them again was a third of a warm compile's
    own time (BERT-base: 718 nodes)."""
    metas: dict[fx.Node, tuple[Any, bool, type]] = {}
    values: dict[fx.Node, Any] = {}
    for node in gm.graph.nodes:
        if node.op == "output":  # what the graph returns: its arguments' values, as ShapeProp runs it
            value = fx.node.map_arg(node.args[0], lambda n: values[n])
        elif "example_value" in node.meta:
            value = values[node] = node.meta["example_value"]
        else:
            return False
        found: list[bool] = []
        try:
            meta = fx.node.map_aggregate(value, functools.partial(_meta_of, found=found))
        except _Symbolic:
            return False
        metas[node] = (meta, bool(found), type(value))
    for node, (meta, found, kind) in metas.items():
        if found:
            node.meta["tensor_meta"] = meta
        node.meta["type"] = kind
    return True


def _meta_of(x: Any, found: list[bool]) -> Any:
    """ShapeProp's ``tensor_meta`` of one value (a tensor's metadata; anything else as it is)."""
    if isinstance(x, torch.Tensor):
        if any(isinstance(d, torch.SymInt) for d in (*x.shape, *x.stride())):
            raise _Symbolic
        found.append(True)
        return _extract_tensor_metadata(x)
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise _Symbolic
    return x


class _Symbolic(Exception):
    """A fake value with a symbolic size: its ``tensor_meta`` comes from ShapeProp on concrete inputs."""


@dataclass
class GraphReport:
    """One Dynamo graph: what was fused in it and what torch runs (``partition``), or why it was not
    fused at all (``skipped``).  A graph with symbolic sizes has one report per set of sizes it was
    specialised to (``shapes``, by its sizes); its ``partition`` is the latest of them."""

    index: int
    nodes: int
    partition: Partition | None = None
    skipped: str | None = None
    ended_by: str | None = None  # the graph break that ended this graph (torch runs what follows it)
    replayed: bool = False  # the fused path runs as one CUDA graph (``replay.GraphReplay``)
    #: why a graph that would be replayed is launched kernel by kernel instead (its capture failed)
    not_replayed: str | None = None
    shapes: dict[str, GraphReport] = field(default_factory=dict)
    #: why its constants were last derived again (a weight changed: ``weights.Stamp.changed``)
    rebuilt: str | None = None
    rebuilds: int = 0
    #: live weights (a training graph) that moved: read again without a new partition (``CompiledGraph._refresh``):
    #: how many calls, how many kernel operands were derived again over them, and the last call's reason
    refreshes: int = 0
    operands_refreshed: int = 0
    refreshed: str | None = None
    #: a training graph (autograd on for its inputs): the reports of the forward and the backward ATen graphs
    #: aot_autograd split it into (``frontend.training``); each is fused on its first call
    forward: GraphReport | None = None
    backward: GraphReport | None = None
    #: ops replaced by kernels derived from their SMG (a training backward's attention backward,
    #: ``training.derive_attention_backwards``), one line each: what runs, as how many kernels
    derived: list[str] = field(default_factory=list)
    #: the measured choice (``measure.Choice``): "kept.fused" or "kept.torch" once decided, None before (or
    #: with ``measure=False``); ``measured`` its report line with both medians, ``fused_s`` / ``torch_s`` them
    kept: str | None = None
    measured: str | None = None
    fused_s: float | None = None
    torch_s: float | None = None
    #: the calls of the current build still alternate between the two paths (no choice yet)
    measuring: bool = False

    def _choice_line(self) -> str:
        """The measured choice's line ("" where none was measured)."""
        if self.measured:
            return "\n" + self.measured
        return "\nmeasuring: the next calls alternate between the fused path and torch's graph" \
            if self.measuring else ""

    def __str__(self) -> str:
        head = f"graph {self.index} ({self.nodes} nodes)"
        if self.ended_by:
            head += f", ended by a graph break: {self.ended_by}"
        if self.not_replayed:
            head += f", launched kernel by kernel: {self.not_replayed}"
        if self.rebuilds:
            head += f", constants derived again {self.rebuilds}x (last: {self.rebuilt})"
        if self.forward is not None or self.backward is not None:
            lines = [f"{head}: a training step, split by aot_autograd into a forward and a backward ATen graph"]
            for stage, r in (("forward", self.forward), ("backward", self.backward)):
                if r is None or (r.partition is None and not r.skipped):
                    lines.append(f"  {stage}: not compiled yet (built on its first call)")
                    continue
                again = f", constants derived again {r.rebuilds}x (last: {r.rebuilt})" if r.rebuilds else ""
                if r.refreshes:
                    again += (f", weights read again {r.refreshes}x without a new partition ({r.operands_refreshed} "
                              f"kernel operands derived again; last: {r.refreshed})")
                body = f"left to torch: {r.skipped}" if r.skipped else str(r.partition) + r._choice_line()
                if r.derived and not r.skipped:
                    body += "\nderived from the SMG (smg.autodiff), not a table row:"
                    body += "".join(f"\n  {line}" for line in r.derived)
                lines.append(f"  {stage} ({r.nodes} nodes){again}: " + body.replace("\n", "\n  "))
            return "\n".join(lines)
        if self.shapes:
            lines = [f"{head}: symbolic sizes, specialised to {len(self.shapes)} set(s) of sizes"]
            for sizes, r in self.shapes.items():
                body = str(r).split(": ", 1)[1] if ": " in str(r) else str(r)
                lines.append(f"  [{sizes}]: " + body.replace("\n", "\n  "))
            return "\n".join(lines)
        if self.skipped:
            return f"{head}: left to torch: {self.skipped}"
        return f"{head}: {self.partition}{self._choice_line()}"

    def partitions(self) -> list[Partition]:
        """This graph's partitions: its own, one per specialisation, or its forward's and backward's."""
        if self.forward is not None or self.backward is not None:
            return [p for r in (self.forward, self.backward) if r is not None for p in r.partitions()]
        if self.shapes:
            return [r.partition for r in self.shapes.values() if r.partition is not None]
        return [self.partition] if self.partition is not None else []

    def coverage(self) -> Coverage:
        """The matmuls and convolutions of what runs per call: each partition's ``Partition.coverage``, but
        where the measured choice kept torch's graph (``kept.torch``) its fused ones are counted as left to
        torch (code "kept.torch"), since torch runs them; the partitions themselves keep their own counts."""
        if self.forward is not None or self.backward is not None:
            parts = [r.coverage() for r in (self.forward, self.backward) if r is not None]
        elif self.shapes:
            parts = [r.coverage() for r in self.shapes.values()]
        elif self.partition is None:
            return Coverage((), ())
        else:
            cov = self.partition.coverage()
            if self.kept != KEPT[TORCH]:
                return cov
            ran = tuple(LeftOp(n, "a fused kernel's op", KEPT_TORCH_SENTENCE, KEPT[TORCH]) for n in cov.fused)
            return Coverage((), ran + cov.left, cov.once)
        return sum(parts, start=Coverage((), ()))


#: the reason a fused op counts as torch's where the measured choice kept torch's graph
KEPT_TORCH_SENTENCE = "fused, but measured slower than torch's graph, which runs instead (measure.Choice)"


#: the most sets of weights one graph keeps a build for (a layer's code after a graph break serves every layer)
MAX_WEIGHT_SETS = 64


class CompiledGraph:
    """One graph of concrete sizes, fused: its weights baked, rebuilt when one changes.

    One graph may serve several sets of weights: where a graph break falls inside a layer, Dynamo compiles
    that layer's code once and calls it with each layer's parameters.  A build is kept per set of weight
    tensors (by identity, at most ``MAX_WEIGHT_SETS``), but only for sets that come back: a set seen before
    (held weakly, so a replaced weight is never kept alive) is built and kept on its second visit, and found
    on every visit after.  Weights replaced for good (a new Parameter each step) are never kept, so their old
    builds' constants are freed.

    Measured (``measure.Choice``, where the owner's ``measuring`` is on): after each build the calls alternate
    between the fused path and torch's own graph (``gm``: Dynamo's graph, or a training stage's ATen graph),
    each call running one of them, until the faster is kept for good.  A build (the first, or ``_switch``'s
    rebuild for other weights) starts a new measurement; a kept build found again, or live weights read again
    (``_refresh``), does not.  Once torch's graph is kept, every call runs ``gm`` on the call's arguments (it
    reads each weight as an argument) with no weight guard and no rebuild: the kernels' speed does not
    depend on the weights' values.

    Slots, not a ``__dict__``: Dynamo wraps the callable a backend returns with ``functools.wraps``, which
    copies the instance's ``__dict__`` into the wrapper, and that copy would hold the first build (its
    baked tensors and derived constants) for as long as Dynamo keeps the graph."""

    __slots__ = ("owner", "gm", "report", "names", "written", "builds", "seen", "fused", "run", "stamp", "replay",
                 "prepare", "live", "refs", "kernels", "choice", "__weakref__")

    def __init__(self, owner: Any, gm: fx.GraphModule, example_inputs: list[Any], report: GraphReport,
                 names: dict[int, str], prepare: Callable[[fx.GraphModule], Any] | None = None,
                 live_weights: bool = False) -> None:
        self.owner, self.gm, self.report, self.names = owner, gm, report, names
        #: a training graph's weights change every step: what torch runs reads them as the call's arguments,
        #: the kernels' operands derived from them are derived again into their buffers when they moved
        #: (``_refresh``), and the graph is partitioned again only where that cannot be (``_switch``)
        self.live = live_weights
        #: {the qualified name a kernel operand reads a weight by: the argument position it comes from}
        self.refs: dict[str, int] = {}
        #: a pass over each build's graph once its weights are lifted, before shapes are propagated: an ATen
        #: graph of a training step read as the torch-level graph the matchers know (``training.read_aten``)
        self.prepare = prepare
        self.written = mutated_inputs(gm)
        self.builds: OrderedDict[tuple[int, ...], tuple] = OrderedDict()
        self.seen: OrderedDict[tuple[int, ...], tuple[weakref.ref, ...]] = OrderedDict()
        self._fuse(example_inputs)
        self._remember(example_inputs)

    def _weights_key(self, args: Sequence[Any]) -> tuple[int, ...]:
        return tuple(id(args[i]) for i in self.stamp.positions)

    def _remember(self, args: Sequence[Any]) -> None:
        key = self._weights_key(args)
        self.seen[key] = tuple(weakref.ref(args[i]) for i in self.stamp.positions)
        self.seen.move_to_end(key)
        while len(self.seen) > 4 * MAX_WEIGHT_SETS:
            self.seen.popitem(last=False)

    def _revisit(self, args: Sequence[Any]) -> bool:
        refs = self.seen.get(self._weights_key(args))
        return refs is not None and all(r() is args[i] for r, i in zip(refs, self.stamp.positions))

    def _switch(self, args: Sequence[Any], why: str) -> None:
        """Serve weights other than the current build's: a kept build of these tensors, unchanged, or a new
        build (kept where this set came back)."""
        key = self._weights_key(args)
        kept = self.builds.get(key)
        if kept is not None and kept[2].changed(args) is None:
            self.builds.move_to_end(key)
            self.fused, self.run, self.stamp, self.replay = kept
            return
        keep = kept is not None or self._revisit(args)
        self.report.rebuilt, self.report.rebuilds = why, self.report.rebuilds + 1
        try:
            self._fuse(list(args))
        except Exception as exc:  # from now on torch runs Dynamo's graph, which reads every weight as it is
            self.report.skipped = f"the rebuild after a weight change failed ({why}): {type(exc).__name__}: {exc}"
            self.run, self.replay, self.stamp = self.gm.forward, None, Stamp.take({})
            self.builds.clear()
            self.choice, self.report.measuring = Choice(on=False), False  # both paths are torch's graph now
            return
        if keep:
            self.builds[key] = (self.fused, self.run, self.stamp, self.replay)
            self.builds.move_to_end(key)
            while len(self.builds) > MAX_WEIGHT_SETS:
                self.builds.popitem(last=False)
        self._remember(args)

    def _fuse(self, example_inputs: list[Any]) -> None:
        with own_reads():  # deriving constants reads weights (ShapeProp's fake copy): no change to them
            self._derive(example_inputs)

    def _derive(self, example_inputs: list[Any]) -> None:
        gm = fx.GraphModule(self.gm, copy.deepcopy(self.gm.graph))  # the lifted get_attrs are per compile
        baked = lift_parameters(gm, example_inputs, self.names, keep=self.written)
        self.refs = _weight_refs(gm, baked)
        if self.prepare is not None:
            self.prepare(gm)
        shaped = unwritten_copies(example_inputs, self.written)
        with torch.no_grad():
            propagate_shapes(gm, shaped)
            # (live weights: a chunk of a weight made a constant would be derived again every step)
            if not self.live and split_projections(gm):  # new nodes: their shapes
                propagate_shapes(gm, unwritten_copies(example_inputs, self.written))
        drop_noops(gm)
        merge_repeated_activations(gm)
        fused = fuse_captured(Captured(gm, tuple(example_inputs)), self.owner.kernels, self.owner.verbose,
                              baked_weights=True, live_weights=self.live)
        if self.live:
            _read_weights_as_arguments(fused.graph_module, self.refs)
        self.report.partition = fused.partition
        self.fused: FusedModel = fused
        self.kernels = [m for m in fused.graph_module.modules() if isinstance(m, FusedKernel)]
        self.run = fused.graph_module.forward
        self.stamp = Stamp.take(baked)
        self._capture(example_inputs)
        self._measure_from_here(example_inputs)

    def _measure_from_here(self, example_inputs: Sequence[Any]) -> None:
        """A new build: a new measurement of it against torch's graph, where the owner measures (its
        ``measuring``; ``timer``: the owner's, else ``measure.wall_timer``).  A plain build (nothing fused, no
        CUDA graph) is torch's graph already: nothing to measure (Dynamo runs ``gm`` itself)."""
        on = bool(getattr(self.owner, "measuring", False)) and not self.plain
        cuda = any(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs)
        self.choice = Choice(on, getattr(self.owner, "timer", None), cuda)
        r = self.report
        r.kept = r.measured = r.fused_s = r.torch_s = None
        r.measuring = on

    def _decided(self, choice: Choice) -> None:
        """The measurement's outcome into the report; torch's graph kept: the CUDA graph and the kept builds
        are released (never run again)."""
        r = self.report
        r.kept, r.measured, r.measuring = KEPT[choice.kept], choice.line(), False
        r.fused_s, r.torch_s = choice.medians[FUSED], choice.medians[TORCH]
        if choice.kept == TORCH:  # (``replayed`` still says how the fused path ran)
            self.replay = None
            self.builds.clear()
        logging.getLogger("spacefusion").info("graph %d: %s", r.index, r.measured)

    def _capture(self, example_inputs: list[Any]) -> None:
        """The CUDA graph replay of ``self.run`` on these inputs, where graphs are replayed on the GPU."""
        tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
        self.replay: GraphReplay | None = None
        on_gpu = getattr(self.owner.kernels, "name", None) == "cuda" and tensors and all(x.is_cuda for x in tensors)
        if self.owner.replay_graphs and on_gpu and not self.owner.export_only:
            try:
                self.replay = GraphReplay(self.run, example_inputs, self.stamp.positions,
                                          clone_outputs=self.owner.clone_outputs, mutated=self.written)
            except Exception as exc:  # e.g. a host tensor copied in (Gemma's embedding scale): not capturable
                torch.cuda.synchronize()
                self.report.not_replayed = f"its CUDA graph capture failed: {type(exc).__name__}: " + \
                    str(exc).splitlines()[0][:300]
        self.report.replayed = self.replay is not None

    @property
    def plain(self) -> bool:
        """Nothing fused and no CUDA graph: torch's own graph does the same, without the guard's cost."""
        return not self.fused.partition.subgraphs and self.replay is None

    def _refresh(self, args: Sequence[Any], why: str) -> bool:
        """Live weights that moved (``why``): each kernel operand derived from one derived again into its
        buffer (``FusedKernel.refresh``), the stamp taken again; no partition, no build.  False where an
        operand would change its shape or dtype (the caller then builds the graph again)."""
        weights = {ref: args[i] for ref, i in self.refs.items()}
        done, moved = 0, False
        try:
            with own_reads(), torch.no_grad():
                for fk in self.kernels:
                    n, m = fk.refresh(weights)
                    done, moved = done + n, moved or m
        except ValueError as exc:
            self.report.refreshed = f"{why}, not refreshed: {exc}"
            return False
        self.stamp = Stamp.take({i: args[i] for i in self.stamp.positions})
        r = self.report
        r.refreshed, r.refreshes, r.operands_refreshed = why, r.refreshes + 1, r.operands_refreshed + done
        if moved and self.replay is not None:  # a buffer at another address: the CUDA graph read the old one
            self._capture(list(args))
        return True

    def __call__(self, *args: Any) -> Any:
        choice = self.choice
        if choice.kept == TORCH:
            return self.gm.forward(*args)
        if choice.kept == FUSED:
            return self._fused(args)
        if choice.cuda and torch.cuda.is_current_stream_capturing():  # a caller's capture: no sync, no sample
            return self._fused(args)
        path = choice.next_path()
        call = (lambda: self._fused(args)) if path == FUSED else (lambda: self.gm.forward(*args))
        out, seconds = choice.timer(path, call, choice.cuda)
        if choice is self.choice and choice.record(path, seconds):  # (a rebuild in the call: a new measurement)
            self._decided(choice)
        return out

    def _fused(self, args: Sequence[Any]) -> Any:
        """The fused path: the weight guard (another build, a refresh), then the CUDA graph replay or the fused
        graph launched kernel by kernel."""
        why = self.stamp.changed(args)
        if why is not None and not (self.live and self._refresh(args, why)):
            # other weights than those baked, or changed: another build, or a new one
            self._switch(args, why)
        if self.replay is not None:
            if not self.replay.captures(args):  # another static-address tensor (a new cache): capture again
                self._capture(list(args))
            if self.replay is not None:
                return self.replay(*args)
        with torch.no_grad():
            return self.run(*args)


#: the most sets of sizes one symbolic graph is specialised to; calls with further sizes run the graph in
#: torch (said in the report), so a loop over thousands of lengths does not build thousands of graphs
MAX_SHAPES = 64


class PerShape:
    """A graph with symbolic sizes: each call runs the ``CompiledGraph`` of its sizes (built on the first
    call with them).  A set of sizes whose build fails runs the symbolic graph in torch, its reason kept
    in that size's report."""

    def __init__(self, owner: Any, gm: fx.GraphModule, example_inputs: list[Any], report: GraphReport,
                 names: dict[int, str], signatures: Sequence[str] = ()) -> None:
        self.owner, self.gm, self.report, self.names = owner, gm, report, names
        self.signatures = tuple(signatures)  # marked in the kernel cache once a set of sizes compiled
        self.key = SizeKey.of_graph(gm, example_inputs)
        self.arg_names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        self.compiled: dict[tuple, Any] = {}

    def _build(self, args: list[Any]) -> Any:
        sizes = self.key.describe(args, self.arg_names)
        report = GraphReport(self.report.index, self.report.nodes)
        self.report.shapes[sizes] = report
        if len(self.compiled) >= MAX_SHAPES:
            report.skipped = f"more than {MAX_SHAPES} sets of sizes: torch runs the further ones (MAX_SHAPES)"
            return self.gm.forward
        per_call = getattr(self.owner.kernels, "sizes_per_call", contextlib.nullcontext)
        try:
            with per_call():  # a CUDA backend's first picks come from the family's ranking (``families``)
                compiled = CompiledGraph(self.owner, concrete(self.gm, args), args, report, self.names)
        except FrontendError as exc:
            report.skipped = str(exc)
            return self.gm.forward
        except Exception as exc:  # a specialisation we could not fuse runs as Dynamo captured it, reported
            report.skipped = f"{type(exc).__name__}: {exc}"
            return self.gm.forward
        self.report.partition, self.report.replayed = report.partition, report.replayed
        self.owner.built(self.signatures)
        self.owner.compiled.append(compiled)
        return self.gm.forward if compiled.plain else compiled

    def __call__(self, *args: Any) -> Any:
        key = self.key.of(args)
        run = self.compiled.get(key)
        if run is None:
            run = self.compiled[key] = self._build(list(args))
            sizes, report = next(reversed(self.report.shapes.items()))
            logging.getLogger("spacefusion").info("graph %d, sizes [%s]: %s", self.report.index, sizes, report)
        if self.owner.export_only:  # the kernels of these sizes are written; torch runs the call
            return self.gm.forward(*args)
        return run(*args)
