"""The measured choice of a compiled graph: its fused path or torch's own graph, whichever the real calls time
faster (issue 55 item 4; issue 58: a compiled graph is never slower than torch running it).

A graph with fused kernels can still be slower than torch running the same graph: a CUDA graph replay of
kernels whose first pick is poor, or the CPU targets' llvm kernels, whose GPU-shaped schedules run scalar.
Like Inductor's max-autotune, which benchmarks its choices, but on the calls the user makes, so no work is
wasted: after a build, the next calls alternate between the two paths, each call running exactly ONE of them
and returning its result (a buffer the graph writes, a step counter, is written once per call, as in eager),
``WARMUP`` untimed calls then ``SAMPLES`` timed calls of each; then the faster median is kept for good.  A
fused path within ``MARGIN`` of torch's keeps the fused path: it is what the user asked for.

What "torch's graph" is: the graph torch would run without this backend, launched op by op (``gm.forward``
of the Dynamo graph for inference, aot_autograd's ATen graph for a training stage).  Where the fused path is
one CUDA graph replay, torch's side is still launched op by op (eager's own way of running it): the rule is
"never slower than eager", and a second capture of torch's graph would hold a second copy of its
activations and needs its own invalidation.

Timing: on CUDA, events recorded around the call and synchronised on at its end (only during the
measurement); on the CPU, ``time.perf_counter``.  A timer is injectable (``Timer``: the backend's
``timer``), so tests choose the numbers instead of depending on a loaded machine's clock.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

#: untimed calls of each path before its timed ones (the first fused call loads its kernels, the first
#: torch call allocates its workspaces)
WARMUP = 1
#: timed calls of each path; their medians decide
SAMPLES = 3
#: a fused median at most this fraction above torch's keeps the fused path (what the user asked for)
MARGIN = 0.03

FUSED, TORCH = "fused", "torch"
#: the report's codes of the two outcomes (declared with the refusal codes, ``refusals.CODES``)
KEPT = {FUSED: "kept.fused", TORCH: "kept.torch"}

#: ``timer(path, call, cuda) -> (call's result, seconds)``: runs ``call()`` once and says how long it took;
#: ``path`` is ``FUSED`` or ``TORCH`` (a test's timer answers by it), ``cuda`` whether the inputs are on the GPU
Timer = Callable[[str, Callable[[], Any], bool], tuple[Any, float]]


def wall_timer(path: str, call: Callable[[], Any], cuda: bool) -> tuple[Any, float]:
    """``call()`` timed: CUDA events around it, synchronised on its end event, where ``cuda``; else
    ``time.perf_counter``."""
    del path
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = call()
        end.record()
        end.synchronize()
        return out, start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    out = call()
    return out, time.perf_counter() - t0


class Choice:
    """One build's measurement: which path the next call runs (``next_path``), the samples (``record``), and
    once both paths have ``SAMPLES`` timed calls, the path kept (``kept``) and the two medians in seconds.

    Calls alternate fused, torch, fused, ...; each path's first ``WARMUP`` calls are not sampled.  ``on``
    False: no measurement, the fused path is kept (``measure=False``: research that wants the kernels
    whatever their speed, and the correctness tests)."""

    def __init__(self, on: bool = True, timer: Timer | None = None, cuda: bool = False) -> None:
        self.timer = timer or wall_timer
        self.cuda = cuda
        self.calls = 0
        self.samples: dict[str, list[float]] = {FUSED: [], TORCH: []}
        self.seen: dict[str, int] = {FUSED: 0, TORCH: 0}
        self.kept: str | None = None if on else FUSED
        self.medians: dict[str, float] = {}

    @property
    def measuring(self) -> bool:
        return self.kept is None

    def next_path(self) -> str:
        """The path the next call runs: the one kept, else the alternation's next."""
        if self.kept is not None:
            return self.kept
        return FUSED if self.calls % 2 == 0 else TORCH

    def record(self, path: str, seconds: float) -> bool:
        """One call of ``path`` took ``seconds``; True when this call decided the choice."""
        if self.kept is not None:
            return False
        if path not in self.samples:
            raise ValueError(f"unknown path {path!r}: {FUSED!r} or {TORCH!r}")
        if seconds < 0 or seconds != seconds:
            raise ValueError(f"a call of the {path} path took {seconds!r} seconds: a timer returns a time >= 0")
        self.calls += 1
        self.seen[path] += 1
        if self.seen[path] > WARMUP:
            self.samples[path].append(float(seconds))
        if any(len(s) < SAMPLES for s in self.samples.values()):
            return False
        self.medians = {p: statistics.median(s) for p, s in self.samples.items()}
        self.kept = FUSED if self.medians[FUSED] <= self.medians[TORCH] * (1 + MARGIN) else TORCH
        return True

    def line(self) -> str:
        """The report's line of a decided choice."""
        f, t = self.medians[FUSED], self.medians[TORCH]
        what = "the fused kernels" if self.kept == FUSED else "torch's graph"
        return (f"measured: kept {what} [{KEPT[self.kept]}]: fused {f * 1e3:.3f} ms, torch {t * 1e3:.3f} ms "
                f"(medians of {SAMPLES} calls each; torch op by op; fused kept within {MARGIN:.0%})")
