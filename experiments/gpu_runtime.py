"""The GPU scripts' access to spacefusion's TVM-free runtime, imported as the package.

The GPU machine has torch and cupy but no TVM: ``spacefusion.runtime`` (and ``smg``, numpy + sympy)
import there without the compiler, from an install (``pip install -e ".[gpu]"``; offline: docs/architecture.md)
or from this checkout, which is put on ``sys.path`` when the package is not installed.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("spacefusion") is None:  # a bare checkout on the GPU machine
    sys.path.insert(0, str(REPO_ROOT))


def load_runtime() -> ModuleType:
    """The ``spacefusion.runtime`` package (imports no TVM, islpy or xgboost)."""
    return importlib.import_module("spacefusion.runtime")


def runtime_module(name: str) -> ModuleType:
    """A submodule of the runtime ('artefact', 'gpu', 'timing', 'batch', 'tensormap')."""
    return importlib.import_module(f"spacefusion.runtime.{name}")


def tolerance_module() -> ModuleType:
    """``smg.tolerance``, the one rule for a kernel's output against its reference."""
    return importlib.import_module("smg.tolerance")


def compare_tensors(out: Any, ref: Any, dtype: str, reduction_len: int = 1, name: str = "output",
                    baseline: bool = False) -> Any:
    """``smg.tolerance.compare`` of two torch tensors (any device, any float dtype): a ``Comparison``; a
    ``baseline`` (a system not ours) gets the rule's BASELINE_SLACK."""
    tol = tolerance_module()
    return tol.compare(out.detach().double().cpu().numpy(), ref.detach().double().cpu().numpy(), dtype,
                       reduction_len, name, tol.BASELINE_SLACK if baseline else 1.0)


def timing_args(parser, warmup: int = 10, iters: int = 100, repeats: int = 3) -> None:
    """The GPU scripts' timing flags (``--warmup``, ``--iters``, ``--repeats``), one definition for all."""
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--iters", type=int, default=iters, help="timed runs per system (median reported)")
    parser.add_argument("--repeats", type=int, default=repeats, help="rounds in which the systems take turns")
