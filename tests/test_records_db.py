"""``experiments/tuning/records_db.py``: committed records rebuild a tuning database that the export's own
lookup (``frontend.dynamo.tuned``) reads, each file under the hardware its device names."""

from __future__ import annotations

import copy
import importlib.util
import json
import lzma
import math
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from schedulers.schedule import Schedule
from search.database import TuningDatabase, tuning_key
from search.prior import read_json
from search.records import MeasureResult

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "experiments" / "tuning" / "unet_convs_wide_rest_h200.json.xz"
TARGET = "cuda:sm_90a"


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_records_db_under_test",
                                                  ROOT / "experiments" / "tuning" / "records_db.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


records_db = _module()


def _three_of_one_smg() -> list[dict[str, Any]]:
    """Three successful records of the first SMG of the committed H200 round with three or more, slowest
    first (records in file order: deterministic)."""
    by_smg: dict[str, list[dict[str, Any]]] = {}
    for r in read_json(SOURCE)["records"]:
        if r["result"]["error"] is None:
            by_smg.setdefault(r["tuning_key"], []).append(r)
    rows = next(rs for rs in by_smg.values() if len({MeasureResult.from_dict(r["result"]).median_us
                                                      for r in rs[:3]}) == 3)[:3]
    return sorted(rows, key=lambda r: -MeasureResult.from_dict(r["result"]).median_us)


def _write(path: Path, device: str, records: list[dict[str, Any]]) -> Path:
    text = json.dumps({"format": "spacefusion-records/1", "device": device, "records": records})
    if path.suffix == ".xz":
        with lzma.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def _failed(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` as a candidate that failed its check: no times, an error."""
    out = copy.deepcopy(record)
    out["result"].update(latencies_us=[], error="check: max_abs_err 3.1 exceeds 0.5")
    return out


def _sched(record: dict[str, Any]) -> Schedule:
    return Schedule.from_json(json.dumps(record["schedule"]))


def test_rebuild_files_each_device_under_its_hardware_for_the_exports_lookup(tmp_path: Path) -> None:
    from spacefusion.frontend.dynamo import tuned
    from spacefusion.lower.build import COMPILE_FLAGS

    slow, mid, fast = _three_of_one_smg()
    smg = _sched(fast).smg
    # the H200 round: the fast one failed here (so the mid one is its best); the H100 round holds all three
    h200 = _write(tmp_path / "round_h200.json.xz", "NVIDIA H200", [slow, mid, _failed(fast)])
    h100 = _write(tmp_path / "round_h100.json", "NVIDIA H100 80GB HBM3", [slow, fast, mid])
    db = tmp_path / "tuning.db"

    assert records_db.rebuild(db, [h200, h100]) == {"H200": 3, "H100": 3}

    never = object()
    def fallback(_: Any) -> Any:
        return never

    assert tuned(db, TARGET, fallback, hardware=("H200", "H100"))(smg).key == _sched(mid).key
    assert tuned(db, TARGET, fallback, hardware=("H100",))(smg).key == _sched(fast).key
    # an SMG with no record falls back, under either machine
    other = next(_sched(r).smg for r in read_json(SOURCE)["records"] if r["tuning_key"] != fast["tuning_key"])
    assert tuned(db, TARGET, fallback, hardware=("H200", "H100"))(other) is never

    # the failure is kept under the key the export looks up (so it is not measured again), never picked
    with TuningDatabase(db, readonly=True) as database:
        rows = database.records(tuning_key(smg, "H200", TARGET, COMPILE_FLAGS))
        assert {s.key for s, _ in rows} == {_sched(r).key for r in (slow, mid, fast)}
        failed = [r for s, r in rows if s.key == _sched(fast).key]
        assert failed[0].error is not None and math.isinf(failed[0].median_us)
        # the stored ``tuning_key`` of these rounds is the SMG's content key, not the database key
        assert fast["tuning_key"] == smg.key != tuning_key(smg, "H200", TARGET, COMPILE_FLAGS)

    report = records_db.key_report(db, [h200, h100])
    assert report["records"] == 6 and report["failed"] == 1 and report["stored_key_differs"] == 6
    assert report.get("not_found_by_export", 0) == 0


def test_unknown_device_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    good = _write(tmp_path / "a_h200.json", "NVIDIA H200", _three_of_one_smg()[:1])
    bad = _write(tmp_path / "b.json", "NVIDIA GeForce RTX 4090", _three_of_one_smg()[:1])
    db = tmp_path / "tuning.db"
    with pytest.raises(SystemExit, match="NVIDIA GeForce RTX 4090"):
        records_db.rebuild(db, [good, bad])
    assert not db.exists()


def test_cli_prints_the_counts_per_hardware(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = _three_of_one_smg()
    src = _write(tmp_path / "r_h100.json.xz", "NVIDIA H100 80GB HBM3", rows[:2])
    db = tmp_path / "cli.db"
    assert records_db.main([str(db), str(src)]) == 0
    out = capsys.readouterr().out
    assert f"2 records of H100 added to {db}" in out
    with TuningDatabase(db, readonly=True) as database:
        assert len(database.workloads()) == 1
