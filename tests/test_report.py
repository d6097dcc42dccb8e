"""`autosched report` in-process: the summary sentence says what the database holds and where the time
went, and the throughput chart shows every label whole."""

from __future__ import annotations

import sqlite3

import pytest

from autosched.database.queries import stats
from autosched.database.store import Database
from autosched.records import MeasureResult
from autosched.report import duration, summary_line, throughput_figure
from autosched.task import Task
from autosched.workloads import make_workload


def test_summary_counts_in_the_singular_and_gives_the_time_spent(tmp_path, cpu_target):
    """Regression: a 12-second run with 0.3 s of kernel timing was reported as "1 workloads ... 0 s
    measuring" (whole seconds, and no wall time)."""
    task = Task.from_workload(make_workload("gemm", "m=64,n=64,k=64"))
    path = tmp_path / "r.db"
    with Database(path) as db:
        wid, tid = db.ensure_workload(task), db.ensure_target(cpu_target)
        run = db.start_run("test", 0)
        results = [MeasureResult((1e-3,), build_seconds=1.5, run_seconds=0.1),
                   MeasureResult.failed("build", "boom", build_seconds=1.25, run_seconds=0.2)]
        db.add_records(wid, tid, run, "matmul@1", [{"x": 0}, {"x": 1}], results)
        db.finish_run(run, "finished")
    con = sqlite3.connect(path)
    con.execute("UPDATE runs SET started_at = '2026-01-01T10:00:00+00:00', finished_at = '2026-01-01T10:00:12+00:00'")
    con.commit()
    con.close()
    with Database(path, readonly=True, create=False) as db:
        line = summary_line(stats(db))
    assert line == (f"2 records (1 failed) of 1 workload on {cpu_target.device_name}; 1 run; 12 s of tuning, "
                    "of which 2.8 s building and 0.3 s checking and timing candidates.")


@pytest.mark.parametrize("seconds,text", [(0.04, "0.04 s"), (0.3, "0.3 s"), (2.75, "2.8 s"), (12, "12 s"),
                                          (600, "10.0 min"), (9000, "2.5 h")])
def test_durations_read_as_a_person_would(seconds, text):
    assert duration(seconds) == text


def test_throughput_chart_shows_whole_labels_inside_the_figure():
    """Regression: workload keys were cut at 40 characters and the values ran over the plot's frame."""
    key = "gemm[m=4096,n=11008,k=4096]:float16;bias=True;act=silu"
    summary = [{"workload": key, "device": "AMD EPYC", "latency_us": 10.0, "gflops": 900.0, "gbps": 5.0},
               {"workload": "rmsnorm[m=1,n=4096]:float32;eps=1e-05", "device": "AMD EPYC", "latency_us": 1.0,
                "gflops": 0.1, "gbps": 40.0}]
    fig = throughput_figure(summary)
    fig.canvas.draw()
    ax = fig.axes[0]
    assert key in ax.get_yticklabels()[0].get_text().replace("\n", "")
    frame = fig.bbox
    for text in [ax.xaxis.label, *ax.get_yticklabels(), *ax.texts]:
        box = text.get_window_extent()
        assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1, text.get_text()
    for value in ax.texts:
        assert value.get_window_extent().x1 <= ax.get_window_extent().x1, value.get_text()


def test_progress_lines_written_to_a_file_are_as_long_as_their_text(capsys, cpu_target):
    """Regression: with stderr redirected to a file, every progress line was padded with spaces to 220 columns."""
    from autosched.cli.common import ConsoleReporter
    from autosched.tuner import RoundStats

    task = Task.from_workload(make_workload("gemm", "m=64,n=64,k=64"))
    reporter = ConsoleReporter()
    reporter.on_start(task, task.space(cpu_target), 64, 0)
    reporter.on_round(task, RoundStats(round=1, trials=16, batch_ok=15, batch_failed=1, batch_best=2e-5, best=2e-5,
                                       elapsed=1.0, failures={"build": 1}))
    reporter.close()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and "tuning gemm[m=64,n=64,k=64]" in lines[0] and "failed 1" in lines[1]
    assert all(line == line.rstrip() and len(line) < 160 for line in lines), [len(line) for line in lines]
