"""TVM's builder, the implementation of ``search.records.Builder`` the tuner is handed."""

from __future__ import annotations

import atexit
import logging
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from schedulers.schedule import Schedule
from search.records import MeasureInput

log = logging.getLogger("spacefusion")


class TVMBuilder:
    """Lowers through TVM (``spacefusion.api.build``): a ``CpuKernel`` for llvm, a ``CudaArtefact`` for CUDA.

    With ``keep_artefacts`` (set by a pool runner that ships artefacts to its workers), ``prebuild`` keeps each
    CUDA candidate's artefact folder, or its build error, for ``artefact`` to hand out until ``forget``."""

    name = "tvm"
    keep_artefacts = False

    @property
    def flags(self) -> tuple[str, ...]:
        from spacefusion.lower.build import COMPILE_FLAGS

        return tuple(COMPILE_FLAGS)

    def build(self, schedule: Schedule, target: str) -> Any:
        from spacefusion.api import build

        return build(schedule, target)

    def target_kind(self, target: str) -> str:
        from spacefusion.lower.build import parse_target

        return parse_target(target)[0]

    def prebuild(self, inputs: list[MeasureInput], workers: int) -> float:
        """Build CUDA candidates in ``workers`` build processes (``import tvm`` and nvcc take seconds per kernel):
        the cubins land in the content-hashed cache, so the runner's own build -- in this process or in a
        measuring worker of this host -- is a cache hit.  The build processes (``processes.build_pool``) start on
        first use and stay for the process's life; several tunes at once share them.  With ``keep_artefacts``
        the artefacts are kept (``artefact``), and built even with one worker."""
        cuda = [i for i in inputs if i.target.startswith(("cuda", "sm_"))]
        keep = self.keep_artefacts
        if not cuda or (workers <= 1 and not keep):
            return 0.0
        from spacefusion.runners.common import RunnerUnavailable
        from spacefusion.runners.processes import build_pool

        t0 = time.perf_counter()
        try:
            pool = build_pool(max(1, workers))
        except RunnerUnavailable as exc:  # only time is lost: the runner builds each candidate itself
            log.warning("prebuild: no build worker started, the runner builds: %s", exc)
            return time.perf_counter() - t0
        folders = [self._folder(i) if keep else None for i in cuda]
        answers = pool.run([{"op": "build", "schedule": i.schedule.to_json(), "target": i.target,
                             **({"out": str(f)} if f is not None else {})} for i, f in zip(cuda, folders)])
        if keep:
            with _KEPT_LOCK:
                for i, f, a in zip(cuda, folders, answers):
                    if a.get("environmental"):  # no build worker left: the runner builds it itself
                        continue
                    error = a.get("error") if a.get("ok") else f"the build worker was lost: {a.get('error')}"
                    self._kept()[(i.key, i.target)] = f if error is None else str(error)
        return time.perf_counter() - t0

    def _kept(self) -> dict[tuple[str, str], Path | str]:
        kept = self.__dict__.get("_kept_artefacts")
        if kept is None:
            kept = self.__dict__["_kept_artefacts"] = {}
        return kept

    def _folder(self, inp: MeasureInput) -> Path:
        return _store() / f"{inp.key}-{inp.target.replace(':', '_')}-{time.time_ns()}"

    def keep(self, inp: MeasureInput) -> None:
        """Build ``inp`` in this process and keep its artefact (or its error), as ``prebuild`` would have."""
        folder = self._folder(inp)
        try:
            self.build(inp.schedule, inp.target).save(folder)
            got: Path | str = folder
        except Exception as exc:  # noqa: BLE001  the candidate's build error, recorded as its result
            from spacefusion.runtime.batch import describe

            got = describe(exc)
        with _KEPT_LOCK:
            self._kept()[(inp.key, inp.target)] = got

    def artefact(self, key: str, target: str) -> Path | str | None:
        """The kept artefact folder of candidate ``(key, target)``, its build error, or None if it was not built."""
        with _KEPT_LOCK:
            return self._kept().get((key, target))

    def forget(self, key: str, target: str) -> None:
        """Drop a kept artefact (measured): its folder goes."""
        with _KEPT_LOCK:
            got = self._kept().pop((key, target), None)
        if isinstance(got, Path):
            shutil.rmtree(got, ignore_errors=True)


_KEPT_LOCK = threading.Lock()
_STORE: list[Path] = []


def _store() -> Path:
    """This process's folder of kept artefacts (removed at exit)."""
    with _KEPT_LOCK:
        if not _STORE:
            _STORE.append(Path(tempfile.mkdtemp(prefix="sf-artefacts-")))
            atexit.register(shutil.rmtree, _STORE[0], True)
        return _STORE[0]
