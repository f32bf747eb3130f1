"""GPU-side runtime for spacefusion kernel artefacts.

Import-light on purpose: it runs on the GPU machine, where TVM, islpy and xgboost are absent
(``pip install -e ".[gpu]"`` there; offline: docs/architecture.md, "Installing on the GPU machine"), and
imports nothing of spacefusion's compiler.
Importing it needs numpy only; ``batch`` (the measuring command) reads workloads with ``smg`` (sympy)
when it runs.  torch/cupy-backed names are resolved lazily on first attribute access.
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
    "find_nvcc": ".gpu",
    "torch_dtype": ".gpu",
    "TimingResult": ".timing",
    "time_cuda": ".timing",
}

__all__ = ["ArtefactError", "KernelArtefact", "ParamSpec", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
