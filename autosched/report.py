"""``autosched report``: tuning curves and speed charts (PNG) and a Markdown page of the tables.

For each workload and device: the best latency so far against trials (with every measured candidate
as a dot, failures marked along the bottom). One chart of the best throughput of every workload, and,
when benchmark result files are given (``benchmarks/*_benchmark.py`` writes them), the tuned speed
against the baselines measured in the same run.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import textwrap
from pathlib import Path
from typing import Any

from autosched.database.queries import history, stats
from autosched.database.store import Database
from autosched.errors import UsageError

# Deferred imports: matplotlib (imported where used: `autosched --help` stays fast).


def _slug(text: str, n: int) -> str:
    return f"{n:02d}_" + re.sub(r"[^A-Za-z0-9]+", "_", text)[:60].strip("_")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def tuning_curves(db: Database, out: Path) -> list[dict[str, Any]]:
    plt = _plt()
    rows = history(db, "")
    curves: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        curves.setdefault((r["workload"], r["device"]), []).append(r)
    made = []
    for n, ((workload, device), points) in enumerate(sorted(curves.items())):
        fig, ax = plt.subplots(figsize=(7, 4))
        ok = [(p["trial"], p["latency_us"]) for p in points if p["latency_us"] is not None]
        failed = [p["trial"] for p in points if p["latency_us"] is None]
        best = [(p["trial"], p["best_us"]) for p in points if p["best_us"] is not None]
        if ok:
            ax.scatter(*zip(*ok), s=8, alpha=0.35, label="candidate")
        if best:
            ax.step(*zip(*best), where="post", color="C3", linewidth=2, label="best so far")
        if failed and ok:
            low = min(v for _, v in ok)
            ax.scatter(failed, [low * 0.9] * len(failed), marker="x", color="grey", s=12, label="failed")
        ax.set_yscale("log")
        ax.set_xlabel("trial")
        ax.set_ylabel("latency (us)")
        ax.set_title(f"{workload}\n{device}", fontsize=8)
        ax.legend(fontsize=7)
        fig.tight_layout()
        name = _slug(workload, n) + ".png"
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        made.append({"workload": workload, "device": device, "image": name, "trials": len(points),
                     "best_us": best[-1][1] if best else None, "failed": len(failed)})
    return made


def throughput_chart(summary: list[dict], out: Path) -> str | None:
    fig = throughput_figure(summary)
    if fig is None:
        return None
    fig.savefig(out / "throughput.png", dpi=110, bbox_inches="tight")
    _plt().close(fig)
    return "throughput.png"


def throughput_figure(summary: list[dict]):
    """Bars of the best throughput of each workload and device (None if nothing succeeded)."""
    plt = _plt()
    rows = [r for r in summary if r["latency_us"]]
    if not rows:
        return None
    labels, values, units = [], [], []
    for r in rows:
        compute = r["gflops"] and r["gbps"] and r["gflops"] / max(r["gbps"], 1e-9) > 10
        # The whole workload key, wrapped: a key cut at a fixed width loses the attributes that tell rows apart.
        labels.append("\n".join(textwrap.wrap(r["workload"], 44, break_on_hyphens=False) + [r["device"]]))
        values.append(r["gflops"] if compute else (r["gbps"] or 0.0))
        units.append("GFLOP/s" if compute else "GB/s")
    lines = sum(label.count("\n") + 1 for label in labels)
    fig, ax = plt.subplots(figsize=(9, max(2.5, 0.13 * lines + 0.3 * len(rows) + 1.2)))
    bars = ax.barh(range(len(rows)), values, color=["C0" if u == "GFLOP/s" else "C2" for u in units])
    for bar, value, unit in zip(bars, values, units):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {value:.1f} {unit}", va="center", fontsize=7)
    ax.set_xlim(0, max(values) * 1.3 or 1.0)  # room for the value written after the longest bar
    ax.set_yticks(range(len(rows)), labels, fontsize=6)
    ax.set_xlabel("best throughput (GFLOP/s if compute-bound, GB/s if memory-bound)")
    ax.invert_yaxis()
    fig.tight_layout()
    return fig


def baseline_chart(bench_files: list[str], out: Path) -> tuple[str | None, list[dict]]:
    """Speed of each method relative to the slowest baseline of its case, from benchmark result files."""
    plt = _plt()
    rows = []
    for path in bench_files:
        data = json.loads(Path(path).read_text())
        for r in data.get("rows", []):
            if "method" in r:  # CPU benchmark: one row per method
                rows.append({"case": r["case"], "method": r["method"], "ms": r["latency_ms"]})
            else:  # GPU benchmark: one row per case with a time per method
                for method, key in (("autosched", "autosched_s"), ("dlight", "dlight_s"), ("torch", "torch_s")):
                    if r.get(key):
                        rows.append({"case": r["case"], "method": method, "ms": r[key] * 1e3})
    if not rows:
        return None, []
    cases = list(dict.fromkeys(r["case"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(cases) * len(methods) / 3), 4.5))
    width = 0.8 / len(methods)
    for m_i, method in enumerate(methods):
        xs, ys = [], []
        for c_i, case in enumerate(cases):
            case_rows = [r for r in rows if r["case"] == case]
            slowest = max(r["ms"] for r in case_rows)
            mine = next((r["ms"] for r in case_rows if r["method"] == method), None)
            if mine:
                xs.append(c_i + m_i * width)
                ys.append(slowest / mine)
        ax.bar(xs, ys, width, label=method)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))], cases, rotation=30, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("speed-up over the slowest method of the case")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "baselines.png", dpi=110)
    plt.close(fig)
    return "baselines.png", rows


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def duration(seconds: float) -> str:
    """Seconds as a person reads them: ``0.42 s``, ``12 s``, ``3.5 min``, ``2.1 h``."""
    if seconds < 10:
        return f"{seconds:.2g} s" if seconds < 1 else f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def summary_line(st: dict[str, Any]) -> str:
    """One sentence of :func:`autosched.database.queries.stats`: what is in the database and where the time went."""
    where = ", ".join(st["devices"]) or "no device"
    time = (f"{duration(st['tuning_seconds'])} of tuning, of which {duration(st['build_seconds'])} building "
            f"and {duration(st['run_seconds'])} checking and timing candidates")
    return (f"{plural(st['records'], 'record')} ({st['failed']} failed) of {plural(st['workloads'], 'workload')} "
            f"on {where}; {plural(st['runs'], 'run')}; {time}.")


def write_report(db_path: str, out_dir: str, bench_files: list[str] | None = None) -> Path:
    """Write the report into ``out_dir``; a report that fails (no database, a bad benchmark file)
    leaves no folder it created behind."""
    out = Path(out_dir)
    for path in bench_files or []:
        if not Path(path).is_file():
            raise UsageError(f"no benchmark results file {path}: give files benchmarks/*_benchmark.py wrote")
    with Database(db_path, readonly=True, create=False) as db:  # before the folder: a wrong --db makes none
        created = [p for p in (out, *out.parents) if not p.exists()]
        out.mkdir(parents=True, exist_ok=True)
        try:
            return _write(db, db_path, out, bench_files)
        except BaseException:
            if created:
                shutil.rmtree(created[-1], ignore_errors=True)
            raise


def _write(db: Database, db_path: str, out: Path, bench_files: list[str] | None) -> Path:
    summary = db.summary()
    curves = tuning_curves(db, out)
    st = stats(db)
    chart = throughput_chart(summary, out)
    base_chart, base_rows = baseline_chart(bench_files or [], out)
    lines = [f"# Tuning report: `{db_path}`", "", summary_line(st), ""]
    if st["failures_by_reason"]:
        lines += ["Failures by reason: " + ", ".join(f"{k} {v}" for k, v in st["failures_by_reason"].items()), ""]
    lines += ["## Best schedule per workload", "",
              "Noise: the spread of the best record's repeats, (slowest - fastest) / median; load: the share of the "
              "machine's CPU other processes used while it was timed (high load: slower, less trustworthy numbers).", "",
              "| workload | device | best (us) | GFLOP/s | GB/s | trials | failed | noise | load |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in summary:
        gf = f"{r['gflops']:.1f}" if r["gflops"] else "-"
        gb = f"{r['gbps']:.1f}" if r["gbps"] else "-"
        best = f"{r['latency_us']:.2f}" if r["latency_us"] else "-"
        noise = f"{r['noise_pct']:.1f}%" if r.get("noise_pct") is not None else "-"
        load = f"{r['load_pct']:.0f}%" if r.get("load_pct") is not None else "-"
        lines.append(f"| `{r['workload']}` | {r['device']} | {best} | {gf} | {gb} | {r['trials']} | {r['failures']} "
                     f"| {noise} | {load} |")
    if chart:
        lines += ["", f"![best throughput]({chart})"]
    if base_chart:
        lines += ["", "## Against the baselines", "", f"![baselines]({base_chart})", "",
                  "| case | method | latency (ms) |", "|---|---|---|"]
        lines += [f"| {r['case']} | {r['method']} | {r['ms']:.4g} |" for r in base_rows]
    lines += ["", "## Tuning curves", ""]
    for c in curves:
        best = f"{c['best_us']:.2f} us" if c["best_us"] and math.isfinite(c["best_us"]) else "none"
        lines += [f"### `{c['workload']}` on {c['device']}", "",
                  f"{c['trials']} trials, {c['failed']} failed, best {best}.", "", f"![curve]({c['image']})", ""]
    page = out / "report.md"
    page.write_text("\n".join(lines) + "\n")
    return page
