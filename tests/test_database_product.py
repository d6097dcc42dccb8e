"""The database as a product: schema upgrades from committed fixtures, queries (history, compare, stats),
reports, shapes nobody tuned, and records from another TVM version re-validated before use."""

from __future__ import annotations

import json
import shutil
import sqlite3
from dataclasses import replace
from pathlib import Path

import pytest

from autosched.database.queries import compare, history, stats
from autosched.database.store import Database, head_revision, known_revisions
from autosched.errors import SchemaVersionError
from autosched.records import MeasureResult
from autosched.task import Task
from autosched.workloads import make_workload

from .helpers import autosched, cli, fill

FIXTURES = Path(__file__).resolve().parent.parent / "database" / "fixtures"


def test_every_past_schema_has_a_fixture():
    past = [r for r in known_revisions() if r != head_revision()]
    for revision in past:
        assert (FIXTURES / f"schema_{revision}.db").exists(), f"no fixture for schema {revision}"


def test_old_schema_is_refused_with_the_upgrade_command_then_upgrades(tmp_path):
    path = tmp_path / "old.db"
    shutil.copy(FIXTURES / "schema_0001.db", path)
    with pytest.raises(SchemaVersionError, match=f"autosched db upgrade --db {path}"):
        Database(path)
    proc = cli("db", "best", "--db", str(path), check=False)
    assert proc.returncode == 1 and "autosched db upgrade" in proc.stderr
    assert "0001 -> " in cli("db", "upgrade", "--db", str(path)).stdout
    with Database(path) as db:
        rows = db.summary()
        assert rows[0]["trials"] == 3 and rows[0]["failures"] == 1
        assert rows[0]["latency_us"] == pytest.approx(9.75)
    assert "already at schema" in cli("db", "upgrade", "--db", str(path)).stdout
    con = sqlite3.connect(path)
    assert con.execute("SELECT COUNT(*) FROM validations").fetchone()[0] == 0  # the 0002 table exists
    con.close()


def test_history_compare_and_stats(tmp_path, cpu_target):
    task = Task.from_workload(make_workload("gemm", "m=64,n=64,k=64"))
    other_device = replace(cpu_target, device_name="Other CPU", arch="znver3")
    with Database(tmp_path / "q.db") as db:
        fill(db, task, cpu_target, [3e-3, 2e-3, None, 2.5e-3, 1e-3], failure=("run", "crash"))
        fill(db, task, other_device, [4e-3, 2e-3])
        rows = history(db, "gemm[m=64", device=cpu_target.device_name.split()[0])  # a part of the name
        assert [r["best_us"] for r in rows] == pytest.approx([3000, 2000, 2000, 2000, 1000])
        assert [r["improved"] for r in rows] == [True, True, False, False, True]
        cmp = compare(db, None, cpu_target.device_name, "Other CPU")
        assert cmp[0]["latency_a_us"] == pytest.approx(1000) and cmp[0]["latency_b_us"] == pytest.approx(2000)
        assert cmp[0]["speedup_b_over_a"] == pytest.approx(0.5)
        st = stats(db)
        assert st["records"] == 7 and st["failed"] == 1 and st["failures_by_reason"] == {"run": 1}
        assert st["runs"] == 2 and len(st["devices"]) == 2


def test_report_writes_charts_and_a_page(tmp_path, cpu_target):
    task = Task.from_workload(make_workload("gemm", "m=64,n=64,k=64"))
    db_path = tmp_path / "r.db"
    with Database(db_path) as db:
        fill(db, task, cpu_target, [3e-3, 2e-3, None, 1e-3])
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"rows": [{"case": "gemm", "method": "numpy", "latency_ms": 2.0},
                                          {"case": "gemm", "method": "autosched", "latency_ms": 1.0}]}))
    out = tmp_path / "report"
    page = autosched("report", "--db", str(db_path), "-o", str(out), "--bench", str(bench)).stdout.strip()
    text = Path(page).read_text()
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert "baselines.png" in pngs and "throughput.png" in pngs and len(pngs) == 3
    for name in pngs:
        assert (out / name).read_bytes()[:4] == b"\x89PNG" and f"({name})" in text
    assert "gemm[m=64,n=64,k=64]" in text and "1 failed" in text


@pytest.mark.slow
def test_untuned_shape_starts_from_the_nearest_tuned_shapes(tmp_path, cpu_target):
    from autosched.measure import Measurer
    from autosched.tuner import TuneOptions, tune
    from autosched.warm_start import adapt_point, nearest_workloads, transfer_points

    # One measurer for the three runs: each would otherwise start its own builder pool and runner (seconds each).
    with Database(tmp_path / "t.db") as db, Measurer(cpu_target) as measurer:
        for m in (32, 128):
            tune(Task.from_workload(make_workload("gemm", f"m={m},n=64,k=64")), cpu_target, db,
                 TuneOptions(trials=8, batch_size=4, transfer=False), measurer=measurer)
        new = Task.from_workload(make_workload("gemm", "m=48,n=64,k=64"))
        near = nearest_workloads(db, new, cpu_target)
        assert [k for _, k in near][0].startswith("gemm[m=32")  # log-distance: 48 is nearer 32 than 128
        space = new.space(cpu_target)
        points = transfer_points(db, new, cpu_target, space)
        assert points and all(space.validate(p) is None for p, _, _ in points)
        result = tune(new, cpu_target, db, TuneOptions(trials=4, batch_size=4), measurer=measurer)
        assert result.trials == 4
        measured = {json.dumps(r.point, sort_keys=True) for r in db.records_for(new.key, cpu_target)}
        assert any(json.dumps(p, sort_keys=True) in measured for p, _, _ in points)
    # A point from another shape whose tile is not offered here is snapped to the nearest choice.
    odd = dict(space.default(), tile_k=(3,))
    assert adapt_point(space, odd)["tile_k"] != (3,)


@pytest.mark.slow  # starts a measurer (a builder pool and a runner) to rebuild and check the records
def test_records_from_another_tvm_version_are_revalidated(tmp_path, cpu_target):
    from autosched.measure import Measurer
    from autosched.validate import trusted_best

    task = Task.from_workload(make_workload("gemm", "m=32,n=32,k=32"))
    space = task.space(cpu_target)
    old_tvm = replace(cpu_target, tvm_version="0.26.0")
    with Database(tmp_path / "v.db") as db:
        wid, tid = db.ensure_workload(task), db.ensure_target(old_tvm)
        good, bad = space.default(), {"not": "a point of this space"}
        db.add_records(wid, tid, None, space.id, [bad, good], [MeasureResult((1e-6,)), MeasureResult((2e-6,))])
        assert trusted_best(db, task, cpu_target, space.id) is None  # never silently trusted
        made = []

        def measurer():
            made.append(Measurer(cpu_target))
            return made[-1]

        try:
            best = trusted_best(db, task, cpu_target, space.id, measurer)
        finally:
            for m in made:
                m.close()
        assert best is not None and best.point == good  # the faster record failed re-validation
        assert db.validation(best.record_id, cpu_target.tvm_version).ok
        failed = [r for r in db.records_for(task.key, cpu_target) if r.point == bad][0]
        assert db.validation(failed.record_id, cpu_target.tvm_version).ok is False


def test_filters_by_shape_and_dtype(tmp_path, cpu_target):
    from autosched.database.transfer import RecordFilter, record_rows

    with Database(tmp_path / "f.db") as db:
        for shape, dtype in (("m=64,n=64,k=64", "float32"), ("m=64,n=128,k=64", "float32"), ("m=64,n=64,k=64", "float16")):
            fill(db, Task.from_workload(make_workload("gemm", shape, dtype)), cpu_target, [1e-3])
        with db.session() as s:
            def keys(flt):
                return sorted(w.key for _, w, _ in record_rows(s, flt))

            assert len(keys(RecordFilter(shape={"n": 64}))) == 2
            assert keys(RecordFilter(shape={"n": 128})) == ["gemm[m=64,n=128,k=64]:float32;bias=False;act=none"]
            assert len(keys(RecordFilter(dtype="float16"))) == 1
            assert len(keys(RecordFilter(shape={"m": 64, "n": 64}, dtype="float32"))) == 1
