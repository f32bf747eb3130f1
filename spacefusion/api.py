"""The public API a research script or notebook calls (``experiments/`` uses only this, ``spacefusion.tuning``,
``spacefusion.runtime`` and ``spacefusion.models``; tests/layer_rules.py holds the rule and its allow-list).

    from spacefusion.api import build, candidates, estimate, export, hardware, load, workloads
    g = workloads.mha(2, 8, 197, 197, 64)
    hw = hardware("h100")              # a preset by name; hardware() is this machine's GPU
    order = candidates(g, hw, head=8)  # the ranked order the tuner's first round measures
    print(estimate(order[0], hw))      # the analytical model's microseconds
    kern = build(order[0], "llvm")     # TVM -> CPU; kern(inputs) -> outputs
    export(order[0], "out/mha")        # TVM -> CUDA artefact folder (kernel.cu, kernel.json, smg.json)
    k = load("out/mha")                # the GPU runtime's kernel (no TVM needed where it runs)

Import-light: this module imports nothing at load time but typing; every name resolves on first use
(``_LAZY``), so a GPU-side script may import it where TVM, islpy and xgboost are absent, as long as it
touches only names whose modules are importable there. The functions below are thin: each delegates to the
one implementation it names.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from schedulers.hardware import HardwareModel
    from schedulers.schedule import Schedule
    from smg.ir import SMG

#: public name -> (module, attribute; None: the module itself)
_LAZY: dict[str, tuple[str, str | None]] = {
    # hardware models
    **{n: ("schedulers.hardware", n) for n in ("HardwareModel", "HardwareError", "H100", "H200", "CPU_STAND_IN",
                                              "get_hardware", "preset_of_device")},
    "device_hardware": ("spacefusion.frontend.dynamo", "device_hardware"),
    # graphs: the IR, the workload and pattern builders
    "SMG": ("smg.ir", "SMG"),
    "workloads": ("smg.workloads", None),
    "patterns": ("smg.patterns", None),
    "builders": ("spacefusion.frontend.builders", None),  # the frontend's pattern graphs (norm, gated_gemm, ...)
    "gated_gemm": ("spacefusion.frontend.builders", "gated_gemm"),
    # schedules
    "Schedule": ("schedulers.schedule", "Schedule"),
    "make_schedule": ("schedulers.schedule", "make_schedule"),
    "ScheduleError": ("schedulers.errors", "ScheduleError"),
    "non_defaults": ("schedulers.options", "non_defaults"),
    "warp_tile_summary": ("schedulers.printing", "warp_tile_summary"),  # a tensor-core schedule, described
    "model_pick": ("spacefusion.frontend.schedules", "model_pick"),
    "first_pick_for": ("spacefusion.frontend.dynamo", "first_pick_for"),
    "interpret": ("schedulers.interpreter", "interpret"),
    "traffic": ("schedulers.traffic", "traffic"),
    # backwards derived from a forward SMG (smg.autodiff), cut into kernels with the derivation printed
    "derive_backward": ("smg.autodiff", "derive_backward"),
    "backward_passes": ("schedulers.passes", "backward_passes"),
    # numerics: the reference, the tolerance rule, the artefact's reference graph file
    **{n: ("smg.reference", n) for n in ("evaluate", "check_numerics", "random_inputs")},
    "tolerance": ("smg.tolerance", None),
    **{n: ("smg.reference_torch", n) for n in ("SMG_FILE", "save_smg", "load_smg", "evaluate_torch",
                                               "input_scales")},
    # building
    "COMPILE_FLAGS": ("spacefusion.lower.build", "COMPILE_FLAGS"),
    # the torch frontend: capture, partition, fused models, torch.compile's backend, model export
    **{n: ("spacefusion.frontend", n) for n in ("capture", "partition", "fuse", "CudaBackend", "Partition",
                                                "Subgraph")},
    **{n: ("spacefusion.frontend.dynamo", n) for n in ("SpaceFusionBackend", "export_cuda", "export_cuda_training",
                                                       "kernel_cache")},
    "measure": ("spacefusion.frontend.measure", None),  # the measured choice: WARMUP, SAMPLES, MARGIN, Choice
    "FusedKernel": ("spacefusion.frontend.fused", "FusedKernel"),
    "recorded_hardware": ("spacefusion.frontend.backends", "recorded_hardware"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'spacefusion.api' has no attribute {name!r}")
    module, attr = _LAZY[name]
    mod = importlib.import_module(module)
    value = mod if attr is None else getattr(mod, attr)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


def hardware(name: str | HardwareModel | None = None) -> HardwareModel:
    """A hardware model: a preset by name (``"h100"``, ``"H200"``, case-insensitive; an unknown one is a
    ``HardwareError`` listing the known), a ``HardwareModel`` as is, or None for this machine's GPU
    (``device_hardware``: its preset, the H100 where none matches)."""
    if name is None:
        from spacefusion.frontend.dynamo import device_hardware

        return device_hardware()
    from schedulers.hardware import get_hardware

    return get_hardware(name)


def schedule(smg: SMG, tiles: dict[str, int] | None = None, serial: str | None = None,
             step: int | None = None, **options: Any) -> Schedule:
    """Slice ``smg`` spatially then temporally (``step``: default 32, or the serial dim if shorter);
    ``options`` (``thread_dim``, ``recompute``, ``hw``, ``lanes``, ``tensor_cores``, ``stages``, ``warps``)
    as in ``schedulers.schedule.make_schedule``.  ``tiles`` are positive ints (a float, bool, zero or
    negative tile is a ScheduleError naming the dim); ``hw`` is a HardwareModel or a preset name such as
    ``"h100"`` or ``"H200"`` (case-insensitive; an unknown one is a HardwareError listing the known)."""
    from schedulers.schedule import make_schedule

    return make_schedule(smg, tiles=tiles, serial=serial, step=step, **options)


def candidates(graph: SMG, hw: HardwareModel | None = None, head: int | None = None) -> list[Schedule]:
    """``graph``'s candidate schedules in the order the tuner's first round measures them (the analytical
    model's estimates for ``hw``, ties broken by the committed prior; None: this GPU's preset); with ``head``
    (1 or more), the first ``head`` of that same order, computed faster (candidates that cannot reach the head
    are not enumerated). A new list each call; the schedules are immutable
    (``spacefusion.frontend.schedules.ranked``)."""
    from spacefusion.frontend.schedules import ranked

    order = ranked(graph, hw, head)
    return order if head is None else order[:head]


def estimate(s: Schedule, hw: HardwareModel) -> float:
    """The analytical cost model's estimate of ``s`` on ``hw``, in microseconds, launch included
    (``search.cost.estimate_us``); the number ``candidates`` orders by."""
    from search.cost import estimate_us

    return estimate_us(s, hw)


def first_pick(graph: SMG, hw: HardwareModel | None = None) -> Schedule:
    """The schedule a build uses with nothing measured: the analytical model's best of ``graph`` for ``hw``
    (None: this GPU's preset), the slicers' default where no candidate fits (correct, not fast)
    (``spacefusion.frontend.dynamo.first_pick``)."""
    from spacefusion.frontend.dynamo import first_pick as pick

    return pick(graph, hw)


def save_schedule(s: Schedule, path: str | Path) -> Path:
    """Write ``s`` as its canonical JSON (``Schedule.to_json``, graph included) to ``path``; returns it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(s.to_json())
    return path


def load_schedule(path: str | Path) -> Schedule:
    """The schedule ``save_schedule`` wrote (``Schedule.from_json``): same content key, same kernel."""
    from schedulers.schedule import Schedule

    return Schedule.from_json(Path(path).read_text())


def build(s: Schedule, target: str = "llvm", symbolic: Any = None) -> Any:
    """Lower through TVM: a runnable CPU kernel for ``"llvm"``, a CUDA artefact (``KernelArtefact``-like:
    source, launch metadata, ``save``) for ``"cuda"`` or ``"cuda:sm_XX"``.  ``symbolic``: a
    ``lower.symbolic.SymbolicDim``, whose dim the kernel takes as a run-time size within its range."""
    from spacefusion.lower.build import build_cuda, build_llvm, parse_target

    kind, arch = parse_target(target)
    if symbolic is not None:
        from spacefusion.lower.build_symbolic import build_llvm_symbolic

        return build_llvm_symbolic(s, symbolic) if kind == "llvm" else build_cuda(s, arch, symbolic)
    return build_llvm(s) if kind == "llvm" else build_cuda(s, arch)


def export(s: Schedule, folder: str | Path, target: str = "cuda:sm_90a", compile_cubin: bool = True) -> Path:
    """Build ``s`` for a CUDA ``target`` and write the artefact folder that ``load`` opens on the GPU machine:
    ``kernel.cu`` and ``kernel.json`` (``KernelArtefact.save``; ``kernel.cubin`` too where nvcc is and
    ``compile_cubin``) and the graph's ``smg.json`` (``save_smg``), the runtime's reference. Returns the folder."""
    from smg.reference_torch import save_smg
    from spacefusion.lower.build import parse_target

    if parse_target(target)[0] != "cuda":
        raise ValueError(f"export writes CUDA artefacts; target {target!r} is not cuda")
    out = build(s, target).save(folder, compile_cubin=compile_cubin)
    save_smg(out, s.smg)
    return out


def load(folder: str | Path, **options: Any) -> Any:
    """The runtime's kernel of an artefact folder (``spacefusion.runtime.load_kernel``: needs torch and a GPU,
    no TVM); ``options`` as there."""
    from spacefusion.runtime import load_kernel

    return load_kernel(folder, **options)


__all__ = sorted([*_LAZY, "build", "candidates", "estimate", "export", "first_pick", "hardware", "load",
                  "load_schedule", "save_schedule", "schedule"])
