"""A schedule's decisions, taken from one SMG and made again on another of the same structure and other sizes.

A graph called with a new sequence length is the same graph with other dim sizes: its search space is the
same space of decisions (which dims are cut and by how much, the serial dim and its step, the memory levels,
the knobs), only their costs move.  ``decisions`` reads those choices off a schedule as plain JSON data, and
``remake`` runs the slicers again with them on the new graph (``make_schedule``: spatial, then temporal with
its update functions, so the plan is derived for the new sizes, never copied), then checks the block fits the
hardware.  A decision the new sizes cannot take (a step longer than the new serial dim, a fold the new sizes
refuse, a block over the shared memory) gives None, never a schedule the lowering would have to refuse.
"""

from __future__ import annotations

from typing import Any

from schedulers.errors import ScheduleError
from schedulers.hardware import HardwareError, HardwareModel
from schedulers.options import GROUPS, non_defaults
from schedulers.resources import check_resources
from schedulers.schedule import Schedule, make_schedule
from smg.fold import FoldError, fold_dims, foldable
from smg.ir import SMG


def decisions(s: Schedule, smg: SMG) -> dict[str, Any]:
    """The choices ``s`` made for ``smg`` (the graph it was searched for: ``s.smg`` is ``smg`` or one of its
    folds), as JSON data: ``remake`` makes them again on a graph of other sizes."""
    fold = None
    if s.smg.key != smg.key:
        fold = next((list(p) for p in foldable(smg) if fold_dims(smg, *p).key == s.smg.key), None)
        if fold is None:
            raise ValueError(f"decisions: the schedule's graph {s.smg.name!r} is neither {smg.name!r} nor a fold of it")
    return {"fold": fold, "tiles": [list(b) for b in s.block], "serial": s.serial, "step": s.step,
            "thread_dim": s.thread_dim, "tensor_cores": s.tensor_cores, "levels": [list(m) for m in s.memory],
            "knobs": {k: v for g in GROUPS for k, v in non_defaults(getattr(s, g)).items()}}


def remake(d: dict[str, Any], smg: SMG, hw: HardwareModel) -> Schedule | None:
    """``d`` (``decisions`` of a schedule of a graph like ``smg``) made on ``smg`` for ``hw``, or None where
    these sizes cannot take it.  A tile longer than its dim is shortened to the dim on CUDA cores (a tensor-core
    tile keeps its shape: the warp tile masks the rows past the end); the step is at most the serial dim."""
    g = smg
    if d["fold"] is not None:
        try:
            g = fold_dims(smg, *d["fold"])
        except FoldError:
            return None
    sizes = g.dim_sizes
    if d["serial"] not in sizes or any(dim not in sizes for dim, _ in d["tiles"]):
        return None
    tiles = {dim: (t if d["tensor_cores"] else min(t, sizes[dim])) for dim, t in d["tiles"]}
    step = min(int(d["step"]), sizes[d["serial"]])
    schedule = None
    for recompute in (False, True):  # a tile on a dim whose blocks recompute an intermediate needs the flag
        try:
            schedule = make_schedule(g, tiles, serial=d["serial"], step=step, thread_dim=d["thread_dim"],
                                     recompute=recompute, hw=hw, levels=dict(map(tuple, d["levels"])),
                                     tensor_cores=d["tensor_cores"], **d["knobs"])
            break
        except (ScheduleError, HardwareError):
            continue
    if schedule is None:
        return None
    try:
        check_resources(schedule, hw)
    except HardwareError:
        return None
    return schedule


__all__ = ["decisions", "remake"]
