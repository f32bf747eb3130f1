"""One tuning round from an empty database, the round a new user gets, written as the offline runner's manifest.

``unseen_shapes.py`` and ``conv_chains.py`` both measure first picks this way. Each candidate gets the analytical
model's estimate beside it, for the report.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any


def build_round(smg: Any, folder: Path, trials: int, workers: int, extra: dict[str, Any]) -> dict[str, Any]:
    """Tune ``smg`` with ``OfflineBatchRunner(folder)`` and a fresh database. The manifest's candidate 0 is the
    model's first pick and the rest are the round's further picks and explorations. ``extra`` is merged into
    the manifest, which is written back and returned."""
    from spacefusion.api import H100, Schedule, estimate
    from spacefusion.tuning import OfflineBatchRunner, tune

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        summary = tune(smg, OfflineBatchRunner(folder), hw=H100, db=Path(tmp) / "t.db", trials=trials,
                       batch=trials, workers=workers, progress=False)
    manifest = json.loads((folder / "manifest.json").read_text())
    for c in manifest["candidates"]:
        c["estimate_us"] = round(estimate(Schedule.from_json(json.dumps(c["schedule"])), H100), 2)
    manifest.update(extra, space=str(summary.space), search_s=round(time.perf_counter() - t0, 2))
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def round_cli(doc: str, flag: str, keys: list[str], trials: int) -> tuple[Any, Any, Any]:
    """(parser, its subparsers, the build subparser) of a first-round script: ``build ART [flag K..]
    [--trials] [--workers]``, ``run ART --out R.json [flag K..]`` with the timing flags, ``report R.json``.
    ``flag`` names the keys (``--shapes``, ``--chains``)."""
    import argparse

    from gpu_runtime import timing_args

    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("art", type=Path)
    b.add_argument(flag, nargs="*", default=None, choices=keys)
    b.add_argument("--trials", type=int, default=trials)
    b.add_argument("--workers", type=int, default=2)
    r = sub.add_parser("run")
    r.add_argument("art", type=Path)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument(flag, nargs="*", default=None)
    timing_args(r)
    sub.add_parser("report").add_argument("results", type=Path)
    return ap, sub, b
