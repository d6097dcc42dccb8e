"""Opening, checking and writing a tuning database: an SQLite file, or a database server by its
SQLAlchemy URL (``postgresql://user@host/db``).

Every write is its own short transaction, so a record is durable as soon as it is measured and an
interrupted tuner loses nothing it measured. An SQLite file runs in WAL mode and takes its write lock
up front (``BEGIN IMMEDIATE``) with a busy timeout: readers never block, and several tuners writing one
file wait for each other instead of failing. A server database lets writers run side by side (MVCC);
two tuners inserting the same workload or target at once meet on a unique key, and the loser's
transaction is retried and finds the winner's row. Creating the schema in an empty server database
takes an advisory lock, so tuners started together run the migrations once. Driver errors become
:class:`~autosched.errors.DatabaseError` subclasses whose message says what to do.
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import time
import uuid
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator
from urllib.parse import quote

from sqlalchemy import create_engine, event, func, inspect, select
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, IntegrityError, InterfaceError, OperationalError
from sqlalchemy.exc import DatabaseError as SADatabaseError
from sqlalchemy.orm import Session

from autosched import __version__
from autosched.errors import (
    DatabaseCorruptError,
    DatabaseError,
    DatabaseLockedError,
    DatabaseUsageError,
    SchemaVersionError,
)
from autosched.records import MeasureResult, TuningRecord

from .models import RecordRow, RunRow, TargetRow, ValidationRow, WorkloadRow, utcnow

if TYPE_CHECKING:
    from autosched.target import TargetSpec
    from autosched.task import Task

# Deferred imports: numpy, alembic, psutil (imported where used: `autosched --help` stays fast).

DEFAULT_BUSY_TIMEOUT = 60.0  # seconds a writer waits for another writer before giving up


def _alembic_config():
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(Path(__file__).parent / "migrations"))
    return cfg


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(_alembic_config()).get_current_head()


def known_revisions() -> list[str]:
    from alembic.script import ScriptDirectory

    return [s.revision for s in ScriptDirectory.from_config(_alembic_config()).walk_revisions()]


def is_url(location: str | os.PathLike) -> bool:
    """Whether ``location`` names a database by URL (``dialect[+driver]://...``) rather than a file path."""
    return "://" in str(location)


def server_url(location: str):
    """The SQLAlchemy URL of a server database; ``postgresql://`` gets the psycopg (v3) driver that
    autosched depends on, instead of SQLAlchemy's default psycopg2."""
    try:
        url = make_url(location)
    except ArgumentError:
        raise DatabaseUsageError(f"{location!r} is not a database URL: use a file path or e.g. "
                            "postgresql://user@host:5432/dbname") from None
    if url.drivername == "postgresql":
        url = url.set(drivername="postgresql+psycopg")
    return url


class Database:
    """A tuning database: an SQLite file, or a server database (PostgreSQL) named by a URL.

    Args:
        path: the SQLite file, or a URL such as ``postgresql://user@host/db`` (``sqlite:///file`` is the
            file). A file is created (with the newest schema) if missing and ``create`` is true; an empty
            server database gets the newest schema on first open.
        readonly: open without writing anything (queries of a file one cannot write).
        create: create the file if it does not exist.
        busy_timeout: seconds to wait for another process's write lock.

    ``path`` is the file's :class:`~pathlib.Path`, or the URL (password hidden) of a server database.
    """

    def __init__(self, path: str | os.PathLike, readonly: bool = False, create: bool = True,
                 busy_timeout: float = DEFAULT_BUSY_TIMEOUT):
        self.readonly = readonly
        self.busy_timeout = busy_timeout
        self._setup(path)
        if self.url is not None:
            self._write_engine = self._server_engine() if not readonly else None
            self._read_engine = self._server_engine()
            self._check_schema()
            return
        if not self.path.exists():
            if readonly or not create:
                raise DatabaseUsageError(f"no tuning database at {self.path}: check --db, or tune first to create one")
            if not self.path.parent.exists():
                raise DatabaseUsageError(f"cannot create database {self.path}: folder {self.path.parent} does not exist")
        elif self.path.is_dir():
            raise DatabaseUsageError(f"{self.path} is a folder, not a database file: give --db a file path")
        self._write_engine = self._engine(immediate=True) if not readonly else None
        self._read_engine = self._engine(immediate=False)
        self._check_schema()

    # ---- connection setup ------------------------------------------------------------------------
    def _setup(self, location: str | os.PathLike) -> None:
        """``self.url`` (None for a file) and ``self.path``."""
        self.url = None
        if is_url(location):
            url = server_url(str(location))
            if url.get_backend_name() == "sqlite":
                if not url.database or url.database == ":memory:":
                    raise DatabaseUsageError(f"{location} names no file: give a file path, e.g. sqlite:///tuning.db")
                location = url.database
            else:
                self.url = url
                self.path = make_url(str(location)).render_as_string(hide_password=True)  # as the user wrote it
                return
        self.path = Path(location)

    @property
    def is_server(self) -> bool:
        return self.url is not None

    def _server_engine(self):
        # pool_pre_ping: a connection the server dropped (restart, idle timeout) is replaced, not fatal.
        options = {"postgresql_readonly": True} if self.readonly and self.url.get_backend_name() == "postgresql" else {}
        connect_args = {"connect_timeout": 10} if self.url.get_backend_name() == "postgresql" else {}
        try:
            engine = create_engine(self.url, pool_pre_ping=True, connect_args=connect_args)
        except ImportError as exc:
            raise DatabaseError(f"no driver for {self.path} ({exc}): pip install 'psycopg[binary]' for PostgreSQL") from None
        return engine.execution_options(**options) if options else engine

    def _engine(self, immediate: bool):
        if self.readonly:
            # A file opened read-only is never written, and nothing is created beside it: SQLite's own
            # read-only mode, and where the folder cannot take the WAL's -shm file (a shared, read-only
            # location) the file is read as immutable, without the WAL's locks.
            uri, timeout = self.readonly_uri(), self.busy_timeout
            if self._may_write_beside():
                # Where the file and its folder may be written, the file is opened read-write but refuses
                # every write (query_only): its last connection then removes the WAL's -wal and -shm files on
                # close, which a connection in SQLite's read-only mode cannot, leaving them beside the file.
                uri = uri.replace("mode=ro", "mode=rw")
            engine = create_engine(f"sqlite:///{self.path}", creator=lambda: sqlite3.connect(uri, uri=True, timeout=timeout,
                                                                                 check_same_thread=False))
        else:
            engine = create_engine(f"sqlite:///{self.path}", connect_args={"timeout": self.busy_timeout})
        readonly, timeout_ms = self.readonly, int(self.busy_timeout * 1000)

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn, _record):
            dbapi_conn.isolation_level = None  # we issue BEGIN ourselves (below)
            cur = dbapi_conn.cursor()
            cur.execute(f"PRAGMA busy_timeout = {timeout_ms}")
            if not readonly:
                cur.execute("PRAGMA journal_mode = WAL")
                cur.execute("PRAGMA synchronous = NORMAL")
            else:
                cur.execute("PRAGMA query_only = 1")
            cur.execute("PRAGMA foreign_keys = ON")
            cur.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn):
            # IMMEDIATE takes the write lock up front, so two writers queue on the busy timeout
            # instead of one failing when it upgrades a read lock (SQLITE_BUSY_SNAPSHOT).
            conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

        return engine

    def _may_write_beside(self) -> bool:
        path = self.path.resolve()
        return os.access(path, os.W_OK) and os.access(path.parent, os.W_OK)

    def readonly_uri(self) -> str:
        """The SQLite URI that opens the file read-only: ``mode=ro``, plus ``immutable=1`` where its folder
        is not writable (no -shm can be made there; a writer cannot be working on it then either)."""
        path = self.path.resolve()
        uri = f"file:{quote(str(path))}?mode=ro"
        if not os.access(path.parent, os.W_OK):
            uri += "&immutable=1"
        return uri

    def _translate(self, exc: Exception) -> DatabaseError:
        # Server drivers add detail lines (DETAIL:, HINT:, a caret under the SQL): the first line says it.
        msg = (str(getattr(exc, "orig", exc)).strip().splitlines() or [repr(exc)])[0]
        low = msg.lower()
        if self.is_server:
            if "does not exist" in low and "database" in low:
                return DatabaseError(f"database server at {self.path}: {msg}; create it (e.g. `createdb`) or fix the URL")
            if "connect" in low or "connection" in low or "timeout" in low or "password" in low:
                return DatabaseError(f"cannot reach the database server at {self.path} ({msg}): check that it runs "
                                     "and the URL's host, port, user and password")
            if "read-only" in low or "read only" in low:
                return DatabaseError(f"database {self.path} was opened read-only ({msg})")
            return DatabaseError(f"database {self.path}: {msg}")
        if "locked" in low or "busy" in low:
            return DatabaseLockedError(f"database {self.path} stayed locked by another process for over "
                                       f"{self.busy_timeout:.0f} s ({msg}); retry, or raise --busy-timeout")
        if "not a database" in low or "malformed" in low or "corrupt" in low:
            return DatabaseCorruptError(f"{self.path} is not a readable autosched database ({msg}): restore it "
                                        "from a backup or an export (`autosched db import`), or use another --db")
        if "readonly" in low or "read-only" in low:
            return DatabaseError(f"database {self.path} is read-only ({msg}): query it with read commands, or "
                                 "copy it somewhere writable to tune into it")
        if "disk is full" in low or "disk i/o" in low or "full" in low:
            return DatabaseError(f"cannot write database {self.path}: {msg}; free disk space. Records committed "
                                 "before this are kept")
        if "unable to open" in low:
            return DatabaseError(f"cannot open database {self.path} ({msg}): check the path and permissions")
        return DatabaseError(f"database {self.path}: {msg}")

    @contextmanager
    def session(self, write: bool = False) -> Iterator[Session]:
        """A session in one transaction: committed on success, rolled back on error."""
        if write and self._write_engine is None:
            raise DatabaseError(f"database {self.path} was opened read-only")
        engine = self._write_engine if write else self._read_engine
        try:
            with Session(engine, expire_on_commit=False) as session, session.begin():
                yield session
        except IntegrityError:
            raise  # a unique key met a concurrent writer's row: _write retries
        except (OperationalError, SADatabaseError, InterfaceError) as exc:
            raise self._translate(exc) from exc
        except sqlite3.Error as exc:
            raise self._translate(exc) from exc

    def _write(self, fn, attempts: int = 5):
        """Run ``fn(session)`` in a write transaction, retrying while another process holds the lock, or
        when a concurrent writer inserted the same workload/target first (the retry then finds it)."""
        for attempt in range(attempts):
            try:
                with self.session(write=True) as s:
                    return fn(s)
            except (DatabaseLockedError, IntegrityError) as exc:
                if attempt == attempts - 1:
                    if isinstance(exc, IntegrityError):
                        raise self._translate(exc) from exc
                    raise
                time.sleep(0.2 * (attempt + 1))

    # ---- schema ----------------------------------------------------------------------------------
    def _current_revision(self, conn) -> str | None:
        tables = set(inspect(conn).get_table_names())
        if "alembic_version" not in tables:
            if tables - {"sqlite_sequence"}:
                kind = "a database server's database" if self.is_server else "an SQLite database"
                raise DatabaseCorruptError(f"{self.path} is {kind} but not an autosched one "
                                           f"(tables: {', '.join(sorted(tables))}): use another --db")
            return None
        row = conn.exec_driver_sql("SELECT version_num FROM alembic_version").first()
        return row[0] if row else None

    def _check_schema(self) -> None:
        head = head_revision()
        try:
            if self.readonly:
                with self._read_engine.connect() as conn:
                    current = self._current_revision(conn)
            else:
                with self._write_engine.begin() as conn:
                    self._lock_schema(conn)
                    current = self._current_revision(conn)
                    if current is None:
                        # A new file: create the newest schema inside this write transaction, so two
                        # processes creating the same file at once do not both run the migrations.
                        cfg = _alembic_config()
                        cfg.attributes["connection"] = conn
                        from alembic import command

                        command.upgrade(cfg, "head")
                        current = head
        except (OperationalError, SADatabaseError, InterfaceError, sqlite3.Error) as exc:
            raise self._translate(exc) from exc
        if current == head:
            return
        if current is None:  # read commands open a file read-only, and create no schema in it
            what = "holds no tables" if self.is_server else "is an empty file"
            raise DatabaseUsageError(f"{self.path} {what}, not an autosched database yet: tune into it first, or give "
                                     "--db the database you tuned into")
        if current in known_revisions():
            raise SchemaVersionError(f"database {self.path} uses the older schema {current} (this autosched "
                                     f"uses {head}): upgrade it with `autosched db upgrade --db {self.path}`")
        raise SchemaVersionError(f"database {self.path} was written by a newer autosched (schema {current}, "
                                 f"this one knows up to {head}): upgrade autosched to read it")

    def _lock_schema(self, conn) -> None:
        """On PostgreSQL, serialise schema checks and migrations of processes opening one database at once
        (a transaction-scoped advisory lock; SQLite's BEGIN IMMEDIATE does the same for a file)."""
        if conn.dialect.name == "postgresql":
            conn.exec_driver_sql("SELECT pg_advisory_xact_lock(7215119)")

    @staticmethod
    def upgrade(path: str | os.PathLike) -> tuple[str | None, str]:
        """Upgrade the database at ``path`` (file or URL) to the newest schema; returns (old revision, new revision)."""
        from alembic import command

        db = Database.__new__(Database)
        db.readonly, db.busy_timeout = False, DEFAULT_BUSY_TIMEOUT
        db._setup(path)
        if db.url is None and not db.path.exists():
            raise DatabaseUsageError(f"no tuning database at {db.path}: check --db")
        db._write_engine = db._server_engine() if db.is_server else db._engine(immediate=True)
        try:
            with db._write_engine.begin() as conn:
                db._lock_schema(conn)
                old = db._current_revision(conn)
                if old is not None and old not in known_revisions():
                    raise SchemaVersionError(f"database {db.path} has schema {old}, newer than this autosched knows")
                cfg = _alembic_config()
                cfg.attributes["connection"] = conn
                command.upgrade(cfg, "head")
        except (OperationalError, SADatabaseError, InterfaceError, sqlite3.Error) as exc:
            raise db._translate(exc) from exc
        finally:
            db._write_engine.dispose()
        return old, head_revision()

    def close(self) -> None:
        for engine in (self._write_engine, self._read_engine):
            if engine is not None:
                engine.dispose()

    def __enter__(self) -> Database:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- writing ---------------------------------------------------------------------------------
    def ensure_workload(self, task: Task) -> int:
        wl = task.workload
        # A kernel without an operator (e.g. from Relax) keeps its name, so queries can find it.
        fields = dict(key=task.key, op=wl.op if wl else "func", dtype=wl.dtype if wl else "",
                      shape_json=json.dumps(wl.shape_dict if wl else {}),
                      attrs_json=json.dumps(wl.attrs_dict if wl else {"kernel": task.name}),
                      structural_hash=task.structural_hash, func_json=task.spec.func_json,
                      flops=task.flops, min_bytes=task.min_bytes)
        return self._write(lambda s: _workload_id(s, fields))

    def ensure_target(self, target: TargetSpec) -> int:
        fields = {k: getattr(target, k) for k in TARGET_FIELDS}
        return self._write(lambda s: _target_id(s, fields))

    def start_run(self, command: str = "", seed: int | None = None) -> int:
        def fn(s: Session) -> int:
            run = RunRow(host=socket.gethostname(), command=command, seed=seed, autosched_version=__version__,
                         pid=os.getpid())
            s.add(run)
            s.flush()
            return run.id

        return self._write(fn)

    def finish_run(self, run_id: int, status: str) -> None:
        def fn(s: Session) -> None:
            run = s.get(RunRow, run_id)
            if run is not None:
                run.status, run.finished_at = status, utcnow()

        self._write(fn)

    def add_records(self, workload_id: int, target_id: int, run_id: int | None, space: str,
                    points: list[dict], results: list[MeasureResult]) -> list[int]:
        """Store one batch of measurements in one transaction; returns their ids."""
        from autosched.search_spaces import point_key

        def fn(s: Session) -> list[int]:
            rows = [RecordRow(uid=uuid.uuid4().hex, workload_id=workload_id, target_id=target_id, run_id=run_id,
                              space=space, point_json=point_key(p), latencies_json=json.dumps(list(r.latencies)),
                              median_us=r.median * 1e6 if r.ok else None, error_kind=r.error_kind,
                              error_msg=r.error_msg, rel_error=r.rel_error, build_seconds=r.build_seconds,
                              run_seconds=r.run_seconds, machine_load=r.load)
                    for p, r in zip(points, results)]
            s.add_all(rows)
            s.flush()
            return [r.id for r in rows]

        return self._write(fn)

    def merge_records(self, records: list[dict[str, Any]], exported_at: str | None = None) -> tuple[int, int]:
        """Add exported records (see :mod:`autosched.database.transfer` for their fields) in one transaction,
        with their workloads, targets and runs; a record whose ``uid`` is present is skipped. Returns
        (added, skipped).

        Raises:
            DatabaseError: a record lacks a field.
        """
        def fn(s: Session) -> tuple[int, int]:
            present = set(s.scalars(select(RecordRow.uid).where(RecordRow.uid.in_({r["uid"] for r in records}))))
            added = 0
            for rec in records:
                if rec["uid"] in present:
                    continue
                try:
                    w, t, run = rec["workload"], rec["target"], rec.get("run")
                    wid = _workload_id(s, dict(key=w["key"], op=w["op"], shape_json=json.dumps(w["shape"]),
                                               dtype=w["dtype"], attrs_json=json.dumps(w["attrs"]),
                                               structural_hash=w["structural_hash"], func_json=w.get("func_json"),
                                               flops=w.get("flops", 0.0), min_bytes=w.get("min_bytes", 0.0)))
                    tid = _target_id(s, {k: t[k] for k in TARGET_FIELDS})
                    run_id = _imported_run_id(s, run, exported_at) if run else None
                    s.add(RecordRow(uid=rec["uid"], workload_id=wid, target_id=tid, run_id=run_id, space=rec["space"],
                                    point_json=json.dumps(rec["point"], sort_keys=True, separators=(",", ":")),
                                    latencies_json=json.dumps(rec["latencies"]), median_us=rec["median_us"],
                                    error_kind=rec["error_kind"], error_msg=rec["error_msg"],
                                    rel_error=rec["rel_error"], build_seconds=rec["build_seconds"],
                                    run_seconds=rec["run_seconds"], created_at=rec["created_at"],
                                    machine_load=rec.get("machine_load")))
                except (KeyError, TypeError) as exc:
                    raise DatabaseError(f"record {rec.get('uid', '?')} of the export is incomplete ({exc})") from None
                present.add(rec["uid"])
                added += 1
            return added, len(records) - added

        return self._write(fn)

    # ---- reading ---------------------------------------------------------------------------------
    def records_for(self, workload_key: str, target: TargetSpec, space: str | None = None,
                    only_ok: bool = False, limit: int | None = None) -> list[TuningRecord]:
        """Records of one workload on targets matching ``target``, fastest first (failures last)."""
        with self.session() as s:
            q = (select(RecordRow, TargetRow.match_key, TargetRow.tvm_version).join(WorkloadRow).join(TargetRow)
                 .where(WorkloadRow.key == workload_key, TargetRow.match_key == target.match_key))
            if space is not None:
                q = q.where(RecordRow.space == space)
            if only_ok:
                q = q.where(RecordRow.median_us.is_not(None))
            q = q.order_by(RecordRow.median_us.is_(None), RecordRow.median_us, RecordRow.id)
            if limit:
                q = q.limit(limit)
            return [to_record(row, workload_key, match_key, {"tvm_version": tvm})
                    for row, match_key, tvm in s.execute(q)]

    def best(self, workload_key: str, target: TargetSpec, space: str | None = None) -> TuningRecord | None:
        found = self.records_for(workload_key, target, space, only_ok=True, limit=1)
        return found[0] if found else None

    def summary(self, op: str | None = None, target_kind: str | None = None) -> list[dict[str, Any]]:
        """One row per (workload, target device): best latency, trials and failures."""
        with self.session() as s:
            best = func.min(RecordRow.median_us)
            # kind, arch and device name are parts of the match key; grouping by them too changes no group
            # but is what PostgreSQL requires of selected columns.
            q = (select(WorkloadRow, TargetRow.match_key, TargetRow.kind, TargetRow.arch, TargetRow.device_name,
                        best, func.count(RecordRow.id), func.count(RecordRow.median_us))
                 .join(RecordRow, RecordRow.workload_id == WorkloadRow.id).join(TargetRow)
                 .group_by(WorkloadRow.id, TargetRow.match_key, TargetRow.kind, TargetRow.arch, TargetRow.device_name)
                 .order_by(WorkloadRow.key, TargetRow.match_key))
            if op:
                q = q.where(WorkloadRow.op == op)
            if target_kind:
                q = q.where(TargetRow.kind == target_kind)
            bests = self._best_rows(s, op, target_kind)
            out = []
            for wl, match_key, kind, arch, device, best_us, trials, ok in s.execute(q):
                best = bests.get((wl.id, match_key))
                out.append({
                    "op": wl.op, "shape": json.loads(wl.shape_json), "dtype": wl.dtype, "attrs": json.loads(wl.attrs_json),
                    "workload": wl.key, "target": f"{kind}:{arch}", "device": device, "target_key": match_key,
                    "latency_us": best_us, "trials": trials, "failures": trials - ok,
                    "gflops": (wl.flops / (best_us * 1e-6) / 1e9) if best_us and wl.flops else None,
                    "gbps": (wl.min_bytes / (best_us * 1e-6) / 1e9) if best_us and wl.min_bytes else None,
                    # How far the best latency can be trusted: its repeats' spread, and the load of the machine.
                    "noise_pct": _pct(best.noise) if best else None, "load_pct": _pct(best.load) if best else None,
                })
            return out

    @staticmethod
    def _best_rows(s: Session, op: str | None, target_kind: str | None) -> dict[tuple[int, str], MeasureResult]:
        """The best record's result per (workload id, target match key)."""
        q = (select(RecordRow.workload_id, TargetRow.match_key, RecordRow.latencies_json, RecordRow.machine_load)
             .select_from(RecordRow).join(TargetRow, RecordRow.target_id == TargetRow.id)
             .join(WorkloadRow, RecordRow.workload_id == WorkloadRow.id).where(RecordRow.median_us.is_not(None))
             .order_by(RecordRow.median_us.desc()))
        if op:
            q = q.where(WorkloadRow.op == op)
        if target_kind:
            q = q.where(TargetRow.kind == target_kind)
        # Slowest first, so the fastest of each group is written last.
        return {(wid, key): MeasureResult(tuple(json.loads(lat)), load=load) for wid, key, lat, load in s.execute(q)}

    def validation(self, record_id: int, tvm_version: str) -> ValidationRow | None:
        with self.session() as s:
            return s.scalar(select(ValidationRow).where(ValidationRow.record_id == record_id,
                                                        ValidationRow.tvm_version == tvm_version))

    def add_validation(self, record_id: int, tvm_version: str, result: MeasureResult) -> None:
        def fn(s: Session) -> None:
            if s.scalar(select(ValidationRow).where(ValidationRow.record_id == record_id,
                                                    ValidationRow.tvm_version == tvm_version)) is None:
                s.add(ValidationRow(record_id=record_id, tvm_version=tvm_version, ok=result.ok,
                                    median_us=result.median * 1e6 if result.ok else None,
                                    error=None if result.ok else f"{result.error_kind}: {result.error_msg}"))

        self._write(fn)

    def count(self) -> int:
        with self.session() as s:
            return s.scalar(select(func.count(RecordRow.id))) or 0


def _pct(value: float | None) -> float | None:
    return None if value is None else round(100 * value, 1)


def run_status(run: RunRow) -> str:
    """A run's status as it is now: a run still marked ``running`` whose tuner process on this host is
    gone (killed with -9, a crash of the machine) is ``stale``. Runs of other hosts cannot be checked
    from here and keep their stored status."""
    if run.status != "running" or run.pid is None or run.host != socket.gethostname():
        return run.status
    import psutil

    try:
        started = _timestamp(run.started_at)
        # A live process with this pid that started after the run did is another process (pid reused).
        return "running" if psutil.Process(run.pid).create_time() <= started + 2 else "stale"
    except psutil.NoSuchProcess:
        return "stale"
    except (psutil.Error, ValueError, TypeError):
        return run.status


def _timestamp(iso: str) -> float:
    moment = datetime.fromisoformat(iso)
    return (moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)).timestamp()


def to_record(row: RecordRow, workload_key: str, target_key: str, meta: dict | None = None) -> TuningRecord:
    from autosched.search_spaces import point_from_json

    result = MeasureResult(tuple(json.loads(row.latencies_json)), row.error_kind, row.error_msg,
                           row.build_seconds, row.run_seconds, row.rel_error, row.machine_load)
    return TuningRecord(workload_key, target_key, row.space, point_from_json(row.point_json), result,
                        row.run_id, row.created_at, row.id, meta or {})


TARGET_FIELDS = ("match_key", "kind", "arch", "device_name", "num_cores", "max_shared_memory", "tvm_version",
                 "driver_version")


def _workload_id(s: Session, fields: dict[str, Any]) -> int:
    """The id of the workload ``fields["key"]``, added with ``fields`` if it is new."""
    row = s.scalar(select(WorkloadRow).where(WorkloadRow.key == fields["key"]))
    if row is None:
        row = WorkloadRow(**fields)
        s.add(row)
        s.flush()
    return row.id


def _target_id(s: Session, fields: dict[str, Any]) -> int:
    """The id of the target with these match key and versions, added with ``fields`` if it is new."""
    row = s.scalar(select(TargetRow).where(TargetRow.match_key == fields["match_key"],
                                           TargetRow.tvm_version == fields["tvm_version"],
                                           TargetRow.driver_version == fields["driver_version"]))
    if row is None:
        row = TargetRow(**fields)
        s.add(row)
        s.flush()
    return row.id


def _imported_run_id(s: Session, run: dict[str, Any], exported_at: str | None) -> int:
    """Imported records keep their original run's host, time and command, in a run marked imported."""
    row = s.scalar(select(RunRow).where(RunRow.host == run.get("host", ""), RunRow.started_at == run.get("started_at"),
                                        RunRow.command == run.get("command", "")))
    if row is None:
        row = RunRow(started_at=run.get("started_at") or utcnow(), finished_at=exported_at, status="imported",
                     host=run.get("host", ""), command=run.get("command", ""), seed=run.get("seed"),
                     autosched_version=run.get("autosched_version", ""))
        s.add(row)
        s.flush()
    return row.id
