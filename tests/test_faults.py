"""Faults: a corrupt, read-only, locked or full database, a process killed while writing, and eight
tuners at once. Each ends with a one-line message and an exit code, and with every record that was
committed still there and readable."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time

import pytest

from autosched.database.store import Database

from .helpers import ENV, cli, start


def _count(path) -> int:
    con = sqlite3.connect(path)
    try:
        return con.execute("SELECT COUNT(*) FROM records").fetchone()[0]
    finally:
        con.close()


def _integrity(path) -> str:
    con = sqlite3.connect(path)
    try:
        return con.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        con.close()


@pytest.fixture(scope="module")
def tuned_db(tmp_path_factory, cpu_target):
    """A small database with real records, copied by each test that damages it (tuned in-process: the
    commands under test are the ones that then meet the damage)."""
    from autosched.task import Task
    from autosched.tuner import TuneOptions, tune
    from autosched.workloads import make_workload

    path = tmp_path_factory.mktemp("tuned") / "tuned.db"
    with Database(path) as db:
        tune(Task.from_workload(make_workload("softmax", "m=16,n=128")), cpu_target, db, TuneOptions(trials=3, batch_size=3))
    return path


@pytest.fixture(scope="module")
def big_export(tmp_path_factory, tuned_db):
    """An export of a few thousand synthetic records (copies of a real one under new ids)."""
    path = tmp_path_factory.mktemp("export") / "many.jsonl"
    cli("db", "export", "--db", str(tuned_db), "-o", str(path))
    header, first = path.read_text().splitlines()[:2]
    record = json.loads(first)
    with open(path, "w") as f:
        f.write(header + "\n")
        for i in range(4000):
            record["uid"] = f"{i:032x}"
            record["error_msg"] = "x" * 200  # make records take room on disk
            f.write(json.dumps(record) + "\n")
    return path


def test_corrupt_file(tmp_path):
    bad = tmp_path / "bad.db"
    bad.write_bytes(os.urandom(8192))
    for args in (["db", "best"], ["tune", "softmax", "--shape", "m=4,n=8", "--trials", "1"]):
        proc = cli(*args, "--db", str(bad), check=False)
        assert proc.returncode == 2 and "not a readable autosched database" in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


def _make_read_only(path):
    if os.geteuid() == 0 and shutil.which("chattr"):
        subprocess.run(["chattr", "+i", str(path)], check=True)  # root ignores file modes
        return lambda: subprocess.run(["chattr", "-i", str(path)], check=True)
    os.chmod(path, 0o444)
    return lambda: os.chmod(path, 0o644)


def test_read_only_file(tuned_db, tmp_path):
    path = tmp_path / "ro.db"
    shutil.copy(tuned_db, path)
    before = _count(path)
    undo = _make_read_only(path)
    try:
        best = json.loads(cli("db", "best", "--db", str(path), "--format", "json").stdout)
        assert best and best[0]["trials"] == before
        proc = cli("tune", "softmax", "--shape", "m=16,n=128", "--trials", "2", "--db", str(path), check=False)
        assert proc.returncode == 1 and "read-only" in proc.stderr and "Traceback" not in proc.stderr
    finally:
        undo()
    assert _count(path) == before and _integrity(path) == "ok"


def test_locked_database(tuned_db, tmp_path):
    path = tmp_path / "locked.db"
    shutil.copy(tuned_db, path)
    before = _count(path)
    holder = subprocess.Popen([sys.executable, "-c", f"""
import sqlite3, sys, time
con = sqlite3.connect({str(path)!r}, isolation_level=None)
con.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
time.sleep(60)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        proc = cli("tune", "softmax", "--shape", "m=16,n=128", "--trials", "2", "--db", str(path),
                   "--busy-timeout", "2", check=False)
        assert proc.returncode == 1 and "locked" in proc.stderr and "--busy-timeout" in proc.stderr
    finally:
        holder.kill()
        holder.wait()
    assert _count(path) == before and _integrity(path) == "ok"


def _tiny_filesystem(tmp_path):
    """A 512 KB filesystem if this machine lets us mount one, else None."""
    mount = tmp_path / "tinyfs"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount)], capture_output=True)
    if proc.returncode != 0:
        return None, None
    return mount, lambda: subprocess.run(["umount", "-l", str(mount)], check=False)


def test_full_disk_keeps_committed_records(big_export, tmp_path):
    mount, undo = _tiny_filesystem(tmp_path)
    if mount is not None:
        path = mount / "full.db"
        cmd = [sys.executable, "-m", "autosched", "db", "import", str(big_export), "--db", str(path)]
    else:
        # No mount permission: the same effect through a file-size limit on the importing process.
        path = tmp_path / "full.db"
        cmd = [sys.executable, "-c", "import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
               "resource.setrlimit(resource.RLIMIT_FSIZE, (512 * 1024, 512 * 1024)); "
               "from autosched.cli import main; sys.exit(main(sys.argv[1:]))",
               "db", "import", str(big_export), "--db", str(path)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)
        assert proc.returncode == 1, proc.stderr
        message = proc.stderr.strip().splitlines()
        assert len(message) == 1 and ("full" in message[0] or "disk" in message[0]) and "kept" in message[0]
        kept = _count(path)
        assert 0 < kept < 4000  # the batches before the disk filled are there
        assert _integrity(path) == "ok"
        copy = tmp_path / "copy.db"
        source, target = sqlite3.connect(path), sqlite3.connect(copy)
        source.backup(target)  # the committed state, WAL included, off the full filesystem
        source.close()
        target.close()
    finally:
        if undo:
            undo()
    best = json.loads(cli("db", "best", "--db", str(copy), "--format", "json").stdout)
    assert best[0]["trials"] == kept


@pytest.mark.slow
def test_killed_in_the_middle_of_a_write(big_export, tmp_path):
    path = tmp_path / "killed.db"
    proc = start("db", "import", str(big_export), "--db", str(path))
    deadline = time.time() + 120
    while time.time() < deadline:
        if path.exists() and _count_safe(path) >= 500:
            break
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    kept = _count(path)
    assert kept >= 500 and _integrity(path) == "ok"
    # Importing again completes the job and adds nothing twice.
    out = json.loads(cli("db", "import", str(big_export), "--db", str(path), "--format", "json").stdout)
    assert out["added"] == 4000 - kept and _count(path) == 4000


def _count_safe(path) -> int:
    try:
        return _count(path)
    except sqlite3.Error:
        return 0


@pytest.mark.slow
def test_eight_tuners_at_once(tmp_path):
    path = str(tmp_path / "eight.db")
    # A candidate at a time: each tuner then starts one build process, not one per core (eight tuners' worth of
    # interpreters importing TVM on two cores is most of this test's time).
    procs = [start("tune", "rmsnorm", "--shape", f"m={4 + i},n=64", "--trials", "2", "--batch-size", "1",
                   "--db", path, "-q") for i in range(8)]
    for p in procs:
        _, err = p.communicate(timeout=900)
        assert p.returncode == 0, err
    with Database(path) as db:
        rows = db.summary()
    assert len(rows) == 8 and all(r["trials"] == 2 for r in rows)
