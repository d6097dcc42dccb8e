"""What a new user trips on (issue 34): budgets that mean what they say, failed commands that leave
nothing behind, damaged inputs named in one line, read-only databases, runs whose process died, and
timings taken under load."""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
import time
import types

import pytest

from autosched.database.store import Database

from .helpers import ENV, InstantMeasurer, cli


def _listing(folder) -> dict[str, bytes]:
    """Every file under ``folder`` with its bytes: what a failed command must leave as it was."""
    out = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            out[os.path.relpath(os.path.join(root, name), folder) + "/"] = b""
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = f.read()
    return out


@pytest.fixture(scope="module")
def tuned_db(tmp_path_factory, cpu_target):
    """A small database with real records (two runs of a tiny softmax)."""
    from autosched.task import Task
    from autosched.tuner import TuneOptions, tune
    from autosched.workloads import make_workload

    path = tmp_path_factory.mktemp("tuned") / "tuned.db"
    with Database(path) as db:
        tune(Task.from_workload(make_workload("softmax", "m=16,n=128")), cpu_target, db, TuneOptions(trials=6, batch_size=3))
    return path


# ---- 1. a time budget without --trials is the budget ---------------------------------------------
class _Clock:
    """A clock for the tuner that advances ``step`` seconds each time it is read: a time budget then ends
    after a number of readings, however fast or loaded the machine is."""

    def __init__(self, step: float):
        self.now, self.step = 0.0, step

    def perf_counter(self) -> float:
        self.now += self.step
        return self.now


@pytest.mark.slow
def test_time_budget_alone_is_the_budget(tmp_path, monkeypatch):
    """`tune --time-budget 6` without --trials measures past the default 64 trials. Measurements are
    instant here (the real search, space and database; no builds) and the tuner's clock is ours, so the
    budget, not the machine's speed or load, decides how many there are."""
    import autosched.tuner

    monkeypatch.setattr(autosched.tuner, "Measurer", lambda target, config: InstantMeasurer())
    monkeypatch.setattr(autosched.tuner, "time", _Clock(step=1.0))
    db = str(tmp_path / "t.db")
    out = json.loads(cli("tune", "gemm", "--shape", "m=8,n=8,k=8", "--time-budget", "6", "--batch-size", "48",
                         "--db", db, "-q", "--format", "json").stdout)
    assert out["trials"] > 64 and out["stop_reason"] == "time budget of 6 s reached"
    # --trials given: it still bounds the run, time budget or not.
    out = json.loads(cli("tune", "gemm", "--shape", "m=8,n=8,k=8", "--time-budget", "60", "--trials", "8",
                         "--db", db, "-q", "--format", "json").stdout)
    assert out["trials"] == 8 and out["stop_reason"] == "trial budget reached"


# ---- 2, 3. failed commands leave nothing behind; a truncated export imports what is complete -----
@pytest.fixture(scope="module")
def export(tuned_db, tmp_path_factory):
    path = tmp_path_factory.mktemp("export") / "records.jsonl"
    cli("db", "export", "--db", str(tuned_db), "-o", str(path))
    return path


def _fails_leaving_nothing(tmp_path, *args, code=1, says=""):
    before = _listing(tmp_path)
    proc = cli(*args, check=False)
    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "internal error" not in lines[0], proc.stderr
    assert _listing(tmp_path) == before
    return lines[0]


def test_failed_import_creates_no_database(tmp_path, export):
    db = str(tmp_path / "imp.db")
    _fails_leaving_nothing(tmp_path, "db", "import", str(tmp_path / "nonexistent.jsonl"), "--db", db, code=2,
                           says="no export file")
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_bytes(os.urandom(3000))
    _fails_leaving_nothing(tmp_path, "db", "import", str(garbage), "--db", db, code=2, says="not an autosched export")
    header, first = export.read_text().splitlines()[:2]
    cut = tmp_path / "cut.jsonl"
    cut.write_text(header + "\n" + first[:len(first) // 2])  # cut inside the first record
    line = _fails_leaving_nothing(tmp_path, "db", "import", str(cut), "--db", db, code=2, says=f"{cut}:2")
    assert "nothing was imported" in line


def test_truncated_export_imports_the_complete_records(tmp_path, export):
    lines = export.read_text().splitlines()
    complete = len(lines) - 2  # the header, and the last record is cut
    cut = tmp_path / "trunc.jsonl"
    cut.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:40])
    db = str(tmp_path / "imp.db")
    proc = cli("db", "import", str(cut), "--db", db, "--format", "json", check=False)
    assert proc.returncode == 1
    message = proc.stderr.strip().splitlines()
    assert len(message) == 1 and f"{cut}:{len(lines)}" in message[0] and f"imported the {complete} complete" in message[0]
    assert json.loads(proc.stdout) == {"read": complete, "added": complete, "already_present": 0, "broken_lines": 1}
    with Database(db, readonly=True) as d:
        assert d.count() == complete
    # The whole file later adds just the record that was cut.
    out = json.loads(cli("db", "import", str(export), "--db", db, "--format", "json").stdout)
    assert out["added"] == 1 and out["already_present"] == complete


def test_import_prints_a_table(tmp_path, export):
    out = cli("db", "import", str(export), "--db", str(tmp_path / "t.db")).stdout
    assert "added" in out and "already_present" in out and "{" not in out


def test_failed_report_creates_no_folder(tmp_path, tuned_db):
    _fails_leaving_nothing(tmp_path, "report", "--db", str(tmp_path / "nothere.db"), "-o", str(tmp_path / "rep"),
                           code=2, says="no tuning database")
    _fails_leaving_nothing(tmp_path, "report", "--db", str(tuned_db), "-o", str(tmp_path / "rep" / "sub"),
                           "--bench", str(tmp_path / "missing.json"), code=2, says="missing.json")


# ---- 4. a damaged artifact is named in one line, exit 2 ------------------------------------------
def _artifact(folder):
    folder.mkdir()
    manifest = {"model": "tiny-llama", "target": {"kind": "llvm", "arch": "x86-64"}, "inputs": [],
                "params": "params.bin", "param_order": [], "library": "model.so", "tuned_kernels": {},
                "default_kernels": []}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    (folder / "params.bin").write_bytes(b"")
    return folder


def test_damaged_artifact(tmp_path):
    art = _artifact(tmp_path / "art")
    line = _fails_leaving_nothing(tmp_path, "run", str(art), code=2, says=str(art / "model.so"))
    assert "missing" in line
    (art / "model.so").write_bytes(os.urandom(4096))
    line = _fails_leaving_nothing(tmp_path, "run", str(art), code=2, says=str(art / "model.so"))
    assert "cannot be loaded" in line
    (art / "manifest.json").write_text('{"model": "tiny-llama", "target": ')
    line = _fails_leaving_nothing(tmp_path, "run", str(art), code=2, says=str(art / "manifest.json"))
    assert "not valid JSON" in line


def test_run_refuses_an_artifact_it_cannot_read_as_a_model_build(tmp_path):
    """A generation artifact is named as one, with the command that reads it; a manifest of a version this
    autosched does not know is refused, not used as if it were version 1."""
    art = _artifact(tmp_path / "art")
    manifest = json.loads((art / "manifest.json").read_text())
    (art / "manifest.json").write_text(json.dumps({**manifest, "format": "autosched-generator", "version": 1}))
    line = _fails_leaving_nothing(tmp_path, "run", str(art), code=2, says="is a generation artifact")
    assert f"autosched generate {art}" in line
    (art / "model.so").write_bytes(b"")
    (art / "manifest.json").write_text(json.dumps({**manifest, "version": 99, "autosched_version": "9.0"}))
    line = _fails_leaving_nothing(tmp_path, "run", str(art), code=2, says="manifest version 99")
    assert "autosched 9.0 wrote it" in line and "reads version 1" in line


def test_the_generation_format_is_the_one_the_generation_build_writes():
    from autosched.artifact import GENERATION_FORMAT
    from autosched.generation.build import FORMAT

    assert GENERATION_FORMAT == FORMAT


@pytest.mark.parametrize("size", ["0", "-5"])
@pytest.mark.parametrize("option", ["--tokens", "--batch"])
def test_run_refuses_sizes_below_one(tmp_path, option, size):
    art = _artifact(tmp_path / "art")
    _fails_leaving_nothing(tmp_path, "run", str(art), option, size, code=2, says=f"{option} must be at least 1 (got {size})")


def test_run_counts_kernels_as_its_profile_labels_them():
    """`run`'s counts and `run --profile`'s schedule column agree: a record of the space's default point is
    not counted as tuned."""
    from collections import Counter

    from autosched.runmodel import kernel_counts, schedule_of

    kernels = {"tuned_kernels": {"a": {"space": "s", "searched": True}, "b": {"space": "s", "searched": False},
                                 "c": {"space": "s"}, "d": {"space": "s", "searched": False}},
               "transferred_kernels": {"e": {}}, "default_kernels": ["f", "g"]}
    labels = Counter(schedule_of(k, kernels).split(" (")[0].split(",")[0] for k in "abcdefg")
    assert kernel_counts(kernels) == {"tuned_kernels": labels["tuned"], "default_point_kernels": labels["default point"],
                                      "transferred_kernels": labels["transferred"], "default_kernels": labels["default"]}
    assert kernel_counts(kernels) == {"tuned_kernels": 2, "default_point_kernels": 2, "transferred_kernels": 1,
                                      "default_kernels": 2}


def test_output_files_are_not_taken_for_folders_nor_overwritten(tmp_path, tuned_db):
    """report -o FILE and db export -o FOLDER are refused in one line; db export does not overwrite a file
    without --force."""
    mine = tmp_path / "mine.txt"
    mine.write_text("keep me")
    _fails_leaving_nothing(tmp_path, "report", "--db", str(tuned_db), "-o", str(mine), code=2, says="cannot be a folder")
    _fails_leaving_nothing(tmp_path, "report", "--db", str(tuned_db), "-o", str(mine / "sub"), code=2,
                           says=f"({mine} is a file)")
    line = _fails_leaving_nothing(tmp_path, "db", "export", "--db", str(tuned_db), "-o", str(mine), code=2,
                                  says=f"-o {mine} exists")
    assert "--force" in line
    _fails_leaving_nothing(tmp_path, "db", "export", "--db", str(tuned_db), "-o", str(tmp_path), code=2, says="is a folder")
    cli("db", "export", "--db", str(tuned_db), "-o", str(mine), "--force")
    assert len(mine.read_text().splitlines()) == 7  # the header and the six records


def test_an_artifact_for_a_device_this_machine_lacks_says_so(tmp_path):
    """A build for cuda:sm_90 made on a machine without a GPU (which `build` allows) cannot run here: one line
    naming the target and the way out, before TVM tries to load CUDA code it has no runtime for."""
    import tvm

    if tvm.cuda(0).exist:
        pytest.skip("this machine has a CUDA GPU")
    art = _artifact(tmp_path / "art")
    manifest = json.loads((art / "manifest.json").read_text())
    (art / "manifest.json").write_text(json.dumps({**manifest, "target": {"kind": "cuda", "arch": "sm_90"}}))
    (art / "model.so").write_bytes(os.urandom(4096))  # never read: the device is checked first
    line = _fails_leaving_nothing(tmp_path, "run", str(art), code=1, says="built for cuda:sm_90")
    assert "build it again with --target llvm" in line


def test_run_checks_its_arguments_before_importing_tvm(tmp_path):
    """`autosched run out/nothere` answers at once: TVM and torch are imported after the arguments are checked
    (shown by the modules loaded, not by a time, which depends on the machine's load)."""
    proc = subprocess.run([sys.executable, "-m", "autosched", "run", str(tmp_path / "nothere")], capture_output=True,
                          text=True, env=ENV, timeout=60)
    assert proc.returncode == 2 and "nothere" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    code = ("import sys; from autosched.cli import main; main(['run', sys.argv[1]]); "
            "print(sorted(m for m in ('tvm', 'torch') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "nothere")], capture_output=True, text=True,
                          env=ENV, timeout=60)
    assert proc.stdout.strip() == "[]", proc.stderr


# ---- 5. a database one can only read answers every read-only command ------------------------------
def _read_only(*paths):
    """Make files and folders unwritable, for root too (root ignores mode bits: the immutable attribute)."""
    if os.geteuid() == 0:
        if not shutil.which("chattr"):
            pytest.skip("running as root without chattr: cannot make a folder read-only for root")
        for path in paths:
            subprocess.run(["chattr", "+i", str(path)], check=True)
        return lambda: [subprocess.run(["chattr", "-i", str(p)], check=True) for p in paths]
    modes = {p: os.stat(p).st_mode for p in paths}
    for p in paths:
        os.chmod(p, 0o555 if os.path.isdir(p) else 0o444)
    return lambda: [os.chmod(p, m) for p, m in modes.items()]


def test_read_only_database_answers_read_commands(tuned_db, tmp_path):
    shared = tmp_path / "ro"
    shared.mkdir()
    path = shared / "autosched.db"
    shutil.copy(tuned_db, path)
    out = tmp_path / "out"
    undo = _read_only(path, shared)
    try:
        assert not os.access(shared, os.W_OK) and not os.access(path, os.W_OK)
        before = _listing(shared)
        db = str(path)
        with Database(path, readonly=True) as d:
            assert "mode=ro" in d.readonly_uri() and "immutable=1" in d.readonly_uri()
            record_id = d.best(d.summary()[0]["workload"], __import__("autosched.target").target.parse_target("llvm")).record_id
        best = json.loads(cli("db", "best", "--db", db, "--format", "json").stdout)
        assert best and best[0]["trials"] == 6
        assert len(json.loads(cli("db", "list", "--db", db, "--format", "json").stdout)) == 6
        assert json.loads(cli("db", "show", str(record_id), "--db", db, "--format", "json").stdout)["id"] == record_id
        assert json.loads(cli("db", "stats", "--db", db, "--format", "json").stdout)["records"] == 6
        assert len(json.loads(cli("db", "history", "softmax", "--db", db, "--format", "json").stdout)) == 6
        assert json.loads(cli("db", "compare", "--db", db, "--other", db, "--format", "json").stdout)
        cli("db", "export", "--db", db, "-o", str(tmp_path / "e.jsonl"))
        assert len((tmp_path / "e.jsonl").read_text().splitlines()) == 7
        assert "softmax" in cli("show", "softmax", "--shape", "m=16,n=128", "--db", db).stdout
        cli("report", "--db", db, "-o", str(out))
        assert (out / "report.md").exists()
        # Nothing was written or created beside it: no -wal, no -shm, the same bytes.
        assert _listing(shared) == before
        # Writing is refused in one line.
        proc = cli("tune", "softmax", "--shape", "m=16,n=128", "--trials", "1", "--db", db, check=False)
        assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1 and "internal" not in proc.stderr
    finally:
        undo()


def test_read_commands_leave_nothing_beside_a_database_they_could_write(tuned_db, tmp_path):
    """In a folder one may write, read commands still create no -wal or -shm file beside the database (a reader
    in SQLite's read-only mode cannot remove them on close), and refuse to write."""
    folder = tmp_path / "mine"
    folder.mkdir()
    path = folder / "autosched.db"
    shutil.copy(tuned_db, path)
    before = _listing(folder)
    db = str(path)
    record_id = json.loads(cli("db", "list", "--db", db, "--format", "json").stdout)[0]["id"]
    for args in (["db", "stats"], ["db", "best"], ["db", "show", str(record_id)], ["db", "history", "softmax"],
                 ["db", "export", "-o", str(tmp_path / "e.jsonl")], ["show", "softmax", "--shape", "m=16,n=128"],
                 ["report", "-o", str(tmp_path / "rep")]):
        cli(*args, "--db", db)
        assert _listing(folder) == before, args
    with Database(path, readonly=True) as d, pytest.raises(Exception, match="read-only|readonly"):
        d.start_run("a read-only database takes no run", 0)
    assert _listing(folder) == before


# ---- 6. a run whose process died is shown as stale, and the counts agree -------------------------
def _runs(path) -> list[tuple]:
    import sqlite3

    try:
        con = sqlite3.connect(path)
        try:
            return con.execute("SELECT id, status, pid FROM runs").fetchall()
        finally:
            con.close()
    except sqlite3.Error:
        return []


def _wait(predicate):
    """Poll until ``predicate()``; a test whose wait never ends is stopped by pytest-timeout (pyproject's
    --timeout), not by a deadline of ours that a loaded machine could miss."""
    while not predicate():
        time.sleep(0.1)


@pytest.mark.slow
def test_killed_tuner_is_shown_stale(tmp_path):
    from .helpers import start

    path = tmp_path / "k.db"
    stats = lambda: json.loads(cli("db", "stats", "--db", str(path), "--format", "json").stdout)  # noqa: E731
    tuner = start("tune", "softmax", "--shape", "m=16,n=128", "--trials", "400", "--batch-size", "2", "--db", str(path))
    try:
        _wait(lambda: path.exists() and _runs(path))  # its run is stored
        assert _runs(path)[0][2] == tuner.pid
        st = stats()
        assert st["runs"] == 1 and st["runs_by_status"] == {"running": 1}
    finally:
        tuner.kill()  # SIGKILL: nothing of ours runs after it
        tuner.wait()
    st = stats()
    assert st["runs"] == 1 and st["runs_by_status"] == {"stale": 1}
    # A second tuner killed before it stored any record still counts, in both fields.
    second = start("tune", "softmax", "--shape", "m=16,n=64", "--trials", "400", "--db", str(path))
    try:
        _wait(lambda: len(_runs(path)) == 2)
    finally:
        second.kill()
        second.wait()
    st = stats()
    assert st["runs"] == 2 == sum(st["runs_by_status"].values()) and st["runs_by_status"] == {"stale": 2}


def test_schema_0002_upgrades_keeping_records_and_validations(tmp_path):
    from autosched.database.store import head_revision

    path = tmp_path / "old.db"
    shutil.copy(os.path.join(os.path.dirname(__file__), "..", "database", "fixtures", "schema_0002.db"), path)
    assert f"0002 -> {head_revision()}" in cli("db", "upgrade", "--db", str(path)).stdout
    best = json.loads(cli("db", "best", "--db", str(path), "--format", "json").stdout)
    assert best[0]["trials"] == 3 and best[0]["latency_us"] == pytest.approx(9.75) and best[0]["load_pct"] is None
    st = json.loads(cli("db", "stats", "--db", str(path), "--format", "json").stdout)
    assert st["runs"] == 1 and st["runs_by_status"] == {"finished": 1}
    with Database(path) as db:
        assert db.validation(2, "0.28.0").ok


# ---- 8. timings taken under load are flagged and stored with their load --------------------------
# The meter's arithmetic is checked on synthetic CPU times, and the tuner's use of it with a meter that
# reads a fixed load: busy processes started by a test share the machine with whatever else runs there
# (other tests, other users, CPU quotas), so what a real meter reads is no test's to predict.
class _CpuTimes(collections.namedtuple("_CpuTimes", "user system idle iowait")):
    pass


def test_load_meter_counts_other_processes_cpu_time(monkeypatch):
    """Other processes' share of the machine: the CPU time all processes used, less ours and our children's,
    over the wall time times the CPUs."""
    import psutil

    import autosched.measure
    from autosched.measure import LoadMeter

    clock = iter([10.0, 12.0])  # start, stop: 2 s
    machine = iter([_CpuTimes(60.0, 40.0, 500.0, 1.0), _CpuTimes(64.0, 42.0, 502.0, 9.0)])  # 6 CPU-seconds busy
    own = iter([{1: 5.0}, {1: 6.0, 2: 1.0}])  # we used 1 s, a child started since used 1 s
    monkeypatch.setattr(autosched.measure, "time", types.SimpleNamespace(monotonic=lambda: next(clock)))
    monkeypatch.setattr(psutil, "cpu_times", lambda: next(machine))
    monkeypatch.setattr(psutil, "cpu_count", lambda: 4)
    monkeypatch.setattr(LoadMeter, "_own", staticmethod(lambda: next(own)))
    meter = LoadMeter()
    meter.start()
    assert meter.stop() == pytest.approx((6.0 - 2.0) / (2.0 * 4))  # idle and iowait are not busy

    # Too short an interval to tell: unknown, not 0.
    clock, machine, own = iter([0.0, 0.01]), iter([_CpuTimes(0, 0, 0, 0)] * 2), iter([{}, {}])
    meter.start()
    assert meter.stop() is None
    # Ours counted twice over (a child's time reaching the machine's counters late) is no negative load.
    clock, machine, own = iter([0.0, 1.0]), iter([_CpuTimes(0, 0, 0, 0)] * 2), iter([{}, {1: 3.0}])
    meter.start()
    assert meter.stop() == 0.0


class _FixedLoad:
    """A load meter that reads the same load for every batch."""

    LOAD = 0.9

    def start(self) -> None:
        pass

    def stop(self) -> float:
        return self.LOAD


@pytest.mark.slow
def test_load_is_measured_warned_and_shown(tmp_path, monkeypatch):
    import autosched.measure

    monkeypatch.setattr(autosched.measure, "LoadMeter", _FixedLoad)
    db = str(tmp_path / "load.db")
    proc = cli("tune", "softmax", "--shape", "m=16,n=128", "--trials", "2", "--batch-size", "2", "--db", db)
    assert "warning:" in proc.stderr and "other processes used 90% of the CPU while round 1 was timed" in proc.stderr
    rows = json.loads(cli("db", "list", "--db", db, "--format", "json").stdout)
    with Database(db, readonly=True) as d, d.session() as s:
        from autosched.database.models import RecordRow

        loads = [r.machine_load for r in s.query(RecordRow)]
    assert len(loads) == len(rows) == 2 and loads == [_FixedLoad.LOAD] * 2
    best = json.loads(cli("db", "best", "--db", db, "--format", "json").stdout)[0]
    assert best["load_pct"] == pytest.approx(100 * _FixedLoad.LOAD) and best["noise_pct"] is not None
    assert "load (%)" in cli("db", "best", "--db", db).stdout
    # An export carries the load to another database.
    cli("db", "export", "--db", db, "-o", str(tmp_path / "e.jsonl"))
    cli("db", "import", str(tmp_path / "e.jsonl"), "--db", str(tmp_path / "other.db"))
    other = json.loads(cli("db", "best", "--db", str(tmp_path / "other.db"), "--format", "json").stdout)[0]
    assert other["load_pct"] == best["load_pct"]
    report = tmp_path / "rep"
    cli("report", "--db", db, "-o", str(report))
    assert f"{best['load_pct']:.0f}%" in (report / "report.md").read_text()


# ---- 9. a stock TVM RPC server is named, not taken for crashing kernels ---------------------------
@pytest.mark.slow
def test_stock_tvm_rpc_server_is_refused_in_one_line(tmp_path):
    pytest.importorskip("tornado", reason="TVM's RPC tracker needs tornado (pip install -e '.[test]')")
    from tvm.rpc.tracker import Tracker

    from autosched.measure.rpc import LocalCluster

    tracker = Tracker("127.0.0.1", port=9190, port_end=10190, silent=True)
    server = subprocess.Popen([sys.executable, "-m", "tvm.exec.rpc_server", "--tracker", f"127.0.0.1:{tracker.port}",
                               "--key", "stock", "--host", "127.0.0.1", "--port", "10200", "--port-end", "11200"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    try:
        probe = LocalCluster.__new__(LocalCluster)  # its registered() only: the tracker and key are ours
        probe.key, probe.address = "stock", f"127.0.0.1:{tracker.port}"
        _wait(lambda: probe.registered() == 1)
        db = tmp_path / "never.db"
        # In-process: what is said and returned (test_rpc.py runs `tune --runner rpc` as a process).
        proc = cli("tune", "softmax", "--shape", "m=16,n=128", "--trials", "2", "--runner", "rpc", "--tracker",
                   probe.address, "--key", "stock", "--db", str(db), check=False)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1, proc.stderr
        assert "stock TVM server" in lines[0] and f"autosched rpc-server --tracker {probe.address} --key stock" in lines[0]
        assert not db.exists()  # found before the tuning started: no candidate was recorded as crashing
    finally:
        server.kill()
        server.wait()
        tracker.terminate()


def test_tracker_command_in_the_error_works_for_any_port():
    from autosched.errors import DeviceError
    from autosched.measure.rpc import RPCRunner

    runner = RPCRunner.__new__(RPCRunner)
    runner.tracker = ("127.0.0.1", 1)
    with pytest.raises(DeviceError, match=r"--port 1 --port-end 2\)"):
        runner.server_count()


# ---- 10. .ci/with-postgres from a private folder --------------------------------------------------
def test_with_postgres_from_a_private_folder(tmp_path):
    import glob

    if not glob.glob("/usr/lib/postgresql/*/bin/initdb") or os.geteuid() != 0:
        pytest.skip("needs PostgreSQL's server binaries and root (the script runs the cluster as another user)")
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    script = os.path.join(os.path.dirname(__file__), "..", ".ci", "with-postgres")
    proc = subprocess.run([os.path.abspath(script), "sh", "-c", 'echo "$AUTOSCHED_TEST_PG_URL"'], cwd=private,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("postgresql://") and "could not change directory" not in proc.stderr


# ---- 7. tune-model's kernels say whether they were searched ------------------------------------
# test_cli.py's test_tune_model_build_and_run_from_the_command_line checks it on the same run it checks tune-model,
# build and run on (a second tune-model, build and run of tiny-llama here took 30-40 s).
# Whether tune-model's latency estimate agrees with `run` is a comparison of two measured times, which a
# loaded machine moves: benchmarks/estimate_vs_run.py makes it.


# ---- issue 70: bad input to the database commands is exit 2 ---------------------------------------
def test_a_file_that_is_not_an_export_or_an_empty_database_is_bad_input(tmp_path):
    """`db import` of a file that is not an export (an empty one, /dev/null) and `db best` on an empty file one
    may write: one line, exit 2, nothing created or changed; the message does not say the file was opened
    read-only."""
    db = str(tmp_path / "imp.db")
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    _fails_leaving_nothing(tmp_path, "db", "import", str(empty), "--db", db, code=2, says="is empty, not an autosched export")
    _fails_leaving_nothing(tmp_path, "db", "import", "/dev/null", "--db", db, code=2, says="/dev/null is not a file")
    blank = tmp_path / "blank.db"
    blank.write_bytes(b"")
    line = _fails_leaving_nothing(tmp_path, "db", "best", "--db", str(blank), code=2,
                                  says=f"{blank} is an empty file, not an autosched database yet")
    assert "read-only" not in line
