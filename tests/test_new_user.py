"""What a new user trips on (issue 34): budgets that mean what they say, failed commands that leave
nothing behind, damaged inputs named in one line, read-only databases, runs whose process died, and
timings taken under load."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

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
def test_time_budget_alone_is_the_budget(tmp_path, monkeypatch):
    """`tune --time-budget 4` without --trials measures past the default 64 trials. Measurements are
    instant here (the real search, space and database; no builds), so the budget, not the machine's
    speed, decides how many there are."""
    import autosched.tuner

    monkeypatch.setattr(autosched.tuner, "Measurer", lambda target, config: InstantMeasurer())
    db = str(tmp_path / "t.db")
    start = time.perf_counter()
    out = json.loads(cli("tune", "gemm", "--shape", "m=8,n=8,k=8", "--time-budget", "6", "--batch-size", "48",
                         "--db", db, "-q", "--format", "json").stdout)
    assert out["trials"] > 64 and out["stop_reason"] == "time budget of 6 s reached"
    assert time.perf_counter() - start < 30
    # --trials given: it still bounds the run, time budget or not.
    out = json.loads(cli("tune", "gemm", "--shape", "m=8,n=8,k=8", "--time-budget", "60", "--trials", "8",
                         "--db", db, "-q", "--format", "json").stdout)
    assert out["trials"] == 8 and out["stop_reason"] == "trial budget reached"
