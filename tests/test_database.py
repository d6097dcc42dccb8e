"""The tuning database: round trip, target matching, schema checks, corrupt files, concurrent writers,
and interrupted runs keeping their records."""

from __future__ import annotations

import json
import multiprocessing as mp
import sqlite3
from dataclasses import replace

import pytest
from sqlalchemy import create_engine, text

from autosched.database.store import Database, head_revision, server_url
from autosched.database.transfer import export_records, import_records
from autosched.errors import DatabaseCorruptError, DatabaseError, SchemaVersionError
from autosched.records import MeasureResult
from autosched.task import Task
from autosched.workloads import make_workload

from .helpers import fill


def _task(n=64):
    return Task.from_workload(make_workload("gemm", f"m={n},n={n},k={n}"))


def _sql(location: str, statement: str) -> None:
    """Run one statement on a database file or server, outside autosched."""
    engine = create_engine(server_url(location) if "://" in location else f"sqlite:///{location}")
    with engine.begin() as conn:
        conn.execute(text(statement))
    engine.dispose()


def test_round_trip_and_best(db_url, cpu_target):
    task = _task()
    with Database(db_url) as db:
        fill(db, task, cpu_target, [3e-3, 1e-3, None, 2e-3])
        best = db.best(task.key, cpu_target)
        assert best.point == {"x": 1} and best.median == pytest.approx(1e-3)
        records = db.records_for(task.key, cpu_target)
        assert [r.point["x"] for r in records] == [1, 3, 0, 2]  # fastest first, failure last
        failed = records[-1].result
        assert failed.error_kind == "build" and failed.error_msg == "boom" and not failed.ok
        summary = db.summary()
        assert summary[0]["trials"] == 4 and summary[0]["failures"] == 1
        assert summary[0]["latency_us"] == pytest.approx(1000.0)


def test_records_apply_only_to_a_matching_target(db_url, cpu_target):
    task = _task()
    other_cpu = replace(cpu_target, arch="znver2", device_name="Other CPU")
    with Database(db_url) as db:
        fill(db, task, other_cpu, [1e-3])
        assert db.best(task.key, cpu_target) is None
        assert db.best(task.key, other_cpu) is not None
        # A newer TVM on the same device is the same match key: records are found (and flagged by version).
        newer = replace(other_cpu, tvm_version="9.9")
        assert db.best(task.key, newer) is not None


def test_corrupt_and_foreign_files_are_refused(tmp_path):
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(DatabaseCorruptError, match="not a readable autosched database"):
        Database(bad)
    foreign = tmp_path / "foreign.db"
    con = sqlite3.connect(foreign)
    con.execute("CREATE TABLE notes (x)")
    con.commit()
    con.close()
    with pytest.raises(DatabaseCorruptError, match="not an autosched one"):
        Database(foreign)
    with pytest.raises(DatabaseError, match="no tuning database"):
        Database(tmp_path / "missing.db", readonly=True)


def test_newer_schema_is_refused_and_older_names_the_upgrade(db_url, cpu_target):
    with Database(db_url) as db:
        fill(db, _task(), cpu_target, [1e-3])
    _sql(db_url, "UPDATE alembic_version SET version_num = 'ffff_future'")
    with pytest.raises(SchemaVersionError, match="newer autosched"):
        Database(db_url)
    _sql(db_url, f"UPDATE alembic_version SET version_num = '{head_revision()}'")
    with Database(db_url) as db:
        assert db.count() == 1


@pytest.mark.parametrize("dst_kind", ["sqlite", "postgresql"])
def test_export_import_is_idempotent(tmp_path, db_url, dst_kind, request, cpu_target):
    """Records move between the two kinds of database, either way, and importing twice adds nothing."""
    task = _task()
    src = db_url
    dst = str(tmp_path / "b.db") if dst_kind == "sqlite" else request.getfixturevalue("new_pg_database")()
    with Database(src) as db:
        fill(db, task, cpu_target, [2e-3, 1e-3, None])
        with open(tmp_path / "export.jsonl", "w") as f:
            assert export_records(db, f) == 3
    header = json.loads((tmp_path / "export.jsonl").read_text().splitlines()[0])
    assert header["format"] == "autosched-records" and header["count"] == 3
    with Database(dst) as db:
        first = import_records(db, tmp_path / "export.jsonl")
        second = import_records(db, tmp_path / "export.jsonl")
        assert (first.added, second.added, second.skipped) == (3, 0, 3)
        assert db.count() == 3
        best = db.best(task.key, cpu_target)
        assert best.point == {"x": 1}


def _writer(path: str, worker: int, n: int, target) -> None:
    task = _task(32 + worker)
    with Database(path) as db:
        wid, tid = db.ensure_workload(task), db.ensure_target(target)
        run = db.start_run(f"writer {worker}")
        for i in range(n):
            db.add_records(wid, tid, run, "matmul@1", [{"i": i}], [MeasureResult((1e-3 * (i + 1),))])
        db.finish_run(run, "finished")


@pytest.mark.slow
def test_concurrent_writers_all_succeed(db_url, cpu_target):
    """Eight processes write one database at once (creating its schema too); every record arrives."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(db_url, w, 25, cpu_target)) for w in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * 8
    with Database(db_url) as db:
        assert db.count() == 8 * 25
        assert len(db.summary()) == 8
