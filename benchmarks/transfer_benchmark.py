"""Shapes nobody tuned: how much of the tuned speed do transferred decisions recover?

Usage: python benchmarks/transfer_benchmark.py [--target llvm] [--trials 64] [--out DIR]

Tunes GEMMs at sequence lengths 512 and 2048 (m; n = k = 512 on the CPU, 4096 on a GPU), then for
lengths never tuned (768, 1000, 1536, 3000) measures, in one run: the space's default point, the best
of the points transferred from the tuned lengths (each checked before it counts), and a search of the
same trial budget on that length from scratch. Writes results.json and results.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

TUNED = (512, 2048)
NEW = (768, 1000, 1536, 3000)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="llvm")
    parser.add_argument("--trials", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/results/transfer")
    args = parser.parse_args()

    from autosched.database.store import Database
    from autosched.measure import MeasureConfig, Measurer
    from autosched.target import parse_target
    from autosched.task import Task
    from autosched.tuner import TuneOptions, tune
    from autosched.warm_start import transfer_points
    from autosched.workloads import make_workload

    target = parse_target(args.target)
    nk = 4096 if target.is_gpu else 512
    dtype = "float16" if target.is_gpu else "float32"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, Measurer(target, MeasureConfig.for_target(target)) as measurer:
        db = Database(Path(tmp) / "transfer.db")
        opts = TuneOptions(trials=args.trials, batch_size=16, seed=0, transfer=False)
        for m in TUNED:
            task = Task.from_workload(make_workload("gemm", f"m={m},n={nk},k={nk}", dtype))
            result = tune(task, target, db, opts, measurer=measurer)
            print(f"tuned m={m}: {result.best_latency * 1e3:.3f} ms", flush=True)
        for m in NEW:
            task = Task.from_workload(make_workload("gemm", f"m={m},n={nk},k={nk}", dtype))
            space = task.space(target)
            (default,) = measurer.measure(task.spec, [space.default()])
            start = time.perf_counter()
            points = transfer_points(db, task, target, space)
            measured = measurer.measure(task.spec, [p for p, _, _ in points]) if points else []
            transfer_s = time.perf_counter() - start
            transferred = min((r.median for r in measured), default=math.inf)
            scratch_db = Database(Path(tmp) / f"scratch_{m}.db")
            scratch = tune(task, target, scratch_db, opts, measurer=measurer)
            scratch_db.close()
            row = {"m": m, "flops": task.flops, "default_ms": default.median * 1e3,
                   "transferred_ms": transferred * 1e3, "transfer_candidates": len(points),
                   "transfer_failed": sum(not r.ok for r in measured), "transfer_seconds": transfer_s,
                   "tuned_ms": scratch.best_latency * 1e3, "tuning_seconds": scratch.seconds,
                   "recovered": scratch.best_latency / transferred if math.isfinite(transferred) else 0.0}
            rows.append(row)
            print(json.dumps(row), flush=True)
        db.close()
    header = (f"Target {target.label}; GEMM m x {nk} x {nk} {dtype}; tuned at m = {', '.join(map(str, TUNED))} "
              f"with {args.trials} trials each; {time.strftime('%Y-%m-%d')}.")
    lines = [header, "", "| m (never tuned) | default point (ms) | transferred (ms) | candidates | "
             f"tuned from scratch, {args.trials} trials (ms) | recovered | transfer time (s) | tuning time (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['m']} | {r['default_ms']:.3f} | {r['transferred_ms']:.3f} | {r['transfer_candidates']} | "
                     f"{r['tuned_ms']:.3f} | {r['recovered']:.0%} | {r['transfer_seconds']:.1f} | "
                     f"{r['tuning_seconds']:.0f} |")
    lines += ["", "recovered = tuned latency / transferred latency (100%: the transfer is as fast as a full search)."]
    (out / "results.json").write_text(json.dumps({"target": target.to_json(), "rows": rows}, indent=2))
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
