"""What the tuner measures and remembers, and the interfaces it measures through: the records
shared by runners, the database and the learned cost model; the ``Builder`` and ``Runner`` protocols
whose implementations (TVM, a GPU) live above this layer and are handed to the tuner.

A ``MeasureInput`` is a schedule and a target; a ``MeasureResult`` is what a
runner observed (numerics first, then timings).  Both are plain, frozen and
JSON round-trippable, so an offline batch measured on another machine can be
imported unchanged.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # only a type here: the GPU runtime reads records without importing the schedulers
    from schedulers.schedule import Schedule
    from smg.ir import SMG

RECORD_FORMAT = "spacefusion-record/1"
#: ``meta`` key a runner sets (True) on a result that failed because of where it ran, not what it ran: no GPU
#: visible, the runtime missing.  Such a result says nothing about the candidate, so the tuner neither stores
#: it nor counts it against the trials, and the database does not count one stored by older code as measured.
ENVIRONMENT = "environment"
#: How ``LocalGPURunner`` began that error before the flag existed (records in databases written then).
_LEGACY_ENVIRONMENT_ERRORS = ("no GPU: ",)


@dataclass(frozen=True)
class MeasureInput:
    """One candidate to measure: a schedule and the target it is built for
    (``"llvm"`` or ``"cuda:<arch>"``).  ``inputs_from``: the SMG whose outputs the schedule's graph reads
    (a split reduction's partial, whose sums its ``stats`` kernel totals), so its check runs on inputs that
    graph computes, not on random ones (``smg.reference.produced_inputs``)."""

    schedule: Schedule
    target: str
    inputs_from: SMG | None = None

    @property
    def key(self) -> str:
        return self.schedule.key


@dataclass(frozen=True)
class MeasureResult:
    """What one measurement gave.

    ``latencies_us`` are the individual timed runs (empty when the candidate
    failed to build, or failed the numerics check, which ``error`` then says).
    ``max_abs_err`` is the check against the unfused numpy reference, done
    before any timing.  ``meta`` holds free-form provenance (device, runner,
    warm-up, build seconds).
    """

    schedule_key: str
    target: str
    latencies_us: tuple[float, ...] = ()
    max_abs_err: float | None = None
    error: str | None = None
    meta: tuple[tuple[str, Any], ...] = field(default=())

    @property
    def ok(self) -> bool:
        return self.error is None and len(self.latencies_us) > 0

    @property
    def environmental(self) -> bool:
        """Failed because of the machine it was measured on (``meta["environment"]``, or an older record's
        "no GPU: ..." error), so the same candidate may well succeed elsewhere: not a verdict on the kernel."""
        if self.ok:
            return False
        return bool(dict(self.meta).get(ENVIRONMENT)) or (self.error or "").startswith(_LEGACY_ENVIRONMENT_ERRORS)

    @property
    def median_us(self) -> float:
        """Median latency, +inf for a failed candidate (so it sorts last)."""
        if not self.ok:
            return math.inf
        xs = sorted(self.latencies_us)
        n = len(xs)
        return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": RECORD_FORMAT,
            "schedule_key": self.schedule_key,
            "target": self.target,
            "latencies_us": list(self.latencies_us),
            "max_abs_err": self.max_abs_err,
            "error": self.error,
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MeasureResult:
        if not isinstance(d, dict) or d.get("format") != RECORD_FORMAT:
            raise ValueError(f"not a spacefusion measurement record: {str(d)[:120]}")
        return cls(
            schedule_key=str(d["schedule_key"]),
            target=str(d["target"]),
            latencies_us=tuple(float(x) for x in d.get("latencies_us", ())),
            max_abs_err=None if d.get("max_abs_err") is None else float(d["max_abs_err"]),
            error=d.get("error"),
            meta=tuple(sorted((str(k), v) for k, v in dict(d.get("meta", {})).items())),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


class Runner(Protocol):
    """Measures candidates; every implementation checks numerics before timing."""

    name: str

    def measure(self, inputs: list[MeasureInput]) -> list[MeasureResult]:
        """One result per input, in order; a failure is a result with ``error``, not an exception."""
        ...


class Builder(Protocol):
    """Lowers schedules to something a runner can check and time (an implementation: TVM's, in
    ``spacefusion.runners.builder``); the tuner calls it only through this interface."""

    name: str
    #: compile flags that decide a result besides the schedule: part of every tuning key
    flags: tuple[str, ...]

    def build(self, schedule: Schedule, target: str) -> Any:
        """The built candidate (a CPU callable, or a CUDA artefact with ``save``); raises if it cannot lower."""
        ...

    def target_kind(self, target: str) -> str:
        """``"llvm"`` or ``"cuda"`` for a target string; ValueError naming an unknown one."""
        ...

    def prebuild(self, inputs: list[MeasureInput], workers: int) -> float:
        """Build ``inputs`` ahead of measuring (e.g. in parallel into a cache); seconds spent."""
        ...
