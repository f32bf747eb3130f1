#!/usr/bin/env python3
"""Rebuild a tuning database from the committed measurement records alone.

Usage:
    python experiments/tuning/records_db.py DB FILE [FILE ...]
    python experiments/tuning/records_db.py DB --all      # every experiments/tuning/unet_* records file

Why: ``dynamo_gpu.py export ART --db DB --hw H200 H100`` builds each SMG's best record from a SQLite tuning
database (``search.database.TuningDatabase``), and that file is not committed.  The rounds filled it with
``batch_rounds.add_to_db``, which reads the round's artefact folder (its ``manifest.json``), not committed
either; what is committed is each round's ``spacefusion-records/1`` file (``batch_rounds.save_records``:
schedule with its SMG, result and label per candidate).  This script puts those records back into a database
the way ``add_to_db`` did: each file under the hardware preset its ``device`` names (an unknown device is
refused), through ``spacefusion.runners.offline.import_offline`` itself (a manifest and a results file are
rebuilt from the records in a temporary folder), so keys, compile flags, fast_math and failed measurements
are filed exactly as an import of the round would file them.

A record's stored ``tuning_key`` is not used: the UNet rounds store the SMG's content key there (the label's
``workload_key``), and a database key covers the spacefusion and TVM versions and the compile flags, which are
this checkout's.  The script says how many stored keys differ from the key recomputed now, and checks that
every successful record can be found by the export's lookup (``frontend.schedules.from_database``: the key
of ``EXPORT_TARGET`` with ``COMPILE_FLAGS``); a fast_math round, for one, is filed under another key.
Rebuild the database after changing spacefusion's version or compile flags: the keys change with them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from spacefusion.api import HardwareModel, Schedule, preset_of_device  # noqa: E402
from spacefusion.tuning import (  # noqa: E402
    MANIFEST_FILE,
    MANIFEST_FORMAT,
    RESULTS_FILE,
    RESULTS_FORMAT,
    MeasureResult,
    TuningDatabase,
    import_offline,
    read_json,
    tuning_key,
)

RECORDS_FORMAT = "spacefusion-records/1"
#: the target ``frontend.dynamo.export_cuda`` looks records up for
EXPORT_TARGET = "cuda:sm_90a"
TUNING = Path(__file__).resolve().parent


def unet_files(folder: Path = TUNING) -> list[Path]:
    """``--all``: the ``spacefusion-records/1`` files of ``folder`` whose name starts ``unet_``, by name."""
    return [p for p in sorted(folder.glob("unet_*.json*"))
            if p.name.endswith((".json", ".json.xz")) and read_json(p).get("format") == RECORDS_FORMAT]


def load(path: Path) -> tuple[HardwareModel, dict[str, Any]]:
    """A records file and the hardware preset its ``device`` names; SystemExit naming the file otherwise."""
    data = read_json(path)
    if not isinstance(data, dict) or data.get("format") != RECORDS_FORMAT or not isinstance(data.get("records"),
                                                                                          list):
        tag = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise SystemExit(f"{path}: format {tag!r} is not {RECORDS_FORMAT!r} with a 'records' list")
    hw = preset_of_device(str(data.get("device", "")))
    if hw is None:
        raise SystemExit(f"{path}: device {data.get('device')!r} has no hardware preset: its measurements "
                         f"would be filed under another machine's key")
    return hw, data


def as_batch(data: dict[str, Any], folder: Path) -> None:
    """The records as the offline batch ``import_offline`` reads: ``manifest.json`` (schedule and workload of
    each candidate; the artefacts are gone, and ``import_offline`` does not need them) and ``results.json``."""
    cands = [{"index": i, "schedule_key": r["result"]["schedule_key"], "target": r["result"]["target"],
              "artefact": None, "schedule": r["schedule"], "workload": r["schedule"]["smg"], "seed": 0,
              "error": None} for i, r in enumerate(data["records"])]
    (folder / MANIFEST_FILE).write_text(json.dumps({"format": MANIFEST_FORMAT, "candidates": cands}))
    (folder / RESULTS_FILE).write_text(json.dumps({"format": RESULTS_FORMAT,
                                                   "results": [r["result"] for r in data["records"]]}))


def rebuild(db: Path, files: Sequence[Path]) -> dict[str, int]:
    """Add every record of ``files`` to the tuning database ``db`` (created if missing; a record already there
    under the same key and schedule is replaced), each file under its device's preset; records added per
    hardware name.  Every file is read and its device checked before anything is written."""
    loaded = [load(Path(f)) for f in files]
    counts: Counter[str] = Counter()
    with TuningDatabase(db) as database:
        for hw, data in loaded:
            with tempfile.TemporaryDirectory() as tmp:
                as_batch(data, Path(tmp))
                counts[hw.name] += import_offline(database, tmp, hw)
    return dict(counts)


def key_report(db: Path, files: Sequence[Path]) -> dict[str, int]:
    """How the records of ``files`` stand against ``db`` and the export: ``records``; ``stored_key_differs``
    (the stored ``tuning_key`` is not the key recomputed now), of which ``stored_smg_key`` name the SMG's
    content key; ``failed`` (an error, not a time: kept so it is not measured again, never picked);
    ``not_found_by_export``: successful records the export's lookup does not see in ``db``."""
    from spacefusion.api import COMPILE_FLAGS

    out: Counter[str] = Counter()
    with TuningDatabase(db, readonly=True) as database:
        for path in files:
            hw, data = load(Path(path))
            for r in data["records"]:
                sched = Schedule.from_json(json.dumps(r["schedule"]))
                res = MeasureResult.from_dict(r["result"])
                key = tuning_key(sched.smg, hw, EXPORT_TARGET, COMPILE_FLAGS)
                out["records"] += 1
                if r.get("tuning_key") != tuning_key(sched.smg, hw, res.target, COMPILE_FLAGS):
                    out["stored_key_differs"] += 1
                    out["stored_smg_key"] += r.get("tuning_key") == sched.smg.key
                if res.error is not None:
                    out["failed"] += 1
                elif sched.key not in database.measured_keys(key):
                    out["not_found_by_export"] += 1
    return dict(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("db", type=Path, help="the tuning database to fill (created if missing)")
    ap.add_argument("files", type=Path, nargs="*", help="spacefusion-records/1 files (.json or .json.xz)")
    ap.add_argument("--all", action="store_true",
                    help=f"also every records file of {TUNING.relative_to(ROOT)} whose name starts unet_")
    a = ap.parse_args(argv)
    files = [*a.files, *(unet_files() if a.all else [])]
    if not files:
        ap.error("name records files, or --all")
    counts = rebuild(a.db, files)
    for hw, n in sorted(counts.items()):
        print(f"{n} records of {hw} added to {a.db}")
    rep = key_report(a.db, files)
    print(f"{len(files)} files, {rep.get('records', 0)} records ({rep.get('failed', 0)} failed measurements, "
          f"kept as failures); stored tuning_key differs from the key recomputed now: "
          f"{rep.get('stored_key_differs', 0)} ({rep.get('stored_smg_key', 0)} of them store the SMG's content "
          f"key); successful records the export's lookup ({EXPORT_TARGET}) does not find: "
          f"{rep.get('not_found_by_export', 0)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
