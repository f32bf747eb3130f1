"""Device-memory traffic of a Schedule against the unfused operator chain.

Unfused: every op reads each input space from device memory and writes its
output.  Fused: inputs are read once per block that needs them (an input that
lacks a cut dim is re-read by every block along that dim), outputs are written
once, intermediates never leave the chip.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from schedulers.schedule import Schedule
from smg.ir import SMG


def _bytes(smg: SMG, space: str, dtype: str | None = None) -> int:
    return math.prod(smg.shape(space)) * np.dtype(dtype or smg.space(space).dtype).itemsize


@dataclass(frozen=True)
class Traffic:
    unfused_bytes: int
    fused_bytes: int

    @property
    def reduction(self) -> float:
        return 1.0 - self.fused_bytes / self.unfused_bytes


def unfused_traffic(smg: SMG) -> int:
    return sum(sum(_bytes(smg, a.space) for a in op.inputs) + _bytes(smg, op.out) for op in smg.ops)


def fused_traffic(s: Schedule) -> int:
    smg, grid = s.smg, s.grid()
    total = 0
    for name in smg.inputs:
        dims = set(smg.space(name).dims)
        reread = math.prod(n for d, n in grid.items() if d not in dims)
        total += _bytes(smg, name) * reread
    return total + sum(_bytes(smg, o) for o in smg.outputs)


def traffic(s: Schedule) -> Traffic:
    return Traffic(unfused_traffic(s.smg), fused_traffic(s))
