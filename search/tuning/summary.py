"""What a tune found (``TuneSummary``), and the same as plain data for result files (``summary_dict``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from schedulers.schedule import Schedule
from search.records import MeasureResult
from search.space import SpaceReport


@dataclass
class TuneSummary:
    """What a tune found, how long it took, and how well the cost models ranked."""

    workload: str
    key: str
    best: Schedule | None
    best_result: MeasureResult | None
    from_cache: bool = False
    pending: str | None = None
    #: why candidates could not be measured on this runner at all (the environment, not the kernels)
    unmeasured: str | None = None
    space: SpaceReport | None = None
    built: int = 0
    measured: int = 0
    failed: int = 0
    wall_s: float = 0.0
    time_to_best_s: float = 0.0
    predicted_us: float | None = None
    analytical: dict[str, float] = field(default_factory=dict)
    learned: dict[str, float] = field(default_factory=dict)

    @property
    def best_us(self) -> float | None:
        return None if self.best_result is None else self.best_result.median_us

    def __str__(self) -> str:
        lines = [f"tune {self.workload}  key={self.key[:12]}"]
        if self.from_cache:
            lines.append("  cached best reused (set SPACEFUSION_NO_CACHE=1 to tune again)")
        if self.space is not None:
            lines.append(f"  {self.space}")
        lines.append(f"  built {self.built}, measured {self.measured} ({self.failed} failed), "
                     f"wall {self.wall_s:.1f} s, best found after {self.time_to_best_s:.1f} s")
        if self.pending:
            lines.append(f"  pending: {self.pending}")
        if self.unmeasured:
            lines.append(f"  not measured (nothing recorded for them): {self.unmeasured}")
        if self.best is not None and self.best_result is not None:
            lines.append(f"  best: {self.best_us:.1f} us  tiles {self.best.tiles} thread dim {self.best.thread_dim} "
                         f"serial {self.best.serial} step {self.best.step}")
            if self.predicted_us is not None:
                lines.append(f"  analytical model predicted {self.predicted_us:.1f} us for it "
                             f"({self.predicted_us / self.best_us:.2f}x)")
        for name, q in (("analytical", self.analytical), ("learned", self.learned)):
            if q:
                lines.append(f"  {name} model on unseen records: spearman {q['spearman']:.3f}, "
                             f"top-1 slowdown {q['top1_slowdown']:.2f}x over {int(q['n'])} records")
        return "\n".join(lines)


def summary_dict(s: TuneSummary) -> dict[str, Any]:
    """Plain data for result files."""
    return {
        "workload": s.workload, "key": s.key, "from_cache": s.from_cache, "pending": s.pending,
        "unmeasured": s.unmeasured,
        "space": None if s.space is None else vars(s.space), "built": s.built, "measured": s.measured,
        "failed": s.failed, "wall_s": s.wall_s, "time_to_best_s": s.time_to_best_s, "best_us": s.best_us,
        "best_schedule": None if s.best is None else s.best.to_dict(), "predicted_us": s.predicted_us,
        "analytical": s.analytical, "learned": s.learned,
    }
