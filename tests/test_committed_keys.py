"""Every schedule committed in the repository's records still loads and recomputes its content keys.

Content keys (``SMG.key``, ``Schedule.key``: sha256 over canonical JSON) name records in tuning databases,
artefact folders and result files, so they must not change when the IR's internals do (issue 60's
expressions parsed once kept every text as the canonical form: the parse lives beside it, not in a field).
Each schedule found in ``experiments/`` (``.json`` and ``.json.xz``), ``search/data/`` and ``tests/data/``
is read with ``Schedule.from_json`` (which re-derives it from its graph and refuses one the slicers no longer
make) and its keys are recomputed:

- where the file stores the schedule's key (a record's ``result.schedule_key``, a round's ``schedules`` map),
  the recomputed key is that key;
- every file listed in ``tests/data/committed_keys.json`` hashes, over its schedules in file order, to the
  digest recorded there of each one's SMG key and schedule key (written at d93ba63, before the change).

A file committed later is checked against its stored keys only.  To add one to the manifest (never to
paper over a changed key): ``python -m tests.test_committed_keys``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from schedulers.schedule import Schedule
from search.prior import read_json
from smg.serialize import smg_from_dict

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "tests" / "data" / "committed_keys.json"
SCHEDULE_FORMAT = "spacefusion-schedule/1"


def committed_files() -> list[Path]:
    """The JSON files that may hold schedules: results, tuning rounds and records, the priors, test data."""
    found = [*ROOT.glob("experiments/**/*.json"), *ROOT.glob("experiments/**/*.json.xz"),
             *ROOT.glob("search/data/*.json"), *ROOT.glob("tests/data/*.json")]
    return sorted(p for p in found if p != MANIFEST)


def schedules_in(data: Any) -> Iterator[tuple[dict[str, Any], str | None]]:
    """(schedule dict with its SMG, the key the file stores for it or None), in file order: schedules
    embedded whole (``format`` + ``smg``), and a round's ``schedules`` map (key -> schedule) beside its one
    ``smg``."""
    def walk(o: Any, stored: str | None) -> Iterator[tuple[dict[str, Any], str | None]]:
        if isinstance(o, dict):
            if isinstance(o.get("result"), dict) and isinstance(o["result"].get("schedule_key"), str):
                stored = o["result"]["schedule_key"]
            if isinstance(o.get("schedule_key"), str):
                stored = o["schedule_key"]
            if o.get("format") == SCHEDULE_FORMAT and "smg" in o:
                yield o, stored
                return
            rounds = isinstance(o.get("schedules"), dict) and isinstance(o.get("smg"), dict)
            if rounds:
                for key, s in o["schedules"].items():
                    yield {**s, "smg": o["smg"]}, key
            for k, v in o.items():
                if not (rounds and k == "schedules"):
                    yield from walk(v, stored)
        elif isinstance(o, list):
            for v in o:
                yield from walk(v, stored)

    yield from walk(data, None)


def recompute(path: Path) -> tuple[int, str, list[str]]:
    """(schedules, sha256 of their ``smg_key schedule_key`` lines, the mismatches with stored keys)."""
    try:
        data = read_json(path)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return 0, hashlib.sha256(b"").hexdigest(), []
    lines, bad = [], []
    for d, stored in schedules_in(data):
        s = Schedule.from_json(json.dumps(d))
        assert s.smg.key == smg_from_dict(d["smg"]).key
        lines.append(f"{s.smg.key} {s.key}")
        if stored is not None and stored != s.key:
            bad.append(f"{path.relative_to(ROOT)}: stored {stored[:12]}, recomputed {s.key[:12]}")
    return len(lines), hashlib.sha256("\n".join(lines).encode()).hexdigest(), bad


def test_every_committed_schedule_recomputes_its_keys() -> None:
    manifest = json.loads(MANIFEST.read_text())["files"]
    total, stored_bad, digest_bad = 0, [], []
    for path in committed_files():
        rel = str(path.relative_to(ROOT))
        n, digest, bad = recompute(path)
        total += n
        stored_bad += bad
        if rel in manifest and (manifest[rel]["schedules"], manifest[rel]["sha256"]) != (n, digest):
            digest_bad.append(f"{rel}: {n} schedules, keys digest {digest[:12]}; recorded "
                              f"{manifest[rel]['schedules']}, {manifest[rel]['sha256'][:12]}")
    assert not stored_bad, stored_bad[:10]
    assert not digest_bad, digest_bad
    assert total >= sum(v["schedules"] for v in manifest.values()) > 5000


def write_manifest() -> None:
    """Record every committed file's schedule count and keys digest (for a newly committed file)."""
    files = {}
    for path in committed_files():
        n, digest, bad = recompute(path)
        assert not bad, bad
        if n:
            files[str(path.relative_to(ROOT))] = {"schedules": n, "sha256": digest}
    MANIFEST.write_text(json.dumps({"format": "spacefusion-committed-keys/1", "files": files}, indent=1,
                                   sort_keys=True) + "\n")


if __name__ == "__main__":
    write_manifest()
