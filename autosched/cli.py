"""The ``autosched`` command line.

Data goes to stdout (tables for people, ``--format json|csv`` for scripts); progress and logs go to
stderr. Exit codes: 0 success, 1 failure, 2 bad input, 130 interrupted. Errors are one line unless
``--debug`` is given.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import sys

from . import __version__
from .errors import AutoschedError, UsageError
from .output import console as _console
from .output import emit, plain

DB_ENV = "AUTOSCHED_DB"
DEFAULT_DB = "autosched.db"
TUNE_TRIALS = 64  # tune's trial budget when neither --trials nor --time-budget is given
TUNE_MODEL_TRIALS = 256  # tune-model's
DEFAULT_MAX_BATCH = 16  # --max-batch
BUILD_BUCKET_GROWTH = 1.25  # `build --tokens dynamic`: finer than the tuned buckets (tune-model: 2)


# ---- output helpers ------------------------------------------------------------------------------
def _fixed(value: float) -> str:
    """A number with about four significant digits and never in scientific notation (1.893e+04 reads
    as 18930)."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    digits = max(0, 3 - math.floor(math.log10(abs(value))))
    return f"{value:.{digits}f}"


def _trials(args, default: int) -> int | None:
    """The trial budget: --trials if given; with --time-budget alone, none (the time is the budget)."""
    if args.trials is None:
        return None if args.time_budget is not None else default
    if args.trials < 1:
        raise UsageError(f"--trials must be at least 1 (got {args.trials})")
    return args.trials


def _fmt_time(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "failed"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.2f} us"
    return f"{seconds * 1e3:.3f} ms"


# ---- progress ------------------------------------------------------------------------------------
class ConsoleReporter:
    """Progress for ``tune``: a bar with the best so far on a terminal, a line per round always."""

    def __init__(self, quiet: bool = False):
        self.console = _console(stderr=True)
        self.quiet = quiet
        self.progress = None
        self.bar = None

    def on_start(self, task, space, trials, seeded) -> None:
        if self.quiet:
            return
        self.task = task
        seeded_txt = f", {seeded} earlier records as seeds" if seeded else ""
        from rich.markup import escape

        budget = f"{trials} trials" if trials is not None else "trials until the time budget ends"
        self.console.log(f"tuning [bold]{escape(task.key)}[/] with space {space.id} ({space.size():.3g} points), "
                         f"{budget}{seeded_txt}")
        if self.console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), console=self.console, transient=True)
            self.progress.start()
            self.bar = self.progress.add_task("measuring", total=trials)

    def on_round(self, task, s) -> None:
        if self.quiet:
            return
        perf = ""
        if math.isfinite(s.best):
            if task.flops and task.flops / task.min_bytes > 10:
                perf = f"  {task.flops / s.best / 1e9:.1f} GFLOP/s"
            elif task.min_bytes:
                perf = f"  {task.min_bytes / s.best / 1e9:.1f} GB/s"
        fails = f"  failed {s.batch_failed}" if s.batch_failed else ""
        self.console.log(f"round {s.round:>3}  trials {s.trials:>4}  batch best {_fmt_time(s.batch_best):>12}  "
                         f"best {_fmt_time(s.best):>12}{perf}{fails}")
        _warn_load(self.console, s)
        if self.progress is not None:
            self.progress.update(self.bar, completed=s.trials, description=f"best {_fmt_time(s.best)}{perf}")

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def _warn_load(console, s, timed: str | None = None) -> bool:
    """Warn of a round timed under load (``timed``: what was timed, default "round N was"); whether it warned."""
    from .measure import LOAD_WARNING

    if s.load is None or s.load <= LOAD_WARNING:
        return False
    timed = timed or f"round {s.round} was"
    console.log(f"[yellow]warning:[/] other processes used {s.load:.0%} of the CPU while {timed} timed: the "
                "timings are slower and noisier than on a quiet machine (the load is stored with each record; "
                "`autosched db best` shows it)")
    return True


# ---- commands ------------------------------------------------------------------------------------
def cmd_ops(args) -> int:
    from .workloads import list_operators

    rows = []
    for op in list_operators():
        rows.append({"op": op.name, "shape_keys": ",".join(op.shape_keys), "dtypes": ",".join(op.dtypes),
                     "attrs": ", ".join(f"{a.name}={'|'.join(map(str, a.choices))}" for a in op.attrs),
                     "presets": ", ".join(p.name for p in op.presets), "description": op.description})
    emit(rows, args.format, [("op", "operator"), ("shape_keys", "shape keys"), ("dtypes", "dtypes"),
                             ("attrs", "attributes"), ("presets", "presets"), ("description", "computes")])
    return 0


def _workload_from_args(args):
    from .workloads import make_workload

    return make_workload(args.op, args.shape, args.dtype, args.attrs, args.preset)


def _open_db(path: str, readonly: bool = False, busy_timeout: float = 60.0):
    from .database.store import Database

    return Database(path, readonly=readonly, busy_timeout=busy_timeout)


def open_build_db(path: str | None):
    """The database a build reads its records from, or None where there is none (a build needs no database).
    Validations of records from another TVM are stored where the database can be written; a file one may
    only read (a team's shared copy) is read as it is."""
    from .database.store import is_url

    if not path:
        return None
    if not (is_url(path) or os.path.exists(path)):
        _console(stderr=True).log(f"[yellow]warning:[/] no tuning database at {path}: building with default "
                                  "schedules (tune first with `autosched tune-model MODEL --db "
                                  f"{path}`, or give --db the database you tuned into)")
        return None
    writable = is_url(path) or (os.access(path, os.W_OK) and os.access(os.path.dirname(os.path.abspath(path)), os.W_OK))
    return _open_db(path, readonly=not writable)


def _measurer(args, target):
    """The measurer that ``--runner``, ``--builder``, ``--tracker``, ``--key`` and ``--devices`` ask for (None:
    the tuner's default, one local runner)."""
    if args.builder == "rpc" and args.runner != "rpc":
        raise UsageError("--builder rpc goes with --runner rpc: the RPC servers build what they measure")
    if args.runner == "local" and args.devices is None:
        if args.tracker or args.key:
            raise UsageError("--tracker and --key go with --runner rpc")
        return None
    from .measure import MeasureConfig, Measurer

    if args.runner == "rpc":
        if args.devices is not None:
            raise UsageError("--devices is for GPUs of this host; with --runner rpc start one server per GPU instead")
        if not args.tracker or not args.key:
            raise UsageError("--runner rpc needs --tracker HOST:PORT and --key KEY (the key its servers registered under)")
        from .measure.rpc import RemoteBuilder, parse_tracker, rpc_runner

        parse_tracker(args.tracker)
        factory = rpc_runner(args.tracker, args.key)
        if args.builder == "rpc":
            return Measurer(target, MeasureConfig.for_target(target), runner=factory, builder=RemoteBuilder)
    else:
        from .measure.parallel import device_runner, parse_devices

        devices = parse_devices(args.devices)
        if not target.is_gpu:
            raise UsageError("--devices picks GPUs (--target cuda): CPU runners would share the cores and disturb "
                             "each other's timings")
        factory = device_runner(devices)
    return Measurer(target, MeasureConfig.for_target(target), runner=factory)


def cmd_tune(args) -> int:
    from .target import parse_target
    from .task import Task
    from .tuner import TuneOptions, check_seed, tune

    check_seed(args.seed, "--seed")
    trials = _trials(args, TUNE_TRIALS)
    if args.time_budget is not None and args.time_budget <= 0:
        raise UsageError(f"--time-budget must be above 0 seconds (got {args.time_budget:g})")
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be at least 1 (got {args.batch_size})")
    wl = _workload_from_args(args)
    target = parse_target(args.target, require_device=args.runner == "local")
    task = Task.from_workload(wl)
    measurer = _measurer(args, target)  # before the database: a missing tracker creates no file
    try:
        db = _open_db(args.db, busy_timeout=args.busy_timeout)
    except BaseException:
        if measurer is not None:
            measurer.close()
        raise
    reporter = ConsoleReporter(quiet=args.quiet)
    options = TuneOptions(trials=trials, batch_size=args.batch_size, seed=args.seed,
                          time_budget=args.time_budget, patience=args.patience, cost_model=args.cost_model,
                          transfer=not args.no_transfer)
    try:
        result = tune(task, target, db, options, reporter, measurer=measurer, command=" ".join(sys.argv))
    finally:
        reporter.close()
        if measurer is not None:
            measurer.close()
    best = db.best(task.key, target)
    summary = {
        "op": wl.op, "shape": wl.shape_dict, "dtype": wl.dtype, "attrs": wl.attrs_dict, "target": target.label,
        "space": result.space, "trials": result.trials, "rounds": result.rounds, "failures": result.failures,
        "seconds": round(result.seconds, 1), "stop_reason": result.stop_reason, "run_id": result.run_id,
        "latency_us": best.median * 1e6 if best else None,
        "gflops": task.flops / best.median / 1e9 if best and task.flops else None,
        "gbps": task.min_bytes / best.median / 1e9 if best and task.min_bytes else None,
        "best_point": best.point if best else None, "record_id": best.record_id if best else None,
        "db": str(db.path),
    }
    db.close()
    if args.format == "json":
        print(json.dumps(summary, indent=2, default=str))
    else:
        rows = [{"field": k, "value": _summary_cell(k, v)} for k, v in summary.items()]
        emit(rows, "table", [("field", "field"), ("value", "value")], title=f"autosched tune: {wl.key}")
    return 0 if best is not None else 1


def _summary_cell(key: str, value) -> str:
    """A value of ``tune``'s summary table: failures as their count (0, or e.g. "3 (build 2, run 1)")
    as ``db best`` shows them, numbers without scientific notation."""
    if key == "failures":
        total = sum(value.values())
        return f"{total} ({', '.join(f'{k} {n}' for k, n in value.items())})" if total else "0"
    if isinstance(value, float):
        return _fixed(value)
    return plain(value)


def _model_kwargs(args) -> dict:
    """The factory's arguments that all buckets share (a --batch or --tokens with several sizes: None)."""
    import torch

    dtype = None
    if args.dtype:
        from .workloads import normalize_dtype

        dtype = getattr(torch, normalize_dtype(args.dtype))
    batches, lengths = _sizes(args)
    return {"batch": batches[0] if batches and len(batches) == 1 else None,
            "tokens": lengths[0] if lengths and len(lengths) == 1 else None, "dtype": dtype}


def _sizes(args) -> tuple[list[int] | None, list[int] | None]:
    """--batch and --tokens: None (the model's default), or the sizes to tune or build (several: a
    bucketed build)."""
    from .pipeline import parse_batches, parse_lengths

    return parse_batches(args.batch, args.max_batch), parse_lengths(args.tokens, args.max_tokens, args.bucket_growth)


def _models(args) -> tuple[list, list]:
    """The model at each bucket --batch and --tokens name, and the buckets ((batch, tokens) pairs; [] for
    one model at one shape)."""
    from .pipeline import bucket_grid, load_model, models_at

    buckets, kwargs = bucket_grid(*_sizes(args)), _model_kwargs(args)
    if not buckets:
        return [load_model(args.model, **kwargs)], []
    return models_at(args.model, kwargs, buckets), buckets


def searched_cell(result) -> str:
    """tune-model's "searched" column for a kernel's TuneResult: whether its best point was found by search, is
    the space's default point, or there is none (no trial reached it and no earlier record)."""
    if result.best_point is None:
        return "no (not measured)"
    return "yes" if result.searched else "no (default point)"


def _describe_buckets(buckets: list) -> str:
    batches = sorted({b for b, _ in buckets if b is not None})
    lengths = sorted({t for _, t in buckets if t is not None})
    parts = ([f"batch {', '.join(map(str, batches))}"] if batches else []) \
        + ([f"{', '.join(map(str, lengths))} tokens"] if lengths else [])
    return f"{len(buckets)} buckets ({'; '.join(parts)})"


def cmd_tune_model(args) -> int:
    from .tuner import check_seed

    check_seed(args.seed, "--seed")
    if args.generate:
        from .generation.cli import cmd_tune_generate

        return cmd_tune_generate(args)
    from .pipeline import extract_tasks, merge_bucket_tasks, prepare, split_tunable
    from .target import parse_target
    from .tuner import TuneOptions, tune_tasks

    trials = _trials(args, TUNE_MODEL_TRIALS)
    target = parse_target(args.target, require_device=args.runner == "local")
    models, buckets = _models(args)
    tasks, untunable = split_tunable(merge_bucket_tasks([extract_tasks(prepare(m, target)[0]) for m in models]), target)
    log = _console(stderr=True)
    at = f" at {_describe_buckets(buckets)}" if buckets else ""
    log.log(f"{args.model}{at}: {len(tasks) + len(untunable)} distinct kernels, "
            f"{sum(t.weight for t in tasks + untunable):.0f} calls per forward pass; {len(tasks)} tunable"
            + (f" ({len(untunable)} without a space keep the default schedule)" if untunable else ""))
    db = _open_db(args.db)
    reporter = ConsoleReporter(quiet=args.quiet or len(tasks) > 1)
    options = TuneOptions(trials=trials, batch_size=args.batch_size, seed=args.seed, time_budget=args.time_budget,
                          scheduler=args.scheduler)
    progress = _ModelProgress(log, tasks, trials) if not args.quiet else None
    measurer = _measurer(args, target)
    try:
        results = tune_tasks(tasks, target, db, options, progress or reporter, measurer=measurer,
                             command=" ".join(sys.argv))
    finally:
        reporter.close()
        if measurer is not None:
            measurer.close()
    db.close()
    rows = [{"kernel": t.name, "weight": t.weight, "space": r.space, "trials": r.trials,
             "searched": searched_cell(r),
             "latency_us": r.best_latency * 1e6 if math.isfinite(r.best_latency) else None,
             "weighted_us": t.weight * r.best_latency * 1e6 if math.isfinite(r.best_latency) else None,
             "failures": sum(r.failures.values())} for t, r in zip(tasks, results)]
    estimate = model_estimate(tasks, results, untunable)
    if len(models) > 1:
        estimate = estimate.replace("per forward pass", f"for one forward pass in each of the {len(models)} buckets")
    elif args.runner == "local":
        # The sum over kernels leaves out what the build runs besides them (copies, allocations, the VM
        # between calls, kernels without a space) and times each kernel with warm caches: build the model
        # with the kernels just tuned and time it, as `autosched run` would.
        log.log(f"{args.model}: building it with the best kernels to time one forward pass")
        estimate = f"{_measured_forward(models[0], target, args.db) * 1e3:.4g} ms per forward pass, measured on " \
                   f"a build with the best kernels ({estimate.replace('estimated ', 'kernels alone: ')})"
    emit(rows, args.format, [("kernel", "kernel"), ("weight", "calls"), ("space", "space"), ("trials", "trials"),
                             ("searched", "searched"), ("latency_us", "best (us)"), ("weighted_us", "x calls (us)"),
                             ("failures", "failed")],
         title=f"{args.model}: {estimate}")
    log.log(f"{args.model}: {estimate}")
    return 0


def _measured_forward(model, target, db_path: str) -> float:
    """Seconds of one forward pass of ``model`` built with the database's best kernels (see :func:`cmd_build`)."""
    from .pipeline import build_model
    from .runmodel import time_forward

    with _open_db(db_path, readonly=True) as db:
        executable, params, _ = build_model(model, target, db)
    return time_forward(executable, params, model.input_specs(), target)


def model_estimate(tasks, results, untunable=()) -> str:
    """The model's estimated latency: the sum over kernels of calls x best latency, and what it leaves out."""
    measured = [(t, r) for t, r in zip(tasks, results) if math.isfinite(r.best_latency)]
    total = sum(t.weight * r.best_latency for t, r in measured)
    text = f"estimated {total * 1e3:.4g} ms per forward pass (sum over kernels of calls x best latency)"
    missing = len(tasks) - len(measured)
    if missing:
        text += f"; {missing} of {len(tasks)} tunable kernels have no successful measurement and are left out"
    if untunable:
        text += f"; {len(untunable)} kernels without a space are not measured"
    return text


class _ModelProgress:
    """Per-task lines and a model-level total: the sum over kernels of calls x best latency."""

    def __init__(self, log, tasks, trials):
        self.log, self.tasks, self.trials = log, tasks, trials
        self.best = {t.key: math.inf for t in tasks}
        self.used = {t.key: 0 for t in tasks}
        self.warned_load = None

    def on_start(self, task, space, trials, seeded) -> None:
        pass

    def on_round(self, task, s) -> None:
        self.best[task.key], self.used[task.key] = s.best, s.trials
        total = sum(t.weight * self.best[t.key] for t in self.tasks)
        done = sum(self.used.values())
        model = f"{total * 1e3:.3f} ms" if math.isfinite(total) else "(not every kernel measured yet)"
        from rich.markup import escape

        of = f"/{self.trials}" if self.trials is not None else ""
        self.log.log(f"[{done}{of}] {escape(task.name)}: best {_fmt_time(s.best)} after {s.trials} trials; "
                     f"model estimate {model}")
        # The kernels of one batch (every kernel's first points are measured together) share its load: one
        # warning for them, not one per kernel; again when the load changes or comes back after a quiet round.
        if s.load != self.warned_load:
            self.warned_load = s.load if _warn_load(self.log, s, "these kernels were") else None


def cmd_build(args) -> int:
    from .output import check_output_folder

    check_output_folder(args.output, "the artifact", build=True)  # before minutes of building
    if args.generate:
        from .generation.cli import cmd_build_generate

        return cmd_build_generate(args)
    from .pipeline import build_buckets, build_model, build_summary, check_padding_is_exact, export_artifact, export_bucketed
    from .pipeline.lengths import bucket_key
    from .target import parse_target

    target = parse_target(args.target, require_device=False)
    models, buckets = _models(args)
    # Several buckets: first check that padding to one is exact for this model (before minutes of building).
    axes = {axis: check_padding_is_exact(args.model, _model_kwargs(args), axis)
            for axis, index in (("batch", 0), ("tokens", 1)) if any(b[index] is not None for b in buckets)}
    db = open_build_db(args.db)
    db_path = str(db.path) if db else None
    log = _console(stderr=True)
    try:
        if not buckets:
            executable, params, report = build_model(models[0], target, db)
            out = export_artifact(args.output, executable, params, models[0], target, report, db_path)
            summary = build_summary(report)
        else:
            def built(bucket, report):
                log.log(f"bucket {bucket_key(bucket)} ({buckets.index(bucket) + 1}/{len(buckets)}): {build_summary(report)}")

            executables, params, reports = build_buckets(models, buckets, target, db, progress=built)
            out = export_bucketed(args.output, executables, params, models[0], target, reports, axes, db_path)
            upto = " and ".join(f"1 to {max(b[i] for b in buckets)} {what}" for i, what in ((0, "sequences"), (1, "tokens"))
                                if buckets[0][i] is not None)
            summary = f"one artifact for {upto}, inputs padded to the smallest of {_describe_buckets(buckets)}"
    finally:
        if db is not None:
            db.close()
    print(str(out))
    log.log(f"{summary}; load it with TVM alone (see README)")
    return 0


def cmd_run(args) -> int:
    from .runmodel import run_artifact

    result = run_artifact(args.artifact, repeat=args.repeat, check=not args.no_check, tokens=args.tokens,
                          batch=args.batch, profile=args.profile)
    if args.format == "json":
        print(json.dumps(result, indent=2))
    else:
        kernels = result.pop("kernels", None)
        emit([{"field": k, "value": v} for k, v in result.items()], "table", [("field", "field"), ("value", "value")])
        if kernels:
            print()
            emit([dict(k, kernel=k["kernel"][:72], ms=round(k["ms"], 4), share=f"{k['share']:.1%}") for k in kernels],
                 "table",
                 [("kernel", "kernel"), ("calls", "calls"), ("ms", "ms per run"), ("share", "share"),
                  ("schedule", "schedule")])
    return 0 if result.get("matches_torch", True) else 1


def cmd_report(args) -> int:
    from .output import check_output_folder
    from .report import write_report

    check_output_folder(args.output, "the report")
    print(write_report(args.db, args.output, args.bench))
    return 0


def cmd_show(args) -> int:
    from .show import render

    wl = _workload_from_args(args)
    print(render(wl, args.target, args.db))
    return 0


def cmd_rpc_server(args) -> int:
    from .measure.rpc import serve

    serve(args.tracker, args.key, args.host, args.port, args.port_end, args.custom_addr)
    return 0


def cmd_db(args) -> int:
    from .database import cli as db_cli

    return db_cli.run(args)


# ---- parser --------------------------------------------------------------------------------------
def _add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("op", help="operator (see `autosched ops`)")
    p.add_argument("--shape", default="", help="shape, e.g. m=2048,n=4096,k=4096 (missing keys: preset or defaults)")
    p.add_argument("--preset", help="a real-model layer shape, e.g. llama2-7b-up (see `autosched ops`)")
    p.add_argument("--dtype", default="float32", help="float32, float16 or bfloat16 (default float32)")
    p.add_argument("--attrs", default="", help="operator attributes, e.g. bias=1,act=gelu")


def _add_db_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", default=os.environ.get(DB_ENV, DEFAULT_DB),
                   help=f"tuning database: a file, or a URL such as postgresql://user@host/db "
                        f"(default: ${DB_ENV} or ./{DEFAULT_DB})")
    p.add_argument("--busy-timeout", type=float, default=60.0,
                   help="seconds to wait while another process writes the database (default 60)")


def _add_measure_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runner", choices=("local", "rpc"), default="local",
                   help="where candidates are checked and timed: this host (default), or every RPC server under --key")
    p.add_argument("--tracker", help="HOST:PORT of the TVM RPC tracker (with --runner rpc)")
    p.add_argument("--key", help="the key the RPC servers registered under (with --runner rpc)")
    p.add_argument("--builder", choices=("local", "rpc"), default="local",
                   help="where candidates are compiled: this host's cores (default), or, with --runner rpc, the "
                        "server that measures each one")
    p.add_argument("--devices", help="GPUs of this host to measure on at once, e.g. 0,1 (one runner process per GPU)")


def _add_format(p: argparse.ArgumentParser, choices=("table", "json", "csv")) -> None:
    p.add_argument("--format", choices=choices, default="table", help="output format (default table)")


def build_parser() -> argparse.ArgumentParser:
    from .generation.cli import add_build_arguments as add_generation_build_arguments
    from .generation.cli import add_generate_parser
    from .generation.cli import add_tune_arguments as add_generation_tune_arguments

    parser = argparse.ArgumentParser(prog="autosched", description="Schedule search for LLM operators on Apache TVM.")
    parser.add_argument("--version", action="version", version=f"autosched {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("ops", help="list the operators, their shape keys, dtypes and presets")
    _add_format(p)
    p.set_defaults(fn=cmd_ops)

    p = sub.add_parser("tune", help="tune one operator for one device")
    _add_workload_args(p)
    p.add_argument("--target", default="llvm", help="llvm (this CPU, default), cuda (first GPU), or kind:arch")
    p.add_argument("--trials", type=int, help=f"candidates to measure (default {TUNE_TRIALS}; with --time-budget "
                   "alone, as many as fit in it)")
    p.add_argument("--batch-size", type=int, default=16, help="candidates per round (default 16)")
    p.add_argument("--seed", type=int, default=0, help="seed of the search (default 0)")
    p.add_argument("--time-budget", type=float, help="stop after this many seconds (without --trials: the only budget)")
    p.add_argument("--patience", type=int, help="stop after this many rounds without improvement")
    p.add_argument("--cost-model", choices=("xgb", "random"), default="xgb", help="search guide (default xgb)")
    p.add_argument("--no-transfer", action="store_true",
                   help="for a shape without records, do not start from the nearest tuned shapes' decisions")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    _add_measure_args(p)
    _add_db_arg(p)
    _add_format(p, ("table", "json"))
    p.set_defaults(fn=cmd_tune)

    p = sub.add_parser("show", help="print the kernel of the best record (CUDA source, or TensorIR for the CPU)")
    _add_workload_args(p)
    p.add_argument("--target", default="llvm", help="llvm or cuda (works without a GPU: cuda means sm_90 then)")
    _add_db_arg(p)
    p.set_defaults(fn=cmd_show)

    def model_args(p, growth=2.0):
        p.add_argument("model", help="an example model (tiny-llama, llama-7b-layers, ...) or module:factory")
        p.add_argument("--target", default="llvm", help="llvm (default) or cuda")
        p.add_argument("--batch", help="batch size of the example input; several (1,4,16) or 'dynamic' (1, 2, 4, "
                       "... up to --max-batch): tune-model tunes every size's kernels, build makes one artifact "
                       "for any batch up to the largest")
        p.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH,
                       help=f"the largest batch of --batch dynamic (default {DEFAULT_MAX_BATCH})")
        p.add_argument("--tokens", help="tokens of the example input (prefill length; 1 = one decode step); "
                       "several lengths (64,256,1024) or 'dynamic' (16, 32, ... up to --max-tokens): tune-model "
                       "tunes every length's kernels, build makes one artifact for any length up to the largest")
        p.add_argument("--max-tokens", type=int, default=2048, help="the largest length of --tokens dynamic (default 2048)")
        p.add_argument("--bucket-growth", type=float, default=growth,
                       help=f"--tokens dynamic: each bucket this many times the one before (default {growth:g}; "
                       "powers of two always among them)")
        p.add_argument("--dtype", help="model dtype (the example's default if not given)")
        _add_db_arg(p)

    p = sub.add_parser("tune-model", help="tune every kernel of a model under one trial budget")
    model_args(p)
    p.add_argument("--trials", type=int, help=f"candidates to measure over all kernels (default {TUNE_MODEL_TRIALS}; "
                   "with --time-budget alone, as many as fit in it)")
    p.add_argument("--batch-size", type=int, default=16, help="candidates per round (default 16)")
    p.add_argument("--scheduler", choices=("gradient", "round-robin"), default="gradient",
                   help="how trials are spread over the kernels (default gradient)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-budget", type=float, help="stop after this many seconds (without --trials: the only budget)")
    p.add_argument("-q", "--quiet", action="store_true")
    _add_measure_args(p)
    _add_format(p)
    add_generation_tune_arguments(p)
    p.set_defaults(fn=cmd_tune_model)

    p = sub.add_parser("build", help="build a deployable module of a model with the database's best kernels")
    # Build finer than tune-model tunes: a bucket nobody tuned takes the nearest tuned one's schedules, and
    # padding by at most a quarter keeps lengths never tuned close to a build for exactly that length
    # (BENCHMARKS.md, "Any length").
    model_args(p, growth=BUILD_BUCKET_GROWTH)
    p.add_argument("-o", "--output", required=True,
                   help="a new or empty folder (or an earlier build's) for the artifact: model.so (generate.so with "
                        "--generate; model-<bucket>.so per bucket of a dynamic build), params.bin and manifest.json")
    add_generation_build_arguments(p)
    p.set_defaults(fn=cmd_build)

    add_generate_parser(sub)

    p = sub.add_parser("run", help="run a built model on random inputs, check it against torch, time it")
    p.add_argument("artifact", help="the folder `autosched build` wrote")
    p.add_argument("--repeat", type=int, default=20, help="timed runs (default 20)")
    p.add_argument("--no-check", action="store_true", help="skip the comparison with torch")
    p.add_argument("--tokens", type=int, help="for a --tokens dynamic build: the length to run (default: the largest)")
    p.add_argument("--batch", type=int, help="for a --batch dynamic build: the batch to run (default: the largest)")
    p.add_argument("--profile", action="store_true", help="also time each kernel (CUDA events on a GPU): where the "
                   "run's time goes, and whether each kernel's schedule was tuned")
    _add_format(p, ("table", "json"))
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("report", help="tuning curves, throughput charts (PNG) and a Markdown page of a database")
    _add_db_arg(p)
    p.add_argument("-o", "--output", required=True, help="folder for report.md and the PNG charts")
    p.add_argument("--bench", nargs="*", default=[], help="benchmark results.json files to chart against baselines")
    p.set_defaults(fn=cmd_report)

    p = sub.add_parser("rpc-server", help="serve candidates to tuners through a TVM RPC tracker (runs until killed)")
    p.add_argument("--tracker", required=True, help="HOST:PORT of the TVM RPC tracker to register with")
    p.add_argument("--key", required=True, help="the device kind tuners ask for, e.g. h200")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for other machines)")
    p.add_argument("--port", type=int, default=9090, help="first port to try (default 9090)")
    p.add_argument("--port-end", type=int, help="first port not to try (default: --port + 100)")
    p.add_argument("--custom-addr", help="the address to report to the tracker, if not --host (e.g. behind NAT)")
    p.set_defaults(fn=cmd_rpc_server)

    from .database import cli as db_cli

    db_cli.add_parser(sub, _add_db_arg, _add_format)
    sub.choices["db"].set_defaults(fn=cmd_db)
    return parser


# Options whose value is a comma-separated list of numbers: a value such as "-1,2" is theirs (argparse would take
# it for an option and answer with its usage), for the command to refuse in one line.
LIST_OPTIONS = ("--prompt-ids", "--stop-ids", "--decode-batches", "--prefill-chunks")


def _attach_list_values(argv: list[str]) -> list[str]:
    """``--prompt-ids -1,2`` as ``--prompt-ids=-1,2``."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in LIST_OPTIONS and i + 1 < len(argv) and re.match(r"-\d", argv[i + 1]):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(_attach_list_values(sys.argv[1:] if argv is None else list(argv)))

    def _terminate(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _terminate)
    try:
        return args.fn(args)
    except AutoschedError as exc:
        if args.debug:
            raise
        print(f"autosched: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        tuning = args.command in ("tune", "tune-model")
        print("autosched: interrupted" + ("; every record measured so far is kept in the database" if tuning else ""),
              file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - one line for users, the traceback with --debug
        if args.debug:
            raise
        print(f"autosched: internal error: {type(exc).__name__}: {exc} (run with --debug for the traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
