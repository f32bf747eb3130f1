"""The local GPU runner: build here with the builder, then check and time through the GPU runtime."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any, cast

from search.records import Builder, MeasureInput, MeasureResult
from spacefusion.runners.builder import TVMBuilder
from spacefusion.runners.common import RunnerUnavailable, fail, ok, prepare, unavailable
from spacefusion.runtime.batch import References, describe, measure_artefact


def gpu_unavailable_reason() -> str | None:
    """Why this process cannot run CUDA kernels (None when it can): torch, cupy and a visible GPU."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "cupy is not installed"
    return None


class _Shipped:
    """The target's kind without TVM (``TVMBuilder.target_kind`` imports it): a shipped artefact was built, for
    its target, where TVM is."""

    @staticmethod
    def target_kind(target: str) -> str:
        return "cuda" if target.startswith(("cuda", "sm_")) else "llvm"


class LocalGPURunner:
    """Builds the CUDA artefact and measures it with ``spacefusion.runtime.batch.measure_artefact``, the
    same check-then-time loop as the offline batch command.

    Needs the builder (TVM) *and* a GPU in one process; with a remote GPU use ``OfflineBatchRunner``.
    ``latencies_us`` holds one value, the median of ``iters`` CUDA-event timings; p10/p90 are in ``meta``.
    Without a usable GPU every result is an error naming what is missing.
    """

    name = "cuda-local"

    def __init__(self, warmup: int = 10, iters: int = 100, flush_l2: bool = True, seed: int = 0,
                 workdir: str | Path | None = None, builder: Builder | None = None) -> None:
        self.warmup, self.iters, self.flush_l2, self.seed = warmup, iters, flush_l2, seed
        self.workdir = None if workdir is None else Path(workdir)
        self.builder: Builder = builder if builder is not None else TVMBuilder()
        self._refs = References()

    def check(self) -> None:
        """Raise ``RunnerUnavailable`` naming what is missing when this process cannot run CUDA kernels: call it
        before a tune, which would otherwise build every candidate only to learn that none can run."""
        reason = gpu_unavailable_reason()
        if reason is not None:
            raise RunnerUnavailable(f"no GPU: {reason}; the {self.name} runner needs torch and cupy with a visible "
                                    "CUDA device")

    def measure(self, inputs: list[MeasureInput]) -> list[MeasureResult]:
        reason = gpu_unavailable_reason()
        if reason is not None:  # the machine's failure, not the kernels': marked so the tuner does not record it
            msg = (f"no GPU: {reason}; {self.name} runner needs torch + cupy with a CUDA device "
                   "(use OfflineBatchRunner for a remote GPU)")
            return [unavailable(inp, msg, {"runner": self.name}) for inp in inputs]
        with tempfile.TemporaryDirectory(prefix="sf-measure-") as tmp:
            root = self.workdir or Path(tmp)
            return [self._one(inp, root) for inp in inputs]

    def _one(self, inp: MeasureInput, root: Path) -> MeasureResult:
        got = self._prepare(inp)
        if isinstance(got, MeasureResult):
            return got
        t0 = time.perf_counter()
        try:
            folder = self.builder.build(inp.schedule, inp.target).save(
                root / f"{inp.key}-{inp.target.replace(':', '_')}")
        except Exception as exc:
            return fail(inp, f"build: {describe(exc)}", got[2])
        return self._checked_and_timed(inp, folder, got, round(time.perf_counter() - t0, 4))

    def measure_built(self, inp: MeasureInput, folder: str | Path) -> MeasureResult:
        """Check and time the artefact another process built for ``inp`` (saved in ``folder``: kernel.cu,
        kernel.json, kernel.cubin where nvcc was), without building: how a pool's GPU worker measures what the
        tuning host built and shipped (it needs no TVM).  As ``measure`` otherwise, environmental failures too."""
        reason = gpu_unavailable_reason()
        if reason is not None:
            return unavailable(inp, f"no GPU: {reason}; {self.name} runner needs torch + cupy with a CUDA device",
                               {"runner": self.name})
        got = self._prepare(inp, cast(Builder, _Shipped()))
        if isinstance(got, MeasureResult):
            return got
        return self._checked_and_timed(inp, Path(folder), got, None)

    def _prepare(self, inp: MeasureInput,
                 builder: Builder | None = None) -> tuple[Any, Any, dict[str, Any]] | MeasureResult:
        import torch

        meta: dict[str, Any] = {"runner": self.name, "seed": self.seed, "device": torch.cuda.get_device_name()}
        got = prepare(inp, builder or self.builder, "cuda", f"{self.name} runner measures CUDA targets", self._refs,
                      self.seed, meta)
        if isinstance(got, MeasureResult):
            return got
        return got[0], got[1], meta

    def _checked_and_timed(self, inp: MeasureInput, folder: Path, got: tuple[Any, Any, dict[str, Any]],
                           build_s: float | None) -> MeasureResult:
        x, ref, meta = got
        if build_s is not None:
            meta["build_s"] = build_s
        m = measure_artefact(folder, inp.schedule.smg, x, ref, warmup=self.warmup, iters=self.iters,
                             flush_l2=self.flush_l2, schedule_key=inp.key)
        meta.update(m.meta)
        if m.error is not None:
            return fail(inp, m.error, meta, m.max_abs_err)
        return ok(inp, [m.latency_us], m.max_abs_err, meta)
