"""TorchDynamo capture: ``torch.compile(model, backend="spacefusion")`` and ``spacefusion.compile(model)``.

Dynamo hands a backend one FX graph per captured region (a graph break splits the forward into several,
and torch runs the code between them).  Its graphs differ from ``fx.symbolic_trace``'s in two ways this
module undoes before the usual partition (``frontend.partition``) sees them:

- modules are inlined: an ``nn.Linear`` is ``torch._C._nn.linear(x, w, b)`` and its parameters are graph
  inputs (placeholders named after their module path).  ``lift_parameters`` turns every placeholder that
  Dynamo sourced from a module's ``_parameters`` or ``_buffers`` into a ``get_attr`` of that tensor under
  its qualified name (``encoder.layer.0.attention.self.query.weight``), which is what the matchers bind as
  a constant operand (weights transposed or stacked once, at build time);
- no-ops at inference stay in the graph (``F.dropout(..., training=False)``, ``.contiguous()`` of a
  contiguous value); ``drop_noops`` removes them so they do not sit between a producer and its consumer.

Kernels are built for the example shapes (``dynamic=False``): a graph with symbolic sizes is left to
torch with that reason.  Weights are baked when a graph is compiled; every call checks that the same
parameter tensors, unmodified (``Tensor._version``), are passed, and recompiles the graph otherwise, so
an in-place weight update or another model instance never runs on stale weights.
"""

from __future__ import annotations

import copy
import math
import operator
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from spacefusion.frontend.backends import get_backend
from spacefusion.frontend.capture import Captured
from spacefusion.frontend.errors import FrontendError
from spacefusion.frontend.fused import FusedModel, fuse_captured
from spacefusion.frontend.graph import activation_of, contiguous, conv_of
from spacefusion.frontend.projections import split_projections
from spacefusion.frontend.records import Partition
from spacefusion.frontend.replay import GraphReplay, mutated_inputs

_ATTR = re.compile(r"\._(?:modules|parameters|buffers)\['([^']+)'\]")


def _qualified(node: fx.Node) -> str | None:
    """The module path of a placeholder Dynamo sourced from a module's parameter or buffer, else None."""
    arg = node.meta.get("grapharg")
    source = getattr(getattr(arg, "source", None), "name", None)
    source = source() if callable(source) else source
    if not isinstance(source, str) or not re.search(r"\._(?:parameters|buffers)\[", source):
        return None
    return ".".join(_ATTR.findall(source)) or None


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


def lift_parameters(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> dict[int, torch.Tensor]:
    """Replace the uses of every parameter/buffer placeholder by a ``get_attr`` of that tensor (registered
    on ``gm`` under its qualified name).  The placeholders stay, unused, so the graph keeps Dynamo's calling
    convention.  Returns {input position: the tensor baked in}."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    baked: dict[int, torch.Tensor] = {}
    taken: set[str] = set()
    anchor = placeholders[-1] if placeholders else None
    for i, node in enumerate(placeholders):
        name, value = _qualified(node), example_inputs[i] if i < len(example_inputs) else None
        if name is None or not isinstance(value, torch.Tensor):
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


def _is_inference_dropout(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target not in (F.dropout, torch.dropout, torch.nn.functional.dropout1d,
                                                         torch.nn.functional.dropout2d):
        return False
    args = dict(zip(("input", "p", "training", "inplace"), node.args)) | dict(node.kwargs)
    return args.get("training", True) is False or args.get("p", 0.5) == 0.0


def _same_view(node: fx.Node) -> bool:
    """A ``view``/``reshape`` to the shape its input already has (HF's ``reshape(b, -1, s, d)`` of an
    attention output): the same tensor, strides included."""
    if node.op != "call_method" or node.target not in ("view", "reshape") or not isinstance(node.args[0], fx.Node):
        return False
    src, out = node.args[0].meta.get("tensor_meta"), node.meta.get("tensor_meta")
    return (src is not None and out is not None and hasattr(src, "shape") and hasattr(out, "shape")
            and tuple(src.shape) == tuple(out.shape) and tuple(src.stride) == tuple(out.stride))


def _lone_operand_of_cat(node: fx.Node) -> fx.Node | None:
    """The one operand of a ``torch.cat`` whose others ShapeProp saw empty (a KV cache's first append,
    ``cat([empty, k])``: a copy of ``k`` that an inference graph may read in place), else None."""
    if node.op != "call_function" or node.target not in (torch.cat, torch.concat):
        return None
    parts = node.args[0] if node.args else node.kwargs.get("tensors")
    out = node.meta.get("tensor_meta")
    if not isinstance(parts, list | tuple) or not hasattr(out, "shape"):
        return None

    def empty(x: Any) -> bool:
        meta = x.meta.get("tensor_meta") if isinstance(x, fx.Node) else None
        return hasattr(meta, "shape") and math.prod(meta.shape) == 0

    kept = [x for x in parts if not empty(x)]
    meta = kept[0].meta.get("tensor_meta") if len(kept) == 1 and isinstance(kept[0], fx.Node) else None
    same = hasattr(meta, "shape") and tuple(meta.shape) == tuple(out.shape) and meta.dtype == out.dtype
    return kept[0] if same else None


def _same_value(src: Any, node: fx.Node) -> bool:
    """Whether ShapeProp saw ``node``'s value with ``src``'s shape, dtype and strides."""
    a = src.meta.get("tensor_meta") if isinstance(src, fx.Node) else None
    b = node.meta.get("tensor_meta")
    return all(hasattr(m, "shape") for m in (a, b)) and (tuple(a.shape), a.dtype, tuple(a.stride)) == (
        tuple(b.shape), b.dtype, tuple(b.stride))


def _identity_arith(node: fx.Node) -> fx.Node | None:
    """The tensor of ``x / 1`` or ``x * 1`` (either side) where the result keeps its dtype, else None:
    diffusers divides every ResNet block's and attention's output by an ``output_scale_factor`` /
    ``rescale_output_factor`` that is 1.0 in SD 1.5, a full read and write of the feature map each (Dynamo
    keeps them)."""
    if node.op != "call_function" or len(node.args) != 2 or node.kwargs:
        return None
    x, c = node.args
    if node.target in (operator.mul, torch.mul) and not isinstance(x, fx.Node):
        x, c = c, x
    ok = (node.target in (operator.truediv, torch.div, operator.mul, torch.mul) and isinstance(x, fx.Node)
          and isinstance(c, int | float) and not isinstance(c, bool) and c == 1 and _same_value(x, node))
    return x if ok else None


def _same_dtype_cast(node: fx.Node) -> bool:
    """``x.to(dtype)`` / ``x.float()`` / ``x.half()`` to the dtype ``x`` has: torch returns ``x`` itself."""
    if node.op != "call_method" or not node.args or not _same_value(node.args[0], node):
        return False
    if node.target in ("float", "half", "bfloat16"):
        return len(node.args) == 1 and not node.kwargs
    return node.target == "to" and len(node.args) + len(node.kwargs) >= 2 and all(
        isinstance(a, torch.dtype) for a in (*node.args[1:], *node.kwargs.values()))


def _channels_last_for_convs(node: fx.Node, gm: fx.GraphModule) -> bool:
    """``.contiguous()`` of a channels-last image read only by convolutions (diffusers' Transformer2D
    ``reshape(b, h, w, c).permute(0, 3, 1, 2).contiguous()`` before its 1x1 ``proj_out``): a copy into NCHW
    that a conv does not need, since it reads either layout (the fused implicit GEMM binds channels-last)."""
    if node.op != "call_method" or node.target != "contiguous" or len(node.args) != 1 or node.kwargs:
        return False
    meta = node.args[0].meta.get("tensor_meta") if isinstance(node.args[0], fx.Node) else None
    if not hasattr(meta, "shape") or len(meta.shape) != 4 or not node.users:
        return False
    _, c, h, w = meta.shape
    cl = tuple(s for s, n in zip(meta.stride[1:], (c, h, w)) if n > 1) == tuple(
        s for s, n in zip((1, w * c, c), (c, h, w)) if n > 1)
    return cl and all(conv_of(u, gm) is not None and conv_of(u, gm).x is node for u in node.users)


def drop_noops(gm: fx.GraphModule) -> int:
    """Remove inference dropouts, views to the same shape, ``.contiguous()`` of values ShapeProp saw
    contiguous (or channels-last, read only by convs), casts to the dtype a value has, ``x / 1`` and
    ``x * 1``, and concatenations with empty tensors (run after shape propagation); returns how many
    nodes went."""
    gone = 0
    for node in list(gm.graph.nodes):
        noop = _is_inference_dropout(node) or _same_view(node) or (
            node.op == "call_method" and node.target == "contiguous" and len(node.args) == 1
            and contiguous(node.args[0])) or _same_dtype_cast(node) or _channels_last_for_convs(node, gm)
        src = node.args[0] if noop else _identity_arith(node) or _lone_operand_of_cat(node)
        if isinstance(src, fx.Node):
            node.replace_all_uses_with(src)
            gm.graph.erase_node(node)
            gone += 1
    gm.recompile()
    return gone


def merge_repeated_activations(gm: fx.GraphModule) -> int:
    """Let one node stand for every later call of the same activation function on the same value
    (diffusers' UNet applies ``silu`` to the time embedding in each of its 22 ResNet blocks; Dynamo keeps
    all 22).  The linears reading that one value then stack into a GEMM per shape (``match_stacked_linears``)
    instead of 22 launches.  Only pure activations (``graph.activation_of``) merge; returns how many went."""
    seen: dict[tuple, fx.Node] = {}
    gone = 0
    for node in list(gm.graph.nodes):
        if node.op not in ("call_function", "call_method") or activation_of(node, gm) is None:
            continue
        try:
            key = (node.op, node.target, tuple(node.args), tuple(sorted(node.kwargs.items())))
            first = seen.setdefault(key, node)
        except TypeError:  # an unhashable argument: left alone
            continue
        if first is not node:
            node.replace_all_uses_with(first)
            gm.graph.erase_node(node)
            gone += 1
    gm.recompile()
    return gone


def _symbolic(example_inputs: Sequence[Any]) -> bool:
    return any(isinstance(x, torch.SymInt) or isinstance(x, torch.Tensor)
               and any(isinstance(s, torch.SymInt) for s in x.shape) for x in example_inputs)


@dataclass
class GraphReport:
    """One Dynamo graph: what was fused in it and what torch runs (``partition``), or why it was not
    fused at all (``skipped``)."""

    index: int
    nodes: int
    partition: Partition | None = None
    skipped: str | None = None
    ended_by: str | None = None  # the graph break that ended this graph (torch runs what follows it)
    replayed: bool = False  # runs as one CUDA graph (``replay.GraphReplay``)
    #: why a graph that would be replayed is launched kernel by kernel instead (its capture failed)
    not_replayed: str | None = None

    def __str__(self) -> str:
        head = f"graph {self.index} ({self.nodes} nodes)"
        if self.ended_by:
            head += f", ended by a graph break: {self.ended_by}"
        if self.not_replayed:
            head += f", launched kernel by kernel: {self.not_replayed}"
        return f"{head}: left to torch: {self.skipped}" if self.skipped else f"{head}: {self.partition}"


class _Compiled:
    """What the backend returns for one graph: the fused graph module, guarded on the baked weights."""

    def __init__(self, owner: SpaceFusionBackend, gm: fx.GraphModule, example_inputs: list[Any],
                 report: GraphReport) -> None:
        self.owner, self.gm, self.report = owner, gm, report
        self._fuse(example_inputs)

    def _fuse(self, example_inputs: list[Any]) -> None:
        gm = fx.GraphModule(self.gm, copy.deepcopy(self.gm.graph))  # the lifted get_attrs are per compile
        baked = lift_parameters(gm, example_inputs)
        with torch.no_grad():
            ShapeProp(gm).propagate(*example_inputs)
            if split_projections(gm):  # new nodes: their shapes
                ShapeProp(gm).propagate(*example_inputs)
        drop_noops(gm)
        merge_repeated_activations(gm)
        fused = fuse_captured(Captured(gm, tuple(example_inputs)), self.owner.kernels, self.owner.verbose,
                              baked_weights=True)
        self.report.partition = fused.partition
        self.fused: FusedModel = fused
        self.run = fused.graph_module.forward
        self.baked = tuple((i, t, t._version) for i, t in baked.items())
        self._capture(example_inputs)

    def _capture(self, example_inputs: list[Any]) -> None:
        """The CUDA graph replay of ``self.run`` on these inputs, where graphs are replayed on the GPU."""
        tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
        self.replay: GraphReplay | None = None
        on_gpu = getattr(self.owner.kernels, "name", None) == "cuda" and tensors and all(x.is_cuda for x in tensors)
        if self.owner.replay_graphs and on_gpu and not self.owner.export_only:
            try:
                self.replay = GraphReplay(self.run, example_inputs, [i for i, _, _ in self.baked],
                                          clone_outputs=self.owner.clone_outputs, mutated=mutated_inputs(self.gm))
            except Exception as exc:  # e.g. a host tensor copied in (Gemma's embedding scale): not capturable
                torch.cuda.synchronize()
                self.report.not_replayed = f"its CUDA graph capture failed: {type(exc).__name__}: " + \
                    str(exc).splitlines()[0][:300]
        self.report.replayed = self.replay is not None

    def __call__(self, *args: Any) -> Any:
        for i, t, version in self.baked:
            if args[i] is not t or t._version != version:
                self._fuse(list(args))  # other weights than those baked: rebuild the constants
                break
        if self.replay is not None:
            if not self.replay.captures(args):  # another static-address tensor (a new cache): capture again
                self._capture(list(args))
            if self.replay is not None:
                return self.replay(*args)
        with torch.no_grad():
            return self.run(*args)


@dataclass
class SpaceFusionBackend:
    """A TorchDynamo backend fusing every captured graph into SMG kernels on ``target``
    (``kernel_backend``): "cuda", "llvm" (TVM's CPU build), "reference" (the SMGs evaluated in numpy: a
    check of the mapping), or a backend object (``frontend.backends``); None picks "cuda" for inputs on
    the GPU, else "llvm".  ``graphs`` keeps one report per graph it compiled; ``str(backend)`` prints them
    with the graph breaks between them."""

    target: Any = None
    verbose: bool = False
    mode: str | None = None
    export_only: bool = False  # build the kernels and report, but return the graph unfused (``export_cuda``)
    db: str | Path | None = None  # a tuning database (``tune_model``): each SMG's best, the first pick where none
    graphs: list[GraphReport] = field(default_factory=list)

    @property
    def replay_graphs(self) -> bool:
        return self.mode != "max-autotune-no-cudagraphs"

    def _set_mode(self, mode: str | None) -> None:
        """On the GPU every graph is one CUDA graph replay unless the mode says no; "reduce-overhead"
        returns the captured outputs (valid until the next call, as torch.compile's), the others copies."""
        if mode not in MODES:
            raise FrontendError(f"unknown mode {mode!r}; known: {', '.join(str(m) for m in MODES)}")
        self.mode, self.clone_outputs = mode, mode != "reduce-overhead"

    def __post_init__(self) -> None:
        self._set_mode(self.mode)
        self.compiled: list[_Compiled] = []  # what each fused graph runs (its FusedModel, its replay)
        if isinstance(self.target, str) and self.target not in TARGETS:
            raise FrontendError(f"unknown spacefusion target {self.target!r}; known: {', '.join(TARGETS)}, "
                                f"or a kernel backend object")
        self._kernels: Any = None
        self._seen = len(_break_reasons())
        if self.db is not None:  # a database that cannot serve is an error now, not inside Dynamo's call
            check_database(self.db, self.target)

    @property
    def kernels(self) -> Any:
        if self._kernels is None:
            self._kernels = kernel_backend(self.target or "llvm", self.db)
        return self._kernels

    def _resolve(self, example_inputs: Sequence[Any]) -> None:
        """No target named: "cuda" when the inputs are on the GPU, else "llvm"."""
        if self.target is None and self._kernels is None:
            on_gpu = any(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs)
            self.target = "cuda" if on_gpu else "llvm"

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any], mode: str | None = None,
                 **_: Any) -> Callable[..., Any]:
        if mode is not None and mode != self.mode:  # torch.compile(..., mode=) passes it to the backend
            self._set_mode(mode)
        report = GraphReport(len(self.graphs), sum(1 for n in gm.graph.nodes if n.op.startswith("call_")))
        reasons = _break_reasons()
        new = reasons[self._seen:] if len(reasons) >= self._seen else reasons  # (a dynamo reset clears them)
        self._seen = len(reasons)
        if new:
            report.ended_by = _describe(new[-1])
        self.graphs.append(report)
        self._resolve(example_inputs)
        _ = self.kernels  # a target that cannot run here (cuda without a GPU) is an error, not a fallback
        if _symbolic(example_inputs):
            report.skipped = ("symbolic sizes (dynamic shapes): SMG kernels are built for concrete shapes; "
                              "compile with dynamic=False")
            return gm.forward
        if any(isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled() for x in example_inputs) \
                and not self.export_only:
            report.skipped = "autograd is on for its inputs: the fused kernels are inference-only (use torch.no_grad)"
            return gm.forward
        try:
            compiled = _Compiled(self, gm, list(example_inputs), report)
            self.compiled.append(compiled)
            return gm.forward if self.export_only else compiled
        except FrontendError as exc:
            report.skipped = str(exc)
        except Exception as exc:  # a graph we could not fuse runs as Dynamo captured it, reported
            report.skipped = f"{type(exc).__name__}: {exc}"
        return gm.forward

    @property
    def partitions(self) -> list[Partition]:
        return [g.partition for g in self.graphs if g.partition is not None]

    def graph_breaks(self) -> list[str]:
        """Dynamo's reasons for the graph breaks that ended this backend's graphs."""
        return [g.ended_by for g in self.graphs if g.ended_by]

    def __str__(self) -> str:
        breaks = len(self.graph_breaks())
        name = getattr(self.kernels, "name", self.target) if self.graphs else "no graph yet"
        head = f"spacefusion ({name}): {len(self.graphs)} Dynamo graphs"
        lines = [head + (f", {breaks} graph breaks (torch runs the code at each)" if breaks else "")]
        lines += [str(g) for g in self.graphs]
        return "\n".join(lines)


#: the targets named by a string
TARGETS = ("cuda", "llvm", "reference")
#: torch.compile's modes: every one but the last replays each graph as a CUDA graph on the GPU (kernels
#: are the first picks in each: tuning is ``spacefusion tune`` / ``frontend.tune``, not a compile mode)
MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def kernel_cache() -> Path:
    """Where the "cuda" target keeps the artefacts it builds (``SPACEFUSION_CACHE``, else ~/.cache)."""
    return Path(os.environ.get("SPACEFUSION_CACHE", Path.home() / ".cache" / "spacefusion")) / "kernels"


def kernel_backend(target: Any, db: str | Path | None = None) -> Any:
    """The kernel backend of a target: "reference", "llvm", "cuda" (TVM builds each SMG's first pick, the
    analytical model's best schedule for an H100, into ``kernel_cache()`` and the GPU runtime launches it:
    TVM, nvcc and the GPU on one machine), or a backend object.  With ``db`` (a tuning database that
    ``frontend.tune.tune_model`` filled) "llvm" and "cuda" build each SMG's best measured schedule there
    ("cuda": measured on this GPU's preset, ``device_hardware``, else on an H100)."""
    if target == "llvm" and db is not None:
        from spacefusion.frontend.backends import LLVMBackend
        from spacefusion.frontend.schedules import default_schedule

        return LLVMBackend(schedule_for=tuned(db, "llvm", default_schedule))
    if target != "cuda":
        return get_backend(target)
    if not torch.cuda.is_available():
        raise FrontendError("target 'cuda' needs a CUDA GPU (torch.cuda.is_available() is False); use 'llvm'")
    from spacefusion.frontend.backends import CudaBackend

    if db is None:
        return CudaBackend(kernel_cache(), schedule_for=first_pick, build_missing=True)
    machines = tuple(dict.fromkeys((device_hardware().name, "H100")))
    return CudaBackend(kernel_cache(), schedule_for=tuned(db, "cuda:sm_90a", first_pick, machines),
                       build_missing=True, by_schedule=True)


def device_hardware() -> Any:
    """The hardware preset of this machine's GPU: the key its tunes file records under, and whose records a
    tuned build reads first (an H200's measurements are not an H100's); the H100's where the device's name
    matches no preset."""
    from schedulers.hardware import H100, preset_of_device

    return preset_of_device(torch.cuda.get_device_name()) or H100


def check_database(db: str | Path, target: Any) -> None:
    """Raise, naming the problem, unless ``db`` is a tuning database that ``target`` can build from."""
    from search.database import DatabaseError, TuningDatabase

    if target is not None and target not in ("llvm", "cuda"):
        raise FrontendError(f"a tuning database applies to the 'llvm' and 'cuda' targets, not {target!r}")
    if not Path(db).is_file():
        raise FrontendError(f"no tuning database at {db} (spacefusion.frontend.tune.tune_model fills one)")
    try:
        TuningDatabase(db, readonly=True).close()
    except DatabaseError as exc:
        raise FrontendError(f"tuning database {db}: {exc}") from exc


def tuned(db: str | Path, target: str, fallback: Any, hardware: Sequence[str] = ("H100",)) -> Any:
    """Each SMG's best schedule in the tuning database ``db`` for ``target``, measured on the first of
    ``hardware`` that has a record of it (records are keyed by the machine they were measured on), else
    ``fallback``'s; a database that is missing or not one, or an unknown machine, is an error naming it."""
    from schedulers.hardware import HardwareError, get_hardware
    from search.database import TuningDatabase
    from spacefusion.frontend.schedules import from_database

    check_database(db, target.split(":")[0])
    try:
        models = [get_hardware(h) for h in hardware]
    except HardwareError as exc:
        raise FrontendError(f"tuning database {db}: {exc}") from exc
    if not models:
        raise FrontendError(f"tuning database {db}: no hardware named to read its records for")
    database = TuningDatabase(db, readonly=True)
    pick = fallback
    for hw in reversed(models):
        pick = from_database(database, hw=hw, target=target, fallback=pick)
    return pick


def first_pick(smg: Any) -> Any:
    """The analytical model's best schedule of ``smg`` for an H100 (``schedules.model_pick``); the slicers'
    default where no candidate fits (a correct kernel, not a fast one)."""
    from spacefusion.frontend.schedules import default_schedule, model_pick

    try:
        return model_pick(smg)[0]
    except Exception:  # no candidate fits
        return default_schedule(smg)


def export_cuda(model: nn.Module, folder: str | Path, *args: Any, db: str | Path | None = None,
                hardware: Sequence[str] = ("H100",), **kwargs: Any) -> SpaceFusionBackend:
    """Capture ``model`` on the example inputs (meta tensors do: nothing runs) and write the CUDA artefact
    of every fused SMG's first pick (with ``db``, its best schedule measured on the first of ``hardware``
    with a record of it) into
    ``folder``, where TVM is and no GPU: on the GPU machine ``spacefusion.compile(model,
    target=CudaBackend(folder))`` then loads them with no TVM there (the SMG content keys name the
    artefacts).  Returns the backend, whose report says what was fused."""
    from spacefusion.frontend.backends import CudaBackend

    pick = first_pick if db is None else tuned(db, "cuda:sm_90a", first_pick, hardware)
    backend = SpaceFusionBackend(CudaBackend(folder, schedule_for=pick, build_missing=True, load=False),
                                 export_only=True)
    with torch.no_grad():
        torch.compile(model, backend=backend, dynamic=False)(*args, **kwargs)
    return backend


def _break_reasons() -> list[Any]:
    from torch._dynamo.utils import graph_break_reasons

    return graph_break_reasons


def _describe(reason: Any) -> str:
    """A graph break's first line and where in the user's code it happened."""
    text = str(getattr(reason, "reason", reason)).strip().splitlines()[0]
    stack = getattr(reason, "user_stack", None) or []
    where = f" (at {stack[-1].filename}:{stack[-1].lineno})" if stack else ""
    return text + where


def dynamo_backend(gm: fx.GraphModule, example_inputs: list[Any], mode: str | None = None,
                   options: dict[str, Any] | None = None) -> Callable[..., Any]:
    """The function registered as Dynamo's "spacefusion" backend (entry point ``torch_dynamo_backends``):
    ``torch.compile(model, backend="spacefusion", options={"target": "reference"})``.  Each call makes a
    backend of its own; use ``spacefusion.compile`` (or a ``SpaceFusionBackend``) to keep the reports."""
    opts = dict(options or {})
    target = opts.pop("target", None)
    verbose = bool(opts.pop("verbose", False))
    db = opts.pop("db", None)
    if opts:
        raise FrontendError(f"unknown spacefusion backend options {sorted(opts)}; known: target, verbose, db")
    return SpaceFusionBackend(target, verbose, mode, db=db)(gm, example_inputs)


def compile(model: nn.Module, target: Any = None, verbose: bool = False, mode: str | None = None,  # noqa: A001
            db: str | Path | None = None, **kwargs: Any) -> nn.Module:
    """``torch.compile(model, backend=SpaceFusionBackend(target, mode=mode, db=db), dynamic=False)``: returns
    the compiled module, with the backend (its per-graph reports) as ``.spacefusion``.  ``db``: a tuning
    database (``frontend.tune.tune_model``) whose best schedules the kernels are built from."""
    backend = SpaceFusionBackend(target, verbose, mode, db=db)
    kwargs.setdefault("dynamic", False)
    compiled = torch.compile(model, backend=backend, **kwargs)
    # on the wrapper itself: OptimizedModule's setattr would put it on ``model``, shared by every compile
    object.__setattr__(compiled, "spacefusion", backend)
    return compiled
