"""Per-schedule memos of pure derived facts (its block's resources, its kernel's traffic).

A search checks each candidate's resources (``resources.check_resources``) and then estimates it
(``search.cost.estimate``), which derives the same block resources again and the fused kernel's traffic twice
(its bytes, and the reads it checks for coalescing).  A ``Schedule`` is immutable, so what these functions
derive from one never changes: ``per_schedule`` keeps the first result in the schedule's own ``__dict__`` (as
``Schedule.key`` and ``warp_tile`` keep theirs) and returns it on the next call.  The results are frozen
dataclasses, shared by every caller.  A schedule made again (``dataclasses.replace``, unpickled) starts with no
memo; one that is pickled carries its memos, which are the values its unpickled copy would derive.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

R = TypeVar("R")


def per_schedule(fn: Callable[[Any], R]) -> Callable[[Any], R]:
    """``fn(s)`` computed once per schedule object ``s`` (kept in ``s.__dict__`` under ``_memo_<name>``).
    ``fn`` must be a pure function of the schedule whose result is immutable; an object without a ``__dict__``
    (a stand-in in a test) is passed through uncached."""
    slot = f"_memo_{fn.__name__}"

    @functools.wraps(fn)
    def cached(s: Any) -> R:
        d = getattr(s, "__dict__", None)
        if d is None:
            return fn(s)
        try:
            return d[slot]
        except KeyError:
            out = d[slot] = fn(s)
            return out

    cached.uncached = fn  # type: ignore[attr-defined]
    return cached
