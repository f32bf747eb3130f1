"""The CPU runner: TVM llvm on this machine, what CI uses to exercise the whole tuning loop."""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from search.records import Builder, MeasureInput, MeasureResult
from smg.reference import check_numerics, float32_error_scales
from spacefusion.runners.builder import TVMBuilder
from spacefusion.runners.common import fail, ok, prepare
from spacefusion.runtime.batch import References, describe


class LLVMRunner:
    """Builds for llvm and times on this CPU with ``time.perf_counter``.

    Each latency is one call of the compiled function on tensors bound once (no host copies), after
    ``warmup`` untimed calls.  CPU latencies say nothing about GPU speed; this runner exists so the
    tuning loop (build -> check -> time -> record) runs, and is tested, on machines without a GPU.
    """

    name = "llvm"

    def __init__(self, repeats: int = 5, warmup: int = 1, seed: int = 0, builder: Builder | None = None) -> None:
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        self.repeats, self.warmup, self.seed = repeats, warmup, seed
        self.builder: Builder = builder if builder is not None else TVMBuilder()
        self._refs = References()
        self._scales: dict[tuple[str, int], tuple[Any, dict[str, Any]]] = {}

    def measure(self, inputs: list[MeasureInput]) -> list[MeasureResult]:
        return [self._one(inp) for inp in inputs]

    def _one(self, inp: MeasureInput) -> MeasureResult:
        meta: dict[str, Any] = {"runner": self.name, "warmup": self.warmup, "repeats": self.repeats,
                                "seed": self.seed, "device": f"cpu ({platform.machine()})"}
        got = prepare(inp, self.builder, "llvm", f"{self.name} runner measures target 'llvm' only", self._refs,
                      self.seed, meta)
        if isinstance(got, MeasureResult):
            return got
        x, ref = got
        t0 = time.perf_counter()
        try:
            kernel = self.builder.build(inp.schedule, inp.target)
        except Exception as exc:
            return fail(inp, f"build: {describe(exc)}", meta)
        meta["build_s"] = round(time.perf_counter() - t0, 4)
        try:
            out = kernel(x)
        except Exception as exc:
            return fail(inp, f"run: {describe(exc)}", meta)
        smg, key = inp.schedule.smg, (inp.schedule.smg.key, id(x))
        if key not in self._scales:  # the error model's bound of fp32 outputs, once per graph and inputs (held,
            self._scales[key] = (x, float32_error_scales(smg, x))  # so their id names no other inputs meanwhile)
        err, problem = check_numerics(smg, ref, out, scales=self._scales[key][1])
        if problem is not None:
            return fail(inp, problem, meta, err)
        try:
            fn = _launcher(kernel, x)
            for _ in range(self.warmup):
                fn()
            lat = []
            for _ in range(self.repeats):
                t = time.perf_counter()
                fn()
                lat.append((time.perf_counter() - t) * 1e6)
        except Exception as exc:
            return fail(inp, f"timing: {describe(exc)}", meta, err)
        return ok(inp, lat, err, meta)


def _launcher(kernel: Any, inputs: Mapping[str, np.ndarray]) -> Callable[[], object]:
    """The kernel's own bound launcher where it has one (``CpuKernel.launcher``); a test double is
    simply called on the numpy inputs."""
    bind = getattr(kernel, "launcher", None)
    return bind(dict(inputs)) if callable(bind) else (lambda: kernel(inputs))
