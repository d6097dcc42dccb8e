"""CPU benchmark: autosched against the untuned schedule, numpy/torch and TVM's MetaSchedule.

Usage: python benchmarks/cpu_benchmark.py [--trials 64 256] [--cases gemm rmsnorm softmax attention] [--out DIR]
                                         [--force] [--skip-metaschedule] [--metaschedule-trials N ...]
       python benchmarks/cpu_benchmark.py --row-widths [--rows 1024] [--out benchmarks/results/row_widths]

For each case, in one run on this machine: the unscheduled TensorIR function compiled by TVM, numpy
(OpenBLAS) and torch, autosched after each trial budget, and MetaSchedule with the same budget on the
same TVM (its builder made to work on small machines, see below). Every kernel is checked against the
float64 reference before it is timed, and all are timed by the same harness (median of repeats);
at the end of a case, every kernel of it measured in this run is timed again side by side, in
interleaved rounds, since a shared machine's memory bandwidth drifts. Writes results.json, results.md
and the tuned kernels' TensorIR (schedules/) to --out and prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import torch
from _timing import interleaved_samples, retime_interleaved

CASES = {  # name: (operator, shape[, attributes])
    "gemm": ("gemm", "m=1024,n=1024,k=1024"),
    "rmsnorm": ("rmsnorm", "m=2048,n=4096"),
    "softmax": ("softmax", "m=2048,n=4096"),
    # small-llama's prefill attention (examples/llama.py, 128 tokens; K/V heads repeated by the import)
    "attention": ("attention", "b=1,h=8,hkv=8,s=128,d=64", "causal=1"),
}
# Cases also tuned in a space that their kernel had before its own: (label, the space left out).
EARLIER_SPACES = {"attention": ("rows space", "cpu_attention")}


def time_host(fn, min_seconds: float = 0.1, repeat: int = 10) -> float:
    """Median over ``repeat`` repeats of the mean time of ``fn`` over at least ``min_seconds``."""
    fn()
    number, elapsed = 1, 0.0
    while True:
        start = time.perf_counter()
        for _ in range(number):
            fn()
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            break
        number *= 2
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - start) / number)
    return statistics.median(samples)


def time_tvm(mod, target, task, inputs, refs, config: dict | None = None, repeat: int = 10, min_repeat_ms: int = 100):
    """Compile ``mod`` (under a space's pass options ``config``) and check it against the reference;
    return its median seconds, its relative error and a function that times it again (a list of seconds)."""
    import tvm

    from autosched.target import compile_module

    checker = task.spec.checker(task.func)
    outs = [torch.empty(s, dtype=getattr(torch, d)) for s, d in checker.output_specs()]
    for out in outs:  # poisoned as the runner poisons them
        out.fill_(float("nan") if out.is_floating_point() else -1)
    lib = compile_module(mod, target, config).jit()
    args = [tvm.runtime.from_dlpack(t) for t in checker.arrange(inputs, outs)]
    lib["main"](*args)
    err = max(checker.errors(inputs, outs, refs))
    if not err <= checker.tolerance:
        raise RuntimeError(f"{task.key}: relative error {err} above {checker.tolerance}")
    timer = lib.time_evaluator("main", tvm.cpu(), number=1, repeat=repeat, min_repeat_ms=min_repeat_ms)
    return float(np.median(timer(*args).results)), err, lambda: list(timer(*args).results)


def host_baselines(case: str, inputs) -> dict[str, object]:
    """The numpy/torch functions to time for ``case``."""
    if case == "gemm":
        a, b = inputs[0].numpy(), inputs[1].numpy()
        return {"numpy (OpenBLAS)": lambda: a @ b.T, "torch": lambda: inputs[0] @ inputs[1].T}
    if case == "rmsnorm":
        x, w = inputs
        return {"torch": lambda: torch.nn.functional.rms_norm(x, (x.shape[-1],), w, 1e-5)}
    if case == "softmax":
        x = inputs[0]
        xn = x.numpy()

        def np_softmax():
            e = np.exp(xn - xn.max(-1, keepdims=True))
            return e / e.sum(-1, keepdims=True)

        return {"numpy": np_softmax, "torch": lambda: torch.softmax(x, -1)}
    if case == "attention":
        q, k, v = inputs[:3]
        sdpa = torch.nn.functional.scaled_dot_product_attention
        return {"torch (scaled_dot_product_attention)": lambda: sdpa(q, k, v, is_causal=True)}
    return {}


@contextlib.contextmanager
def space_left_out(name: str):
    """Spaces are chosen as if the space ``name`` did not exist (for the rows of EARLIER_SPACES)."""
    from autosched.search_spaces import space_classes

    cls = space_classes()[name]
    suits = cls.__dict__["suits"]
    cls.suits = classmethod(lambda *_args, **_kwargs: False)
    try:
        yield
    finally:
        cls.suits = suits


def run_autosched(task, target, trials: int, db_path: str) -> tuple[object, float]:
    from autosched.database.store import Database
    from autosched.search_spaces import point_key  # noqa: F401
    from autosched.tuner import TuneOptions, tune

    start = time.perf_counter()
    with Database(db_path) as db:
        result = tune(task, target, db, TuneOptions(trials=trials, batch_size=16, seed=0))
    return result, time.perf_counter() - start


def run_metaschedule(task, target, trials: int, work_dir: str):
    """MetaSchedule's own tuner on the same function and target, made to work on a small machine:
    its default builder imports tvm.s_tir.tensor_intrin in every fresh worker (about 100 s here, beyond
    its build timeout), so that package is replaced by one that loads only the x86 intrinsics its CPU
    rules ask for, and the build function is the default one without that import."""
    import tvm

    if "tvm.s_tir.tensor_intrin" not in sys.modules:
        import tvm.s_tir

        package = types.ModuleType("tvm.s_tir.tensor_intrin")
        package.__path__ = [str(Path(tvm.s_tir.__file__).parent / "tensor_intrin")]
        sys.modules["tvm.s_tir.tensor_intrin"] = package
        import tvm.s_tir.tensor_intrin.x86  # noqa: F401  (registers the VNNI/AVX-512 intrinsics)
    from tvm.s_tir import meta_schedule as ms

    def build_no_intrin(mod, tgt, _params):
        from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

        mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
        return tvm.tirx.build(mod, target=tgt)

    tvm_target = target.tvm_target()
    start = time.perf_counter()
    database = ms.tune_tir(task.func, tvm_target, work_dir, max_trials_global=trials, num_trials_per_iter=16,
                           builder=ms.builder.LocalBuilder(f_build=build_no_intrin, max_workers=os.cpu_count(),
                                                           timeout_sec=60),
                           runner=ms.runner.LocalRunner(timeout_sec=60),
                           num_tuning_cores=os.cpu_count())
    seconds = time.perf_counter() - start
    sch = ms.tir_integration.compile_tir(database, task.func, tvm_target)
    return (sch.mod if sch is not None else None), seconds


PAIRS = ((777, 768), (1000, 1024), (4095, 4096))


def row_widths(args) -> int:
    """`--row-widths`: RMSNorm and softmax (float32) at widths no 16-wide vector divides (777, 1000, 4095)
    against the nearest width one does, each at the rows space's default point (what an untuned build uses),
    checked against float64 and timed side by side in interleaved rounds. Besides the median, the fastest
    sample (what the kernel can do on a shared machine); the figure of merit is the time per element
    relative to the divisible width."""
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
            task = Task.from_workload(make_workload(op, f"m={args.rows},n={n}", "float32"))
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
                rows.append({"op": op, "m": args.rows, "n": n, "point": point, "median_us": median[n] * 1e6,
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--out", default="benchmarks/results/cpu")
    parser.add_argument("--skip-metaschedule", action="store_true")
    parser.add_argument("--metaschedule-trials", type=int, nargs="+", default=None,
                        help="MetaSchedule's budgets (default: those of --trials)")
    parser.add_argument("--force", action="store_true",
                        help="measure the given cases again (rows of other cases in results.json are kept)")
    widths = parser.add_argument_group("row widths")
    widths.add_argument("--row-widths", action="store_true",
                        help="instead of the cases: RMSNorm and softmax at widths no vector divides against their neighbours")
    widths.add_argument("--rows", type=int, default=1024, help="rows of every --row-widths case")
    widths.add_argument("--ops", nargs="+", default=["rmsnorm", "softmax"])
    widths.add_argument("--rounds", type=int, default=15, help="interleaved rounds (3 samples of every kernel each)")
    args = parser.parse_args()
    if args.row_widths:
        if args.out == parser.get_default("out"):
            args.out = "benchmarks/results/row_widths"
        return row_widths(args)

    import tvm

    from autosched.target import parse_target
    from autosched.task import Task
    from autosched.workloads import make_workload

    target = parse_target("llvm")
    torch.set_num_threads(target.num_cores)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    machine = {"cpu": target.device_name, "llvm_mcpu": target.arch, "threads": target.num_cores,
               "tvm": tvm.__version__, "torch": torch.__version__, "numpy": np.__version__,
               "python": platform.python_version(), "date": time.strftime("%Y-%m-%d")}
    print(f"machine: {machine}", flush=True)
    # Results accumulate across invocations (one case or method at a time on a busy machine): a method
    # already measured for a case is kept unless --force.
    previous = out_dir / "results.json"
    rows = json.loads(previous.read_text())["rows"] if previous.exists() else []
    if args.force:
        rows = [r for r in rows if r["case"] not in args.cases]
    done = {(r["case"], r["method"]) for r in rows}
    for case in args.cases:
        op, shape, *attrs = CASES[case]
        task = Task.from_workload(make_workload(op, shape, attrs=attrs[0] if attrs else None))
        checker = task.spec.checker(task.func)
        inputs = checker.make_inputs(torch.Generator().manual_seed(0), "cpu")
        refs = checker.reference(inputs)

        def wanted(method):
            return (case, method) not in done

        timers = {}  # the TVM kernels of this case measured in this invocation, for the final re-timing

        def keep_schedule(method, mod):
            """The scheduled TensorIR of a tuned kernel, to read or rebuild it later."""
            name = f"{case}--{method.replace(' ', '-')}.tir"
            (out_dir / "schedules").mkdir(exist_ok=True)
            (out_dir / "schedules" / name).write_text(f"# {task.key}: {method}\n" + mod.script())

        def add(method, seconds, tune_seconds=None, trials=None, err=None, timer=None):
            row = {"case": case, "workload": task.key, "method": method, "latency_ms": seconds * 1e3,
                   "gflops": task.flops / seconds / 1e9, "gbps": task.min_bytes / seconds / 1e9,
                   "tuning_s": tune_seconds, "trials": trials, "rel_error": err}
            rows.append(row)
            if timer is not None:
                timers[method] = timer
            print(json.dumps(row), flush=True)
            save()

        def save():
            (out_dir / "results.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))

        if wanted("untuned (TVM, no schedule)"):
            lat, err, timer = time_tvm(tvm.IRModule({"main": task.func}), target, task, inputs, refs)
            add("untuned (TVM, no schedule)", lat, err=err, timer=timer)
        for name, fn in host_baselines(case, inputs).items():
            if wanted(name):
                add(name, time_host(fn), timer=lambda fn=fn: [time_host(fn, repeat=3)])
        label, left_out = EARLIER_SPACES.get(case, (None, None))
        runs = [(f"autosched {trials} trials", trials, None) for trials in args.trials]
        runs += [(f"autosched {label}, {trials} trials", trials, left_out) for trials in args.trials if label]
        for method, trials, without in runs:
            if not wanted(method):
                continue
            with tempfile.TemporaryDirectory() as tmp, \
                    space_left_out(without) if without else contextlib.nullcontext():
                result, tune_s = run_autosched(task, target, trials, os.path.join(tmp, "a.db"))
                space = task.space(target)
                mod = space.apply(result.best_point)
                lat, err, timer = time_tvm(mod, target, task, inputs, refs, space.build_config(result.best_point))
                add(method, lat, tune_s, result.trials, err, timer)
                keep_schedule(method, mod)
        if not args.skip_metaschedule:
            for trials in args.metaschedule_trials or args.trials:
                if not wanted(f"MetaSchedule {trials} trials"):
                    continue
                with tempfile.TemporaryDirectory() as tmp:
                    mod, tune_s = run_metaschedule(task, target, trials, tmp)
                    if mod is None:
                        print(f"MetaSchedule found no valid schedule for {task.key}", flush=True)
                        continue
                    lat, err, timer = time_tvm(mod, target, task, inputs, refs)
                    add(f"MetaSchedule {trials} trials", lat, tune_s, trials, err, timer)
                    keep_schedule(f"MetaSchedule {trials} trials", mod)
        if len(timers) > 1:
            for method, seconds in retime_interleaved(timers).items():
                row = next(r for r in rows if r["case"] == case and r["method"] == method)
                row.update(latency_ms=seconds * 1e3, gflops=task.flops / seconds / 1e9,
                           gbps=task.min_bytes / seconds / 1e9, interleaved=True)
            save()
    write_markdown(out_dir / "results.md", machine, rows)
    print((out_dir / "results.md").read_text())
    return 0


def write_markdown(path: Path, machine: dict, rows: list[dict]) -> None:
    lines = [f"Machine: {machine['cpu']} (LLVM {machine['llvm_mcpu']}), {machine['threads']} threads; "
             f"TVM {machine['tvm']}, torch {machine['torch']}, numpy {machine['numpy']}; {machine['date']}.", ""]
    for case in sorted({r["case"] for r in rows}, key=list(CASES).index):
        sub = [r for r in rows if r["case"] == case]
        untuned = next(r["latency_ms"] for r in sub if r["method"].startswith("untuned"))
        lines += [f"**{sub[0]['workload']}**", "",
                  "| method | latency (ms) | GFLOP/s | GB/s | speed-up vs untuned | tuning time (s) | trials measured |",
                  "|---|---|---|---|---|---|---|"]
        for r in sub:
            tune = f"{r['tuning_s']:.0f}" if r["tuning_s"] else ""
            mark = " †" if r.get("interleaved") else ""
            lines.append(f"| {r['method']}{mark} | {r['latency_ms']:.3f} | {r['gflops']:.1f} | {r['gbps']:.1f} | "
                         f"{untuned / r['latency_ms']:.1f}x | {tune} | {r['trials'] or ''} |")
        lines.append("")
    lines.append("† re-timed at the end of its case's run, side by side with the other † rows of that case "
                 "(7 interleaved rounds, median), so that drift of the shared machine's memory bandwidth "
                 "does not enter their ratios.")
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
