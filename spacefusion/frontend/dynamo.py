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

Kernels are built for concrete sizes.  A graph Dynamo traced with symbolic sizes (``dynamic=True``, or
torch.compile's default after a second input shape: automatic dynamic shapes) is specialised per set of
sizes it is called with (``compiled.PerShape``), so every call stays fused and Dynamo keeps one graph.
Weights are baked when a graph is compiled and guarded on every call (``weights.Stamp``: identity,
``Tensor._version``, address and writes through ``.data``); a change derives the constants again, so an
in-place weight update, ``load_state_dict`` or another model instance never runs on stale weights.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from spacefusion.frontend.backends import get_backend
from spacefusion.frontend.compiled import (
    CompiledGraph,
    GraphReport,
    PerShape,
    parameter_names,
)
from spacefusion.frontend.errors import FrontendError
from spacefusion.frontend.records import Coverage, Partition
from spacefusion.frontend.seen import graph_signature, model_signature, seen
from spacefusion.frontend.specialize import symbolic_graph


@dataclass
class SpaceFusionBackend:
    """A TorchDynamo backend fusing every captured graph into SMG kernels on ``target``
    (``kernel_backend``): "cuda", "llvm" (TVM's CPU build), "reference" (the SMGs evaluated in numpy: a
    check of the mapping), or a backend object (``frontend.backends``); None picks "cuda" for inputs on
    the GPU, else "llvm".  ``graphs`` keeps one report per graph it compiled; ``str(backend)`` prints them
    with the graph breaks between them.

    ``measure``: whether each compiled graph with fused kernels times its fused path against torch's own graph
    on its first calls after a build and keeps the faster for good (``measure.Choice``: a compiled graph is
    never slower than torch running it).  None (the default) measures on the "cuda" target and not on the CPU
    targets: "reference" and "llvm" are correctness targets (the reference kernels are numpy; the llvm
    kernels run GPU-shaped schedules scalar, so torch would be kept nearly everywhere and the tests that
    check the kernels ran would check torch), and research that wants the fused kernels whatever their
    speed passes False.  ``timer``: the measurement's clock (``measure.Timer``; None: CUDA events on the
    GPU, ``time.perf_counter`` on the CPU), a test's numbers in tests."""

    target: Any = None
    verbose: bool = False
    mode: str | None = None
    export_only: bool = False  # build the kernels and report, but return the graph unfused (``export_cuda``)
    db: str | Path | None = None  # a tuning database (``tune_model``): each SMG's best, the first pick where none
    graphs: list[GraphReport] = field(default_factory=list)
    measure: bool | None = None
    timer: Callable[[str, Callable[[], Any], bool], tuple[Any, float]] | None = None

    @property
    def measuring(self) -> bool:
        """Whether compiled graphs measure their fused path against torch's (``measure``; None: on "cuda")."""
        if self.measure is not None:
            return bool(self.measure)
        return getattr(self.kernels, "name", None) == "cuda"

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
        self.compiled: list[CompiledGraph] = []  # what each fused graph runs (its FusedModel, its replay)
        if isinstance(self.target, str) and self.target not in TARGETS:
            raise FrontendError(f"unknown spacefusion target {self.target!r}; known: {', '.join(TARGETS)}, "
                                f"or a kernel backend object")
        self._kernels: Any = None
        self._seen = len(_break_reasons())
        #: the model's ``seen.model_signature`` where ``spacefusion.compile`` knows the model: marked with
        #: each graph compiled, so the next compile of it does not start the export workers early
        self.model_signature: str | None = None
        if self.db is not None:  # a database that cannot serve is an error now, not inside Dynamo's call
            check_database(self.db, self.target)
        if self.measure is not None and not isinstance(self.measure, bool):
            raise FrontendError(f"measure must be True, False or None (None: on for the 'cuda' target), "
                                f"not {self.measure!r}")
        if self.timer is not None and not callable(self.timer):
            raise FrontendError(f"timer must be callable as timer(path, call, cuda) -> (result, seconds), "
                                f"not {self.timer!r}")

    def built(self, signatures: Sequence[str]) -> None:
        """A graph of ``signatures`` compiled: the kernel cache records it (``seen.mark``)."""
        if signatures and hasattr(self._kernels, "mark_seen"):
            self._kernels.mark_seen(signatures)

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
        if not any(r() is self for r in _BACKENDS):
            _BACKENDS.append(weakref.ref(self))
        try:
            return self._compile_graph(gm, example_inputs, mode)
        finally:  # a symbolic graph is reported per set of sizes, as each is built (``PerShape``)
            if self.graphs and (self.graphs[-1].partition is not None or self.graphs[-1].skipped):
                log.info("%s", self.graphs[-1])

    def _compile_graph(self, gm: fx.GraphModule, example_inputs: list[Any], mode: str | None) -> Callable[..., Any]:
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
        kernels = self.kernels  # a target that cannot run here (cuda without a GPU) is an error, not a fallback
        # a training step: aot_autograd's forward and backward, each fused (export_only: each stage's kernels
        # written on its first call, then torch runs the stage: ``export_cuda_training``)
        if any(isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled() for x in example_inputs):
            from spacefusion.frontend.training import compile_training, first_line

            try:
                return compile_training(self, gm, example_inputs, report, parameter_names(gm))
            except Exception as exc:  # aot_autograd could not trace it: torch runs Dynamo's graph, reported
                report.skipped = f"aot_autograd failed on this training graph: {type(exc).__name__}: {first_line(exc)}"
                return gm.forward
        signatures: list[str] = []
        if hasattr(kernels, "warm_up"):  # export workers importing while this graph is partitioned
            signatures = [graph_signature(gm, example_inputs)] + [s for s in (self.model_signature,) if s]
            kernels.warm_up(signatures[0])
        names = parameter_names(gm)  # now: Dynamo drops the placeholders' sources once this returns
        if symbolic_graph(gm, example_inputs):
            return PerShape(self, gm, list(example_inputs), report, names, signatures)
        try:
            compiled = CompiledGraph(self, gm, list(example_inputs), report, names)
            self.built(signatures)
            self.compiled.append(compiled)
            return gm.forward if self.export_only or compiled.plain else compiled
        except FrontendError as exc:
            report.skipped = str(exc)
        except Exception as exc:  # a graph we could not fuse runs as Dynamo captured it, reported
            report.skipped = f"{type(exc).__name__}: {exc}"
        return gm.forward

    @property
    def partitions(self) -> list[Partition]:
        return [p for g in self.graphs for p in g.partitions()]

    def coverage(self) -> Coverage:
        """The matmuls and convolutions of every graph, counted by what runs per call (``GraphReport.coverage``:
        a graph whose measured choice kept torch's graph counts its fused ops as torch's, ``kept.torch``)."""
        return sum((g.coverage() for g in self.graphs), start=Coverage((), ()))

    def graph_breaks(self) -> list[str]:
        """Dynamo's reasons for the graph breaks that ended this backend's graphs."""
        return [g.ended_by for g in self.graphs if g.ended_by]

    def __str__(self) -> str:
        breaks = len(self.graph_breaks())
        # the kernels as made (a report never makes them: a "cuda" target without a GPU would raise here)
        name = getattr(self._kernels, "name", self.target) if self.graphs else "no graph yet"
        ranked_for = getattr(self._kernels, "hardware", None) if self.graphs else None
        if ranked_for is not None:  # which machine's numbers ranked the kernels, and why (a default said so)
            name += f", ranked for the {ranked_for}"
        head = f"spacefusion ({name}): {len(self.graphs)} Dynamo graphs"
        lines = [head + (f", {breaks} graph breaks (torch runs the code at each)" if breaks else "")]
        lines += [str(g) for g in self.graphs]
        return "\n".join(lines)


#: each graph's report as it is compiled (and each new set of sizes of a symbolic graph): ``logging`` at INFO
log = logging.getLogger("spacefusion")
#: the backends that compiled a graph in this process, held weakly (each lives as long as its compiled graphs):
#: ``torch.compile(model, backend="spacefusion")`` keeps no handle on the backend it makes
_BACKENDS: list[weakref.ref] = []


def report() -> str:
    """What every spacefusion backend of this process fused, per Dynamo graph (and per set of sizes), what
    torch runs and why, and the graph breaks: ``print(spacefusion.report())`` after calling a model compiled
    with ``torch.compile(model, backend="spacefusion")``, which gives no handle on its backend
    (``spacefusion.compile`` keeps it as ``.spacefusion``).  The same reports go to the ``spacefusion``
    logger at INFO as each graph is compiled."""
    live = [b for b in (r() for r in _BACKENDS) if b is not None and b.graphs]
    _BACKENDS[:] = [weakref.ref(b) for b in (r() for r in _BACKENDS) if b is not None]
    if not live:
        return "spacefusion: no graph compiled in this process yet"
    return "\n\n".join(str(b) for b in live)


#: the targets named by a string
TARGETS = ("cuda", "llvm", "reference")
#: torch.compile's modes: every one but the last replays each graph as a CUDA graph on the GPU (kernels
#: are the first picks in each: tuning is ``spacefusion tune`` / ``frontend.tune``, not a compile mode)
MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def kernel_cache(hw: Any = None) -> Path:
    """Where the "cuda" target keeps the artefacts it builds (``SPACEFUSION_CACHE``, else ~/.cache): with
    ``hw`` (a ``HardwareModel``), the folder of the kernels ranked for it, ``kernels/<preset>``.  Each machine
    has its own: a first pick, a split and a layout are decided for one machine's numbers, and the artefacts
    (and ``split.json``, ``layouts.json``, the ``seen`` marks) are named by the SMG alone, so an H100's would
    otherwise be served to an H200."""
    root = Path(os.environ.get("SPACEFUSION_CACHE", Path.home() / ".cache" / "spacefusion")) / "kernels"
    if hw is None:
        return root
    from spacefusion.frontend.machine import hardware_dir

    return root / hardware_dir(hw)


def writable_kernel_cache(hw: Any = None) -> Path:
    """``kernel_cache(hw)``, made and checked writable now: FrontendError naming the folder and
    ``SPACEFUSION_CACHE`` otherwise (a read-only HOME), before anything is traced or built rather than as a
    PermissionError inside the first export."""
    folder = kernel_cache(hw)
    probe = folder / f".write-test-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise FrontendError(f"the kernel cache {folder} cannot be written ({exc.strerror or exc}): the 'cuda' target "
                            f"builds its kernels there; set SPACEFUSION_CACHE to a writable folder") from None
    return folder


def kernel_backend(target: Any, db: str | Path | None = None) -> Any:
    """The kernel backend of a target: "reference", "llvm", "cuda" (TVM builds each SMG's first pick, the
    analytical model's best schedule for this GPU's preset, ``device_hardware``, into its folder of
    ``kernel_cache``, and the GPU runtime launches it: TVM, nvcc and the GPU on one machine), or a backend
    object.  With ``db`` (a tuning database that ``frontend.tune.tune_model`` filled) "llvm" and "cuda" build
    each SMG's best measured schedule there ("cuda": measured on this GPU's preset, else on an H100; "llvm":
    filed under ``CPU_STAND_IN``, the CPU having no model)."""
    if target == "llvm" and db is not None:
        from schedulers.hardware import CPU_STAND_IN
        from spacefusion.frontend.backends import LLVMBackend
        from spacefusion.frontend.schedules import default_schedule

        return LLVMBackend(schedule_for=tuned(db, "llvm", default_schedule, (CPU_STAND_IN.name,)))
    if target != "cuda":
        return get_backend(target)
    if not torch.cuda.is_available():
        raise FrontendError("target 'cuda' needs a CUDA GPU (torch.cuda.is_available() is False); use 'llvm'")
    from spacefusion.frontend.backends import CudaBackend
    from spacefusion.frontend.machine import ranking_hardware

    choice = ranking_hardware()
    folder = writable_kernel_cache(choice.model)
    if db is None:
        return CudaBackend(folder, schedule_for=first_pick_for(choice.model), build_missing=True, hardware=choice)
    machines = tuple(dict.fromkeys((choice.model.name, "H100")))
    return CudaBackend(folder, schedule_for=tuned(db, "cuda:sm_90a", first_pick_for(choice.model), machines),
                       build_missing=True, by_schedule=True, hardware=choice)


def device_hardware() -> Any:
    """The hardware preset of this machine's GPU (``machine.ranking_hardware``): what its first picks are ranked
    for, the key its tunes file records under, and whose records a tuned build reads first (an H200's
    measurements are not an H100's); ``DEFAULT_GPU`` (the H100), logged, where the device matches no preset
    or there is none."""
    from spacefusion.frontend.machine import ranking_hardware

    return ranking_hardware().model


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


def first_pick(smg: Any, hw: Any = None) -> Any:
    """The analytical model's best schedule of ``smg`` for ``hw`` (``schedules.model_pick``; None: this GPU's
    preset, else the reported default, ``machine.ranking_hardware``); the slicers' default where no candidate
    fits (a correct kernel, not a fast one)."""
    from spacefusion.frontend.schedules import default_schedule, model_pick

    try:
        return model_pick(smg, hw)[0]
    except Exception as exc:  # no candidate fits, or the ranking broke: said, not silent (issue 56's bf16)
        log.warning("%s: no ranked schedule (%s: %s); the slicers' default (CUDA cores) is built",
                    getattr(smg, "name", smg), type(exc).__name__, str(exc)[:300])
        return default_schedule(smg)


def first_pick_for(hw: Any) -> Callable[[Any], Any]:
    """``first_pick`` ranked for ``hw``: a ``functools.partial``, so the export workers receive it pickled."""
    import functools

    return functools.partial(first_pick, hw=hw)


def _export_backend(folder: str | Path, db: str | Path | None, hardware: Any) -> SpaceFusionBackend:
    """The export-only backend of ``export_cuda`` and ``export_cuda_training``: first picks (or ``db``'s
    best) ranked for ``hardware``, each SMG's CUDA artefact written into ``folder``, nothing loaded."""
    from spacefusion.frontend.backends import CudaBackend
    from spacefusion.frontend.machine import ranking_hardware

    names = [hardware] if hardware is None or isinstance(hardware, str) or not isinstance(hardware, Sequence) \
        else list(hardware)
    if not names:
        raise FrontendError("export_cuda: hardware names no machine (give a preset's name, or None for this GPU)")
    choice = ranking_hardware(names[0])
    machines = tuple(dict.fromkeys([choice.model.name, *(n if isinstance(n, str) else n.name for n in names[1:])]))
    if hardware is None:  # the GPU in hand's records first, then the H100's (as ``kernel_backend`` reads them)
        machines = tuple(dict.fromkeys((*machines, "H100")))
    pick = first_pick_for(choice.model)
    if db is not None:
        pick = tuned(db, "cuda:sm_90a", pick, machines)
    return SpaceFusionBackend(CudaBackend(folder, schedule_for=pick, build_missing=True, load=False, hardware=choice),
                              export_only=True)


def export_cuda(model: nn.Module, folder: str | Path, *args: Any, db: str | Path | None = None,
                hardware: Any = None, **kwargs: Any) -> SpaceFusionBackend:
    """Capture ``model`` on the example inputs (meta tensors do: nothing runs) and write the CUDA artefact
    of every fused SMG's first pick into ``folder``, where TVM is and no GPU: on the GPU machine
    ``spacefusion.compile(model, target=CudaBackend(folder))`` then loads them with no TVM there (the SMG
    content keys name the artefacts).  Returns the backend, whose report says what was fused and for which
    machine.

    ``hardware``: the machine the first picks (and splits and layouts) are ranked for, a preset's name or a
    ``HardwareModel``, or a sequence of names: the first ranks, and with ``db`` each SMG's best schedule is
    the one measured on the first of them with a record of it.  None: the GPU in hand's preset, else
    ``DEFAULT_GPU`` (the H100), which is reported: in the report, in ``folder/hardware.json`` and each
    kernel's ``timing.json``, and in a log line."""
    backend = _export_backend(folder, db, hardware)
    with torch.no_grad():
        torch.compile(model, backend=backend, dynamic=False)(*args, **kwargs)
    return backend


def export_cuda_training(model: nn.Module, folder: str | Path, loss: Callable[[Any], torch.Tensor], *args: Any,
                         db: str | Path | None = None, hardware: Any = None, **kwargs: Any) -> SpaceFusionBackend:
    """``export_cuda`` for a training step: ``loss(model(*args, **kwargs)).backward()`` once with grad on, so
    aot_autograd splits each Dynamo graph and each stage (``training.Stage``) writes the CUDA artefacts of its
    fused SMGs on its first call, then runs as torch (meta tensors do: nothing is launched).  On the GPU
    machine ``torch.compile(model, backend=SpaceFusionBackend(CudaBackend(folder)))`` loads them by content
    key; an SMG the GPU's graph has and this capture had not (the GPU's attention ops differ from the
    capturing device's) has no artefact there and is left to torch, reported.  Returns the backend."""
    backend = _export_backend(folder, db, hardware)
    with torch.enable_grad():
        loss(torch.compile(model, backend=backend, dynamic=False)(*args, **kwargs)).backward()
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
    measure = opts.pop("measure", None)
    if opts:
        raise FrontendError(f"unknown spacefusion backend options {sorted(opts)}; known: target, verbose, db, "
                            f"measure")
    return SpaceFusionBackend(target, verbose, mode, db=db, measure=measure)(gm, example_inputs)


def compile(model: nn.Module, target: Any = None, verbose: bool = False, mode: str | None = None,  # noqa: A001
            db: str | Path | None = None, measure: bool | None = None, **kwargs: Any) -> nn.Module:
    """``torch.compile(model, backend=SpaceFusionBackend(target, mode=mode, db=db, measure=measure), **kwargs)``:
    returns the compiled module, with the backend (its per-graph reports) as ``.spacefusion``.  ``db``: a tuning
    database (``frontend.tune.tune_model``) whose best schedules the kernels are built from.  ``measure``: each
    graph's fused path timed against torch's on its first calls, the faster kept (``SpaceFusionBackend``; None:
    on for "cuda", off for the CPU targets, which are correctness targets).  Dynamo's own
    defaults hold (``dynamic`` unset: a second input shape recompiles with symbolic sizes, which the backend
    specialises per shape), so a loop over shapes never reaches Dynamo's recompile limit."""
    backend = SpaceFusionBackend(target, verbose, mode, db=db, measure=measure)
    if target in (None, "cuda") and torch.cuda.is_available() and importlib.util.find_spec("tvm") is not None:
        from spacefusion.frontend.parallel_build import start_pool

        backend.model_signature = model_signature(model)
        from spacefusion.frontend.machine import ranking_hardware

        if db is not None or not seen(writable_kernel_cache(ranking_hardware().model), backend.model_signature):
            start_pool()  # the export workers import TVM while Dynamo traces the first call (as Inductor's do)
    compiled = torch.compile(model, backend=backend, **kwargs)
    # on the wrapper itself: OptimizedModule's setattr would put it on ``model``, shared by every compile
    object.__setattr__(compiled, "spacefusion", backend)
    return compiled
