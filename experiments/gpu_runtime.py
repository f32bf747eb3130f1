"""Load spacefusion's TVM-free GPU runtime by file path, for scripts run on the GPU machine.

The GPU machine has torch and cupy but no TVM: importing the ``spacefusion`` package (which
pulls in the lowering) must never happen there.  The runtime is therefore loaded from its
files as a private package, ``_spacefusion_runtime``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parents[1]
RUNTIME_DIR = REPO_ROOT / "spacefusion" / "runtime"
RUNTIME_PKG = "_spacefusion_runtime"


def load_runtime() -> ModuleType:
    """Import spacefusion/runtime by file path under RUNTIME_PKG; never imports ``spacefusion``."""
    if RUNTIME_PKG in sys.modules:
        return sys.modules[RUNTIME_PKG]
    spec = importlib.util.spec_from_file_location(
        RUNTIME_PKG, RUNTIME_DIR / "__init__.py", submodule_search_locations=[str(RUNTIME_DIR)]
    )
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the runtime from {RUNTIME_DIR}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[RUNTIME_PKG] = module
    spec.loader.exec_module(module)
    return module


def runtime_module(name: str) -> ModuleType:
    """A submodule of the runtime ('artefact', 'gpu', 'timing'), loaded by file path."""
    load_runtime()
    return importlib.import_module(f"{RUNTIME_PKG}.{name}")


def timing_args(parser, warmup: int = 10, iters: int = 100, repeats: int = 3) -> None:
    """The GPU scripts' timing flags (``--warmup``, ``--iters``, ``--repeats``), one definition for all."""
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--iters", type=int, default=iters, help="timed runs per system (median reported)")
    parser.add_argument("--repeats", type=int, default=repeats, help="rounds in which the systems take turns")
