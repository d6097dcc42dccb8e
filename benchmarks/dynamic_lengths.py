"""One artifact for every length against one static build per length, at lengths never tuned.

The dynamic side tunes the model at its bucket lengths (``tune-model --tokens dynamic``, the same trials
per length as each static build) and builds one artifact (``build --tokens dynamic``); the static side
tunes and builds the model for exactly each length measured. Both are run with ``autosched run`` (median
of its timed runs, checked against torch), one after the other in one process tree.

    python benchmarks/dynamic_lengths.py --model hf-llama --max-tokens 1024 --lengths 77,300,1000 \
        --trials-per-length 32 --out benchmarks/results/dynamic_lengths_cpu.json

``--build-growth 1.125`` builds the artifact at finer buckets than the tuned ones: a bucket nobody tuned
runs the nearest tuned bucket's schedules (checked at build time), and pads a length less.

On the GPU machine, whose calls are cut off after 10 minutes, give ``--work`` a folder that outlives the call
(e.g. ``.bench/dynamic``, ignored by git) and repeat the same command until the result says ``complete``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def autosched(*args: str, env: dict, log: Path | None = None) -> str:
    """``log``: a file for the command's progress (stderr), e.g. the build's seconds per bucket and step."""
    proc = subprocess.run([sys.executable, "-m", "autosched", *args], capture_output=True, text=True, env=env)
    if log is not None:
        log.write_text(proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"autosched {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def run(artifact: Path, env: dict, tokens: int | None = None) -> dict:
    extra = ["--tokens", str(tokens)] if tokens is not None else []
    return json.loads(autosched("run", str(artifact), "--format", "json", "--repeat", "30", *extra, env=env))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="hf-llama")
    parser.add_argument("--target", default="llvm")
    parser.add_argument("--dtype", help="model dtype (the example's default if not given), e.g. float16 on a GPU")
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--bucket-growth", default="2", help="growth of the buckets tune-model tunes")
    parser.add_argument("--build-growth", help="growth of the buckets the artifact is built at (default: the tuned "
                        "ones; finer buckets pad less and take the nearest tuned bucket's schedules)")
    parser.add_argument("--lengths", default="77,300,1000")
    parser.add_argument("--trials-per-length", type=int, default=32)
    parser.add_argument("--threads", default="1", help="TVM_NUM_THREADS for every step (1: steadier on a small VM)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--work", type=Path, help="folder for the databases and artifacts (default: a new temporary "
                        "one); a second call with the same folder skips the steps the first one finished, so the "
                        "benchmark can span several time-limited calls")
    args = parser.parse_args()
    env = {**os.environ, "TVM_NUM_THREADS": args.threads}
    lengths = [int(x) for x in args.lengths.split(",")]
    from autosched.pipeline import parse_lengths

    buckets = parse_lengths("dynamic", args.max_tokens, float(args.bucket_growth))
    build_growth = args.build_growth or args.bucket_growth
    built = parse_lengths("dynamic", args.max_tokens, float(build_growth))
    growth = ["--bucket-growth", args.bucket_growth]
    work = args.work or Path(tempfile.mkdtemp(prefix="autosched-dynamic-"))
    work.mkdir(parents=True, exist_ok=True)
    # Steps finished by an earlier call with the same --work (their seconds included) are not repeated.
    steps_file = work / "steps.json"
    steps = json.loads(steps_file.read_text()) if steps_file.exists() else {}
    # Each step's progress output, beside the result if there is one (a GPU call brings back only that folder).
    logs = args.out.parent / f"{args.out.stem}_logs" if args.out else work
    logs.mkdir(parents=True, exist_ok=True)

    def step(name: str, *cli: str) -> None:
        if name in steps:
            print(f"{name}: done by an earlier call ({steps[name]} s)", flush=True)
            return
        began = time.time()
        autosched(*cli, env=env, log=logs / f"{name.replace(' ', '_')}.log")
        steps[name] = round(time.time() - began)
        steps_file.write_text(json.dumps(steps, indent=2) + "\n")
        print(f"{name}: {steps[name]} s", flush=True)

    common = ["--target", args.target, *(["--dtype", args.dtype] if args.dtype else [])]
    started = time.time()
    dyn_db, dyn_out = work / "dynamic.db", work / "dynamic"
    step("tune dynamic", "tune-model", args.model, *common, "--tokens", "dynamic", "--max-tokens", str(args.max_tokens),
         *growth, "--trials", str(args.trials_per_length * len(buckets)), "--db", str(dyn_db))
    step("build dynamic", "build", args.model, *common, "--tokens", "dynamic", "--max-tokens", str(args.max_tokens),
         "--bucket-growth", build_growth, "--db", str(dyn_db), "-o", str(dyn_out))
    build_seconds = steps["build dynamic"]

    def write_result(rows: list, complete: bool = False) -> None:
        # Written after every length, so a run cut off by a time limit still leaves the lengths it finished.
        if not args.out:
            return
        result = {"model": args.model, "target": args.target, "dtype": args.dtype,
                  "bucket_growth": float(args.bucket_growth), "buckets": buckets,
                  "build_growth": float(build_growth), "built_buckets": built, "dynamic_build_seconds": build_seconds,
                  "trials_per_length": args.trials_per_length,
                  "tvm_num_threads": args.threads, "machine": f"{platform.node()} ({os.cpu_count()} cores)",
                  "step_seconds": steps, "seconds": round(time.time() - started), "complete": complete,
                  "rows": rows}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")

    rows = []
    for n in lengths:
        db, out = work / f"static{n}.db", work / f"static{n}"
        step(f"tune {n}", "tune-model", args.model, *common, "--tokens", str(n), "--trials", str(args.trials_per_length),
             "--db", str(db))
        step(f"build {n}", "build", args.model, *common, "--tokens", str(n), "--db", str(db), "-o", str(out))
        dynamic, static = run(dyn_out, env, n), run(out, env)
        rows.append({"tokens": n, "bucket": dynamic["bucket"], "dynamic_ms": dynamic["latency_ms"],
                     "static_ms": static["latency_ms"], "dynamic_over_static": dynamic["latency_ms"] / static["latency_ms"],
                     "dynamic_matches_torch": dynamic["matches_torch"], "static_matches_torch": static["matches_torch"]})
        print(f"{n:5d} tokens (bucket {dynamic['bucket']:5d}): dynamic {dynamic['latency_ms']:.3f} ms, "
              f"static {static['latency_ms']:.3f} ms, ratio {rows[-1]['dynamic_over_static']:.2f}, "
              f"both match torch: {dynamic['matches_torch'] and static['matches_torch']}", flush=True)
        write_result(rows)
    write_result(rows, complete=True)


if __name__ == "__main__":
    main()
