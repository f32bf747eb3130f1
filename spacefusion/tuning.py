"""Tuning, the public face: ``tune`` (the whole search with its default parts) and ``tune_with`` (the same loop
with any part swapped), the interfaces a research script implements, and the implementations that ship.

    from spacefusion.tuning import TuningContext, SearchStrategy, tune_with, tuning_hardware
    ctx = TuningContext(g, tuning_hardware("llvm"), "llvm")
    summary = tune_with(ctx, LLVMRunner(), strategy=MyStrategy(), trials=32)

The parts live in ``search.tuning`` (one file per implementation); docs/tuning.md says how to swap one.
"""

from __future__ import annotations

import search.tuning as _parts
from search.tuner import tune, tuning_hardware
from search.tuning import *  # noqa: F403  (every part: search.tuning.__all__)

__all__ = [*_parts.__all__, "tune", "tuning_hardware"]
