"""The fingerprint of the code that turns an SMG into a kernel (no TVM imported here).

A kernel folder keyed by the SMG alone (``frontend.backends.CudaBackend``, the default kernel cache of
``spacefusion.compile``) would otherwise keep serving what an older version built: after the GELU epilogue's
``erff`` became ``erf_fast``, a cache filled before still launched the slow kernel, and a changed cost model's
first pick was never seen.  Each artefact records the fingerprint it was built by (``kernel.json``'s
``code``); a backend that can build rebuilds one whose fingerprint differs (the cubin cache, keyed by the
source, makes an unchanged kernel's rebuild a copy).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
#: what decides a kernel from an SMG: the graph (smg), the schedule (schedulers, search: the cost models,
#: the prior's data) and the lowering
CODE_DIRS = ("smg", "schedulers", "search", "spacefusion/lower")


@functools.cache
def code_fingerprint() -> str:
    """sha256 (16 hex digits) over the ``.py`` and ``.json`` files of ``CODE_DIRS``, by relative path."""
    h = hashlib.sha256()
    for d in CODE_DIRS:
        root = _ROOT / d
        for f in sorted(root.rglob("*")):
            if f.suffix in (".py", ".json") and "__pycache__" not in f.parts and f.is_file():
                h.update(str(f.relative_to(_ROOT)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


__all__ = ["CODE_DIRS", "code_fingerprint"]
