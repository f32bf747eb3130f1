"""The CUDA artefacts of a graph's distinct SMGs, exported side by side in worker processes.

A cold compile spends most of its time per distinct SMG: the first pick (``schedules.model_pick`` enumerates
and ranks the SMG's search space in Python) and the build (TVM's lowering, then nvcc).  The SMGs of one graph
do not depend on each other, so ``export_many`` runs them in ``build_workers()`` worker processes (new ones:
TVM and CUDA do not survive a fork) before the backend compiles them one by one, which then finds each artefact
on disk.  Why processes: the enumeration holds the GIL.  A worker that fails leaves its SMG to the serial path,
which exports it again and reports its error where the partition does.
"""

from __future__ import annotations

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

    folder, arch, schedule_for, by_schedule, smg = pickle.loads(job.read_bytes())
    CudaBackend(folder, arch, schedule_for=schedule_for, build_missing=True, load=False,
                by_schedule=by_schedule).export(smg)
    return smg.key


#: how a worker's stdout line reports a finished job (other output on stdout is not ours: TVM's, nvcc's)
_DONE = "spacefusion-export-done "


def _worker() -> int:
    """A worker process: one job file path per line of stdin, one ``_DONE`` line per job on stdout."""
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


def export_many(folder: Path, arch: str, schedule_for: Callable[[Any], Any], by_schedule: bool,
                smgs: Sequence[Any], workers: int | None = None) -> dict[str, str]:
    """Export the artefacts of ``smgs`` into ``folder`` in parallel; {SMG key: error} of those that failed.
    Nothing happens with fewer than two SMGs or workers, or a ``schedule_for`` that cannot be sent to a
    worker (a closure over a tuning database): the caller's serial path exports them.

    The workers are ``python -m spacefusion.frontend.parallel_build`` processes fed one job at a time as
    they finish (the slow SMGs do not hold up the rest), not a ``multiprocessing`` pool: a spawned pool
    re-runs the user's script in each worker unless it is guarded by ``if __name__ == "__main__"``."""
    workers = build_workers() if workers is None else workers
    if len(smgs) < 2 or workers < 2:
        return {}
    try:
        pickle.dumps(schedule_for)
    except (pickle.PicklingError, TypeError, AttributeError):
        return {}
    failed: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="sf-export-") as tmp:
        jobs = []
        for i, smg in enumerate(smgs):  # the job files: transient messages to our own workers, never kept
            path = Path(tmp) / f"job{i}.pkl"
            path.write_bytes(pickle.dumps((Path(folder), arch, schedule_for, by_schedule, smg)))
            jobs.append(path)
        key_of = {str(p): smg.key for p, smg in zip(jobs, smgs)}
        pending, done = list(jobs), set()
        procs = [subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True, bufsize=1)
                 for _ in range(min(workers, len(jobs)))]
        with selectors.DefaultSelector() as sel:
            for proc in procs:
                proc.stdin.write(f"{pending.pop(0)}\n")
                sel.register(proc.stdout, selectors.EVENT_READ, proc)
            while sel.get_map():
                for event, _ in sel.select():
                    proc = event.data
                    line = proc.stdout.readline()
                    if not line:  # the worker ended (crashed): its job is left to the serial path
                        sel.unregister(proc.stdout)
                        continue
                    if not line.startswith(_DONE):
                        continue
                    got = json.loads(line[len(_DONE):])
                    done.add(got["job"])
                    if got["error"]:
                        failed[key_of[got["job"]]] = got["error"]
                    if pending:
                        proc.stdin.write(f"{pending.pop(0)}\n")
                    else:
                        proc.stdin.close()
        for proc in procs:
            proc.wait()
        failed |= {key_of[str(p)]: "its worker process ended before it" for p in jobs if str(p) not in done}
    return failed


__all__ = ["WORKERS_ENV", "build_workers", "export_many"]


if __name__ == "__main__":
    raise SystemExit(_worker())
