"""RPC benchmark: candidates measured per minute through 1, 2, 3 ... TVM RPC servers, against the local runner.

Usage: python benchmarks/rpc_benchmark.py [--servers 1 2 3] [--candidates 24] [--threads 1] [--out DIR]
       python benchmarks/rpc_benchmark.py --target cuda --devices 0 0,1 [--shape ...] [--dtype float16] --out DIR
       (several GPUs)

One set of candidates (a GEMM's space, sampled with a fixed seed) is built once on this host; then the
same builds are checked and timed by the local runner and by a tracker with N servers on loopback
(autosched.measure.rpc.LocalCluster: TVM's Tracker and Server with our callback), each configuration
after a warm-up batch that computes the task's reference on every server. Only the measurement is
timed: building is the same local step for every configuration. Every candidate is checked (the
relative error comes back from the server) and timed with the default CPU settings (5 repeats of at
least 20 ms). ``--threads`` sets TVM_NUM_THREADS for every runner: servers on one host share its cores,
so N servers scale only up to the number of cores. With ``--devices``, instead of servers, the same
builds are measured by one runner process per GPU of each set (``--devices 0 0,1``: one GPU, then two),
as ``autosched tune --devices`` does. Writes results.json and results.md to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--candidates", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1, help="TVM_NUM_THREADS of every runner (default 1)")
    parser.add_argument("--shape", default="m=256,n=256,k=256", help="the GEMM's shape")
    parser.add_argument("--dtype", default="float32", help="the GEMM's input type (float16: the tensor-core spaces)")
    parser.add_argument("--target", default="llvm", help="llvm, or cuda with --devices")
    parser.add_argument("--devices", nargs="+", help="GPU sets to measure on at once, e.g. 0 0,1 (instead of servers)")
    parser.add_argument("--out", default="benchmarks/results/rpc")
    args = parser.parse_args()
    os.environ["TVM_NUM_THREADS"] = str(args.threads)  # inherited by the runner and server processes

    import numpy as np

    from autosched.measure import Builder, MeasureConfig, Runner
    from autosched.measure.rpc import LocalCluster, RPCRunner
    from autosched.target import parse_target
    from autosched.task import Task
    from autosched.workloads import make_workload

    target = parse_target(args.target)
    config = MeasureConfig.for_target(target)
    task = Task.from_workload(make_workload("gemm", args.shape, dtype=args.dtype))
    space = task.space(target)
    rng = np.random.default_rng(0)
    points = [space.default()] + [space.sample(rng) for _ in range(args.candidates - 1)]
    builder = Builder(target)
    builds = builder.build(task.spec, points)
    builder.close()
    ok = sum(b.ok for b in builds)
    print(f"{task.key}: {ok} of {len(builds)} candidates built; timing their measurement", file=sys.stderr)

    def measure(runner) -> dict:
        runner.run(task.spec, builds[:2])  # warm-up: the reference on every slot/server
        start = time.perf_counter()
        results = runner.run(task.spec, builds)
        seconds = time.perf_counter() - start
        checked = sum(r.ok and r.rel_error is not None for r in results)
        # Seconds of checking and timing summed over candidates, per second of wall time: how many
        # candidates were being measured at once on average (1 for the local runner).
        concurrency = sum(r.run_seconds for r in results) / seconds
        return {"seconds": round(seconds, 2), "candidates": len(results), "checked_ok": checked,
                "per_minute": round(len(results) / seconds * 60, 1), "concurrency": round(concurrency, 2),
                "slots_used": len(set(getattr(runner, "measured_by", ["local"]))),
                "best_us": round(min(r.median for r in results) * 1e6, 2)}

    rows = []
    local = Runner(target, config)
    rows.append({"runner": "local", "servers": 0, **measure(local)})
    local.close()
    print(rows[-1], file=sys.stderr)
    for devices in args.devices or []:
        from autosched.measure.parallel import DeviceRunner, parse_devices

        runner = DeviceRunner(target, config, parse_devices(devices))
        try:
            rows.append({"runner": f"devices {devices}", "servers": len(runner.devices), **measure(runner),
                         "gpu_of_each_runner": _gpus_in_use(runner)})
        finally:
            runner.close()
        print(rows[-1], file=sys.stderr)
    for n in [] if args.devices else args.servers:
        with LocalCluster(n, key=f"bench-{n}") as cluster:
            runner = RPCRunner(target, config, cluster.address, cluster.key)
            try:
                rows.append({"runner": "rpc", "servers": n, **measure(runner)})
            finally:
                runner.close()
        print(rows[-1], file=sys.stderr)

    meta_load = os.getloadavg()
    for b in builds:
        if b.artifact and os.path.exists(b.artifact):
            os.remove(b.artifact)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"host": platform.node(), "cpus": os.cpu_count(), "tvm_num_threads": args.threads,
            "load_average_1_5_15": [round(x, 2) for x in meta_load],
            "workload": task.key, "date": time.strftime("%Y-%m-%d %H:%M")}
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [f"# Measurement throughput, {target.label} ({meta['date']}, {meta['cpus']} CPUs, TVM_NUM_THREADS={args.threads}, "
             f"load average {meta_load[0]:.1f} at the end)", "",
             f"{task.key}, {len(builds)} candidates built once; only checking and timing is measured.", "",
             "| runner | servers or GPUs | seconds | candidates/min | measured at once | checked ok | best (us) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['runner']} | {r['servers'] or '-'} | {r['seconds']} | {r['per_minute']} | {r['concurrency']} | "
                     f"{r['checked_ok']}/{r['candidates']} | {r['best_us']} |")
    lines += [f"\n{r['runner']}: runner processes on the GPUs at {r['gpu_of_each_runner']}" for r in rows
              if "gpu_of_each_runner" in r]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def _gpus_in_use(runner) -> dict[str, str]:
    """The PCI address of the GPU on which each device runner's process holds a context, as the driver
    reports it: the check that N runners measure on N GPUs, not N times on one."""
    import subprocess

    from autosched.tvm_adapter import worker_process

    apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_bus_id", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout
    bus_of_pid = dict(line.split(", ") for line in apps.strip().splitlines() if ", " in line)
    return {slot.name: bus_of_pid.get(str(worker_process(slot.runner._worker).pid), "none") for slot in runner.slots()}


if __name__ == "__main__":
    sys.exit(main())
