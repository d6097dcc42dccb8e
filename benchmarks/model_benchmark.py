"""Whole-model latency: torch eager, torch.compile, the untuned TVM build and the autosched-tuned build.

Usage: python benchmarks/model_benchmark.py [--target llvm|cuda] [--model NAME] [--configs B:T ...]
                                           [--trials N] [--time-budget S] [--out DIR]
       python benchmarks/model_benchmark.py --combine results_a.json ... --out DIR

A config B:T is a batch of B sequences of T tokens (T = 1 is one decode step of the decoder without a
KV cache). Each build is checked against torch before it is timed; the four ways of running the model
are timed side by side, in 7 interleaved rounds (median), since a shared machine's speed drifts.
Writes results_<target>.json and results_<target>.md. ``--combine`` merges the rows of several runs
(e.g. one per configuration, to fit a GPU session's call limit) into one table.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import sys
import time
from pathlib import Path

import torch
from _timing import retime_interleaved


def torch_timer(fn, device: str):
    """A function that returns ``repeat`` times (seconds) of single runs of ``fn``, after a warm-up."""
    def timer(repeat: int = 20) -> list[float]:
        with torch.no_grad():
            for _ in range(3):
                fn()
            times = []
            for _ in range(repeat):
                if device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                fn()
                if device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
        return times

    return timer


def vm_timer(executable, params, inputs, target):
    """The output of the built model on ``inputs``, a function that times it like :func:`torch_timer`,
    and one that times each of its kernels (:func:`autosched.runmodel.kernel_times`)."""
    import tvm
    from tvm import relax

    dev = target.device()
    vm = relax.VirtualMachine(executable, dev)
    args = [tvm.runtime.from_dlpack(t) for t in inputs] + [p.copyto(dev) for p in params]
    out = vm["main"](*args)

    def timer(repeat: int = 20) -> list[float]:
        # On the CPU a single run of a small model is dominated by thread-pool wake-ups: 50 ms batches.
        evaluator = vm.time_evaluator("main", dev, number=1, repeat=repeat, min_repeat_ms=0 if target.is_gpu else 50)
        return list(evaluator(*args).results)

    def per_kernel() -> list[dict]:
        from autosched.runmodel import kernel_times

        return kernel_times(vm, args, dev)

    return out, timer, per_kernel


def write_results(rows: list[dict], out_dir: Path) -> None:
    """results_<kind>.json and a Markdown table, results_<kind>.md, of ``rows``."""
    kind = rows[0]["target"].split(":")[0]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"results_{kind}.json").write_text(json.dumps(rows, indent=2))
    models = list(dict.fromkeys(r["model"] for r in rows))  # several after --combine: a column of its own
    lines = [f"{', '.join(models)} on {rows[0]['target']}; {rows[0].get('date', '')}.", "",
             ("| model " if len(models) > 1 else "")
             + "| batch x tokens | torch eager (ms) | torch.compile (ms) | TVM untuned (ms) | autosched tuned (ms) | "
             "tuned vs untuned | tuned vs eager | tuned vs compile | kernels | tuning (s) | budget |",
             ("|---" if len(models) > 1 else "") + "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tc = r.get("torch_compile_ms")
        budget = f"{r.get('trial_budget', '?')} trials" + (f" or {r['time_budget_s']:.0f} s" if r.get("time_budget_s") else "")
        lines.append((f"| {r['model']} " if len(models) > 1 else "")
                     + f"| {r['batch']} x {r['tokens']} | {r['torch_eager_ms']:.3f} | "
                     + (f"{tc:.3f}" if tc else "-")
                     + f" | {r['untuned_ms']:.3f} | {r['tuned_ms']:.3f} | {r['untuned_ms'] / r['tuned_ms']:.2f}x | "
                     f"{r['torch_eager_ms'] / r['tuned_ms']:.2f}x | "
                     + (f"{tc / r['tuned_ms']:.2f}x" if tc else "-")
                     + f" | {r['tuned_kernels']}/{r['kernels']} | {r['tuning_s']:.0f} | {budget} |")
    lines += ["", "Ratios above 1 mean the autosched build is faster. The four latencies of a row were timed side by "
              "side in 7 interleaved rounds (median); both builds were checked against torch first."]
    autotuned = [r for r in rows if r.get("torch_max_autotune_ms")]
    if autotuned:
        lines += ["", "torch.compile(mode='max-autotune'), timed in the same rounds: " + "; ".join(
            f"{r['batch']} x {r['tokens']}: {r['torch_max_autotune_ms']:.3f} ms, tuned "
            f"{r['torch_max_autotune_ms'] / r['tuned_ms']:.2f}x (compile {r['torch_max_autotune_build_s']:.0f} s)"
            for r in autotuned) + "."]
    for r in rows:
        if r.get("tuned_kernel_times"):
            lines += ["", f"Where the tuned build's time goes, {r['model']} {r['batch']} x {r['tokens']} (each kernel "
                      "timed alone, median of 5 runs; the slowest 12):", "",
                      "| kernel | calls | ms per run | share | schedule |", "|---|---|---|---|---|"]
            lines += [f"| {k['kernel'][:70]} | {k['calls']} | {k['ms']:.4f} | {k['share']:.1%} | {k['schedule']} |"
                      for k in r["tuned_kernel_times"][:12]]
    (out_dir / f"results_{kind}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="llvm")
    parser.add_argument("--model", default=None, help="default: small-llama on the CPU, llama-7b-layers on a GPU")
    parser.add_argument("--configs", nargs="+", default=None, help="batch:tokens pairs")
    parser.add_argument("--trials", type=int, default=256)
    parser.add_argument("--time-budget", type=float, default=None, help="tuning seconds per config")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--max-autotune", action="store_true",
                        help="also time torch.compile(mode='max-autotune') (Triton GEMM autotuning, CUDA graphs)")
    parser.add_argument("--profile", action="store_true", help="also time each kernel of the tuned build")
    parser.add_argument("--out", default="benchmarks/results/model")
    parser.add_argument("--combine", nargs="+", metavar="JSON", help="only merge these results into one table")
    args = parser.parse_args()
    if args.combine:
        rows = [row for path in args.combine for row in json.loads(Path(path).read_text())]
        write_results(rows, Path(args.out))
        return 0

    from autosched.correctness import relative_error
    from autosched.database.store import Database
    from autosched.pipeline import build_model, extract_tasks, load_model, prepare, split_tunable
    from autosched.target import parse_target
    from autosched.tuner import TuneOptions, tune_tasks

    target = parse_target(args.target)
    device = target.torch_device
    model_name = args.model or ("llama-7b-layers" if target.is_gpu else "small-llama")
    configs = args.configs or (["1:512", "16:512", "1:1", "16:1"] if target.is_gpu else ["1:128", "1:1", "8:1"])
    dtype = torch.float16 if target.is_gpu else torch.float32
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    db = Database(out_dir / f"model_{target.kind}.db")
    rows = []
    for cfg in configs:
        batch, tokens = (int(x) for x in cfg.split(":"))
        model = load_model(model_name, batch=batch, tokens=tokens, dtype=dtype)
        module = copy.deepcopy(model.module).to(device)  # the export below needs the CPU original
        inputs = tuple(t.to(device) for t in model.inputs)
        row = {"model": model_name, "batch": batch, "tokens": tokens, "target": target.label,
               "trial_budget": args.trials, "time_budget_s": args.time_budget, "date": time.strftime("%Y-%m-%d")}
        with torch.no_grad():
            ref = module(*inputs).double()
        timers = {"torch_eager_ms": torch_timer(lambda: module(*inputs), device)}
        if not args.no_compile:
            try:
                compiled = torch.compile(module)
                start = time.perf_counter()
                with torch.no_grad():
                    compiled(*inputs)
                row["torch_compile_build_s"] = time.perf_counter() - start
                timers["torch_compile_ms"] = torch_timer(lambda: compiled(*inputs), device)
            except Exception as exc:  # noqa: BLE001 - torch.compile needs a working toolchain
                row["torch_compile_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        if args.max_autotune:
            # torch's strongest setting: Triton GEMM autotuning and CUDA graphs (minutes of compiling).
            try:
                autotuned = torch.compile(module, mode="max-autotune")
                start = time.perf_counter()
                with torch.no_grad():
                    autotuned(*inputs)
                row["torch_max_autotune_build_s"] = time.perf_counter() - start
                timers["torch_max_autotune_ms"] = torch_timer(lambda: autotuned(*inputs), device)
            except Exception as exc:  # noqa: BLE001
                row["torch_max_autotune_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        executable, params, _ = build_model(model, target, None)
        out, timers["untuned_ms"], _ = vm_timer(executable, params, inputs, target)
        row["untuned_err"] = relative_error(torch.from_dlpack(out).to(ref.device), ref)
        tasks, _ = split_tunable(extract_tasks(prepare(model, target)[0]), target)
        start = time.perf_counter()
        tune_tasks(tasks, target, db, TuneOptions(trials=args.trials, batch_size=16, time_budget=args.time_budget))
        row["tuning_s"] = time.perf_counter() - start
        row["kernels"] = len(tasks)
        executable, params, report = build_model(model, target, db)
        out, timers["tuned_ms"], tuned_kernel_times = vm_timer(executable, params, inputs, target)
        row["tuned_err"] = relative_error(torch.from_dlpack(out).to(ref.device), ref)
        row["tuned_kernels"] = len(report.tuned)
        # 7 interleaved rounds of 5 runs each (milliseconds)
        retimed = retime_interleaved({name: functools.partial(timer, 5) for name, timer in timers.items()})
        row.update({name: seconds * 1e3 for name, seconds in retimed.items()})
        if args.profile:
            from autosched.artifact import kernel_sources
            from autosched.runmodel import schedule_of

            kernels = kernel_sources(report)
            row["tuned_kernel_times"] = [dict(k, schedule=schedule_of(k["kernel"], kernels))
                                         for k in tuned_kernel_times()]
        rows.append(row)
        print(json.dumps(row), flush=True)
        write_results(rows, out_dir)
    db.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
