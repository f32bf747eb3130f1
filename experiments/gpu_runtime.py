"""Load spacefusion's TVM-free GPU runtime by file path, for scripts run on the GPU machine.

The GPU machine has torch and cupy but no TVM: importing the ``spacefusion`` package (which
pulls in the lowering) must never happen there.  The runtime is therefore loaded from its
files as a private package, ``_spacefusion_runtime``; the output check, ``smg/tolerance.py``,
likewise as ``_smg_tolerance`` (the ``smg`` package would pull in sympy).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
RUNTIME_DIR = REPO_ROOT / "spacefusion" / "runtime"
RUNTIME_PKG = "_spacefusion_runtime"
TOLERANCE_FILE = REPO_ROOT / "smg" / "tolerance.py"
TOLERANCE_MOD = "_smg_tolerance"


def load_file(name: str, path: Path, package_dir: Path | None = None) -> ModuleType:
    """The module (or, with ``package_dir``, the package) at ``path`` imported under ``name``, once: the GPU
    scripts take the pieces they need by file path, never the packages that would pull in TVM or sympy."""
    if name in sys.modules:
        return sys.modules[name]
    where = {"submodule_search_locations": [str(package_dir)]} if package_dir else {}
    spec = importlib.util.spec_from_file_location(name, path, **where)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while a class is built
    spec.loader.exec_module(module)
    return module


def load_runtime() -> ModuleType:
    """Import spacefusion/runtime by file path under RUNTIME_PKG; never imports ``spacefusion``."""
    return load_file(RUNTIME_PKG, RUNTIME_DIR / "__init__.py", RUNTIME_DIR)


def runtime_module(name: str) -> ModuleType:
    """A submodule of the runtime ('artefact', 'gpu', 'timing'), loaded by file path."""
    load_runtime()
    return importlib.import_module(f"{RUNTIME_PKG}.{name}")


def tolerance_module() -> ModuleType:
    """``smg/tolerance.py``, the one rule for a kernel's output against its reference, loaded by file path
    under TOLERANCE_MOD: it needs numpy only, where importing the ``smg`` package would pull in sympy."""
    return load_file(TOLERANCE_MOD, TOLERANCE_FILE)


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
