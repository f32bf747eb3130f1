"""Scheduling errors: they say which dim, op or state blocks the schedule and why."""

from smg.errors import SpaceFusionError


class ScheduleError(SpaceFusionError, ValueError):
    """A requested schedule is invalid (tile too large, unknown dim, ...)."""


class TemporalSliceError(ScheduleError):
    """A dependent reduction chain cannot be corrected by update functions."""
