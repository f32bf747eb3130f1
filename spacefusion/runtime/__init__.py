"""GPU-side runtime for spacefusion kernel artefacts.

Import-light on purpose: it must run where TVM, islpy, xgboost and sympy are absent, and must not
import the rest of spacefusion. Modules here import each other only relatively, so the folder can also
be loaded from its file path under another package name (see experiments/run_artefacts_gpu.py).
torch/cupy-backed names are resolved lazily on first attribute access.
"""

from __future__ import annotations

import importlib
from typing import Any

from .artefact import ArtefactError, KernelArtefact, ParamSpec

_LAZY = {
    "CudaKernel": ".gpu",
    "KernelCompileError": ".gpu",
    "KernelLaunchError": ".gpu",
    "load_kernel": ".gpu",
    "TimingResult": ".timing",
    "time_cuda": ".timing",
}

__all__ = ["ArtefactError", "KernelArtefact", "ParamSpec", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
