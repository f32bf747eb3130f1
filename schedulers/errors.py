"""Scheduling errors: they say which dim, op or state blocks the schedule and why.

Each carries a stable ``code`` (the search counts refusals by it) and, where one option is to blame,
its ``knob`` (the search drops an option it offered where it cannot apply), so nothing parses the text.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from smg.errors import SpaceFusionError

if TYPE_CHECKING:
    from schedulers.knobs import Rejection


class ScheduleError(SpaceFusionError, ValueError):
    """A requested schedule is invalid (tile too large, unknown dim, ...)."""

    default_code = "schedule"

    def __init__(self, message: str = "", *, code: str | None = None, knob: str | None = None) -> None:
        super().__init__(message)
        self.code = code or self.default_code
        self.knob = knob

    @classmethod
    def rejected(cls, r: Rejection) -> ScheduleError:
        return cls(r.sentence, code=r.code, knob=r.knob)


class TemporalSliceError(ScheduleError):
    """A dependent reduction chain cannot be corrected by update functions."""

    default_code = "temporal"
