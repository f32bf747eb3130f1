"""SMG partition: split a graph that can't be scheduled on chip into several kernels.

A fused schedule must hold its per-block state, streamed tiles and staged
inputs on chip (exact footprints from ``schedulers.traffic``).  Outputs that
keep the serial dim are written in a second pass; if that pass would
recompute a reduction (a GEMM) per step, the row is kept on chip instead
(one step), which may not fit.  When no schedule of the whole graph fits, the
graph is cut between user-level operators (``Op.group``): the longest prefix
of operators that fits becomes a kernel, the spaces crossing the cut are
materialised in device memory, and the rest is partitioned again.  Every
kernel is sliced afresh by the spatial and temporal slicers.
"""

from __future__ import annotations

from dataclasses import dataclass

from schedulers.errors import ScheduleError
from schedulers.hardware import HardwareModel
from schedulers.schedule import Schedule, make_schedule
from schedulers.traffic import on_chip
from smg.ir import SMG
from smg.subgraph import sub_smg


def budget_bytes(hw: HardwareModel) -> int:
    """On-chip bytes one block may hold: its shared memory plus its register file."""
    return hw.smem_per_block_bytes + 4 * hw.regs_per_block


@dataclass(frozen=True)
class Partition:
    """The kernels a graph was split into, in launch order, and why."""

    smg: SMG
    kernels: tuple[Schedule, ...]
    materialised: tuple[str, ...]
    reasons: tuple[str, ...]

    @property
    def fused(self) -> bool:
        return len(self.kernels) == 1

    def __str__(self) -> str:
        lines = [f"{self.smg.name}: {len(self.kernels)} kernel(s)"]
        for s in self.kernels:
            lines.append(f"  kernel {s.smg.name}: ops {', '.join(op.out for op in s.smg.ops)}; "
                         f"writes {', '.join(s.smg.outputs)}")
        if self.materialised:
            lines.append(f"  materialised in device memory: {', '.join(self.materialised)}")
        lines += [f"  why: {r}" for r in self.reasons]
        return "\n".join(lines)


def fit(smg: SMG, hw: HardwareModel, tiles: dict[str, int] | None = None, step: int = 32) -> Schedule | str:
    """A schedule of ``smg`` that fits ``hw`` on chip, or the reason none does."""
    sizes = smg.dim_sizes
    tiles = {d: min(t, sizes[d]) for d, t in (tiles or {}).items() if d in sizes}
    try:
        s = make_schedule(smg, _cuttable(smg, tiles), step=1, hw=hw)
        if s.plan.second_pass and any(smg.producer(n).reduce and s.serial in smg.producer(n).iter_dims
                                      for n in s.plan.streamed):
            steps = [sizes[s.serial]]  # the second pass would recompute a reduction: keep the row on chip
            why = f"its second pass would recompute {_recomputed(s)}, so the {s.serial} row stays on chip"
        else:
            steps = [min(step, sizes[s.serial])]
            why = ""
        s = make_schedule(smg, s.tiles, serial=s.serial, step=steps[0], thread_dim=s.thread_dim, hw=hw)
    except ScheduleError as e:
        return str(e)
    need = sum(b for _, b in on_chip(s))
    if need > budget_bytes(hw):
        return (f"{smg.name} needs {need / 1024:.1f} KiB on chip per block, {hw.name} has "
                f"{budget_bytes(hw) / 1024:.1f} KiB (shared memory + registers)" + (f"; {why}" if why else ""))
    return s


def _cuttable(smg: SMG, tiles: dict[str, int]) -> dict[str, int]:
    from schedulers.spatial import cuttable

    cut = set(cuttable(smg))
    return {d: t for d, t in tiles.items() if d in cut}


def _recomputed(s: Schedule) -> str:
    return ", ".join(n for n in s.plan.streamed if s.smg.producer(n).reduce)


def partition(smg: SMG, hw: HardwareModel, tiles: dict[str, int] | None = None, step: int = 32) -> Partition:
    """Schedule ``smg`` as one kernel if it fits ``hw``, else split it between operators."""
    whole = fit(smg, hw, tiles, step)
    if isinstance(whole, Schedule):
        return Partition(smg, (whole,), (), ())
    reasons = [f"not fused as one kernel: {whole}"]
    groups = list(smg.groups)
    ops_of = {g: [op for op in smg.ops if smg.group_of(op) == g] for g in groups}
    kernels: list[Schedule] = []
    i = 0
    while i < len(groups):
        best: tuple[int, Schedule] | None = None
        last_reason = ""
        for j in range(len(groups), i, -1):  # the longest prefix of operators that fits
            part = sub_smg(smg, [op for g in groups[i:j] for op in ops_of[g]], f"{smg.name}.k{len(kernels)}")
            got = fit(part, hw, tiles, step)
            if isinstance(got, Schedule):
                best = (j, got)
                break
            last_reason = got
        if best is None:
            raise ScheduleError(f"operator {groups[i]!r} of {smg.name!r} does not fit {hw.name} even alone: "
                                f"{last_reason}", code="partition.no_fit")
        j, s = best
        kernels.append(s)
        if j < len(groups):
            reasons.append(f"kernel {s.smg.name} = {', '.join(groups[i:j])}; cut before {groups[j]!r}")
        i = j
    produced = [o for s in kernels[:-1] for o in s.smg.outputs if o not in smg.outputs]
    return Partition(smg, tuple(kernels), tuple(produced), tuple(reasons))
