"""A pool of measuring workers, one candidate each at a time, and the runner over it (``PoolRunner``).

What every way of measuring on several devices shares, whatever starts the workers (``ProcessRunner``: one
subprocess per GPU of this host; ``RayRunner``: Ray actors anywhere on a cluster):

* **one candidate per worker at a time.** A worker owns one GPU (``CUDA_VISIBLE_DEVICES``), so timings never
  share a device; a slow build holds up only its own worker.
* **thread-safe.** ``measure`` may be called from several threads at once (``frontend.tune`` tunes several
  SMGs side by side): their candidates join one queue, and every idle worker takes the next.
* **a lost worker is a retry, not a loss.** A worker that dies with a candidate in hand (killed, its node
  gone, a crash in TVM or the CUDA driver) is started again, and the candidate goes to *another* worker first.  A
  candidate that took down ``attempts`` workers is a failed result that says so: it is what failed, and a
  rerun should not crash them again.  When no worker is left, the candidates still waiting come back as
  environmental failures (``MeasureResult.environmental``): the tuner records none of them and releases their
  claims, so a rerun measures them; nothing is recorded twice, and nothing measured is lost.
* **workers that cannot work never start.** A worker checks at start that it can measure (``worker.Worker``):
  one that cannot (no GPU, no TVM where it must build) is named in ``RunnerUnavailable`` if none starts, and
  left out (with a warning) if others do.
"""

from __future__ import annotations

import base64
import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

from schedulers.schedule import Schedule
from search.records import Builder, MeasureInput, MeasureResult
from smg.serialize import smg_to_dict
from spacefusion.runners.builder import TVMBuilder
from spacefusion.runners.common import RunnerUnavailable, fail, unavailable
from spacefusion.runners.llvm import LLVMRunner
from spacefusion.runtime.batch import describe

log = logging.getLogger("spacefusion")

#: how many workers a candidate may take down before it is recorded as failed (one death may be the worker's)
ATTEMPTS = 2
#: how many times in a row a slot starts its worker again after losing it before it gives up
RESTARTS = 2
#: seconds a worker has to say it is ready (it imports torch, TVM, the search: 5-20 s on a busy host)
START_TIMEOUT_S = 180.0
#: seconds a worker has to answer for one candidate (its build, nvcc, the check and the timing) before it is
#: stopped and the candidate handed to another: a kernel that never ends would hold a GPU for good
CANDIDATE_TIMEOUT_S = 900.0


class WorkerLost(Exception):
    """The worker is gone (killed, crashed, its node lost) or never came up; the message says which and why."""


class Slot(Protocol):
    """One place a worker runs (a GPU of this host, a Ray actor); used only by the pool thread that owns it,
    except ``stop``, which ``close`` may call from another thread while ``call`` waits."""

    label: str

    def start(self) -> dict[str, Any]:
        """Start (or start again) the worker; its ``hello``.  Raises ``WorkerLost`` saying why it did not start."""
        ...

    def call(self, request: dict[str, Any]) -> dict[str, Any]:
        """The worker's answer to ``request``; raises ``WorkerLost`` if the worker died before answering, or (the
        worker then stopped) did not answer within the slot's time limit."""
        ...

    def stop(self) -> None:
        """End the worker (a call waiting on it then raises ``WorkerLost``)."""
        ...


@dataclass(eq=False)
class _Job:
    request: dict[str, Any]
    done: threading.Event = field(default_factory=threading.Event)
    answer: dict[str, Any] | None = None
    lost: list[str] = field(default_factory=list)  # "worker: why", one per worker it took down
    avoid: set[int] = field(default_factory=set)  # the slots it was lost on: others take it first

    def finish(self, answer: dict[str, Any]) -> None:
        self.answer = {**answer, "lost_on": list(self.lost)}
        self.done.set()


def grouped(reasons: Iterable[str]) -> str:
    """``"label: why"`` reasons, those with the same why said once: ``"worker 0, worker 1: why"``."""
    by_why: dict[str, list[str]] = {}
    for r in reasons:
        label, _, why = r.partition(": ")
        by_why.setdefault(why, []).append(label)
    return "; ".join(f"{', '.join(labels)}: {why}" for why, labels in by_why.items())


class WorkerPool:
    """Workers in ``slots``, each served by a thread of its own that hands it one job at a time.

    ``start`` starts them all (in parallel) and returns once each has started or given up, raising
    ``RunnerUnavailable`` with every reason if none started.  ``run(requests)`` answers each request, in
    order; an answer is the worker's (``{"ok": ...}``), or the pool's own when the request could not be run:
    ``{"ok": False, "lost": True, "error": ...}`` after ``attempts`` lost workers, ``{"ok": False,
    "environmental": True, "error": ...}`` when no worker is left.  Every answer has ``worker`` (the label of
    the worker that gave it, or None) and ``lost_on`` (the workers lost with it in hand, and why)."""

    def __init__(self, slots: Sequence[Slot], *, name: str, attempts: int = ATTEMPTS, restarts: int = RESTARTS) -> None:
        if not slots:
            raise ValueError(f"{name}: a pool needs at least one worker")
        if attempts < 1 or restarts < 0:
            raise ValueError(f"{name}: attempts must be >= 1 and restarts >= 0, got {attempts}, {restarts}")
        self.name, self.attempts, self.restarts = name, attempts, restarts
        self._slots = list(slots)
        self._cond = threading.Condition()
        self._queue: list[_Job] = []
        self._starting = len(self._slots)  # slots not yet started (or given up) for the first time
        self._live: set[int] = set()  # slots serving: started, not given up (perhaps starting again: _down)
        self._down: set[int] = set()  # live slots whose worker was lost and is starting again
        self._busy: dict[int, _Job] = {}
        self._gone: dict[int, str] = {}
        self._closed = False
        self._threads: list[threading.Thread] = []
        #: each live slot's worker, as it said hello (host, pid, GPU)
        self.hellos: dict[int, dict[str, Any]] = {}

    # -- the caller's side -------------------------------------------------------------------------
    def start(self) -> None:
        with self._cond:
            if self._threads:
                return
            for i, slot in enumerate(self._slots):
                t = threading.Thread(target=self._serve, args=(i, slot), name=f"{self.name}-{i}", daemon=True)
                self._threads.append(t)
                t.start()
            self._cond.wait_for(lambda: self._starting == 0)
            if not self._live:
                raise RunnerUnavailable(f"{self.name}: no worker started: {grouped(self._gone.values())}")
            for i, why in self._gone.items():
                log.warning("%s: worker %d did not start and is left out: %s", self.name, i, why)

    @property
    def live(self) -> int:
        """How many workers are up now (the parallelism a caller can expect; one starting again is not)."""
        with self._cond:
            return len(self._live - self._down)

    def busy(self) -> list[dict[str, Any]]:
        """The hellos of the workers with a job in hand now."""
        with self._cond:
            return [self.hellos[i] for i in self._busy if i in self.hellos]

    def run(self, requests: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        jobs = [_Job(dict(r)) for r in requests]
        with self._cond:
            if self._closed or (not self._live and self._starting == 0):
                why = "the pool is closed" if self._closed else f"no worker left: {grouped(self._gone.values())}"
                for job in jobs:
                    job.finish({"ok": False, "environmental": True, "error": f"{self.name}: {why}", "worker": None})
            else:
                self._queue.extend(jobs)
                self._cond.notify_all()
        for job in jobs:
            job.done.wait()
        return [cast(dict[str, Any], job.answer) for job in jobs]

    def close(self) -> None:
        """End every worker; requests still waiting are answered as environmental failures."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            waiting, self._queue = self._queue, []
            self._cond.notify_all()
        for job in waiting:
            job.finish({"ok": False, "environmental": True, "error": f"{self.name}: the pool was closed",
                        "worker": None})
        for slot in self._slots:
            try:
                slot.stop()
            except Exception as exc:  # noqa: BLE001  closing goes on for the others
                log.warning("%s: stopping %s: %s", self.name, slot.label, describe(exc))
        for t in self._threads:
            t.join(timeout=10)

    # -- each slot's thread ------------------------------------------------------------------------
    def _serve(self, i: int, slot: Slot) -> None:
        up = self._start_slot(i, slot, tries=1)
        with self._cond:
            self._starting -= 1
            self._cond.notify_all()
        if not up:
            self._retire(i, None)
            return
        streak = 0  # jobs lost in a row: a worker that loses every one is given up, not started forever
        while True:
            job = self._take(i)
            if job is None:
                break
            try:
                answer = slot.call(job.request)
            except WorkerLost as exc:
                streak += 1
                self._lost(i, job, f"{slot.label}: {exc}")
                if self._closed:  # close() stopped it: nothing to start again
                    break
                if streak > self.restarts or not self._start_slot(i, slot, tries=self.restarts):
                    why = f"{slot.label}: lost {streak} job(s) in a row, last: {exc}"
                    self._retire(i, None if self._closed else why)
                    return
                continue
            except Exception as exc:  # noqa: BLE001  not the worker's death: this job's failure
                answer = {"ok": False, "error": describe(exc)}
            streak = 0
            with self._cond:
                self._busy.pop(i, None)
            job.finish({**answer, "worker": slot.label})
        self._retire(i, None)

    def _start_slot(self, i: int, slot: Slot, tries: int) -> bool:
        why = ""
        for _ in range(max(1, tries)):
            with self._cond:
                if self._closed:
                    return False
            try:
                hello = slot.start()
            except WorkerLost as exc:
                why = f"{slot.label}: {exc}"
                continue
            with self._cond:
                self.hellos[i] = hello
                self._live.add(i)
                self._down.discard(i)
                self._cond.notify_all()
            return True
        with self._cond:
            self._gone[i] = why
        return False

    def _take(self, i: int) -> _Job | None:
        """The first waiting job this worker should take: one it has not lost before, unless every live worker
        has lost it (then anyone may try it again); None once the pool is closed."""
        with self._cond:
            while not self._closed:
                for k, job in enumerate(self._queue):
                    if i not in job.avoid or (self._live - self._down) <= job.avoid:
                        self._busy[i] = self._queue.pop(k)
                        return job
                self._cond.wait()
            return None

    def _lost(self, i: int, job: _Job, why: str) -> None:
        with self._cond:
            self._busy.pop(i, None)
            self._down.add(i)  # until it is started again (a request arriving meanwhile waits for it)
            job.lost.append(why)
            job.avoid.add(i)
            if self._closed:
                job.finish({"ok": False, "environmental": True, "error": f"{self.name}: the pool was closed",
                            "worker": None})
            elif len(job.lost) >= self.attempts:
                job.finish({"ok": False, "lost": True, "worker": None,
                            "error": f"it took down {len(job.lost)} workers: " + "; ".join(job.lost)})
            else:
                self._queue.insert(0, job)
            self._cond.notify_all()

    def _retire(self, i: int, why: str | None) -> None:
        """Slot ``i`` serves no more; with no worker left, every waiting job is answered as environmental."""
        with self._cond:
            self._live.discard(i)
            self._down.discard(i)
            if why is not None:
                self._gone[i] = why
                log.warning("%s: worker %d given up: %s", self.name, i, why)
            if not self._live and self._starting == 0 and not self._closed:
                reasons = grouped(self._gone.values()) or "every worker ended"
                for job in self._queue:
                    job.finish({"ok": False, "environmental": True, "worker": None,
                                "error": f"{self.name}: no worker left ({reasons})"})
                self._queue = []
            self._cond.notify_all()


def ship(s: Schedule) -> tuple[str, str | None]:
    """The schedule as JSON, and an error if that JSON does not read back to the same schedule.

    A lossy round trip would make the worker build a different kernel than the one the key names, so
    its result would be recorded under the wrong schedule; refuse instead.
    """
    text = s.to_json()
    try:
        back = Schedule.from_json(text)
    except Exception as exc:
        return text, f"schedule: its JSON does not read back: {describe(exc)}"
    if back == s:
        return text, None
    fields = [f for f in ("smg", "block", "thread_dim", "serial", "step", "plan", "memory", "spatial")
              if getattr(back, f) != getattr(s, f)]
    return text, (f"schedule: does not survive Schedule.to_json/from_json (differs in {fields}); "
                  "a worker would build a different kernel")


def _made_by(inner: Callable[[], Any]) -> Any:
    """The class (or function) a factory calls: ``inner`` itself, or a ``functools.partial``'s function."""
    return getattr(inner, "func", inner)


def inner_name(inner: Callable[[], Any]) -> str:
    """The name of the runner a factory makes (``LLVMRunner`` -> ``llvm``), without making one."""
    return str(getattr(inner, "name", None) or getattr(getattr(inner, "func", None), "name", "?"))


class PoolRunner:
    """A ``search.records.Runner`` over a ``WorkerPool``: each candidate goes to the next idle worker, whose inner
    runner builds, checks and times it; results come back in input order.  Subclasses say where workers run
    (``_slots``).  ``connect()`` starts the workers (``measure`` does on first use); ``close()`` ends them.

    A worker that does not say it is ready within ``start_timeout_s``, or answer for a candidate within
    ``candidate_timeout_s`` (None: no limit), is stopped and counts as lost.

    ``measure`` is thread-safe; ``parallelism`` is how many workers are up.  ``answered`` counts, per (schedule
    key, target), the results workers gave (a lost worker's candidate is counted once, where it was measured).
    ``builder`` keys the database and prebuilds on the tuner's side.  With ``ship`` (by default where the
    builder is TVM's and the inner runner can measure a built artefact: ``LocalGPURunner``) CUDA candidates are
    built on the tuning host -- ahead, in its build processes -- and their artefacts shipped to the workers, which
    then need no TVM and spend their GPU's time measuring; otherwise each worker builds what it measures."""

    via = "pool"

    def __init__(self, inner: Callable[[], Any] | None = None, builder: Builder | None = None,
                 attempts: int = ATTEMPTS, restarts: int = RESTARTS, start_timeout_s: float = START_TIMEOUT_S,
                 candidate_timeout_s: float | None = CANDIDATE_TIMEOUT_S, ship: bool | None = None) -> None:
        self.inner = inner or LLVMRunner
        self.attempts, self.restarts = attempts, restarts
        self.start_timeout_s, self.candidate_timeout_s = start_timeout_s, candidate_timeout_s
        self.builder: Builder = builder if builder is not None else TVMBuilder()
        can = isinstance(self.builder, TVMBuilder) and callable(getattr(_made_by(self.inner), "measure_built", None))
        if ship and not can:
            raise ValueError(f"ship=True needs a TVMBuilder and an inner runner with measure_built (LocalGPURunner); "
                             f"got {type(self.builder).__name__} and {inner_name(self.inner)}")
        #: CUDA candidates are built here (the builder's prebuild) and shipped to the workers, which build nothing
        self.ship = can if ship is None else ship
        if self.ship:
            cast(TVMBuilder, self.builder).keep_artefacts = True
        self.name = f"{self.via}[{inner_name(self.inner)}]"
        self.answered: Counter[tuple[str, str]] = Counter()
        self._pool: WorkerPool | None = None
        self._lock = threading.Lock()

    def _slots(self) -> list[Slot]:
        raise NotImplementedError

    def connect(self) -> None:
        """Start the workers, raising ``RunnerUnavailable`` (naming each reason) where none can start."""
        self._started()

    def _started(self) -> WorkerPool:
        with self._lock:
            if self._pool is None:
                pool = WorkerPool(self._slots(), name=self.name, attempts=self.attempts, restarts=self.restarts)
                try:
                    pool.start()
                except BaseException:
                    pool.close()
                    raise
                self._pool = pool
            return self._pool

    @property
    def parallelism(self) -> int:
        """Workers up now (0 before ``connect``)."""
        return 0 if self._pool is None else self._pool.live

    @property
    def pool(self) -> WorkerPool | None:
        return self._pool

    def measure(self, inputs: list[MeasureInput]) -> list[MeasureResult]:
        if not inputs:
            return []
        pool = self._started()
        out: list[MeasureResult | None] = [None] * len(inputs)
        sent: list[int] = []
        requests = []
        shipped = [i for i in inputs if self.ship and i.target.startswith(("cuda", "sm_"))]
        builder = cast(TVMBuilder, self.builder)
        for inp in shipped:
            if builder.artefact(inp.key, inp.target) is None:  # not prebuilt (no tuner, no build worker): now, here
                builder.keep(inp)
        ships = {id(i) for i in shipped}
        try:
            for i, inp in enumerate(inputs):
                text, problem = ship(inp.schedule)
                if problem is not None:
                    out[i] = fail(inp, problem, {"runner": self.name})
                    continue
                request: dict[str, Any] = {
                    "op": "measure", "schedule": text, "target": inp.target,
                    "inputs_from": None if inp.inputs_from is None else smg_to_dict(inp.inputs_from)}
                if id(inp) in ships:
                    built = builder.artefact(inp.key, inp.target)
                    if not isinstance(built, Path):  # it did not build: said here, no worker needed
                        out[i] = fail(inp, f"build: {built}", {"runner": self.name, "built": "here"})
                        continue
                    request["artefact"] = {p.name: base64.b64encode(p.read_bytes()).decode()
                                           for p in sorted(built.iterdir()) if p.is_file()}
                sent.append(i)
                requests.append(request)
            for i, answer in zip(sent, pool.run(requests)):
                out[i] = self._result(inputs[i], answer)
        finally:
            for inp in shipped:
                builder.forget(inp.key, inp.target)
        return cast(list[MeasureResult], out)  # every index was filled above

    def _result(self, inp: MeasureInput, answer: dict[str, Any]) -> MeasureResult:
        extra = {"via": self.via, "worker": answer.get("worker")}
        if answer.get("lost_on"):
            extra["lost_workers"] = list(answer["lost_on"])
        if answer.get("ok"):
            r = MeasureResult.from_dict(answer["result"])
            with self._lock:
                self.answered[(r.schedule_key, r.target)] += 1
            return MeasureResult(r.schedule_key, r.target, r.latencies_us, r.max_abs_err, r.error,
                                 tuple(sorted({**dict(r.meta), **extra}.items())))
        meta = {"runner": self.name, **extra}
        if answer.get("environmental"):
            return unavailable(inp, str(answer.get("error")), meta)
        return fail(inp, f"worker: {answer.get('error')}", meta)

    def close(self) -> None:
        """End the workers (a later ``measure`` starts new ones)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def __enter__(self) -> PoolRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
