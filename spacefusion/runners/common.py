"""What every runner shares: result constructors and the target/reference checks before a build."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from search.records import ENVIRONMENT, Builder, MeasureInput, MeasureResult
from smg.errors import SpaceFusionError
from spacefusion.runtime.batch import References, describe


class RunnerUnavailable(SpaceFusionError):
    """A runner cannot measure anything where it was asked to (no GPU visible, no Ray cluster at the address):
    raised before tuning starts, so no candidate is spent on a machine that could not run it."""


def fail(inp: MeasureInput, error: str, meta: Mapping[str, Any] | None = None,
         max_abs_err: float | None = None) -> MeasureResult:
    """A failed result: no latencies, ``error`` says why."""
    return MeasureResult(inp.key, inp.target, (), max_abs_err, error, tuple(sorted((meta or {}).items())))


def unavailable(inp: MeasureInput, error: str, meta: Mapping[str, Any] | None = None) -> MeasureResult:
    """A result that failed because of the machine, not the kernel (``MeasureResult.environmental``): the tuner
    does not record it, so the candidate is measured again where the runner works."""
    return fail(inp, error, {**(meta or {}), ENVIRONMENT: True})


def ok(inp: MeasureInput, latencies_us: Sequence[float], max_abs_err: float | None,
       meta: Mapping[str, Any]) -> MeasureResult:
    """A checked and timed result."""
    return MeasureResult(inp.key, inp.target, tuple(float(x) for x in latencies_us), max_abs_err, None,
                         tuple(sorted(meta.items())))


def prepare(inp: MeasureInput, builder: Builder, kind: str, refusal: str, refs: References, seed: int,
            meta: Mapping[str, Any]) -> tuple[Any, Any] | MeasureResult:
    """(inputs, numpy reference) for ``inp``, or the failed result that says why not (a target of
    another kind, an unknown target, a reference that cannot be computed)."""
    try:
        if builder.target_kind(inp.target) != kind:
            return fail(inp, f"target: {refusal}, got {inp.target!r}", meta)
    except Exception as exc:
        return fail(inp, f"target: {describe(exc)}", meta)
    try:
        _, x, ref = refs.get(inp.schedule.smg, seed, inp.inputs_from)
        return x, ref
    except Exception as exc:
        return fail(inp, f"reference: {describe(exc)}", meta)
