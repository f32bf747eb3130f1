"""The tuning database: round trip, reuse, interruption, refusing bad files, keys and the cache switch."""

from __future__ import annotations

import dataclasses
import os
import re
import sqlite3
import subprocess
import sys
import textwrap
import time
from functools import cache
from pathlib import Path

import pytest

from schedulers.hardware import A100, H100
from schedulers.schedule import Schedule, make_schedule
from search.database import (
    FORMAT_TAG,
    SCHEMA_VERSION,
    DatabaseError,
    RecordError,
    TuningDatabase,
    cache_enabled,
    key_parts,
    tuning_key,
)
from search.records import MeasureResult
from smg.workloads import gemm, softmax_gemm

ROOT = Path(__file__).resolve().parents[1]
HEX64 = re.compile(r"[0-9a-f]{64}")


@cache
def sched(n: int = 8, step: int = 4) -> Schedule:
    return make_schedule(gemm(16, 16, 8), tiles={"n": n}, step=step)


@cache
def key() -> str:
    return tuning_key(gemm(16, 16, 8), H100, "llvm")


def ok(s: Schedule, *lat: float) -> MeasureResult:
    return MeasureResult(s.key, "llvm", latencies_us=lat, max_abs_err=0.0)


def failed(s: Schedule) -> MeasureResult:
    return MeasureResult(s.key, "llvm", error="build failed: out of registers")


def run_py(script: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


def filled_db(path: Path, n: int = 3) -> None:
    with TuningDatabase(path) as db:
        for i, (tile, step) in enumerate([(8, 4), (4, 4), (16, 4), (8, 2), (4, 2), (16, 2), (8, 8), (4, 8)][:n]):
            db.add(key(), sched(tile, step), ok(sched(tile, step), 10.0 + i, 11.0 + i, 12.0 + i))


# -- round trip and reuse --------------------------------------------------------------------------


def test_round_trip_best_records_and_failures(tmp_path: Path) -> None:
    a, b, c, bad = sched(8, 4), sched(4, 4), sched(16, 4), sched(8, 2)
    assert len({a.key, b.key, c.key, bad.key}) == 4
    with TuningDatabase(tmp_path / "t.db") as db:
        db.add(key(), a, ok(a, 30.0, 31.0, 29.0))
        db.add(key(), b, ok(b, 12.0, 10.0, 11.0))
        db.add(key(), c, ok(c, 20.0))
        db.add(key(), bad, failed(bad))
        best = db.best(key())
        assert best is not None
        s, r = best
        assert s.key == b.key and s == b
        assert r == ok(b, 12.0, 10.0, 11.0) and r.median_us == 11.0
        got = db.records(key())
        assert [x.key for x, _ in got] == [a.key, b.key, c.key, bad.key]
        assert got[3][1].error == "build failed: out of registers" and not got[3][1].ok
        assert db.measured_keys(key()) == {a.key, b.key, c.key, bad.key}
        assert db.count(key()) == 4
        assert db.workloads() == [key()]
        assert db.best("0" * 64) is None and db.count("0" * 64) == 0


def test_failed_only_is_never_best_and_replace_keeps_one_row(tmp_path: Path) -> None:
    a = sched(8, 4)
    with TuningDatabase(tmp_path / "t.db") as db:
        db.add(key(), a, failed(a))
        assert db.best(key()) is None and db.count(key()) == 1
        db.add(key(), a, ok(a, 5.0))  # re-measured: replaces the failure
        assert db.count(key()) == 1
        assert db.best(key())[1].median_us == 5.0


def test_cached_best_is_reused_after_reopen_quickly(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    filled_db(path, 3)
    t0 = time.perf_counter()
    with TuningDatabase(path) as db:
        best = db.best(key())
    assert time.perf_counter() - t0 < 0.5
    assert best is not None and best[0].key == sched(8, 4).key and best[1].median_us == 11.0


def test_parts_are_stored_and_checked(tmp_path: Path) -> None:
    parts = key_parts(gemm(16, 16, 8), H100, "llvm")
    a = sched()
    with TuningDatabase(tmp_path / "t.db") as db:
        db.add(key(), a, ok(a, 1.0), parts=parts)
        assert db.parts(key()) == parts
        other = key_parts(softmax_gemm(16, 16, 8), H100, "llvm")
        with pytest.raises(RecordError, match="hash"):
            db.add(key(), a, ok(a, 1.0), parts=other)
        with pytest.raises(RecordError, match="not the workload"):
            db.add(tuning_key(softmax_gemm(16, 16, 8), H100, "llvm"), a, ok(a, 1.0), parts=other)


def test_result_for_another_schedule_is_refused(tmp_path: Path) -> None:
    a, b = sched(8, 4), sched(4, 4)
    with TuningDatabase(tmp_path / "t.db") as db:
        with pytest.raises(RecordError, match=f"{a.key}.*{b.key}"):
            db.add(key(), b, ok(a, 1.0))
        with pytest.raises(RecordError, match="64 lowercase hex"):
            db.add("gemm", a, ok(a, 1.0))
        assert db.count(key()) == 0


def test_import_results_adds_many(tmp_path: Path) -> None:
    pairs = [(sched(t, 4), ok(sched(t, 4), float(t))) for t in (4, 8, 16)]
    with TuningDatabase(tmp_path / "t.db") as db:
        assert db.import_results(key(), pairs) == 3
        assert db.count(key()) == 3
        assert db.best(key())[0].key == sched(4, 4).key


def test_unreadable_row_names_its_id(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    filled_db(path, 2)
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE records SET schedule_json = '{\"format\": \"nope\"}' WHERE id = 2")
    conn.close()
    with TuningDatabase(path) as db, pytest.raises(DatabaseError, match="record id 2"):
        db.records(key())


# -- interruption ------------------------------------------------------------------------------------


def test_records_survive_a_killed_process(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    proc = run_py(f"""
        import os
        from schedulers.hardware import H100
        from schedulers.schedule import make_schedule
        from search.database import TuningDatabase, tuning_key
        from search.records import MeasureResult
        from smg.workloads import gemm
        key = tuning_key(gemm(16, 16, 8), H100, "llvm")
        db = TuningDatabase({str(path)!r})
        for tile, lat in ((8, 7.0), (4, 3.0)):
            s = make_schedule(gemm(16, 16, 8), tiles={{"n": tile}}, step=4)
            db.add(key, s, MeasureResult(s.key, "llvm", latencies_us=(lat,)))
        print(key, flush=True)
        os._exit(1)  # no close(), no atexit: as if killed
    """)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.strip() == key()
    with TuningDatabase(path) as db:
        assert db.measured_keys(key()) == {sched(8, 4).key, sched(4, 4).key}
        assert db.best(key())[0].key == sched(4, 4).key


# -- refusing bad files, never touching them --------------------------------------------------------


def refused(path: Path, match: str) -> DatabaseError:
    before = path.read_bytes()
    with pytest.raises(DatabaseError, match=match) as info:
        TuningDatabase(path)
    assert path.read_bytes() == before
    assert str(path) in str(info.value)
    with pytest.raises(DatabaseError, match=match):
        TuningDatabase(path, readonly=True)
    assert path.read_bytes() == before
    return info.value


def test_random_bytes_are_not_sqlite(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    path.write_bytes(os.urandom(8192))
    refused(path, r"not a spacefusion tuning database \(not SQLite")


def test_sqlite_magic_followed_by_garbage_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    path.write_bytes(b"SQLite format 3\x00" + os.urandom(4096))
    refused(path, "not SQLite|corrupt")


def test_foreign_sqlite_database(tmp_path: Path) -> None:
    path = tmp_path / "other.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE foo (x INTEGER)")
        conn.execute("INSERT INTO foo VALUES (1)")
    conn.close()
    refused(path, "foreign.*foo")


def test_foreign_meta_table(tmp_path: Path) -> None:
    path = tmp_path / "other.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)")
        conn.execute("INSERT INTO meta VALUES ('format', 'someone-elses-db')")
    conn.close()
    refused(path, "foreign: format tag 'someone-elses-db'")


def test_changed_format_tag(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    filled_db(path, 1)
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE meta SET value = 'spacefusion-tuning-db-fork' WHERE key = 'format'")
    conn.close()
    refused(path, "foreign.*spacefusion-tuning-db-fork")


def test_newer_schema_version(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    filled_db(path, 1)
    newer = SCHEMA_VERSION + 1
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(newer),))
    conn.close()
    refused(path, f"schema version {newer} is newer than this spacefusion understands")


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    path.touch()
    refused(path, r"empty file \(0 bytes\)")
    assert path.stat().st_size == 0


@pytest.mark.parametrize("cut", ["half", "page"])
def test_truncated_database(tmp_path: Path, cut: str) -> None:
    good = tmp_path / "good.db"
    filled_db(good, 8)
    data = good.read_bytes()
    assert len(data) >= 4 * 4096
    path = tmp_path / "t.db"
    path.write_bytes(data[: len(data) // 2] if cut == "half" else data[: 4096 * 2])
    refused(path, "corrupt")


def test_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DatabaseError, match="not a regular file"):
        TuningDatabase(tmp_path)


def test_new_database_has_meta(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "t.db"
    TuningDatabase(path).close()
    with sqlite3.connect(path) as conn:
        meta = dict(conn.execute("SELECT key, value FROM meta"))
    conn.close()
    assert meta["format"] == FORMAT_TAG and meta["schema_version"] == str(SCHEMA_VERSION)
    assert [p.name for p in path.parent.iterdir()] == ["t.db"]  # no temporary left behind


# -- read-only ---------------------------------------------------------------------------------------


def test_readonly_refuses_writes(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    with pytest.raises(DatabaseError, match="does not exist"):
        TuningDatabase(path, readonly=True)
    assert not path.exists()
    filled_db(path, 2)
    before = path.read_bytes()
    with TuningDatabase(path, readonly=True) as db:
        assert db.count(key()) == 2 and db.best(key()) is not None
        s = sched(16, 4)
        with pytest.raises(DatabaseError, match="read-only"):
            db.add(key(), s, ok(s, 1.0))
        with pytest.raises(DatabaseError, match="read-only"):
            db.import_results(key(), [(s, ok(s, 1.0))])
    assert path.read_bytes() == before


def test_closed_database_refuses_use(tmp_path: Path) -> None:
    db = TuningDatabase(tmp_path / "t.db")
    db.close()
    with pytest.raises(DatabaseError, match="closed"):
        db.count(key())


# -- the tuning key ----------------------------------------------------------------------------------


def test_tuning_key_covers_workload_hardware_and_target() -> None:
    g = gemm(16, 16, 8)
    k = tuning_key(g, H100, "llvm")
    assert HEX64.fullmatch(k)
    assert tuning_key(dataclasses.replace(g, name="my_gemm"), H100, "llvm") == k
    assert tuning_key(gemm(16, 16, 8), "h100", "llvm") == k
    others = {
        tuning_key(gemm(16, 16, 16), H100, "llvm"),
        tuning_key(gemm(16, 16, 8, dtype="float16"), H100, "llvm"),
        tuning_key(g, A100, "llvm"),
        tuning_key(g, H100, "cuda:sm_90a"),
        tuning_key(g, H100, "llvm", ("-O3",)),
    }
    assert k not in others and len(others) == 5
    parts = key_parts(g, H100, "llvm")
    assert "name" not in parts["workload"]
    assert parts["hardware"]["fingerprint"] == H100.fingerprint
    assert set(parts) >= {"workload", "hardware", "spacefusion", "tvm", "target", "compile_flags"}


def test_tuning_key_is_stable_across_processes() -> None:
    proc = run_py("""
        from schedulers.hardware import H100
        from search.database import tuning_key
        from smg.workloads import gemm
        print(tuning_key(gemm(16, 16, 8), H100, "llvm"))
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == key()


def test_tuning_key_does_not_import_tvm() -> None:
    proc = run_py("""
        import sys
        from schedulers.hardware import H100
        from search.database import tuning_key
        from smg.workloads import gemm
        tuning_key(gemm(16, 16, 8), H100, "llvm")
        print("tvm" in sys.modules)
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


# -- the cache switch --------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "enabled"), [("1", False), ("true", False), ("YES", False), ("0", True),
                                                ("", True), ("no", True)])
def test_cache_switch(monkeypatch: pytest.MonkeyPatch, value: str, enabled: bool) -> None:
    monkeypatch.setenv("SPACEFUSION_NO_CACHE", value)
    assert cache_enabled() is enabled


def test_cache_enabled_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPACEFUSION_NO_CACHE", raising=False)
    assert cache_enabled()


def test_a_file_two_hosts_tune_into_over_a_network_file_system_is_refused(tmp_path, monkeypatch) -> None:
    """SQLite's locks do not hold between hosts on NFS and its kind: a tune of this host claiming in a file where
    another host's tune holds live claims is refused with what to do instead, and nothing is written (the other
    host's claims and records stay).  On a local file system the claims keep the two apart, as before."""
    import search.database as dbmod

    key = tuning_key(gemm(16, 16, 8), H100, "llvm")
    path = tmp_path / "shared.db"
    with TuningDatabase(path) as db:
        db.add(key, sched(), MeasureResult(sched().key, "llvm", (3.0,)))
        assert db.claim(key, ["s1", "s2"], "otherhost/4242/tok") == ["s1", "s2"]
        mine = dbmod.claim_owner()
        monkeypatch.setattr(dbmod, "filesystem_type", lambda p: "nfs4")
        with pytest.raises(DatabaseError, match=r"shared.db: is on nfs4 and otherhost is tuning into it too; SQLite's "
                                                r"locks do not hold between hosts there.*Nothing was written.*"
                                                r"--runner ray --ray-address HEAD:PORT"):
            db.claim(key, ["s2", "s3"], mine)
        with sqlite3.connect(path) as c:
            assert sorted(c.execute("SELECT schedule_key, owner FROM claims")) == [("s1", "otherhost/4242/tok"),
                                                                                    ("s2", "otherhost/4242/tok")]
        assert db.count(key) == 1
        monkeypatch.setattr(dbmod, "filesystem_type", lambda p: "ext4")
        assert db.claim(key, ["s2", "s3"], mine) == ["s3"]


def test_the_file_system_of_a_path_is_read_from_the_mounts() -> None:
    from search.database import filesystem_type

    assert filesystem_type(Path("/proc/self")) == "proc"
    assert filesystem_type(ROOT) not in (None, "proc")
