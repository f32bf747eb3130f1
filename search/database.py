"""The tuning database: every measured schedule, keyed by what makes a measurement reusable.

A record is (tuning key, schedule, measurement).  The tuning key (``tuning_key``) is a sha256
over the workload (ops, shapes, dtypes -- not its display name), the hardware fingerprint, the
spacefusion and TVM versions, the target and compile flags: a measurement is reused only where
all of these match.  Failed candidates are stored too (``median_us`` NULL) so they are not
measured again -- except where they failed because of the machine, not the kernel (no GPU there,
``MeasureResult.environmental``): those are not counted as measured, so a rerun measures them.

Storage is one SQLite file (stdlib ``sqlite3``, no pickle: schedules and results are JSON).
Each ``add`` is its own committed transaction, so a tune that is killed keeps what it measured.
An existing file is verified before use -- SQLite header, ``quick_check``, the ``meta`` format
tag and schema version -- and any problem raises ``DatabaseError`` without writing to the file:
a database is never overwritten, truncated, migrated or deleted.  A file another process holds locked
(a tune committing, a program inside a transaction) raises ``DatabaseLockedError`` -- a lock, named as one
with the process that holds it where the OS says, never reported as corruption -- after waiting
``LOCK_WAIT_S`` seconds for it to go.

One file, one host.  Tunes of one host share a file through claims (``claim``: disjoint candidates, a claim
lapsing with its process); several hosts measure for one tune as workers of a Ray cluster whose driver alone
writes the file.  Why not several hosts on one file: SQLite's locks do not hold between hosts on network file
systems, so a tune whose claims meet a live tune of another host in a file on one (``NETWORK_FS``) is refused
before it writes.

Environment: ``SPACEFUSION_NO_CACHE=1`` (or ``true`` / ``yes`` / ``on``) makes ``cache_enabled()``
return False, so the tuner measures again instead of reusing a cached best; records are still
written.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import json
import math
import os
import re
import socket
import sqlite3
import time
import tomllib
import urllib.parse
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

from schedulers.errors import ScheduleError
from schedulers.hardware import HardwareModel, get_hardware
from schedulers.schedule import Schedule
from search.records import MeasureResult
from smg.errors import SpaceFusionError
from smg.hashing import canonical, content_key
from smg.ir import SMG
from smg.serialize import smg_to_dict

__all__ = [
    "FORMAT_TAG",
    "KEY_FORMAT",
    "SCHEMA_VERSION",
    "LOCK_WAIT_S",
    "NETWORK_FS",
    "DatabaseError",
    "DatabaseLockedError",
    "RecordError",
    "TuningDatabase",
    "cache_enabled",
    "filesystem_type",
    "key_parts",
    "tuning_key",
]

#: The ``meta`` row that marks a file as ours.
FORMAT_TAG = "spacefusion-tuning-db"
#: Schema this code reads and writes; a file with a larger one is refused, never migrated.
SCHEMA_VERSION = 1
#: Version of the tuning-key recipe; part of every key, so changing the recipe orphans old keys.
KEY_FORMAT = "spacefusion-tuning-key/1"

_SQLITE_MAGIC = b"SQLite format 3\x00"
_HEX64 = re.compile(r"[0-9a-f]{64}")
_TRUTHY = frozenset({"1", "true", "yes", "on"})

_SCHEMA = (
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)",
    "CREATE TABLE workloads (tuning_key TEXT PRIMARY KEY, parts_json TEXT, created REAL)",
    "CREATE TABLE records (id INTEGER PRIMARY KEY AUTOINCREMENT, tuning_key TEXT NOT NULL, "
    "schedule_key TEXT NOT NULL, schedule_json TEXT NOT NULL, target TEXT, median_us REAL, "
    "result_json TEXT NOT NULL, created REAL, UNIQUE (tuning_key, schedule_key))",
    "CREATE INDEX records_by_latency ON records (tuning_key, median_us)",
)
_TABLES = ("meta", "workloads", "records")
#: File systems that several hosts mount and whose locks SQLite cannot rely on between them (its FAQ: "file
#: locking is broken in many NFS implementations"): two hosts tuning into one file there are refused.
NETWORK_FS = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "afs", "ceph", "glusterfs", "lustre", "gpfs",
                        "beegfs", "fuse.sshfs", "fuse.glusterfs", "fuse.ceph", "fuse.s3fs", "fuse.gcsfuse",
                        "fuse.rclone", "fuse.juicefs"})
#: Seconds a read or write waits for another process's lock on the file before ``DatabaseLockedError``.
LOCK_WAIT_S = 30.0
#: SQLite's primary result codes for "another connection holds a lock" (SQLITE_BUSY, SQLITE_LOCKED).
_LOCK_CODES = frozenset({5, 6})


class DatabaseError(SpaceFusionError):
    """A tuning-database file is missing, foreign, corrupt, too new, read-only or locked; the message names it."""


class DatabaseLockedError(DatabaseError):
    """The file is sound but another process holds it locked (SQLite busy/locked) longer than we waited.
    Separate from corruption because the remedy differs: wait and run again, nothing is wrong with the file."""


def _is_lock(e: sqlite3.Error) -> bool:
    """Whether SQLite refused because another connection holds a lock (not because the file is damaged)."""
    code = getattr(e, "sqlite_errorcode", None)
    if isinstance(code, int):
        return code & 0xFF in _LOCK_CODES
    return "locked" in str(e) or "busy" in str(e)


def _lock_holders(path: Path) -> list[str]:
    """The processes holding a POSIX lock on ``path`` as ``pid N (command)``, from Linux's /proc/locks (what
    SQLite's locks are); empty where the OS does not say (another OS, a network file system, no permission)."""
    try:
        st = path.stat()
        table = Path("/proc/locks").read_text()
    except OSError:
        return []
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = sorted({int(f[4]) for f in (line.split() for line in table.splitlines())
                   if len(f) > 5 and f[5] == dev and f[4].isdigit() and int(f[4]) != os.getpid()})
    out = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            cmd = ""
        out.append(f"pid {pid}" + (f" ({cmd[:120]})" if cmd else ""))
    return out


def filesystem_type(path: Path) -> str | None:
    """The type of the file system ``path`` is on (``ext4``, ``nfs4``, ...), from Linux's /proc/mounts: the mount
    whose point is the longest prefix of the resolved path; None where the OS does not say."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
        where = str(path.resolve())
    except OSError:
        return None
    best, kind = "", None
    for line in mounts:
        f = line.split()
        if len(f) < 3:
            continue
        point = f[1].replace("\\040", " ")
        inside = where == point or where.startswith(point.rstrip("/") + "/")
        if inside and len(point) > len(best):
            best, kind = point, f[2]
    return kind


class RecordError(SpaceFusionError, ValueError):
    """A record handed to the database is inconsistent (schedule vs result, key vs parts)."""


# ---------------------------------------------------------------------- cache switch and keys


def cache_enabled() -> bool:
    """False when ``SPACEFUSION_NO_CACHE`` is truthy: the tuner then ignores cached bests."""
    return os.environ.get("SPACEFUSION_NO_CACHE", "").strip().lower() not in _TRUTHY


@functools.cache
def _spacefusion_version() -> str:
    """Installed version, else pyproject's (a source checkout), else ``0+unknown``."""
    try:
        return importlib.metadata.version("spacefusion")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        with open(Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as f:
            return str(tomllib.load(f)["project"]["version"])
    except (OSError, KeyError, TypeError, tomllib.TOMLDecodeError):
        return "0+unknown"


@functools.cache
def _tvm_version() -> str:
    """From package metadata, so computing a key never imports TVM."""
    try:
        return importlib.metadata.version("apache-tvm")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def key_parts(smg: SMG, hw: HardwareModel | str, target: str,
              compile_flags: Iterable[str] = ()) -> dict[str, Any]:
    """Everything a tuning key covers, as plain JSON data (what ``tuning_key`` hashes).

    The SMG's display name is left out: two equal graphs share measurements whatever they are called.
    """
    if not isinstance(smg, SMG):
        raise TypeError(f"key_parts needs an SMG, got {type(smg).__name__}")
    if not isinstance(target, str) or not target:
        raise ValueError(f"target must be a non-empty string, got {target!r}")
    flags = (compile_flags,) if isinstance(compile_flags, str) else tuple(compile_flags)
    if not all(isinstance(f, str) for f in flags):
        raise ValueError(f"compile_flags must be strings, got {flags!r}")
    hw = get_hardware(hw)
    workload = smg_to_dict(smg)
    workload.pop("name", None)
    return canonical({
        "format": KEY_FORMAT,
        "workload": workload,
        "hardware": {"name": hw.name, "fingerprint": hw.fingerprint},
        "spacefusion": _spacefusion_version(),
        "tvm": _tvm_version(),
        "target": target,
        "compile_flags": list(flags),
    })


def tuning_key(smg: SMG, hw: HardwareModel | str, target: str, compile_flags: Iterable[str] = ()) -> str:
    """sha256 hex of ``key_parts(...)``: stable across processes and machines (never Python's hash())."""
    return content_key(key_parts(smg, hw, target, compile_flags))


def _workload_of(smg: SMG) -> dict[str, Any]:
    d = smg_to_dict(smg)
    d.pop("name", None)
    return d


# ---------------------------------------------------------------------- the database


def _uri(path: Path, mode: str) -> str:
    return f"file:{urllib.parse.quote(str(path))}?mode={mode}"


class TuningDatabase:
    """One SQLite tuning database; a context manager.

    ``readonly`` opens with ``mode=ro`` (the file must exist) and refuses every write.
    A missing file is created complete (schema and ``meta``) under a temporary name and then
    linked into place, so no half-initialised database is ever visible.
    """

    def __init__(self, path: str | os.PathLike[str], *, readonly: bool = False,
                 lock_wait_s: float | None = None) -> None:
        self.path = Path(path).expanduser().absolute()
        self.readonly = readonly
        self.lock_wait_s = LOCK_WAIT_S if lock_wait_s is None else float(lock_wait_s)
        self._conn: sqlite3.Connection | None = None
        if not self.path.exists():
            if readonly:
                raise DatabaseError(f"tuning database {self.path} does not exist (opened read-only, so not created)")
            self._create()
        self._conn = self._open_existing()

    # -- opening -------------------------------------------------------------------------
    def _err(self, problem: str) -> DatabaseError:
        return DatabaseError(f"{self.path}: {problem}")

    def _fail(self, doing: str, e: sqlite3.Error) -> DatabaseError:
        """The error for SQLite's ``e`` while ``doing``: a lock as a lock (who holds it, what to do), anything
        else as ``doing`` failed."""
        if not _is_lock(e):
            return self._err(f"{doing}: {e}")
        holders = _lock_holders(self.path)
        who = (f"held by {', '.join(holders)}" if holders
               else "held by another process (another tune, or a program with the database open in a transaction)")
        journal = [p.name for p in (self.path.with_name(self.path.name + s) for s in ("-journal", "-wal"))
                   if p.exists()]
        return DatabaseLockedError(
            f"{self.path}: is locked, not damaged ({doing}: SQLite says {e!s} after waiting {self.lock_wait_s:g} s); "
            f"the lock is {who}{'; its journal: ' + ', '.join(journal) if journal else ''}. Nothing was changed: "
            f"wait for that process to finish (or stop it) and run again")

    def _create(self) -> None:
        """Build the database next to ``path`` and link it in; if another process won the race, use theirs."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise self._err(f"cannot create its directory: {e}") from None
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{time.time_ns()}.tmp")
        try:
            conn = sqlite3.connect(str(tmp), isolation_level=None)
            try:
                conn.execute("BEGIN")
                for stmt in _SCHEMA:
                    conn.execute(stmt)
                now = repr(time.time())
                conn.executemany("INSERT INTO meta (key, value) VALUES (?, ?)", [
                    ("format", FORMAT_TAG), ("schema_version", str(SCHEMA_VERSION)),
                    ("created", now), ("created_by", f"spacefusion {_spacefusion_version()}")])
                conn.execute("COMMIT")
            finally:
                conn.close()
            try:
                os.link(tmp, self.path)  # fails if path exists: never overwrites
            except FileExistsError:
                pass  # a concurrent tuner created it first; it is verified like any existing file
            except OSError:  # no hard links here: fall back to an exclusive create + copy
                with open(self.path, "xb") as out, open(tmp, "rb") as src:
                    out.write(src.read())
                    out.flush()
                    os.fsync(out.fileno())
        except FileExistsError:
            pass
        except (OSError, sqlite3.Error) as e:
            raise self._err(f"cannot create tuning database: {e}") from None
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()

    def _check_header(self) -> None:
        """Refuse files SQLite should not even open: directories, empty files, non-SQLite bytes."""
        if not self.path.is_file():
            raise self._err("is not a regular file, so not a spacefusion tuning database")
        try:
            with open(self.path, "rb") as f:
                head = f.read(100)
        except OSError as e:
            raise self._err(f"cannot be read: {e}") from None
        if not head:
            raise self._err("is an empty file (0 bytes), not a spacefusion tuning database; it was left as is "
                            "(remove it, or choose another path, to start a new database)")
        if not head.startswith(_SQLITE_MAGIC):
            raise self._err("is not a spacefusion tuning database (not SQLite: no SQLite header); it was left as is")
        if len(head) < 100:
            raise self._err(f"is corrupt: truncated SQLite header ({len(head)} bytes)")

    def _open_existing(self) -> sqlite3.Connection:
        """Connect and verify without writing: integrity, format tag, schema version, tables."""
        self._check_header()
        try:
            conn = sqlite3.connect(_uri(self.path, "ro" if self.readonly else "rw"), uri=True,
                                   isolation_level=None, timeout=self.lock_wait_s)
        except sqlite3.Error as e:
            raise self._err(f"cannot be opened: {e}") from None
        try:
            self._verify(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def _verify(self, conn: sqlite3.Connection) -> None:
        try:
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            check = [r[0] for r in conn.execute("PRAGMA quick_check")]
        except sqlite3.DatabaseError as e:
            if _is_lock(e):  # another writer holds the file: a lock, not corruption
                raise self._fail("opening it", e) from None
            if "not a database" in str(e):
                raise self._err(f"is not a spacefusion tuning database (not SQLite: {e})") from None
            raise self._err(f"is corrupt: {e}") from None
        if check != ["ok"]:
            raise self._err(f"is corrupt: SQLite quick_check reports {'; '.join(map(str, check[:5]))}")
        if "meta" not in tables:
            raise self._err(f"is not a spacefusion tuning database (foreign SQLite database: no meta table; "
                            f"tables: {', '.join(sorted(tables)) or 'none'}); it was left as is")
        try:
            meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
        except sqlite3.Error as e:
            if _is_lock(e):
                raise self._fail("opening it", e) from None
            raise self._err(f"is not a spacefusion tuning database (foreign: unreadable meta table: {e})") from None
        if meta.get("format") != FORMAT_TAG:
            raise self._err(f"is not a spacefusion tuning database (foreign: format tag {meta.get('format')!r}, "
                            f"expected {FORMAT_TAG!r}); it was left as is")
        raw = meta.get("schema_version")
        try:
            version = int(str(raw))
        except ValueError:
            raise self._err(f"is corrupt: schema version {raw!r} is not an integer") from None
        if version > SCHEMA_VERSION:
            raise self._err(f"schema version {version} is newer than this spacefusion understands "
                            f"({SCHEMA_VERSION}); upgrade spacefusion to use it")
        if version < SCHEMA_VERSION:
            raise self._err(f"is corrupt: schema version {version} is unknown (this spacefusion writes "
                            f"{SCHEMA_VERSION} and never had an older one)")
        missing = [t for t in _TABLES if t not in tables]
        if missing:
            raise self._err(f"is corrupt: tables missing: {', '.join(missing)}")

    # -- lifecycle -----------------------------------------------------------------------
    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> TuningDatabase:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._conn is None else ("read-only" if self.readonly else "open")
        return f"TuningDatabase({str(self.path)!r}, {state})"

    @property
    def conn(self) -> sqlite3.Connection:
        if self._conn is None:
            raise self._err("tuning database is closed")
        return self._conn

    def _query(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        try:
            return self.conn.execute(sql, args).fetchall()
        except sqlite3.Error as e:
            raise self._fail("read failed", e) from None

    def _writable(self) -> sqlite3.Connection:
        if self.readonly:
            raise self._err("tuning database is opened read-only; writes are refused")
        return self.conn

    # -- writing -------------------------------------------------------------------------
    def _row(self, key: str, schedule: Schedule, result: MeasureResult,
             parts: dict[str, Any] | None) -> tuple[Any, ...]:
        """Validate one record and turn it into the columns stored."""
        if not isinstance(key, str) or not _HEX64.fullmatch(key):
            raise RecordError(f"tuning key must be 64 lowercase hex characters (from tuning_key), got {key!r}")
        if not isinstance(schedule, Schedule) or not isinstance(result, MeasureResult):
            raise RecordError(f"a record is (Schedule, MeasureResult), got ({type(schedule).__name__}, "
                              f"{type(result).__name__})")
        if result.schedule_key != schedule.key:
            raise RecordError(f"result is for schedule {result.schedule_key}, not for the schedule given "
                              f"({schedule.key})")
        if parts is not None:
            if content_key(parts) != key:
                raise RecordError(f"parts hash to {content_key(parts)}, not to the tuning key {key}")
            if "workload" in parts and parts["workload"] != canonical(_workload_of(schedule.smg)):
                raise RecordError(f"schedule {schedule.key[:12]} is for workload {schedule.smg.name!r}, "
                                  f"which is not the workload of tuning key {key[:12]}")
        try:
            result_json = result.to_json()
        except (TypeError, ValueError) as e:
            raise RecordError(f"result for schedule {schedule.key[:12]} is not JSON-serialisable: {e}") from None
        median = result.median_us
        return (key, schedule.key, schedule.to_json(), result.target,
                median if math.isfinite(median) else None, result_json, time.time())

    def _insert(self, conn: sqlite3.Connection, key: str, row: tuple[Any, ...], parts: dict[str, Any] | None) -> None:
        parts_json = None if parts is None else json.dumps(canonical(parts), sort_keys=True)
        conn.execute("INSERT INTO workloads (tuning_key, parts_json, created) VALUES (?, ?, ?) "
                     "ON CONFLICT (tuning_key) DO UPDATE SET parts_json = COALESCE(parts_json, excluded.parts_json)",
                     (key, parts_json, row[-1]))
        conn.execute("INSERT INTO records (tuning_key, schedule_key, schedule_json, target, median_us, result_json, "
                     "created) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (tuning_key, schedule_key) DO UPDATE SET "
                     "schedule_json = excluded.schedule_json, target = excluded.target, "
                     "median_us = excluded.median_us, result_json = excluded.result_json, "
                     "created = excluded.created", row)

    def _transaction(self, write: Callable[[sqlite3.Connection], None]) -> None:
        conn = self._writable()
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                write(conn)
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        except sqlite3.Error as e:
            raise self._fail("write failed", e) from None

    def add(self, key: str, schedule: Schedule, result: MeasureResult, parts: dict[str, Any] | None = None) -> None:
        """Insert (or replace) one record and commit it at once, so an interrupted tune keeps it.

        ``parts`` (from ``key_parts``) is stored once per key, for inspection; when given it is
        checked to hash to ``key`` and to describe the schedule's workload.
        """
        row = self._row(key, schedule, result, parts)
        self._transaction(lambda conn: self._insert(conn, key, row, parts))

    def import_results(self, key: str, pairs: Iterable[tuple[Schedule, MeasureResult]],
                       parts: dict[str, Any] | None = None) -> int:
        """Add many records (e.g. an offline batch) in one transaction: all are validated first, then
        all or none are stored.  Returns how many were stored."""
        rows = [self._row(key, s, r, parts) for s, r in pairs]

        def write(conn: sqlite3.Connection) -> None:
            for row in rows:
                self._insert(conn, key, row, parts)

        if rows:
            self._transaction(write)
        return len(rows)

    # -- claims: concurrent tuners measure disjoint candidates ---------------------------
    def claim(self, key: str, schedule_keys: Iterable[str], owner: str, ttl_s: float = 6 * 3600) -> list[str]:
        """Of ``schedule_keys``, those ``owner`` may measure now: not measured yet and not claimed by another
        live tuner; they are claimed for ``owner`` in the same transaction.  A claim lapses when its process
        (``owner`` is ``host/pid/token``) is gone from this host, or after ``ttl_s``: a killed tune's
        candidates return.  Why: two tunes on one database measured the same candidates twice.

        One host per file: the claims of a live tune of another host in a file on a network file system
        (``NETWORK_FS``, where SQLite's locks do not hold between hosts) raise ``DatabaseError`` and nothing is
        written; several hosts measure for one tune through a Ray cluster instead (its driver alone writes)."""
        wanted, granted = list(dict.fromkeys(schedule_keys)), []
        host = socket.gethostname()

        def write(conn: sqlite3.Connection) -> None:
            conn.execute("CREATE TABLE IF NOT EXISTS claims (tuning_key TEXT NOT NULL, schedule_key TEXT NOT NULL, "
                         "owner TEXT NOT NULL, at REAL NOT NULL, PRIMARY KEY (tuning_key, schedule_key))")
            now = time.time()
            held = {}
            for sk, who, at in conn.execute("SELECT schedule_key, owner, at FROM claims WHERE tuning_key = ?",
                                            (key,)):
                if who != owner and now - at < ttl_s and _alive(who, host):
                    held[sk] = who
            self._one_host(host, {w.split("/")[0] for w in held.values()} - {host})
            done = _measured(conn.execute("SELECT schedule_key, median_us, result_json FROM records "
                                          "WHERE tuning_key = ?", (key,)).fetchall())
            for sk in wanted:
                if sk not in held and sk not in done:
                    conn.execute("INSERT INTO claims (tuning_key, schedule_key, owner, at) VALUES (?, ?, ?, ?) "
                                 "ON CONFLICT (tuning_key, schedule_key) DO UPDATE SET owner = excluded.owner, "
                                 "at = excluded.at", (key, sk, owner, now))
                    granted.append(sk)

        self._transaction(write)
        return granted

    def _one_host(self, host: str, others: set[str]) -> None:
        """Refuse a file on a network file system that a live tune of another host claims in (see ``claim``)."""
        if not others:
            return
        fs = filesystem_type(self.path)
        if fs not in NETWORK_FS:
            return
        raise self._err(f"is on {fs} and {', '.join(sorted(others))} is tuning into it too; SQLite's locks do not "
                        f"hold between hosts there, so two writers could lose records or damage the file. Nothing "
                        f"was written. Tune from one host (this one, {host}, once the other's tune has ended) and let "
                        f"it measure on the other hosts' GPUs through a Ray cluster: --runner ray --ray-address "
                        f"HEAD:PORT (docs/tuning.md)")

    def release(self, key: str, owner: str) -> None:
        """Drop ``owner``'s claims under ``key`` (its candidates are measured, or it gives up)."""
        def write(conn: sqlite3.Connection) -> None:
            conn.execute("CREATE TABLE IF NOT EXISTS claims (tuning_key TEXT NOT NULL, schedule_key TEXT NOT NULL, "
                         "owner TEXT NOT NULL, at REAL NOT NULL, PRIMARY KEY (tuning_key, schedule_key))")
            conn.execute("DELETE FROM claims WHERE tuning_key = ? AND owner = ?", (key, owner))

        self._transaction(write)

    # -- reading -------------------------------------------------------------------------
    def _parse(self, row: tuple[Any, ...]) -> tuple[Schedule, MeasureResult]:
        rid, schedule_key, schedule_json, result_json = row
        try:
            schedule = Schedule.from_json(schedule_json)
            result = MeasureResult.from_dict(json.loads(result_json))
        except (ScheduleError, ValueError, TypeError, KeyError) as e:
            raise self._err(f"record id {rid} cannot be read back: {e}") from None
        if schedule.key != schedule_key or result.schedule_key != schedule_key:
            raise self._err(f"record id {rid} is inconsistent: stored schedule key {schedule_key}, schedule hashes "
                            f"to {schedule.key}, result names {result.schedule_key}")
        return schedule, result

    _COLS = "id, schedule_key, schedule_json, result_json"

    def records(self, key: str) -> list[tuple[Schedule, MeasureResult]]:
        """Every record under ``key``, failed ones included, oldest first."""
        rows = self._query(f"SELECT {self._COLS} FROM records WHERE tuning_key = ? ORDER BY id", (key,))
        return [self._parse(r) for r in rows]

    def best(self, key: str) -> tuple[Schedule, MeasureResult] | None:
        """The successful record with the lowest median latency (earliest on a tie); None if there is none."""
        rows = self._query(f"SELECT {self._COLS} FROM records WHERE tuning_key = ? AND median_us IS NOT NULL "
                           "ORDER BY median_us, id LIMIT 1", (key,))
        return self._parse(rows[0]) if rows else None

    def measured_keys(self, key: str) -> set[str]:
        """Schedule keys measured under ``key``, kernel failures too: the tuner skips these and counts them against
        its trials.  A record that failed because of the environment (``MeasureResult.environmental``: no GPU
        where it ran) is kept but not counted, so a rerun where the runner works measures that candidate (its
        new record then replaces the old one)."""
        return _measured(self._query("SELECT schedule_key, median_us, result_json FROM records WHERE tuning_key = ?",
                                     (key,)))

    def count(self, key: str) -> int:
        return int(self._query("SELECT COUNT(*) FROM records WHERE tuning_key = ?", (key,))[0][0])

    def workloads(self) -> list[str]:
        """Tuning keys with records, oldest first."""
        return [r[0] for r in self._query("SELECT tuning_key FROM workloads ORDER BY created, tuning_key")]

    def parts(self, key: str) -> dict[str, Any] | None:
        """What ``key`` covers, if some ``add`` stored it."""
        rows = self._query("SELECT parts_json FROM workloads WHERE tuning_key = ?", (key,))
        if not rows or rows[0][0] is None:
            return None
        try:
            return json.loads(rows[0][0])
        except ValueError as e:
            raise self._err(f"workload {key[:12]}: stored parts are not JSON ({e})") from None


def _measured(rows: Iterable[tuple[Any, ...]]) -> set[str]:
    """The schedule keys of ``(schedule_key, median_us, result_json)`` rows that count as measured: every success,
    and every failure but an environmental one (see ``measured_keys``); a failure's result that cannot be read
    counts (it is not known to be environmental, and ``records`` names it)."""
    out = set()
    for sk, median, result_json in rows:
        if median is None:
            try:
                if MeasureResult.from_dict(json.loads(result_json)).environmental:
                    continue
            except (ValueError, TypeError, KeyError):
                pass
        out.add(sk)
    return out


def claim_owner() -> str:
    """A tuner's name in the claims table: this host, this process, and a token of its own (two tunes in one
    process are two owners)."""
    return f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:12]}"


def _alive(owner: str, host: str) -> bool:
    """Whether the process named by ``owner`` may still be measuring: on another host, assume so (the claim's
    age decides); on this one, whether the pid exists."""
    parts = owner.split("/")
    if len(parts) != 3 or parts[0] != host or not parts[1].isdigit():
        return True
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
