"""Space-Mapping Graph: the IR of spacefusion and its analyses.

The names below resolve on first use (PEP 562), so that ``import smg.tolerance`` (numpy only) does not
pull in sympy through the IR: the GPU scripts check outputs with it.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "ShapeError": "smg.errors", "SpaceFusionError": "smg.errors", "UnknownAxisError": "smg.errors",
    "UnknownOperatorError": "smg.errors", "SMG": "smg.ir", "Access": "smg.ir", "DataSpace": "smg.ir",
    "Dim": "smg.ir", "Edge": "smg.ir", "Kind": "smg.ir", "Op": "smg.ir", "join_smgs": "smg.ir",
    "Builder": "smg.ops", "Tensor": "smg.ops", "evaluate": "smg.reference", "random_inputs": "smg.reference",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'smg' has no attribute {name!r}")
