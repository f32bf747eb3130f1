"""First picks for a new set of sizes of a graph already ranked: the ranking's head, made again and re-ranked.

A graph with symbolic sizes (torch.compile's default after a recompile) meets a new sequence length in the
middle of a user's session, and the call waits for its kernels.  A full first pick enumerates and ranks the
whole search space (0.5-10 s per SMG, more at odd sizes, whose divisors multiply the tiles); the graph's
structure, and so the space of decisions, is the same at every length.  So a full ranking keeps its head
(``HEAD`` decisions, ``schedulers.retarget.decisions``) in the kernel cache, filed by the graph's *family*:
its content key with the dim sizes left out (``family_key``).  A new size of the family makes those decisions
again on its own graph (``retarget.remake``: the slicers run anew, the update functions are derived for the
new sizes), drops those the sizes cannot take, and ranks the rest as a full ranking does (the analytical
model's estimate at the new sizes, ties by the prior): milliseconds instead of seconds.

Where it applies: ``CudaBackend`` turns it on for the specialisations of a graph with symbolic sizes only
(``compiled.PerShape``), so a graph compiled at static sizes keeps the full ranking's pick.  The entry of the
family ranked at the nearest sizes serves (log-distance over the dims), where each dim is within ``NEAR``
times its size; entries from other code (``lower.fingerprint``) or another machine are ignored, and a family
with no usable entry is ranked in full.  A tuned best from a database still wins over either (``dynamo.tuned``
asks the database first).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from schedulers.hardware import HardwareModel
from schedulers.retarget import decisions, remake
from schedulers.schedule import Schedule
from smg.hashing import content_key
from smg.ir import SMG
from smg.serialize import smg_to_dict

#: how many of a full ranking's best decisions its family keeps (each remade and estimated on a new size)
HEAD = 24
#: how many decisions a family keeps in all: the head, then one of each further grid shape (``kept``)
KEEP = 128
#: how far apart sizes may be for one's ranking to serve the other (each dim within this factor).  Why a bound:
#: the best tiles follow the sizes; on BERT-base's GEMMs ranked at M = 1024 (H100 model), the picks made from
#: the kept decisions at M = 512..2400 estimate within 6% of the full ranking's, at M = 296 up to 1.25x and at
#: M = 128 up to 1.5x.  Sizes further off are ranked in full, and that ranking is kept too, so a session's
#: family fills in where its sizes are.
NEAR = 2.0
#: how many ranked sets of sizes a family keeps (the oldest dropped), so the nearest can serve
ENTRIES = 8


def family_key(smg: SMG) -> str:
    """sha256 of ``smg``'s canonical form with every dim's size left out: graphs equal up to their dim sizes
    share it (sizes written into the ops, e.g. a norm's ``1/768``, still tell families apart)."""
    d = smg_to_dict(smg)
    d["dims"] = [{**x, "size": None} for x in d["dims"]]
    return content_key(d)


#: {SMG key: the sizes of the family entry its last first pick came from}, for the export's timing.json
ORIGIN: dict[str, dict[str, int]] = {}
#: (the family folder, whether picks may come from it) for the exports of this context (``transferring``)
_SCOPE: contextvars.ContextVar[tuple[Path, bool] | None] = contextvars.ContextVar("spacefusion_families",
                                                                                  default=None)


@contextlib.contextmanager
def transferring(folder: Path | None, transfer: bool) -> Iterator[None]:
    """First picks made inside save their head under ``folder`` (None: nowhere), and with ``transfer`` a new
    size of a saved family is picked from it (``pick``)."""
    token = _SCOPE.set((folder, transfer) if folder is not None else None)
    try:
        yield
    finally:
        _SCOPE.reset(token)


def scope() -> tuple[Path, bool] | None:
    return _SCOPE.get()


def _code() -> str:
    from spacefusion.lower.fingerprint import code_fingerprint

    return code_fingerprint()


def _path(folder: Path, smg: SMG) -> Path:
    return folder / f"{family_key(smg)[:24]}.json"


def _entries(folder: Path, smg: SMG) -> list[dict[str, Any]]:
    try:
        data = json.loads(_path(folder, smg).read_text())
    except (OSError, ValueError):
        return []
    return data.get("entries", []) if isinstance(data, dict) else []


def shape(s: Schedule) -> tuple:
    """What decides a schedule's grid and its work per block: the graph (or fold) it cuts, its block tiles,
    how many blocks or warp groups share one tile's reduction, and its pipeline depth."""
    return s.smg.key, s.block, s.tensor_cores, s.slices, s.split, s.stages


def kept(order: list[Schedule]) -> list[Schedule]:
    """What a family keeps of a full ranking: its ``HEAD`` best, then the best schedule of each further grid
    shape (``shape``) in rank order, up to ``KEEP`` in all.  Why the second part: the best tiles move with the
    sizes (a smaller M fills fewer SMs, and wants smaller tiles or a K split across blocks), and a head of
    one size alone holds few shapes (at M = 1024 the head of BERT's 3072 -> 768 GEMM missed the split that is
    best at M = 512: its estimate 1.34x the full ranking's pick)."""
    out = list(order[:HEAD])
    shapes = {shape(s) for s in out}
    for s in order[HEAD:]:
        if len(out) >= KEEP:
            break
        if shape(s) not in shapes:
            shapes.add(shape(s))
            out.append(s)
    return out


def _decided(s: Schedule, smg: SMG) -> dict[str, Any] | None:
    """``decisions`` of ``s``, or None where they can't be recorded (a schedule of a graph that is no fold of
    ``smg``): saving is best-effort, and must never fail the first pick it records."""
    try:
        return decisions(s, smg)
    except ValueError:
        return None


def save(folder: Path, smg: SMG, hw: HardwareModel, order: list[Schedule]) -> None:
    """Keep the head of ``smg``'s full ranking ``order`` for ``hw`` in its family's file (written whole, by
    rename: concurrent workers lose at most an entry, never the file).  Best-effort: a folder that cannot be
    written costs the next size its full ranking, nothing else."""
    entry = {"sizes": smg.dim_sizes, "hardware": hw.name, "code": _code(),
             "decisions": [d for d in map(lambda s: _decided(s, smg), kept(order)) if d is not None]}
    if not entry["decisions"]:
        return
    keep = [e for e in _entries(folder, smg) if e.get("sizes") != entry["sizes"] or e.get("hardware") != hw.name]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"family": family_key(smg), "name": smg.name, "entries": (keep + [entry])[-ENTRIES:]}, f)
        os.replace(tmp, _path(folder, smg))
    except OSError:
        return


def _distance(a: dict[str, int], b: dict[str, int]) -> float:
    return sum(abs(math.log(a[d] / b[d])) for d in a if d in b and a[d] > 0 and b[d] > 0)


def nearest(folder: Path, smg: SMG, hw: HardwareModel) -> dict[str, Any] | None:
    """The family's entry ranked for ``hw`` by this code at the sizes nearest ``smg``'s, or None."""
    code, sizes = _code(), smg.dim_sizes
    usable = [e for e in _entries(folder, smg) if e.get("hardware") == hw.name and e.get("code") == code
              and set(e.get("sizes", {})) == set(sizes) and _near(e["sizes"], sizes)]
    return min(usable, key=lambda e: _distance(e["sizes"], sizes), default=None)


def _near(a: dict[str, int], b: dict[str, int]) -> bool:
    """Every dim within ``NEAR`` times the other's size."""
    return all(0 < a[d] <= NEAR * b[d] and 0 < b[d] <= NEAR * a[d] for d in a)


def ranked_from(entry: dict[str, Any], smg: SMG, hw: HardwareModel) -> list[Schedule]:
    """``entry``'s decisions made on ``smg`` (those its sizes take), best first by the analytical model's
    estimate at these sizes, ties by the prior: ``schedules.ranked``'s rule over the remade head."""
    from search.cost import estimate_us
    from search.prior import first_round_order, prior_for

    cands: dict[str, Schedule] = {}
    for d in entry["decisions"]:
        s = remake(d, smg, hw)
        if s is not None:
            cands.setdefault(s.key, s)
    est = {k: estimate_us(s, hw) for k, s in cands.items()}
    return [cands[k] for k in first_round_order(cands, est, prior_for(hw).model)]


__all__ = ["ENTRIES", "HEAD", "KEEP", "NEAR", "ORIGIN", "family_key", "kept", "nearest", "ranked_from", "save",
           "scope", "transferring"]
