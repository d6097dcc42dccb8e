"""A tuning database on a PostgreSQL server (``--db postgresql://...``): migrations, every ``db`` command,
an interrupted run and four tuners writing at once. The server comes from ``$AUTOSCHED_TEST_PG_URL``
(``.ci/run`` starts a throwaway one); without it these tests skip. The contract tests shared with
SQLite (round trip, concurrent writers, export/import both ways) are in test_database.py."""

from __future__ import annotations

import json
import signal
import sqlite3
import time
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from autosched.database.store import Database, _alembic_config, server_url

from .helpers import autosched, cli, start

FIXTURES = Path(__file__).resolve().parent.parent / "database" / "fixtures"


def _engine(url: str):
    return create_engine(server_url(url))


def _count(url: str) -> int:
    engine = _engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(text("SELECT COUNT(*) FROM records")).scalar_one()
    except Exception:  # noqa: BLE001 - the schema does not exist yet
        return 0
    finally:
        engine.dispose()


def test_old_schema_on_the_server_is_refused_then_upgraded(pg_url):
    """The committed 0001 fixture's rows, in a PostgreSQL database at schema 0001: refused with the upgrade
    command, upgraded by `db upgrade`, every row still there."""
    from alembic import command

    engine = _engine(pg_url)
    with engine.begin() as conn:
        cfg = _alembic_config()
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0001")
    src = sqlite3.connect(FIXTURES / "schema_0001.db")
    with engine.begin() as conn:
        for table in ("runs", "targets", "workloads", "records"):
            cur = src.execute(f"SELECT * FROM {table}")
            cols = [d[0] for d in cur.description]
            for row in cur:
                values = dict(zip(cols, row))
                if table == "records":
                    # The fixture's uids are 33 characters; PostgreSQL enforces the column's 32.
                    values["uid"] = values["uid"][-32:]
                conn.execute(text(f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({', '.join(':' + c for c in cols)})"),
                             values)
    src.close()
    engine.dispose()
    proc = autosched("db", "best", "--db", pg_url, check=False)
    assert proc.returncode == 1 and "autosched db upgrade" in proc.stderr
    assert "0001 -> 0003" in autosched("db", "upgrade", "--db", pg_url).stdout
    assert "already at schema" in autosched("db", "upgrade", "--db", pg_url).stdout
    with Database(pg_url) as db:
        rows = db.summary()
    assert rows[0]["trials"] == 3 and rows[0]["failures"] == 1 and rows[0]["latency_us"] == pytest.approx(9.75)


@pytest.mark.slow
def test_every_db_command_on_the_server(pg_url, tmp_path):
    # compare and export run as processes; the rest in-process (a new interpreter costs seconds of importing TVM,
    # test_readme.py runs the others as processes, and the tests below tune processes on the server).
    out = json.loads(cli("tune", "gemm", "--shape", "m=64,n=48,k=40", "--trials", "6", "--batch-size", "3",
                         "--db", pg_url, "--format", "json").stdout)
    assert out["trials"] == 6 and out["latency_us"] > 0 and out["db"] == pg_url
    best = json.loads(cli("db", "best", "--db", pg_url, "--format", "json").stdout)
    assert len(best) == 1 and best[0]["trials"] == 6 and best[0]["latency_us"] == pytest.approx(out["latency_us"])
    listed = json.loads(cli("db", "list", "--db", pg_url, "--shape", "m=64", "--format", "json").stdout)
    assert len(listed) == 6
    assert json.loads(cli("db", "list", "--db", pg_url, "--shape", "m=65", "--format", "json").stdout) == []
    shown = json.loads(cli("db", "show", str(out["record_id"]), "--db", pg_url, "--format", "json").stdout)
    assert shown["point"] == out["best_point"]
    history = json.loads(cli("db", "history", "gemm[", "--db", pg_url, "--format", "json").stdout)
    assert [h["trial"] for h in history] == list(range(1, 7))
    stats = json.loads(cli("db", "stats", "--db", pg_url, "--format", "json").stdout)
    assert stats["records"] == 6 and stats["runs_by_status"] == {"finished": 1}
    compare = json.loads(autosched("db", "compare", "--db", pg_url, "--format", "json").stdout)
    assert compare[0]["latency_a_us"] == pytest.approx(out["latency_us"])
    assert "record" in cli("show", "gemm", "--shape", "m=64,n=48,k=40", "--db", pg_url).stdout
    export = tmp_path / "e.jsonl"
    autosched("db", "export", "--db", pg_url, "-o", str(export))
    sqlite_db = str(tmp_path / "copy.db")
    assert json.loads(cli("db", "import", str(export), "--db", sqlite_db, "--format", "json").stdout)["added"] == 6
    assert json.loads(cli("db", "import", str(export), "--db", pg_url, "--format", "json").stdout)["added"] == 0


@pytest.mark.slow
def test_interrupted_run_keeps_its_records_on_the_server(pg_url):
    proc = start("tune", "gemm", "--shape", "m=128,n=128,k=128", "--trials", "400", "--batch-size", "4", "--db", pg_url)
    deadline = time.time() + 300
    while _count(pg_url) < 8 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.5)
    assert proc.poll() is None, proc.communicate()[1]
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    # 130, or killed by SIGINT itself after saying so: see test_cli.py's test_interrupted_run_keeps_its_records.
    assert proc.returncode in (130, -signal.SIGINT) and "kept" in err, (proc.returncode, err)
    kept = _count(pg_url)
    assert kept >= 8
    engine = _engine(pg_url)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT status FROM runs")).scalar_one() == "interrupted"
    engine.dispose()
    best = json.loads(autosched("db", "best", "--db", pg_url, "--format", "json").stdout)
    assert best[0]["trials"] == kept


@pytest.mark.slow
def test_four_tuners_write_one_server_database_at_once(pg_url):
    """Four tuners start together on an empty database (one creates the schema, the others wait for it)
    and two of them share a workload, so their first writes meet on its unique key."""
    shapes = ["m=8,n=64", "m=8,n=64", "m=12,n=64", "m=16,n=64"]
    # A candidate at a time: each tuner then starts one build process, not one per core (importing TVM is most of
    # this test's time).
    procs = [start("tune", "rmsnorm", "--shape", shape, "--trials", "4", "--batch-size", "1", "--seed", str(i),
                   "--db", pg_url, "-q") for i, shape in enumerate(shapes)]
    for p in procs:
        _, err = p.communicate(timeout=900)
        assert p.returncode == 0, err
    with Database(pg_url) as db:
        rows = {r["shape"]["m"]: r["trials"] for r in db.summary()}
        assert db.count() == 16
    assert rows == {8: 8, 12: 4, 16: 4}
