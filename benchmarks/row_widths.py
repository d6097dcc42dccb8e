"""Row reductions at widths no vector divides against the nearest width one does, on the CPU.

Usage: python benchmarks/row_widths.py [--m 1024] [--out benchmarks/results/row_widths]

RMSNorm and softmax (float32) at n = 777, 1000 and 4095 and at 768, 1024 and 4096, each with the rows
space's default point (rfactor, 16-wide vectors: what an untuned `autosched build` uses), checked
against the float64 reference and then timed side by side in interleaved rounds. On a shared 2-core
machine a two-thread kernel waits whenever either core is taken, so besides the median the table gives
the fastest sample, which is what the kernel can do; the figure of merit is the time per element
relative to the divisible width, for both.
Writes results.json and results.md to --out and prints the table.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from _timing import interleaved_samples
from cpu_benchmark import time_tvm

PAIRS = ((777, 768), (1000, 1024), (4095, 4096))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=1024, help="rows of every case")
    parser.add_argument("--ops", nargs="+", default=["rmsnorm", "softmax"])
    parser.add_argument("--out", default="benchmarks/results/row_widths")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds (each takes 3 samples of every kernel)")
    args = parser.parse_args()

    import tvm

    from autosched.target import parse_target
    from autosched.task import Task
    from autosched.workloads import make_workload

    target = parse_target("llvm")
    machine = {"cpu": target.device_name, "llvm_mcpu": target.arch, "threads": target.num_cores,
               "tvm": tvm.__version__, "torch": torch.__version__, "python": platform.python_version(),
               "date": time.strftime("%Y-%m-%d")}
    print(f"machine: {machine}", flush=True)
    rows = []
    for op in args.ops:
        timers, tasks = {}, {}
        for n in sorted({n for pair in PAIRS for n in pair}):
            task = Task.from_workload(make_workload(op, f"m={args.m},n={n}", "float32"))
            space = task.space(target)
            point = space.default()
            checker = task.spec.checker(task.func)
            inputs = checker.make_inputs(torch.Generator().manual_seed(0), "cpu")
            _, err, timer = time_tvm(space.apply(point), target, task, inputs, checker.reference(inputs),
                                 space.build_config(point), repeat=3, min_repeat_ms=30)
            timers[n], tasks[n] = timer, (task, point, err)
        samples = interleaved_samples(timers, args.rounds)
        median = {n: statistics.median(s) for n, s in samples.items()}
        best = {n: min(s) for n, s in samples.items()}
        for odd, even in PAIRS:
            for n in (odd, even):
                task, point, err = tasks[n]
                rows.append({"op": op, "m": args.m, "n": n, "point": point, "median_us": median[n] * 1e6,
                             "best_us": best[n] * 1e6, "gbps_best": task.min_bytes / best[n] / 1e9,
                             "median_vs_divisible": median[n] / n / (median[even] / even),
                             "best_vs_divisible": best[n] / n / (best[even] / even), "rel_error": err})
                print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))
    lines = [f"Machine: {machine['cpu']} (LLVM {machine['llvm_mcpu']}), {machine['threads']} threads; "
             f"TVM {machine['tvm']}, torch {machine['torch']}; {machine['date']}.", "",
             "| operator | m | n | fastest (us) | GB/s | per element vs divisible width | median (us) | "
             "per element vs divisible width |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['op']} | {r['m']} | {r['n']} | {r['best_us']:.1f} | {r['gbps_best']:.1f} | "
                     f"{r['best_vs_divisible']:.2f}x | {r['median_us']:.1f} | {r['median_vs_divisible']:.2f}x |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
