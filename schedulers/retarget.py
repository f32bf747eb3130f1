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
        fold = _fold_path(smg, s.smg.key)
        if fold is None:
            raise ValueError(f"decisions: the schedule's graph {s.smg.name!r} is neither {smg.name!r} nor a fold of it")
    return {"fold": fold, "tiles": [list(b) for b in s.block], "serial": s.serial, "step": s.step,
            "thread_dim": s.thread_dim, "tensor_cores": s.tensor_cores, "levels": [list(m) for m in s.memory],
            "knobs": {k: v for g in GROUPS for k, v in non_defaults(getattr(s, g)).items()}}


#: the most folds one after another that ``decisions`` looks for (a GQA decode attention folds its unit batch
#: into the kv heads and the query group into its rows: two)
MAX_FOLDS = 3


def _fold_path(smg: SMG, key: str) -> list[list[str]] | None:
    """The folds (``fold_dims`` pairs, in order) that turn ``smg`` into the graph of content key ``key``, or
    None.  Breadth first, so the shortest sequence is found; a graph has few foldable pairs."""
    frontier: list[tuple[SMG, list[list[str]]]] = [(smg, [])]
    for _ in range(MAX_FOLDS):
        nxt = []
        for g, path in frontier:
            for pair in foldable(g):
                folded = fold_dims(g, *pair)
                if folded.key == key:
                    return path + [list(pair)]
                nxt.append((folded, path + [list(pair)]))
        frontier = nxt
    return None


def _folds(fold: Any) -> list[list[str]]:
    """A record's ``fold``: None, one pair (the form before sequences), or a sequence of pairs."""
    if not fold:
        return []
    return [list(fold)] if isinstance(fold[0], str) else [list(p) for p in fold]


def remake(d: dict[str, Any], smg: SMG, hw: HardwareModel) -> Schedule | None:
    """``d`` (``decisions`` of a schedule of a graph like ``smg``) made on ``smg`` for ``hw``, or None where
    these sizes cannot take it.  A tile longer than its dim is shortened to the dim on CUDA cores (a tensor-core
    tile keeps its shape: the warp tile masks the rows past the end); the step is at most the serial dim."""
    g = smg
    for pair in _folds(d["fold"]):
        try:
            g = fold_dims(g, *pair)
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
