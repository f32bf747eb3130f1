"""Tune every distinct fused subgraph of one or more models with the existing search (``search.tuner``).

One ``TuningDatabase`` serves all subgraphs and models: a subgraph whose SMG (hence tuning key) was tuned
before, in this model or another, is a cached best and costs nothing.  A ``tqdm`` bar counts subgraphs and
the total tuning time is printed at the end.
"""

from __future__ import annotations

import threading
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
                    progress: bool = True, jobs: int | None = None) -> TuningReport:
    """Tune each distinct subgraph of ``partitions`` on ``runner`` (``trials`` candidates each), all in ``db``,
    filed under ``hw`` (None: ``search.tuner.tuning_hardware``: the GPU in hand's preset, ``CPU_STAND_IN`` for
    llvm, else the logged default).

    ``jobs`` SMGs are tuned at once, each in a thread with its own connection to ``db`` (None: as many as the
    runner has workers, ``runner.parallelism`` once connected, else 1).  Why: between its batches a tune ranks,
    refits and builds, and a runner with several GPUs would idle through that; SMGs tuned side by side keep
    every worker busy, and their candidates share the runner's one queue.  The database's claims keep them
    apart as they keep apart tunes of several processes; the report lists the SMGs in their order either way.

    ``runner`` may be a function of the SMG giving its runner: an ``OfflineBatchRunner`` needs a folder
    of its own per subgraph, whose batch is measured on the GPU machine and picked up by the next call."""
    parts = [partitions] if isinstance(partitions, Partition) else list(partitions)
    own = not isinstance(db, TuningDatabase)
    database = TuningDatabase(db) if own else db
    t0 = time.perf_counter()
    if jobs is None:
        jobs = _parallelism(runner)
    if jobs < 1:
        raise FrontendError(f"jobs must be at least 1, got {jobs}")
    try:
        todo: list[_Item] = [(label, smg, uses) for sub, uses in _distinct(parts) for label, smg in _tunable(sub)]
        bar = tqdm(total=len(todo), desc="tuning subgraphs", unit="subgraph", disable=not progress)

        def one(item: _Item, on: TuningDatabase) -> TunedSubgraph:
            label, smg, uses = item
            run = runner if hasattr(runner, "measure") else runner(smg)  # type: ignore[operator]
            summary = tune(smg, run, hw=hw, target=target, db=on, trials=trials, batch=batch, workers=workers,
                           seed=seed, progress=False)
            bar.set_postfix_str(label[:48])
            bar.update(1)
            return TunedSubgraph(label, uses, summary)

        if jobs == 1 or len(todo) < 2:
            tuned = [one(item, database) for item in todo]
        else:
            tuned = _side_by_side(todo, one, database, jobs)
        bar.close()
    finally:
        if own:
            database.close()
    report = TuningReport(tuple(tuned), time.perf_counter() - t0)
    if progress:
        print(f"total tuning time {report.wall_s:.1f} s for {len(tuned)} distinct subgraphs ({report.cached} cached)")
    return report


def _parallelism(runner: object) -> int:
    """How many candidates ``runner`` measures at once: a pool's workers (started here, so the count is known
    before the first tune), 1 for anything else."""
    connect = getattr(runner, "connect", None)
    if not hasattr(runner, "parallelism") or not callable(connect):
        return 1
    connect()
    return max(1, int(getattr(runner, "parallelism", 1) or 1))


_Item = tuple[str, SMG, int]  # (label, SMG, uses)


def _side_by_side(todo: list[_Item], one: Callable[[_Item, TuningDatabase], TunedSubgraph], database: TuningDatabase,
                  jobs: int) -> list[TunedSubgraph]:
    """``one`` over ``todo`` in ``jobs`` threads, each tune with a connection of its own to ``database``'s file
    (an SQLite connection belongs to the thread that made it); the results in ``todo``'s order.  The first
    failure is raised once the tunes already running have finished (their records are kept), and no new one
    starts after it."""
    from concurrent.futures import ThreadPoolExecutor

    failed = threading.Event()

    def run(item: _Item) -> TunedSubgraph | None:
        if failed.is_set():
            return None
        try:
            with TuningDatabase(database.path, readonly=database.readonly, lock_wait_s=database.lock_wait_s) as on:
                return one(item, on)
        except BaseException:
            failed.set()
            raise

    with ThreadPoolExecutor(max_workers=min(jobs, len(todo)), thread_name_prefix="sf-tune") as ex:
        futures = [ex.submit(run, item) for item in todo]
    return [r for r in (f.result() for f in futures) if r is not None]


#: where ``tune_model`` measures: "gpu" (TVM and a GPU in this process, CUDA for sm_90a) or "llvm" (this CPU)
RUNNERS = {"gpu": "cuda:sm_90a", "llvm": "llvm"}


class _Collect(_Cached):
    """A kernel backend that builds nothing: the capture for tuning needs the partitions, not kernels."""

    name = "capture"

    def _compile(self, smg: SMG) -> Kernel:
        def never(inputs: dict) -> dict:
            raise FrontendError(f"{smg.name}: captured for tuning only")

        return never


def tune_model(model: nn.Module, *args: Any, db: str | Path, runner: str | Runner = "gpu", trials: int = 16,
               workers: int | None = None, progress: bool = True, gpus: int | None = None, jobs: int | None = None,
               target: str | None = None, hw: HardwareModel | None = None, **kwargs: Any) -> TuningReport:
    """Capture ``model`` with TorchDynamo on the example inputs as ``spacefusion.compile`` would (nothing built;
    the model runs unfused once) and tune every distinct fused SMG into the database ``db``: ``trials``
    candidates each, measured on ``runner``: "gpu" (TVM here; every visible GPU of this host at once, one worker
    each, or ``gpus`` of them: ``runners.gpu_runner``), "llvm" (this CPU), or a runner of your own (a
    ``RayRunner`` on a cluster, with the ``target`` and ``hw`` its records are for; default CUDA for sm_90a under
    ``search.tuner.tuning_hardware``'s preset).  ``jobs`` SMGs are tuned at once (``tune_partitions``: by default
    as many as the runner has workers); ``workers`` processes build CUDA candidates (default: every CPU core).
    Then ``spacefusion.compile(model, db=db)`` builds each SMG's best; a database tuned before (this model or
    another sharing its SMGs) is reused, so a second call costs only the capture."""
    if isinstance(runner, str) and runner not in RUNNERS:
        raise FrontendError(f"unknown tuning runner {runner!r}; known: {', '.join(RUNNERS)}, or a Runner")
    if trials < 1:
        raise FrontendError(f"trials must be at least 1, got {trials}")
    from spacefusion.runners import cpu_cores

    own = isinstance(runner, str)
    if runner == "gpu":
        from spacefusion.runners import LocalGPURunner, gpu_runner, gpu_unavailable_reason

        reason = gpu_unavailable_reason()
        if reason is not None:
            raise FrontendError(f"runner 'gpu' needs a CUDA GPU here ({reason}); tune with runner='llvm'")
        from spacefusion.frontend.dynamo import device_hardware

        measure: Runner = gpu_runner(gpus=gpus)
        if not isinstance(measure, LocalGPURunner):
            measure.connect()  # type: ignore[attr-defined]  # a pool: its workers up before the capture
        hw = hw or device_hardware()  # records under this GPU's preset, which compile(..., db=) reads first
        target = target or RUNNERS["gpu"]
    elif runner == "llvm":
        from spacefusion.runners import LLVMRunner

        measure, hw = LLVMRunner(), CPU_STAND_IN  # the CPU has no model: its records are filed under the stand-in
        target = "llvm"
    else:
        measure, target = runner, target or RUNNERS["gpu"]  # type: ignore[assignment]
    try:
        return tune_partitions(captured_partitions(model, *args, **kwargs), measure, db, hw=hw, target=target,
                               trials=trials, workers=workers or cpu_cores(), progress=progress, jobs=jobs)
    finally:
        close = getattr(measure, "close", None)
        if own and callable(close):  # the workers this call started end with it
            close()


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
