"""The CUDA artefacts of a graph's distinct SMGs, exported side by side by a pool of warm worker processes.

A cold compile spends most of its time per distinct SMG: the first pick (``schedules.model_pick`` enumerates
and ranks the SMG's search space in Python) and the build (TVM's lowering, then nvcc).  The SMGs of one graph
do not depend on each other, so ``export_many`` hands them to worker processes (new ones: TVM and CUDA do not
survive a fork) before the backend compiles them one by one, which then finds each artefact on disk.  Why
processes: the enumeration holds the GIL.  A worker that fails leaves its SMG to the serial path, which
exports it again and reports its error where the partition does.

The workers form one pool per process that lives as long as the process, as Inductor's compile workers do:

- **started early.** ``start_pool`` is called when a backend that builds CUDA kernels first sees a graph,
  before the partition; each worker imports torch, TVM and the search while the main process partitions, so
  the 5-8 s those imports take are off the cold compile's critical path;
- **kept warm.** A later graph, a new set of sizes of a graph with symbolic sizes (``compiled.PerShape``) or
  a model compiled next reaches workers that have imported everything already;
- **ended with the process.** The pool is closed at exit (``atexit``: the workers killed, none has a job
  then); a worker also exits at the end of its stdin, so one whose process died, whatever killed it, ends
  after the job it has.
"""

from __future__ import annotations

import atexit
import json
import os
import pickle
import selectors
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

#: how many worker processes export at once (default: half the CPUs, at most 8; 1 exports in this process)
WORKERS_ENV = "SPACEFUSION_BUILD_WORKERS"
#: how much less of the CPU a worker asks for than the process it serves (``os.nice``)
WORKER_NICENESS = 10


def build_workers() -> int:
    """``SPACEFUSION_BUILD_WORKERS`` if set (a whole number >= 1), else half the CPUs, at most 8."""
    env = os.environ.get(WORKERS_ENV)
    if env is not None:
        try:
            n = int(env)
        except ValueError:
            n = 0
        if n < 1:
            from spacefusion.frontend.errors import FrontendError

            raise FrontendError(f"{WORKERS_ENV}={env!r}: give a whole number of worker processes, 1 or more")
        return n
    return max(1, min(8, (os.cpu_count() or 1) // 2))


def _export_one(job: Path) -> str:
    """Export the SMG of one job file (written by ``export_many``); its key."""
    from spacefusion.frontend.backends import CudaBackend

    folder, arch, schedule_for, by_schedule, (split_hw, split_kw), hardware, transfer, smg = \
        pickle.loads(job.read_bytes())
    backend = CudaBackend(folder, arch, schedule_for=schedule_for, build_missing=True, load=False,
                          by_schedule=by_schedule, split_hw=split_hw, hardware=hardware)
    backend.split_kw, backend.transfer = split_kw, transfer
    backend.export_all(smg)
    return smg.key


#: how a worker's stdout line reports a finished job (other output on stdout is not ours: TVM's, nvcc's)
_DONE = "spacefusion-export-done "
#: how a worker says it has imported what a job needs
_READY = "spacefusion-export-ready"


def _warm() -> None:
    """What every job needs, imported before the first arrives: torch (the backends), TVM (the lowering),
    the search (enumeration, cost model, prior) and the first-pick function jobs name."""
    import search.cost  # noqa: F401
    import search.prior  # noqa: F401
    import search.space  # noqa: F401
    import spacefusion.frontend.backends  # noqa: F401
    import spacefusion.frontend.dynamo  # noqa: F401
    import spacefusion.lower.build  # noqa: F401


def _worker() -> int:
    """A worker process: imports, says it is ready, then one job file path per line of stdin and one
    ``_DONE`` line per job on stdout, until stdin ends."""
    try:
        os.nice(WORKER_NICENESS)  # behind the process that compiles (its own imports, partition, kernel loads)
    except (AttributeError, OSError):
        pass
    try:
        _warm()
    except Exception:  # noqa: BLE001  a job reports what is missing, with its own error
        pass
    sys.stdout.write(_READY + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        job = Path(line.strip())
        try:
            _export_one(job)
            error = None
        except Exception as exc:  # reported to the parent, which leaves the SMG to the serial path
            error = f"{type(exc).__name__}: {exc}"
        sys.stdout.write(_DONE + json.dumps({"job": str(job), "error": error}) + "\n")
        sys.stdout.flush()
    return 0


class _Pool:
    """This process's worker processes (``python -m spacefusion.frontend.parallel_build``), each fed one job
    at a time as it finishes (the slow SMGs do not hold up the rest).  Not a ``multiprocessing`` pool: a
    spawned pool re-runs the user's script in each worker unless it is guarded by ``if __name__ ==
    "__main__"``."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def grow(self, n: int) -> None:
        """At least ``n`` live workers (those that ended are dropped)."""
        self.procs = [p for p in self.procs if p.poll() is None]
        while len(self.procs) < n:
            self.procs.append(subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0))

    def run(self, jobs: list[Path], workers: int) -> tuple[set[str], dict[str, str]]:
        """Run ``jobs`` on up to ``workers`` workers; (the jobs done, {job: error} of those that failed).
        A worker's output is read from its pipe as it comes (``os.read``), split into lines here: a buffered
        reader could hold a second line that the selector would then never report."""
        self.grow(workers)
        pending, done, failed = list(jobs), set(), {}
        idle = list(self.procs[:workers])
        busy: dict[int, subprocess.Popen] = {}
        partial: dict[int, bytes] = {}
        with selectors.DefaultSelector() as sel:
            while pending or busy:
                while pending and idle:
                    proc = idle.pop(0)
                    try:
                        proc.stdin.write(f"{pending[0]}\n".encode())
                    except OSError:  # it ended: its job goes to another worker
                        continue
                    fd = proc.stdout.fileno()
                    busy[fd] = proc
                    sel.register(fd, selectors.EVENT_READ)
                    pending.pop(0)
                if not busy:  # every worker ended: what is left goes to the serial path
                    break
                for event, _ in sel.select():
                    fd = event.fd
                    chunk = os.read(fd, 1 << 16)
                    if not chunk:  # the worker ended (crashed) in its job: left to the serial path
                        sel.unregister(fd)
                        busy.pop(fd)
                        continue
                    *lines, partial[fd] = (partial.get(fd, b"") + chunk).split(b"\n")
                    for line in lines:
                        text = line.decode(errors="replace")
                        if not text.startswith(_DONE):  # its ready line, or output that is not ours
                            continue
                        got = json.loads(text[len(_DONE):])
                        done.add(got["job"])
                        if got["error"]:
                            failed[got["job"]] = got["error"]
                        sel.unregister(fd)
                        idle.append(busy.pop(fd))
        return done, failed

    def close(self) -> None:
        """End every worker now.  Between exports none has a job, only imports or nothing to do: a process
        that exits right after a warm compile does not wait for workers still importing TVM."""
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()
            for pipe in (p.stdin, p.stdout):
                try:
                    pipe.close()
                except OSError:
                    pass
        self.procs = []


_POOL: _Pool | None = None


def _pool() -> _Pool:
    global _POOL
    if _POOL is None:
        _POOL = _Pool()
        atexit.register(_POOL.close)
    return _POOL


def start_pool(workers: int | None = None) -> int:
    """Start this process's export workers now (``build_workers()`` of them, none where that is 1), so their
    imports overlap what the caller does before its first export.  How many are live."""
    workers = build_workers() if workers is None else workers
    if workers < 2:
        return 0
    pool = _pool()
    pool.grow(workers)
    return len(pool.procs)


def close_pool() -> None:
    """End this process's export workers (a later export starts new ones)."""
    if _POOL is not None:
        _POOL.close()


def export_many(folder: Path, arch: str, schedule_for: Callable[[Any], Any], by_schedule: bool,
                smgs: Sequence[Any], workers: int | None = None,
                split: tuple[Any, dict[str, int]] = (None, {}), hardware: Any = None,
                transfer: bool = False) -> dict[str, str]:
    """Export the artefacts of ``smgs`` into ``folder`` on the pool's workers (``CudaBackend.export_all``: each
    SMG's split decided for ``split``'s machine and keywords, as the caller's backend would, for the caller's
    ``hardware`` (its ``HardwareChoice``, recorded in each ``timing.json``), then its
    kernels, first picks from a family's ranking where ``transfer``, as the caller's ``CudaBackend.transfer``);
    {SMG key: error} of those that failed.  Nothing happens with no SMG, fewer than two workers, or
    a ``schedule_for`` that cannot be sent to a worker (a closure over a tuning database): the caller's serial
    path exports them."""
    workers = build_workers() if workers is None else workers
    if not smgs or workers < 2:
        return {}
    try:
        pickle.dumps(schedule_for)
    except (pickle.PicklingError, TypeError, AttributeError):
        return {}
    with tempfile.TemporaryDirectory(prefix="sf-export-") as tmp:
        jobs = []
        for i, smg in enumerate(smgs):  # the job files: transient messages to our own workers, never kept
            path = Path(tmp) / f"job{i}.pkl"
            path.write_bytes(pickle.dumps((Path(folder), arch, schedule_for, by_schedule, split, hardware, transfer,
                                           smg)))
            jobs.append(path)
        key_of = {str(p): smg.key for p, smg in zip(jobs, smgs)}
        done, failed = _pool().run(jobs, workers)
    out = {key_of[j]: e for j, e in failed.items()}
    return out | {key_of[str(p)]: "its worker process ended before it" for p in jobs if str(p) not in done}


__all__ = ["WORKERS_ENV", "build_workers", "close_pool", "export_many", "start_pool"]


if __name__ == "__main__":
    raise SystemExit(_worker())
