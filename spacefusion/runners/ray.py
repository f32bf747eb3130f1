"""The Ray runner: candidates spread over a Ray cluster's workers (actors), each running an inner runner.

A ``PoolRunner`` (``pool.py``) whose workers are Ray actors: one candidate per actor at a time, one GPU per actor
for CUDA (Ray sets its ``CUDA_VISIBLE_DEVICES``), an actor lost mid-batch started again and its candidate
retried on another.  CUDA candidates for GPU actors (``LocalGPURunner``) are built by the driver, where TVM is,
and shipped as artefacts (``PoolRunner.ship``), so the GPU hosts need no TVM; an llvm actor builds where it
runs.  An actor that cannot work (no GPU where it needs one, no TVM where it must build) refuses to start and
is named.  The driver -- the process that tunes -- is the only one that reads and writes the tuning database:
results travel back to it through Ray, so the database stays one SQLite file on one host however many hosts
measure (docs/tuning.md, "Tuning on several GPUs").
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import socket
from collections.abc import Callable, Mapping
from typing import Any

from search.records import Builder
from spacefusion.runners.common import RunnerUnavailable
from spacefusion.runners.pool import (
    ATTEMPTS,
    CANDIDATE_TIMEOUT_S,
    RESTARTS,
    START_TIMEOUT_S,
    PoolRunner,
    Slot,
    WorkerLost,
    ship,
)
from spacefusion.runners.processes import child_env
from spacefusion.runners.worker import Worker
from spacefusion.runtime.batch import describe

_ship = ship  # the name tests and scripts knew it by


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


def _short(exc: BaseException) -> str:
    """Ray's error as one line: its last line names the cause (an actor's creation error ends with the
    exception its constructor raised, after the traceback)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    last = re.sub(r"^(?:\w+\.)+(\w+: )", r"\1", lines[-1]) if lines else type(exc).__name__  # the class's own name
    return last if len(last) <= 300 else last[:300] + " ..."


class _RayWorker:
    """A Ray actor around ``worker.Worker``: requests in, answers out, as plain dicts."""

    def __init__(self, factory: Callable[[], Any], builds: bool = True) -> None:
        self.worker = Worker(factory, builds)

    def hello(self) -> dict[str, Any]:
        return self.worker.hello()

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        return self.worker.handle(request)


class RaySlot:
    """One actor of the pool; started again (a new actor) after it is lost, never restarted by Ray itself, so
    an actor whose node is gone cannot wait forever for a place: its start times out and the slot gives up."""

    def __init__(self, ray: Any, actor_cls: Any, factory: Callable[[], Any], index: int, needs: str,
                 start_timeout_s: float, call_timeout_s: float | None = None, builds: bool = True) -> None:
        self.ray, self.actor_cls, self.factory, self.index, self.builds = ray, actor_cls, factory, index, builds
        self.needs, self.start_timeout_s, self.call_timeout_s = needs, start_timeout_s, call_timeout_s
        self.label = f"ray worker {index}"
        self.actor: Any = None
        exc = ray.exceptions
        self._lost = tuple(getattr(exc, n) for n in ("RayActorError", "WorkerCrashedError", "NodeDiedError",
                                                     "ObjectLostError", "LocalRayletDiedError", "RaySystemError")
                           if hasattr(exc, n))

    def start(self) -> dict[str, Any]:
        self.stop()
        self.actor = self.actor_cls.remote(self.factory, self.builds)
        try:
            hello = self.ray.get(self.actor.hello.remote(), timeout=self.start_timeout_s)
        except self.ray.exceptions.GetTimeoutError:
            self.stop()
            raise WorkerLost(f"no actor came up within {self.start_timeout_s:g} s (no free {self.needs} on the "
                             f"cluster?)") from None
        except Exception as exc:  # its creation failed: the worker said why (no GPU, no TVM, ...)
            self.stop()
            raise WorkerLost(f"cannot work: {_short(exc)}") from None
        gpu = hello.get("cuda_visible_devices")
        self.label = f"ray worker {self.index} ({hello['host']} pid {hello['pid']}{f', GPU {gpu}' if gpu else ''})"
        return hello

    def call(self, request: dict[str, Any]) -> dict[str, Any]:
        if self.actor is None:
            raise WorkerLost("not started")
        try:
            return self.ray.get(self.actor.handle.remote(request), timeout=self.call_timeout_s)
        except self.ray.exceptions.GetTimeoutError:
            self.stop()
            raise WorkerLost(f"gave no answer within {self.call_timeout_s:g} s (stopped)") from None
        except self._lost as exc:
            raise WorkerLost(_short(exc)) from None

    def stop(self) -> None:
        actor, self.actor = self.actor, None
        if actor is not None:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001  already gone
                pass


def start_local(**init_kwargs: Any) -> None:
    """``ray.init`` a new local Ray instance whose workers import the same spacefusion as this process (its
    ``sys.path`` as their ``PYTHONPATH``: a checkout run from, not only the installed package)."""
    ray = _import_ray()
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = child_env()["PYTHONPATH"]
    try:
        ray.init(**init_kwargs)
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


class RayRunner(PoolRunner):
    """Spreads candidates over a Ray cluster: ``num_workers`` actors, each with its own inner runner.

    ``inner`` is a zero-argument factory run inside each actor (default ``LLVMRunner``; on a GPU
    cluster e.g. ``functools.partial(LocalGPURunner, iters=200)`` with ``num_gpus=1``, so each actor
    owns one GPU and timings never share a device).  ``num_workers`` defaults to as many as the cluster's GPUs
    (or CPUs) allow.  Joins the cluster at ``address`` (``HOST:PORT``, ``ray://HOST:PORT``, ``auto``) or, with
    ``None``, Ray's default (a cluster ``ray start`` left on this machine, else a new local instance;
    ``"local"``: always a new one); a Ray already initialised in this process is used as it is, and an
    ``address`` that names another cluster than it is refused.  What goes wrong before a tune is
    ``RunnerUnavailable`` within seconds: nothing answering at ``address`` within ``connect_timeout_s``, fewer
    GPUs on the cluster than one actor needs, no actor that can start (each one's reason named).  The rest, and
    what happens when an actor is lost, is ``PoolRunner``'s.
    """

    via = "ray"

    def __init__(self, address: str | None = None, num_workers: int | None = None,
                 inner: Callable[[], Any] | None = None, num_gpus: float = 0, num_cpus: float = 1,
                 init_kwargs: Mapping[str, Any] | None = None, builder: Builder | None = None,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S, start_timeout_s: float = START_TIMEOUT_S,
                 candidate_timeout_s: float | None = CANDIDATE_TIMEOUT_S, attempts: int = ATTEMPTS,
                 restarts: int = RESTARTS, ship: bool | None = None) -> None:
        self.available()  # fail at construction, not mid-tuning
        super().__init__(inner, builder, attempts, restarts, start_timeout_s, candidate_timeout_s, ship)
        self.address, self.num_workers = address, num_workers
        self.connect_timeout_s = connect_timeout_s
        self.num_gpus, self.num_cpus = num_gpus, num_cpus
        self.init_kwargs = dict(init_kwargs or {})

    @staticmethod
    def available() -> None:
        """Raise ImportError saying how to install Ray where it is not installed."""
        if importlib.util.find_spec("ray") is None:
            raise ImportError("RayRunner needs Ray, an optional extra: pip install spacefusion[ray]")

    def connect(self) -> None:
        """Join the cluster (or start a local one), check it has the GPUs the actors need, and start the actors;
        ``RunnerUnavailable`` naming the address and the reason otherwise (see the class docstring).  ``measure``
        connects on first use; call this first to fail before a tune instead of in it."""
        super().connect()

    def _join(self, ray: Any) -> None:
        if self.address is not None:
            probe(self.address, self.connect_timeout_s)  # even where Ray is up: the address must answer
        if ray.is_initialized():
            self._same_cluster(ray)
        elif self.address is None or self.address == "local":
            self._init(ray, local=True)
        else:
            self._init(ray, local=False)
        if self.num_gpus:
            gpus = ray.cluster_resources().get("GPU", 0)
            if gpus < self.num_gpus:
                where = self.address or "the local Ray instance"
                raise RunnerUnavailable(f"the Ray cluster at {where} has {gpus:g} GPUs; {self.name} actors need "
                                        f"{self.num_gpus:g} each (measure on its CPUs with --target llvm)")

    def _same_cluster(self, ray: Any) -> None:
        """Refuse an ``address`` naming another cluster than the one this process is connected to (Ray joins
        one per process, and the actors would silently go to the other)."""
        hp = None if self.address is None or self.address.startswith("ray://") else _host_port(self.address)
        if hp is None:
            return
        try:
            gcs = _host_port(ray.get_runtime_context().gcs_address or "")
            same = gcs is not None and gcs[1] == hp[1] and socket.gethostbyname(gcs[0]) == socket.gethostbyname(hp[0])
        except (OSError, AttributeError):
            return  # cannot tell: Ray's own behaviour
        if not same:
            raise RunnerUnavailable(f"this process is connected to the Ray cluster at {gcs[0]}:{gcs[1]}; a runner "
                                    f"for {self.address} cannot join another one in it (ray.shutdown() first)")

    def _init(self, ray: Any, local: bool) -> None:
        """``ray.init``, bounded and with its failure named: something that accepts connections at the address
        but is no Ray cluster made Ray retry for about 20 s and raise a ConnectionError traceback.  Ray's own
        budget for reaching the cluster (``RAY_gcs_server_port_wait_time_s``, in seconds) is set to
        ``connect_timeout_s`` for this call unless the environment sets it."""
        var = "RAY_gcs_server_port_wait_time_s"
        mine = var not in os.environ
        if mine:
            os.environ[var] = str(max(1, math.ceil(self.connect_timeout_s)))
        try:
            if local:
                start_local(address=self.address, **self.init_kwargs)
            else:
                ray.init(address=self.address, **self.init_kwargs)
        except Exception as exc:
            where = f"at {self.address}" if self.address not in (None, "local") else "(a local instance)"
            raise RunnerUnavailable(f"no Ray cluster {where}: ray.init failed: {describe(exc)}") from None
        finally:
            if mine:
                os.environ.pop(var, None)

    def _slots(self) -> list[Slot]:
        ray = _import_ray()
        self._join(ray)
        n = self.num_workers
        res = ray.cluster_resources()
        if n is None:  # one actor per GPU (or CPU) share the cluster has
            per, have = (self.num_gpus, res.get("GPU", 0)) if self.num_gpus else (self.num_cpus, res.get("CPU", 1))
            n = max(1, int(have // per) if per else 1)
        needs = f"{self.num_gpus:g} GPU" if self.num_gpus else f"{self.num_cpus:g} CPU"
        actor_cls = ray.remote(_RayWorker).options(num_cpus=self.num_cpus, num_gpus=self.num_gpus, max_restarts=0)
        return [RaySlot(ray, actor_cls, self.inner, i, needs, self.start_timeout_s, self.candidate_timeout_s,
                        builds=not self.ship) for i in range(n)]
