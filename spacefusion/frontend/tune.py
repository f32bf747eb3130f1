"""Tune every distinct fused subgraph of one or more models with the existing search (``search.tuner``).

One ``TuningDatabase`` serves all subgraphs and models: a subgraph whose SMG (hence tuning key) was tuned
before, in this model or another, is a cached best and costs nothing.  A ``tqdm`` bar counts subgraphs and
the total tuning time is printed at the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn
from tqdm import tqdm

from schedulers.barrier import Barrier, find_barrier, stages
from schedulers.hardware import CPU_STAND_IN, HardwareModel
from schedulers.schedule import Schedule
from search.database import TuningDatabase
from search.records import Runner
from search.tuner import TuneSummary, tune
from smg.ir import SMG
from spacefusion.frontend.backends import Kernel, _Cached
from spacefusion.frontend.errors import FrontendError
from spacefusion.frontend.records import Partition, Subgraph
from spacefusion.frontend.schedules import ScheduleFor, default_schedule


@dataclass(frozen=True)
class TunedSubgraph:
    label: str
    uses: int  # how many subgraphs (over all the partitions) share this SMG
    summary: TuneSummary


@dataclass(frozen=True)
class TuningReport:
    tuned: tuple[TunedSubgraph, ...]
    wall_s: float

    @property
    def cached(self) -> int:
        return sum(t.summary.from_cache for t in self.tuned)

    def schedule_for(self, fallback: ScheduleFor = default_schedule) -> ScheduleFor:
        """Each tuned SMG's best schedule (for ``LLVMBackend``/``CudaBackend``), ``fallback`` for others."""
        by_smg = {t.summary.best.smg.key: t.summary.best for t in self.tuned if t.summary.best is not None}

        def pick(smg: SMG) -> Schedule:
            return by_smg.get(smg.key) or fallback(smg)

        return pick

    def __str__(self) -> str:
        lines = [f"tuned {len(self.tuned)} distinct subgraphs ({self.cached} cached) in {self.wall_s:.1f} s"]
        for t in self.tuned:
            s = t.summary
            best = (f"{s.best_us:.1f} us" if s.best_us is not None
                    else s.pending if s.pending else "no valid candidate")
            lines.append(f"  {t.uses:3d} x {t.label}: {best}{' (cached)' if s.from_cache else ''}, "
                         f"{s.measured} measured in {s.wall_s:.1f} s")
        return "\n".join(lines)


def _distinct(partitions: Iterable[Partition]) -> list[tuple[Subgraph, int]]:
    seen: dict[str, list[Subgraph]] = {}
    for p in partitions:
        for s in p.subgraphs:
            seen.setdefault(s.key, []).append(s)
    return [(subs[0], len(subs)) for subs in seen.values()]


def _tunable(sub: Subgraph) -> list[tuple[str, SMG]]:
    """What is scheduled of ``sub``: its SMG, or where nothing of it can be cut into blocks, the kernels of
    its barrier (``schedulers.barrier``), each tuned on its own (the backends build each by its own key)."""
    barrier = find_barrier(sub.smg)
    if not isinstance(barrier, Barrier):
        return [(sub.label, sub.smg)]
    return [(f"{sub.label} [{g.name}]", g) for g, _ in stages(barrier)]


def tune_partitions(partitions: Partition | Iterable[Partition], runner: Runner | Callable[[SMG], Runner],
                    db: TuningDatabase | str | Path, *, hw: HardwareModel | None = None, target: str = "cuda:sm_90a",
                    trials: int = 32, batch: int = 16, workers: int = 2, seed: int = 0,
                    progress: bool = True) -> TuningReport:
    """Tune each distinct subgraph of ``partitions`` on ``runner`` (``trials`` candidates each), all in ``db``,
    filed under ``hw`` (None: ``search.tuner.tuning_hardware``: the GPU in hand's preset, ``CPU_STAND_IN`` for
    llvm, else the logged default).

    ``runner`` may be a function of the SMG giving its runner: an ``OfflineBatchRunner`` needs a folder
    of its own per subgraph, whose batch is measured on the GPU machine and picked up by the next call."""
    parts = [partitions] if isinstance(partitions, Partition) else list(partitions)
    own = not isinstance(db, TuningDatabase)
    database = TuningDatabase(db) if own else db
    t0 = time.perf_counter()
    tuned = []
    try:
        todo = _distinct(parts)
        bar = tqdm(todo, desc="tuning subgraphs", unit="subgraph", disable=not progress)
        for sub, uses in bar:
            bar.set_postfix_str(sub.label[:48])
            for label, smg in _tunable(sub):
                run = runner if hasattr(runner, "measure") else runner(smg)
                summary = tune(smg, run, hw=hw, target=target, db=database, trials=trials, batch=batch,
                               workers=workers, seed=seed, progress=False)
                tuned.append(TunedSubgraph(label, uses, summary))
        bar.close()
    finally:
        if own:
            database.close()
    report = TuningReport(tuple(tuned), time.perf_counter() - t0)
    if progress:
        print(f"total tuning time {report.wall_s:.1f} s for {len(tuned)} distinct subgraphs ({report.cached} cached)")
    return report


#: where ``tune_model`` measures: "gpu" (TVM and a GPU in this process, CUDA for sm_90a) or "llvm" (this CPU)
RUNNERS = {"gpu": "cuda:sm_90a", "llvm": "llvm"}


class _Collect(_Cached):
    """A kernel backend that builds nothing: the capture for tuning needs the partitions, not kernels."""

    name = "capture"

    def _compile(self, smg: SMG) -> Kernel:
        def never(inputs: dict) -> dict:
            raise FrontendError(f"{smg.name}: captured for tuning only")

        return never


def tune_model(model: nn.Module, *args: Any, db: str | Path, runner: str = "gpu", trials: int = 16,
               workers: int = 2, progress: bool = True, **kwargs: Any) -> TuningReport:
    """Capture ``model`` with TorchDynamo on the example inputs as ``spacefusion.compile`` would (nothing built;
    the model runs unfused once) and tune every distinct fused SMG into the database ``db``: ``trials``
    candidates each, measured on ``runner`` ("gpu": TVM and the GPU in this process; "llvm": this CPU).
    Then ``spacefusion.compile(model, db=db)`` builds each SMG's best; a database tuned before (this model or
    another sharing its SMGs) is reused, so a second call costs only the capture."""
    if runner not in RUNNERS:
        raise FrontendError(f"unknown tuning runner {runner!r}; known: {', '.join(RUNNERS)}")
    if trials < 1:
        raise FrontendError(f"trials must be at least 1, got {trials}")
    if runner == "gpu":
        from spacefusion.runners import LocalGPURunner, gpu_unavailable_reason

        reason = gpu_unavailable_reason()
        if reason is not None:
            raise FrontendError(f"runner 'gpu' needs a CUDA GPU here ({reason}); tune with runner='llvm'")
        from spacefusion.frontend.dynamo import device_hardware

        measure: Runner = LocalGPURunner()
        hw = device_hardware()  # records under this GPU's preset, which compile(..., db=) reads first
    else:
        from spacefusion.runners import LLVMRunner

        measure, hw = LLVMRunner(), CPU_STAND_IN  # the CPU has no model: its records are filed under the stand-in
    return tune_partitions(captured_partitions(model, *args, **kwargs), measure, db, hw=hw, target=RUNNERS[runner],
                           trials=trials, workers=workers, progress=progress)


def captured_partitions(model: nn.Module, *args: Any, kinds: Iterable[str] | None = None,
                        **kwargs: Any) -> list[Partition]:
    """The partitions of ``model``'s Dynamo graphs as ``spacefusion.compile`` makes them, nothing built (the
    model runs unfused once; meta tensors do); ``kinds`` keeps only the subgraphs of those kinds ("conv",
    "attention", ...), to tune a model's convolutions alone."""
    import dataclasses

    import torch

    from spacefusion.frontend.dynamo import SpaceFusionBackend

    capture = SpaceFusionBackend(_Collect(), export_only=True)
    with torch.no_grad():
        torch.compile(model, backend=capture, dynamic=False)(*args, **kwargs)
    skipped = [g.skipped for g in capture.graphs if g.skipped]
    if not capture.partitions:
        raise FrontendError(f"nothing to tune: no Dynamo graph of {type(model).__name__} was partitioned"
                            + (f" ({skipped[0]})" if skipped else ""))
    if kinds is None:
        return capture.partitions
    keep, found = set(kinds), {s.kind for p in capture.partitions for s in p.subgraphs}
    if not keep & found:
        raise FrontendError(f"no subgraph of kind {', '.join(sorted(keep))} in {type(model).__name__}; its kinds: "
                            f"{', '.join(sorted(found))}")
    return [dataclasses.replace(p, subgraphs=tuple(s for s in p.subgraphs if s.kind in keep))
            for p in capture.partitions]
