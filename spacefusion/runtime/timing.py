"""The one GPU timer: CUDA events per iteration, L2 flushed between runs, median reported.

The flush *reads* a buffer twice the L2 by default, leaving L2 full of clean lines. Zeroing it
instead (``flush="write"``, Triton's ``do_bench`` way) leaves ~L2-size of dirty lines whose write-back
the timed kernel then pays for (measured: docs/architecture.md, 'Timing a kernel'). A cold-L2 timing
should bill the kernel for its own traffic only.

Every benchmark (the artefact harness, baselines, the tuner) uses this, so their numbers compare.
torch is imported lazily so that the module imports on CPU-only machines.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

#: Flush buffer floor; also at least twice the device's L2 (H100: 50 MB, H200: 60 MB).
MIN_FLUSH_BYTES = 256 * 1024 * 1024
#: How the L2 is flushed between timed runs: "read" (clean lines, the default) or "write" (dirty).
FLUSH_MODES = ("read", "write")
DEFAULT_FLUSH = "read"
#: ``torch.cuda._sleep`` counts clock cycles: at the H100's 1.98 GHz boost this holds the GPU a little longer
#: than asked at lower clocks, never shorter
SLEEP_CYCLES_PER_S = 2.0e9
#: the hold before the timed runs: twice the host's enqueueing time, at least 1 ms, at most 0.25 s
HOLD_MIN_S, HOLD_MAX_S = 1e-3, 0.25


@dataclass(frozen=True)
class TimingResult:
    """Per-launch GPU time in microseconds over ``iters`` timed runs (cold L2 when flushed)."""

    median_us: float
    p10_us: float
    p90_us: float
    iters: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default) of already sorted values; q in [0, 100]."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(samples_us: Sequence[float]) -> TimingResult:
    """Median and 10th/90th percentiles: the median resists clock and launch outliers."""
    ordered = sorted(samples_us)
    return TimingResult(
        median_us=percentile(ordered, 50),
        p10_us=percentile(ordered, 10),
        p90_us=percentile(ordered, 90),
        iters=len(ordered),
    )


def time_cuda(
    fn: Callable[[], object],
    warmup: int = 10,
    iters: int = 100,
    flush_l2: bool = True,
    *,
    flush_bytes: int | None = None,
    flush: str = DEFAULT_FLUSH,
    hold: bool = True,
) -> TimingResult:
    """Time ``fn`` (which launches GPU work on torch's current stream) with CUDA events.

    Each iteration brackets only ``fn`` with a start/end event pair; the L2 flush (reading, or with
    ``flush="write"`` zeroing, a buffer larger than L2) is enqueued before the start event, so it is
    ordered before but not timed. All events are read after one final synchronise, so the host never
    stalls the stream mid-run, and a sleep kernel holds the GPU while the host enqueues them, so the
    runs go back to back and no host launch latency falls between an event and its kernel.  ``hold=False``
    leaves the host's pace in the times: a whole model run eagerly is as slow as its host, and a model
    benchmark bills it for that.
    """
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    if flush not in FLUSH_MODES:
        raise ValueError(f"unknown L2 flush mode {flush!r}; known: {', '.join(FLUSH_MODES)}")
    import torch

    device = torch.device("cuda", torch.cuda.current_device())
    evict: Callable[[], object] | None = None
    if flush_l2:
        l2 = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0))
        nbytes = flush_bytes if flush_bytes is not None else max(MIN_FLUSH_BYTES, 2 * l2)
        buf = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
        evict = buf.zero_ if flush == "write" else buf.amax

    marks = [time.perf_counter()]
    for _ in range(warmup):
        if evict is not None:
            evict()
        fn()
        marks.append(time.perf_counter())
    # an iteration's enqueueing (or the GPU's, if longer); the first (a module's load, an allocation) left out
    host_s = (marks[-1] - marks[1]) / (len(marks) - 2) if len(marks) > 2 else marks[-1] - marks[0]
    torch.cuda.synchronize(device)

    # the GPU busy while the host enqueues every timed run: otherwise a start event fires when recorded and a
    # kernel shorter than the host's launch waits for it inside the timed window (a 5 us kernel measured
    # 5-47 us when launched from Python)
    if hold:
        torch.cuda._sleep(int(min(HOLD_MAX_S, 2 * host_s * iters + HOLD_MIN_S) * SLEEP_CYCLES_PER_S))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends, strict=True):
        if evict is not None:
            evict()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    samples_us = [start.elapsed_time(end) * 1000.0 for start, end in zip(starts, ends, strict=True)]
    del evict
    return summarize(samples_us)
