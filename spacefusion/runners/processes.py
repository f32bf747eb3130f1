"""Workers as subprocesses of this one (``python -m spacefusion.runners.worker``): every GPU of this host without
Ray (``ProcessRunner``), and the tuner's build workers (``build_pool``).

Why subprocesses and not ``multiprocessing``: a forked child inherits CUDA, TVM's and Ray's threads and
whatever locks other threads held (the tuner runs several tunes in threads), and a spawned one re-runs the
user's script unless it is guarded by ``if __name__ == "__main__"``.  A subprocess starts clean, imports what
it needs once, and lives as long as its pool; it speaks JSON lines (``worker.py``), so nothing is pickled.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from search.records import Builder
from spacefusion.runners.pool import (
    ATTEMPTS,
    CANDIDATE_TIMEOUT_S,
    RESTARTS,
    START_TIMEOUT_S,
    PoolRunner,
    Slot,
    WorkerLost,
    WorkerPool,
)
from spacefusion.runners.worker import factory_spec

#: how a worker process is started (``python -c``: ``-m spacefusion.runners.worker`` would import the module twice,
#: once with its package, and say so)
WORKER_MAIN = "import sys; from spacefusion.runners.worker import main; sys.exit(main())"


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a worker, with ``PYTHONPATH`` led by this process's ``sys.path``: the
    worker imports the same spacefusion as the driver (a checkout on ``sys.path`` by pytest or a script, not
    the installed one), so both sides agree on schedules, keys and results."""
    env = dict(os.environ)
    paths = [str(Path(p).resolve()) for p in sys.path if p and Path(p).is_dir()]
    old = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([*paths, *old]))
    env.update(extra or {})
    return env


def _tail(path: Path, lines: int = 6) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])


class ProcessSlot:
    """One worker subprocess: started with ``spec`` (``worker.factory_spec``) and ``env``; its stderr goes to a
    log file whose last lines name what went wrong when it dies.  ``call_timeout_s``: how long an answer may
    take (None: no limit) before the process is stopped and the call counts as lost."""

    def __init__(self, spec: dict[str, Any], label: str, env: Mapping[str, str], log: Path,
                 start_timeout_s: float = START_TIMEOUT_S, call_timeout_s: float | None = None) -> None:
        self.spec, self.label, self.env, self.log = spec, label, dict(env), log
        self.start_timeout_s, self.call_timeout_s = start_timeout_s, call_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self._stdout: IO[bytes] | None = None

    def start(self) -> dict[str, Any]:
        self.stop()
        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen([sys.executable, "-c", WORKER_MAIN, json.dumps(self.spec)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=self.env)
        self._stdout = self.proc.stdout
        if not self._wait(self.start_timeout_s):
            self.stop()
            raise WorkerLost(f"not ready within {self.start_timeout_s:g} s")
        line = self._stdout.readline()
        if not line:
            raise WorkerLost(self._why("exited before it was ready"))
        hello = self._parse(line)
        if not hello.get("ready"):
            self.stop()
            raise WorkerLost(f"cannot work: {hello.get('error')}")
        hello.pop("ready", None)
        return hello

    def call(self, request: dict[str, Any]) -> dict[str, Any]:
        proc = self.proc
        if proc is None or proc.stdin is None or self._stdout is None:
            raise WorkerLost("not started")
        try:
            proc.stdin.write((json.dumps(request) + "\n").encode())
            proc.stdin.flush()
            if not self._wait(self.call_timeout_s):
                self.stop()
                raise WorkerLost(f"pid {proc.pid} gave no answer within {self.call_timeout_s:g} s (stopped)")
            line = self._stdout.readline()
        except (OSError, ValueError):  # a closed pipe: the process ended, or stop() closed it
            line = b""
        if not line:
            raise WorkerLost(self._why("ended with a candidate in hand"))
        return self._parse(line)

    def _parse(self, line: bytes) -> dict[str, Any]:
        """One protocol line as JSON; anything else (the stream out of step: something wrote to the worker's
        stdout before it took it over) stops the worker, which counts as lost."""
        try:
            got = json.loads(line)
            if isinstance(got, dict):
                return got
        except ValueError:
            pass
        self.stop()
        raise WorkerLost(f"said something that is not the protocol's: {line[:200]!r}")

    def _wait(self, timeout_s: float | None) -> bool:
        """Whether the worker's stdout has something to read within ``timeout_s`` (None: wait for it).  One
        request, one answer line: nothing is left in the reader's buffer between calls, so the pipe tells."""
        if timeout_s is None or self._stdout is None:
            return True
        with selectors.DefaultSelector() as sel:
            sel.register(self._stdout, selectors.EVENT_READ)
            return bool(sel.select(timeout_s))

    def _why(self, what: str) -> str:
        rc = None
        if self.proc is not None:
            try:
                rc = self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        tail = _tail(self.log)
        how = f"exit status {rc}" if rc is not None and rc >= 0 else f"killed by signal {-rc}" if rc else "no status"
        return f"pid {self.proc.pid if self.proc else '?'} {what} ({how})" + (f"; its log: {tail}" if tail else "")

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            try:
                if pipe is not None:
                    pipe.close()
            except OSError:
                pass


def cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity, where the OS says; else the count): how many build
    workers a tune starts by default."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` names them (indices or UUIDs): its entries where
    it is set, else one index per device torch counts; empty without torch or a GPU."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip() and not g.strip().startswith("-")]
    try:
        import torch
    except ImportError:
        return []
    return [str(i) for i in range(torch.cuda.device_count())]


class ProcessRunner(PoolRunner):
    """Workers as subprocesses of this host: one per GPU of ``gpus`` (each with ``CUDA_VISIBLE_DEVICES`` set to
    its GPU, so it sees that one only), or ``workers`` of them on the CPU (no GPU named).

    ``inner`` makes each worker's runner and must be importable (a class or function, or a
    ``functools.partial`` of one with JSON keywords: ``worker.factory_spec``); default ``LLVMRunner``.  The
    rest: ``PoolRunner``'s.  The workers start on ``connect()`` or the first ``measure``; ``close()`` ends them."""

    via = "processes"

    def __init__(self, workers: int | None = None, inner: Callable[[], Any] | None = None,
                 gpus: Sequence[str] | None = None, builder: Builder | None = None, attempts: int = ATTEMPTS,
                 restarts: int = RESTARTS, start_timeout_s: float = START_TIMEOUT_S,
                 candidate_timeout_s: float | None = CANDIDATE_TIMEOUT_S, ship: bool | None = None) -> None:
        super().__init__(inner, builder, attempts, restarts, start_timeout_s, candidate_timeout_s, ship)
        self.spec = {**factory_spec(self.inner), "builds": not self.ship}  # refused now, not in every worker
        if gpus is not None:
            self.gpus: list[str | None] = [str(g) for g in gpus]
        else:
            self.gpus = [None] * (workers or 2)
        if not self.gpus or (workers is not None and gpus is not None and workers != len(self.gpus)):
            raise ValueError(f"{self.name}: give workers >= 1 or the GPUs, one worker each; got workers={workers}, "
                             f"gpus={gpus}")
        self._logs: Path | None = None

    def _slots(self) -> list[Slot]:
        self._logs = Path(tempfile.mkdtemp(prefix="sf-workers-"))
        slots: list[Slot] = []
        for i, gpu in enumerate(self.gpus):
            env = child_env({} if gpu is None else {"CUDA_VISIBLE_DEVICES": gpu})
            label = f"worker {i}" + ("" if gpu is None else f" (GPU {gpu})")
            slots.append(ProcessSlot(self.spec, label, env, self._logs / f"worker{i}.log", self.start_timeout_s,
                                     self.candidate_timeout_s))
        return slots

    def close(self) -> None:
        super().close()
        if self._logs is not None:
            shutil.rmtree(self._logs, ignore_errors=True)
            self._logs = None


# ---- the tuner's build workers ----------------------------------------------------------------------------

_BUILD_POOLS: dict[int, WorkerPool] = {}
_BUILD_LOCK = threading.Lock()


def build_pool(workers: int) -> WorkerPool:
    """This process's pool of ``workers`` build workers (``TVMBuilder`` each), started on first use and kept
    until exit, so TVM is imported once per worker rather than once per batch; shared by every tune of the
    process (the pool is thread-safe)."""
    with _BUILD_LOCK:
        pool = _BUILD_POOLS.get(workers)
        if pool is None:
            logs = Path(tempfile.mkdtemp(prefix="sf-build-workers-"))
            spec = {"factory": "spacefusion.runners.builder:TVMBuilder", "kwargs": {}}
            pool = WorkerPool([ProcessSlot(spec, f"builder {i}", child_env(), logs / f"builder{i}.log")
                               for i in range(workers)], name=f"build pool of {workers}")
            pool.start()
            if not _BUILD_POOLS:
                atexit.register(close_build_pools)
            _BUILD_POOLS[workers] = pool
        return pool


def close_build_pools() -> None:
    """End every build worker of this process (a later prebuild starts new ones)."""
    with _BUILD_LOCK:
        pools = list(_BUILD_POOLS.values())
        _BUILD_POOLS.clear()
    for pool in pools:
        pool.close()
