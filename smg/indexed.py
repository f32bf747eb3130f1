"""What indexed stores (``smg.stores``) and indexed loads (``smg.loads``) share: a graph's records of either kind
carried in ``SMG.attrs`` as canonical JSON, the check that their parameter names are free, and the range of a
run-time index.

Why ``SMG.attrs``: the content key hashes every field of the graph, so a new field would change every committed
key; records in an attribute give new keys only to the graphs that have them (and those keys depend on them).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import numpy as np

from smg.ir import SMG

R = TypeVar("R")


def attach(smg: SMG, attr: str, records: tuple[Any, ...]) -> SMG:
    """``smg`` with ``records`` (frozen dataclasses) as the canonical JSON of their fields under ``attr``:
    the same ops and outputs, a new content key; ``smg`` itself (its key unchanged) where there are none."""
    if not records:
        return smg
    text = json.dumps([dataclasses.asdict(r) for r in records], sort_keys=True, separators=(",", ":"))
    attrs = tuple((k, v) for k, v in smg.attrs if k != attr) + ((attr, text),)
    return dataclasses.replace(smg, attrs=attrs)


def attached(smg: SMG, attr: str, make: Callable[[dict[str, Any]], R]) -> tuple[R, ...]:
    """The records ``attach`` put under ``attr``, each rebuilt by ``make`` from its JSON fields; () if none."""
    text = dict(smg.attrs).get(attr)
    return () if text is None else tuple(make(d) for d in json.loads(text))


def check_free(smg: SMG, where: str, names: Iterable[str]) -> None:
    """Raise ``ValueError`` (saying ``where``) unless ``names`` are distinct and name no space or dim of ``smg``:
    they become kernel parameters beside the graph's own."""
    names = list(names)
    taken = {s.name for s in smg.spaces} | set(smg.dim_sizes)
    if set(names) & taken or len(set(names)) != len(names):
        raise ValueError(f"{where}: parameter names {names} clash with the graph's or with each other")


def inside(index: np.ndarray, length: int) -> np.ndarray:
    """Where a run-time index (int64) lies in ``[0, length)``: the only positions a kernel writes or reads
    (outside, a store is skipped and a load reads zero; a kernel cannot raise, and must not touch memory past
    the caller's tensor)."""
    return (index >= 0) & (index < length)
