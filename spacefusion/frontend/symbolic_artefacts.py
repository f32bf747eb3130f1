"""The CUDA backend's kernels with a run-time row count, kept in its kernel folder for a family's later sizes.

``symbolic_kernels`` keeps the llvm backend's in memory; a CUDA backend's kernels are artefact folders that
export workers write and another process (the GPU machine) loads, so the record is on disk: under the kernel
folder's ``symbolic/``, one artefact folder per symbolic kernel (named by ``lower.symbolic.symbolic_key``) and
one index per family (``families.family_key``) listing each kernel's run-time dim (``symbolic_kernels.rows``:
``m``, an embeddings' norm's sequence) and its range, the other dims' sizes and
the code that built it.  ``served`` finds the artefact an SMG of that family can run on (every other size equal,
its rows in range, built by this code); ``record`` adds one, written whole by rename (concurrent workers lose at
most an entry: a later size then builds its own, nothing else).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from schedulers.schedule import Schedule
from smg.ir import SMG
from spacefusion.frontend.families import family_key
from spacefusion.frontend.symbolic_kernels import ROWS, others, rows, symbolic_dim

#: the kernel folder's subfolder of symbolic artefacts and their family indexes
SYMBOLIC = "symbolic"


def _code() -> str:
    from spacefusion.lower.fingerprint import code_fingerprint

    return code_fingerprint()


def _index(folder: Path, smg: SMG) -> Path:
    return Path(folder) / SYMBOLIC / f"{family_key(smg)[:24]}.json"


def _entries(folder: Path, smg: SMG) -> list[dict[str, Any]]:
    try:
        data = json.loads(_index(folder, smg).read_text())
    except (OSError, ValueError):
        return []
    return data.get("entries", []) if isinstance(data, dict) else []


def served(folder: Path, smg: SMG) -> Path | None:
    """The artefact folder of a symbolic kernel of ``smg``'s family built by this code whose range holds
    ``smg``'s rows, every other dim's size equal; None where there is none."""
    dim = rows(smg)
    if dim is None:
        return None
    m, rest, code = smg.dim_sizes[dim], others(smg), _code()
    for e in _entries(folder, smg):
        lo, hi = e.get("range", (0, -1))
        path = Path(folder) / SYMBOLIC / str(e.get("dir"))
        if (e.get("code") == code and e.get("others") == rest and e.get("dim", ROWS) == dim and lo <= m <= hi
                and (path / "kernel.json").is_file()):
            return path
    return None


def artefact_dir(folder: Path, s: Schedule, sym: Any) -> Path:
    """Where the symbolic artefact of ``s`` over ``sym`` is written."""
    from spacefusion.lower.symbolic import symbolic_key

    return Path(folder) / SYMBOLIC / symbolic_key(s, sym)[:16]


def record(folder: Path, smg: SMG, sym: Any, path: Path) -> None:
    """Add the artefact at ``path`` (built for ``smg``'s family over ``sym``) to the family's index.
    Best-effort: an index that cannot be written costs a later size its own build."""
    entry = {"range": [sym.lo, sym.hi], "dim": sym.dim, "others": others(smg), "dir": Path(path).name,
             "code": _code()}
    keep = [e for e in _entries(folder, smg) if e.get("dir") != entry["dir"]]
    index = _index(folder, smg)
    try:
        index.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=index.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"family": family_key(smg), "name": smg.name, "entries": [*keep, entry]}, f)
        os.replace(tmp, index)
    except OSError:
        return


__all__ = ["SYMBOLIC", "artefact_dir", "record", "served", "symbolic_dim"]
