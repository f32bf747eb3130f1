"""The plumbing the per-model tuning rounds share (``unet_convs.py``, ``unet_groupnorms.py``): run an offline
batch on the GPU with a baseline beside it, read its results back against the labels it was exported with,
and keep them as tuning records or in a tuning database.  Each script keeps what is its own: which
candidates, which baseline, which table."""

from __future__ import annotations

import argparse
import json
import lzma
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def first_and_families(smg: Any, top: int, per: int, family: Callable[[Any], tuple],
                       say: Callable[[tuple], str]) -> list[tuple[str, Any]]:
    """(why, schedule): the tuner's first ``top`` (``ranked``), then the analytical model's best of each
    ``family`` not yet held, in estimate order (``say(family)`` the why), up to ``per`` in all: one run
    shows which family the first round should have measured."""
    from spacefusion.api import H100, candidates, estimate

    order = candidates(smg)
    out = [(f"rank {i}", s) for i, s in enumerate(order[:top])]
    seen = {family(s) for _, s in out}
    best: dict[tuple, Any] = {}
    for s in order[top:]:
        best.setdefault(family(s), s)
    for fam, s in sorted(best.items(), key=lambda kv: estimate(kv[1], H100)):
        if len(out) >= per:
            break
        if fam not in seen:
            seen.add(fam)
            out.append((say(fam), s))
    return out


def run_batch(art: Path, out: Path, iters: int, baseline_key: str, baseline: Callable[[int], list]) -> int:
    """``spacefusion.runtime.batch`` on ``art`` (each candidate checked, then timed), then ``baseline(iters)``
    in the same process, written to ``out`` under ``baseline_key``; the batch's exit status."""
    tmp = out.with_suffix(".batch.json")
    rc = subprocess.call([sys.executable, "-m", "spacefusion.runtime.batch", str(art), "--out", str(tmp),
                          "--iters", str(iters)], cwd=ROOT)
    whole = json.loads(tmp.read_text())
    whole[baseline_key] = baseline(iters)
    out.write_text(json.dumps(whole, indent=1) + "\n")
    return rc


def load_round(art: Path, results: Path) -> tuple[list[dict], dict[str, Any]]:
    """(the labels ``art`` was exported with, the results file), refusing results of another batch by name."""
    labels = json.loads((art / "labels.json").read_text())
    whole = json.loads(results.read_text())
    if len(labels) != len(whole["results"]):
        raise SystemExit(f"{results} holds {len(whole['results'])} results but {art} exported {len(labels)} "
                         f"candidates: the results are not this batch's")
    return labels, whole


def save_records(art: Path, labels: list[dict], whole: dict[str, Any], records: Path, baseline_key: str) -> None:
    """Tuning records (``search.prior.read_records``) with the labels and the baseline beside them; a path
    ending ``.xz`` is written xz-compressed."""
    manifest = json.loads((art / "manifest.json").read_text())["candidates"]
    rows = [{"workload": entry["workload"]["name"], "tuning_key": lab["workload_key"],
             "schedule": entry["schedule"], "result": raw, "label": lab}
            for lab, entry, raw in zip(labels, manifest, whole["results"], strict=True)]
    meta = {k: v for k, v in whole.items() if k not in ("results", "format", baseline_key)}
    text = json.dumps({"format": "spacefusion-records/1", **meta, baseline_key: whole.get(baseline_key, []),
                       "records": rows}, indent=1) + "\n"
    if records.suffix == ".xz":  # the schedules repeat: xz keeps a round's records 40x smaller in the repo
        with lzma.open(records, "wt") as f:
            f.write(text)
    else:
        records.write_text(text)


def add_to_db(art: Path, whole: dict[str, Any], db: Path, baseline_key: str) -> None:
    """Every measurement of the round into the tuning database ``db`` (the batch folder's layout), under the
    hardware the results name (an H200's measurements are not an H100's; before, every round went in as
    H100's). Results that name no device, or one with no preset, are refused by name."""
    import shutil
    import tempfile

    from spacefusion.api import preset_of_device
    from spacefusion.tuning import MANIFEST_FILE, RESULTS_FILE, import_offline

    hw = preset_of_device(str(whole.get("device", "")))
    if hw is None:
        raise SystemExit(f"the results' device {whole.get('device')!r} has no hardware preset: its "
                         f"measurements would be filed under another machine's key")
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(art / MANIFEST_FILE, Path(tmp) / MANIFEST_FILE)
        Path(tmp, RESULTS_FILE).write_text(json.dumps({k: v for k, v in whole.items() if k != baseline_key}))
        print(f"{import_offline(db, tmp, hw)} measurements of {hw.name} added to {db}")


def keep_round(art: Path, labels: list[dict], whole: dict[str, Any], records: Path | None, db: Path | None,
               baseline_key: str) -> None:
    """What a round's ``table --records OUT --db DB`` keeps: the records file and the database rows, each where
    asked for."""
    if records is not None:
        save_records(art, labels, whole, records, baseline_key)
    if db is not None:
        add_to_db(art, whole, db, baseline_key)


def round_main(doc: str, export_args: Callable[[argparse.ArgumentParser], None],
               export: Callable[[argparse.Namespace], None], run: Callable[[Path, Path, int], int],
               table: Callable[[Path, Path, Path | None, Path | None], None]) -> None:
    """A round script's command line: ``export ART ...`` (its own arguments, added by ``export_args``), then
    the shared ``run`` and ``table`` (``add_round_commands``)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export")
    e.add_argument("art", type=Path)
    export_args(e)
    add_round_commands(sub)
    a = ap.parse_args()
    if a.cmd == "export":
        export(a)
    elif a.cmd == "run":
        sys.exit(run(a.art, a.out, a.iters))
    else:
        table(a.art, a.results, a.records, a.db)


def add_round_commands(sub: argparse._SubParsersAction) -> None:
    """The ``run ART --out R.json [--iters N]`` and ``table ART R.json [--records OUT] [--db DB]`` sub-commands."""
    r = sub.add_parser("run")
    r.add_argument("art", type=Path)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--iters", type=int, default=50)
    t = sub.add_parser("table")
    t.add_argument("art", type=Path)
    t.add_argument("results", type=Path)
    t.add_argument("--records", type=Path, default=None)
    t.add_argument("--db", type=Path, default=None)
