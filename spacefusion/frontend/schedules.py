"""Which schedule a subgraph's kernel is built from: a tuned best from a database, else the slicers' default."""

from __future__ import annotations

from collections.abc import Callable

from schedulers.hardware import H100, HardwareModel
from schedulers.schedule import Schedule, make_schedule, pick_serial
from schedulers.spatial import analyse_spatial
from smg.ir import SMG

#: the serial step of a default schedule (capped at the serial dim's size)
DEFAULT_STEP = 32

ScheduleFor = Callable[[SMG], Schedule]


def default_schedule(smg: SMG) -> Schedule:
    """``make_schedule``'s defaults (64 threads along the output's innermost cut dim, the serial dim the
    slicer picks) with a step no longer than that dim: a correct kernel for any shape, not a fast one."""
    serial = pick_serial(smg, analyse_spatial(smg))
    return make_schedule(smg, serial=serial, step=min(DEFAULT_STEP, smg.dim_sizes[serial]))


def from_database(db, hw: HardwareModel = H100, target: str = "llvm",
                  fallback: ScheduleFor = default_schedule) -> ScheduleFor:
    """Schedules from a ``search.database.TuningDatabase``'s best record of each SMG (as ``spacefusion tune``
    stored it for ``hw`` and ``target``), ``fallback`` for SMGs it has not measured."""
    from search.database import tuning_key
    from spacefusion.lower.build import COMPILE_FLAGS

    def pick(smg: SMG) -> Schedule:
        best = db.best(tuning_key(smg, hw, target, COMPILE_FLAGS))
        return best[0] if best is not None else fallback(smg)

    return pick
