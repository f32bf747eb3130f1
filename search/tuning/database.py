"""The database interface: what a tune reads and writes its records through (``search.database.TuningDatabase``
implements it with SQLite; a research script may hand an in-memory one)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

from schedulers.schedule import Schedule
from search.records import MeasureResult


@runtime_checkable
class Database(Protocol):
    """Records of measured candidates under a tuning key (``search.database.tuning_key``: the workload, the
    hardware, the versions, the compile flags).

    ``readonly``: every write is refused (the tuner then claims nothing and leaves committing to the
    callbacks, which fail on the first write).  ``claim``/``release`` keep concurrent tunes on one database
    apart: ``claim`` returns the keys the owner may measure now and claims them in one transaction."""

    readonly: bool

    def add(self, key: str, schedule: Schedule, result: MeasureResult, parts: dict[str, Any] | None = None) -> None:
        """Store one record at once (an interrupted tune keeps it)."""
        ...

    def records(self, key: str) -> list[tuple[Schedule, MeasureResult]]:
        """Every record under ``key``, failures too, oldest first."""
        ...

    def best(self, key: str) -> tuple[Schedule, MeasureResult] | None:
        """The successful record of the lowest median latency (the earliest on a tie)."""
        ...

    def measured_keys(self, key: str) -> set[str]:
        """Schedule keys that count as measured (every record but an environmental failure)."""
        ...

    def claim(self, key: str, schedule_keys: Iterable[str], owner: str, ttl_s: float = ...) -> list[str]:
        """Of ``schedule_keys``, those ``owner`` may measure now, claimed for it."""
        ...

    def release(self, key: str, owner: str) -> None:
        """Drop ``owner``'s claims under ``key``."""
        ...


DATABASE_MEMBERS = ("readonly", "add", "records", "best", "measured_keys", "claim", "release")


def check_database(db: object) -> Database:
    """``db`` if it offers every member of ``Database``; else a TypeError naming what it lacks."""
    missing = [m for m in DATABASE_MEMBERS if not hasattr(db, m)]
    if missing:
        raise TypeError(f"{type(db).__name__} is not a tuning database (search.tuning.Database): it lacks "
                        f"{', '.join(missing)}")
    return db  # type: ignore[return-value]
