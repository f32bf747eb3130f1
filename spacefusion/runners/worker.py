"""The worker side of the measuring pools (``pool.py``): one process -- a subprocess of ``ProcessRunner`` or a
Ray actor of ``RayRunner`` -- that keeps one inner runner and answers one request at a time.

Requests and answers are JSON-able dicts (schedules as ``Schedule.to_json``, SMGs as ``smg_to_dict``, results
as ``MeasureResult.to_dict``): nothing TVM-side crosses a process boundary, and nothing is pickled but, under
Ray, the factory that makes the inner runner.

* ``{"op": "measure", "schedule": JSON, "target": str, "inputs_from": SMG dict | None}`` ->
  ``{"ok": True, "result": record dict}``, measured by the inner runner (which builds, checks, then times);
  with ``"artefact": {file name: base64}`` (a CUDA artefact built and shipped by the tuning host), written to
  a scratch folder and measured by the inner runner's ``measure_built``, nothing built here.
* ``{"op": "build", "schedule": JSON, "target": str, "out": folder?}`` -> ``{"ok": True, "error": str | None,
  "build_s": float}``: a build worker (inner ``TVMBuilder``) saves the artefact into ``out`` (kept, to be
  shipped) or a scratch folder; nvcc's cubin lands in the content-hashed cache either way.
* anything that raises -> ``{"ok": False, "error": "Type: message"}``.

A worker is made ready (``Worker.__init__``) only if it can do its work: a GPU runner without a visible GPU,
or a runner that builds with TVM where TVM is not installed, refuses to start, so a pool never hands it a
candidate whose failure would then be recorded as the kernel's.

``main([SPEC])`` is the subprocess form (``ProcessRunner``, ``processes.WORKER_MAIN``): SPEC is
``factory_spec``'s JSON; the first line on stdout says it is ready (``hello``) or why not, then one answer line
per request line on stdin, until stdin ends.  Everything else the process prints (TVM, nvcc) goes to stderr.
"""

from __future__ import annotations

import base64
import functools
import importlib
import importlib.util
import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spacefusion.runtime.batch import describe


def factory_spec(factory: Callable[[], Any]) -> dict[str, Any]:
    """``factory`` (a class or function, or a ``functools.partial`` of one with JSON-able keywords) as the JSON
    a subprocess makes it again from (``factory_from_spec``): its import path and keywords, no pickle.
    ValueError naming what cannot be sent (a lambda, a closure, positional arguments, non-JSON keywords)."""
    kwargs: dict[str, Any] = {}
    fn = factory
    if isinstance(factory, functools.partial):
        if factory.args:
            raise ValueError(f"{factory!r}: a worker's factory takes keywords only, not positional arguments")
        fn, kwargs = factory.func, dict(factory.keywords)
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or not name or "<" in name:
        raise ValueError(f"{factory!r}: a worker process makes its runner from an importable class or function "
                         f"(module:name), not a lambda or a nested function")
    try:
        json.dumps(kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{factory!r}: its keywords must be JSON values to reach a worker process ({e})") from None
    return {"factory": f"{module}:{name}", "kwargs": kwargs}


def factory_from_spec(spec: dict[str, Any]) -> Callable[[], Any]:
    """The factory ``factory_spec`` described (imported here)."""
    module, _, name = str(spec["factory"]).partition(":")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return functools.partial(obj, **dict(spec.get("kwargs", {})))


def _builds_with_tvm(inner: Any) -> bool:
    from spacefusion.runners.builder import TVMBuilder

    return isinstance(inner, TVMBuilder) or isinstance(getattr(inner, "builder", None), TVMBuilder)


class Worker:
    """One inner runner (or builder) and the requests it answers; see the module docstring.

    ``builds``: whether the worker will be asked to build (False where the pool ships every candidate built, so
    a worker without TVM may start).  The inner object is made once, so its reference cache (inputs and numpy
    references per graph) and, for a GPU runner, its CUDA context serve every candidate the worker is given."""

    def __init__(self, factory: Callable[[], Any], builds: bool = True) -> None:
        self.inner = factory()
        check = getattr(self.inner, "check", None)
        if callable(check):  # a GPU runner: a visible GPU, torch and cupy (RunnerUnavailable otherwise)
            check()
        if builds and _builds_with_tvm(self.inner) and importlib.util.find_spec("tvm") is None:
            raise RuntimeError(f"{type(self.inner).__name__} builds with TVM, which is not installed on "
                               f"{socket.gethostname()} (pip install 'spacefusion[tvm]' there, or "
                               f"tools/offline_bundle.py)")
        self.answered = 0

    def hello(self) -> dict[str, Any]:
        """Who this worker is: host, pid, the GPU it sees (``CUDA_VISIBLE_DEVICES``, as Ray or the pool set it),
        the inner runner's name."""
        return {"host": socket.gethostname(), "pid": os.getpid(),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "inner": getattr(self.inner, "name", type(self.inner).__name__)}

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        """The answer to one request; never raises (an exception is ``{"ok": False, "error": ...}``)."""
        try:
            op = request.get("op")
            if op == "measure":
                answer = {"ok": True, "result": self._measure(request)}
            elif op == "build":
                answer = {"ok": True, **self._build(request)}
            elif op == "ping":
                answer = {"ok": True}
            else:
                raise ValueError(f"unknown request {op!r}")
        except Exception as exc:  # noqa: BLE001  one bad request must not take the worker down
            answer = {"ok": False, "error": describe(exc)}
        self.answered += 1
        return answer

    def _measure(self, request: dict[str, Any]) -> dict[str, Any]:
        from schedulers.schedule import Schedule
        from search.records import MeasureInput
        from smg.serialize import smg_from_dict

        frm = request.get("inputs_from")
        inp = MeasureInput(Schedule.from_json(request["schedule"]), str(request["target"]),
                           None if frm is None else smg_from_dict(frm))
        files = request.get("artefact")
        if files is None:
            return self.inner.measure([inp])[0].to_dict()
        with tempfile.TemporaryDirectory(prefix="sf-shipped-") as tmp:  # built and shipped by the tuning host
            for name, data in files.items():
                (Path(tmp) / Path(name).name).write_bytes(base64.b64decode(data))
            out = self.inner.measure_built(inp, tmp).to_dict()
        out["meta"] = {**out.get("meta", {}), "shipped": sorted(Path(n).name for n in files)}
        return out

    def _build(self, request: dict[str, Any]) -> dict[str, Any]:
        from schedulers.schedule import Schedule

        t0 = time.perf_counter()
        try:
            built = self.inner.build(Schedule.from_json(request["schedule"]), str(request["target"]))
            if hasattr(built, "save"):
                if request.get("out"):  # kept, to be shipped to a measuring worker
                    built.save(request["out"])
                else:
                    with tempfile.TemporaryDirectory(prefix="sf-build-") as tmp:
                        built.save(tmp)
            error = None
        except Exception as exc:  # noqa: BLE001  the runner builds it again and reports the error as the result's
            error = describe(exc)
        return {"error": error, "build_s": round(time.perf_counter() - t0, 4)}


def main(argv: list[str] | None = None) -> int:
    """The subprocess form (see the module docstring): ``argv`` is ``[SPEC]``."""
    argv = sys.argv[1:] if argv is None else argv
    proto = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol's own copy of stdout ...
    os.dup2(2, 1)  # ... and everything else printed, by Python or by C (TVM, nvcc), goes to the log
    try:
        spec = json.loads(argv[0])
        worker = Worker(factory_from_spec(spec), builds=bool(spec.get("builds", True)))
        proto.write(json.dumps({"ready": True, **worker.hello()}) + "\n")
    except Exception as exc:  # noqa: BLE001  said to the pool, which names it where it reports the worker gone
        proto.write(json.dumps({"ready": False, "error": describe(exc)}) + "\n")
        return 1
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
        except ValueError as exc:
            answer = {"ok": False, "error": f"the request is not JSON: {describe(exc)}"}
        else:
            answer = worker.handle(request)
        proto.write(json.dumps(answer) + "\n")
    return 0

