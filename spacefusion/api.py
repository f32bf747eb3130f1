"""The short Python API a research script or notebook calls.

    from spacefusion import workloads, schedule, build
    g = workloads.mha(2, 8, 197, 197, 64)
    s = schedule(g)                  # spatial + temporal slicers, update functions
    print(g, s)
    kern = build(s, "llvm")          # TVM -> CPU; kern(inputs) -> outputs
    art = build(s, "cuda:sm_90a")    # TVM -> CUDA source + launch metadata
    art.save("out/mha")
    check_numerics(g, evaluate(g, x), kern(x))  # (max abs error, None or why it is not close enough)
"""

from __future__ import annotations

from schedulers.interpreter import interpret
from schedulers.schedule import Schedule, make_schedule
from schedulers.traffic import traffic
from smg.ir import SMG
from smg.reference import check_numerics, evaluate, random_inputs


def schedule(smg: SMG, tiles: dict[str, int] | None = None, serial: str | None = None,
             step: int | None = None, **options) -> Schedule:
    """Slice ``smg`` spatially then temporally (``step``: default 32, or the serial dim if shorter);
    ``options`` (``thread_dim``, ``recompute``, ``hw``, ``lanes``, ``tensor_cores``, ``stages``, ``warps``)
    as in ``schedulers.schedule.make_schedule``.  ``tiles`` are positive ints (a float, bool, zero or
    negative tile is a ScheduleError naming the dim); ``hw`` is a HardwareModel or a preset name such as
    ``"h100"`` or ``"H200"`` (case-insensitive; an unknown one is a HardwareError listing the known)."""
    return make_schedule(smg, tiles=tiles, serial=serial, step=step, **options)


def build(s: Schedule, target: str = "llvm"):
    """Lower through TVM: a runnable CPU kernel for llvm, a CUDA artefact for cuda."""
    from spacefusion.lower.build import build_cuda, build_llvm, parse_target

    kind, arch = parse_target(target)
    return build_llvm(s) if kind == "llvm" else build_cuda(s, arch)


__all__ = ["build", "check_numerics", "evaluate", "interpret", "random_inputs", "schedule", "traffic"]
