"""The Ray runner: spreads candidates over a Ray cluster, each actor running an inner runner."""

from __future__ import annotations

import importlib.util
import math
import os
import socket
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, cast

from schedulers.schedule import Schedule
from search.records import Builder, MeasureInput, MeasureResult
from spacefusion.runners.builder import TVMBuilder
from spacefusion.runners.common import RunnerUnavailable, fail
from spacefusion.runners.llvm import LLVMRunner
from spacefusion.runtime.batch import describe


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ImportError("RayRunner needs Ray, an optional extra: pip install spacefusion[ray]") from exc
    return ray


#: seconds ``RayRunner`` waits for a cluster's address to answer before giving up (``ray.init`` itself retries
#: for minutes against an address where nothing listens)
CONNECT_TIMEOUT_S = 5.0


def _host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a Ray address given as ``host:port`` or ``ray://host:port``; None for the forms that
    name no socket (``auto``, ``local``: Ray finds the cluster itself and fails at once if there is none)."""
    rest = address.split("://", 1)[1] if "://" in address else address
    host, sep, port = rest.rstrip("/").rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]") or "127.0.0.1", int(port)


def probe(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Raise ``RunnerUnavailable`` naming ``address`` if nothing accepts a TCP connection there within
    ``timeout_s`` seconds.  Why: ``ray.init`` against an address where nothing listens retries for minutes
    (the CLI still waited after 300 s); a socket answers or fails in bounded time."""
    hp = _host_port(address)
    if hp is None:
        if address in ("auto", "local"):
            return
        raise RunnerUnavailable(f"Ray address {address!r} is not HOST:PORT, ray://HOST:PORT, 'auto' or 'local'")
    try:
        with socket.create_connection(hp, timeout=timeout_s):
            pass
    except OSError as e:
        why = "no answer" if isinstance(e, TimeoutError) else (e.strerror or str(e))
        raise RunnerUnavailable(f"no Ray cluster at {address}: connecting to {hp[0]}:{hp[1]} failed within "
                                f"{timeout_s:g} s ({why}); start one there (ray start --head --port {hp[1]}), or "
                                f"check the address") from None


class _RayWorker:
    """Runs in a Ray actor: keeps one inner runner (and so its reference cache) across candidates.

    Schedules arrive as JSON and results leave as record dicts, so nothing TVM-side is ever pickled.
    """

    def __init__(self, factory: Callable[[], Any]) -> None:
        self.runner = factory()

    def measure(self, schedule_json: str, target: str) -> dict[str, Any]:
        inp = MeasureInput(Schedule.from_json(schedule_json), target)
        return self.runner.measure([inp])[0].to_dict()


def _ship(s: Schedule) -> tuple[str, str | None]:
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
                  "a Ray worker would build a different kernel")


class RayRunner:
    """Spreads candidates over a Ray cluster: ``num_workers`` actors, each with its own inner runner.

    ``inner`` is a zero-argument factory run inside each actor (default ``LLVMRunner``; on a GPU
    cluster e.g. ``functools.partial(LocalGPURunner, iters=200)`` with ``num_gpus=1``, so each actor
    owns one GPU and timings never share a device).  Connects with ``ray.init(address)`` unless Ray is
    already initialised (``address=None`` starts a local instance).  Actors are started on first use and
    reused; call ``close()`` to stop them.  Results come back in input order; a crashed task becomes an
    error result.
    """

    def __init__(self, address: str | None = None, num_workers: int | None = None,
                 inner: Callable[[], Any] | None = None, num_gpus: float = 0, num_cpus: float = 1,
                 init_kwargs: Mapping[str, Any] | None = None, builder: Builder | None = None,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        self.available()  # fail at construction, not mid-tuning
        self.address, self.num_workers = address, num_workers
        self.connect_timeout_s = connect_timeout_s
        self.inner = inner or LLVMRunner
        self.num_gpus, self.num_cpus = num_gpus, num_cpus
        self.init_kwargs = dict(init_kwargs or {})
        inner_name = getattr(self.inner, "name", None) or getattr(getattr(self.inner, "func", None), "name", "?")
        self.name = f"ray[{inner_name}]"
        self._actors: list[Any] = []
        #: the tuner's builder here (its flags key the database; it prebuilds); each actor builds with its own
        self.builder: Builder = builder if builder is not None else TVMBuilder()

    @staticmethod
    def available() -> None:
        """Raise ImportError saying how to install Ray where it is not installed."""
        if importlib.util.find_spec("ray") is None:
            raise ImportError("RayRunner needs Ray, an optional extra: pip install spacefusion[ray]")

    def connect(self) -> None:
        """Join the cluster (or start a local one, ``address=None``) and check it can run the actors, raising
        ``RunnerUnavailable`` that names the address otherwise: nothing answering there within
        ``connect_timeout_s`` (checked before ``ray.init``, which would retry for minutes), or GPU actors asked
        of a cluster without GPUs (they would wait for one forever).  ``measure`` connects on first use; call
        this first to fail before a tune instead of in it."""
        ray = _import_ray()
        if not ray.is_initialized():
            if self.address is not None:
                probe(self.address, self.connect_timeout_s)
            self._init(ray)
        if self.num_gpus:
            gpus = ray.cluster_resources().get("GPU", 0)
            if gpus < self.num_gpus:
                where = self.address or "the local Ray instance"
                raise RunnerUnavailable(f"the Ray cluster at {where} has {gpus:g} GPUs; {self.name} actors need "
                                        f"{self.num_gpus:g} each (measure on its CPUs with --target llvm)")

    def _init(self, ray: Any) -> None:
        """``ray.init``, bounded and with its failure named: something that accepts connections at the address
        but is no Ray cluster made Ray retry for about 20 s and raise a ConnectionError traceback.  Ray's own
        budget for reaching the cluster (``RAY_gcs_server_port_wait_time_s``, in seconds) is set to
        ``connect_timeout_s`` for this call unless the environment sets it."""
        var = "RAY_gcs_server_port_wait_time_s"
        mine = var not in os.environ
        if mine:
            os.environ[var] = str(max(1, math.ceil(self.connect_timeout_s)))
        try:
            ray.init(address=self.address, **self.init_kwargs)
        except Exception as exc:
            where = f"at {self.address}" if self.address is not None else "(a local instance)"
            raise RunnerUnavailable(f"no Ray cluster {where}: ray.init failed: {describe(exc)}") from None
        finally:
            if mine:
                os.environ.pop(var, None)

    def _start(self) -> list[Any]:
        ray = _import_ray()
        if not ray.is_initialized():
            self.connect()
        if not self._actors:
            n = self.num_workers
            if n is None:
                res = ray.cluster_resources()  # one actor per GPU (or CPU) share the cluster has
                per, have = (self.num_gpus, res.get("GPU", 0)) if self.num_gpus else (self.num_cpus, res.get("CPU", 1))
                n = int(have // per) if per else 1
            actor_cls = ray.remote(_RayWorker).options(num_cpus=self.num_cpus, num_gpus=self.num_gpus,
                                                       max_restarts=-1)  # a crashed build kills only its task
            self._actors = [actor_cls.remote(self.inner) for _ in range(max(1, n))]
        return self._actors

    def measure(self, inputs: list[MeasureInput]) -> list[MeasureResult]:
        if not inputs:
            return []
        ray = _import_ray()
        actors = self._start()
        pending: dict[Any, tuple[int, Any]] = {}  # object ref -> (input index, actor running it)
        idle = list(actors)
        queue = deque(enumerate(inputs))
        out: list[MeasureResult | None] = [None] * len(inputs)
        while queue or pending:
            while queue and idle:  # one candidate per actor at a time: a slow build never holds up the rest
                i, inp = queue.popleft()
                text, problem = _ship(inp.schedule)
                if problem is not None:
                    out[i] = fail(inp, problem, {"runner": self.name})
                    continue
                actor = idle.pop()
                pending[actor.measure.remote(text, inp.target)] = (i, actor)
            if not pending:
                continue
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            i, actor = pending.pop(ref)
            idle.append(actor)
            try:
                r = MeasureResult.from_dict(ray.get(ref))
                out[i] = MeasureResult(r.schedule_key, r.target, r.latencies_us, r.max_abs_err, r.error,
                                       tuple(sorted({**dict(r.meta), "via": "ray"}.items())))
            except Exception as exc:  # the actor died or the task raised: this candidate fails, the rest go on
                out[i] = fail(inputs[i], f"ray: {describe(exc)}", {"runner": self.name})
        return cast(list[MeasureResult], out)  # every index was filled above

    def close(self) -> None:
        """Stop the actors (the Ray instance itself is left to whoever started it)."""
        if self._actors:
            ray = _import_ray()
            for a in self._actors:
                ray.kill(a)
            self._actors = []

    def __enter__(self) -> RayRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
