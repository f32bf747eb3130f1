"""TVM's builder, the implementation of ``search.records.Builder`` the tuner is handed."""

from __future__ import annotations

import os
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from schedulers.schedule import Schedule
from search.records import MeasureInput


def _prebuild_one(args: tuple[str, str, str]) -> str | None:
    """Worker: lower one candidate and compile its cubin into the content-hashed cache."""
    schedule_json, target, folder = args
    try:
        TVMBuilder().build(Schedule.from_json(schedule_json), target).save(folder)
        return None
    except Exception as exc:  # reported by the runner when it builds the same candidate
        return f"{type(exc).__name__}: {exc}"


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
        """Build CUDA candidates in parallel processes (``import tvm`` and nvcc take seconds per kernel):
        the cubins land in the content-hashed cache, so the runner's own build is a cache hit."""
        cuda = [i for i in inputs if i.target.startswith(("cuda", "sm_"))]
        if not cuda or workers <= 1:
            return 0.0
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp, ProcessPoolExecutor(workers) as pool:
            jobs = [(i.schedule.to_json(), i.target, os.path.join(tmp, i.key)) for i in cuda]
            list(pool.map(_prebuild_one, jobs))
        return time.perf_counter() - t0
