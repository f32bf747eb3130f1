"""TVM's builder, the implementation of ``search.records.Builder`` the tuner is handed."""

from __future__ import annotations

import logging
import time
from typing import Any

from schedulers.schedule import Schedule
from search.records import MeasureInput

log = logging.getLogger("spacefusion")


class TVMBuilder:
    """Lowers through TVM (``spacefusion.api.build``): a ``CpuKernel`` for llvm, a ``CudaArtefact`` for CUDA."""

    name = "tvm"

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
        first use and stay for the process's life; several tunes at once share them."""
        cuda = [i for i in inputs if i.target.startswith(("cuda", "sm_"))]
        if not cuda or workers <= 1:
            return 0.0
        from spacefusion.runners.common import RunnerUnavailable
        from spacefusion.runners.processes import build_pool

        t0 = time.perf_counter()
        try:
            pool = build_pool(workers)
        except RunnerUnavailable as exc:  # only time is lost: the runner builds each candidate itself
            log.warning("prebuild: no build worker started, the runner builds: %s", exc)
            return time.perf_counter() - t0
        pool.run([{"op": "build", "schedule": i.schedule.to_json(), "target": i.target} for i in cuda])
        return time.perf_counter() - t0
