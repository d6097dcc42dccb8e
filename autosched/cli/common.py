"""What the commands share: the tuning database, the measurer, the trial budget and its checks, progress on
stderr, and the parsing of number lists."""

from __future__ import annotations

import argparse
import math
import os
import sys

from ..errors import UsageError
from ..output import console

DB_ENV = "AUTOSCHED_DB"

DEFAULT_DB = "autosched.db"

TUNE_TRIALS = 64  # tune's trial budget when neither --trials nor --time-budget is given

TUNE_MODEL_TRIALS = 256  # tune-model's

DEFAULT_MAX_BATCH = 16  # --max-batch



# ---- output --------------------------------------------------------------------------------------
# ---- output helpers ------------------------------------------------------------------------------
def fixed(value: float) -> str:
    """A number with about four significant digits and never in scientific notation (1.893e+04 reads
    as 18930)."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    digits = max(0, 3 - math.floor(math.log10(abs(value))))
    return f"{value:.{digits}f}"



def fmt_time(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "failed"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.2f} us"
    return f"{seconds * 1e3:.3f} ms"


# ---- budgets and number lists ---------------------------------------------------------------------
def tuning_budget(args, default: int) -> int | None:
    """The trial budget of ``tune``, ``tune-model`` and ``tune-model --generate`` (--trials if given; with
    --time-budget alone, none: the time is the budget), after the checks they share."""
    if args.time_budget is not None and args.time_budget <= 0:
        raise UsageError(f"--time-budget must be above 0 seconds (got {args.time_budget:g})")
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be at least 1 (got {args.batch_size})")
    if getattr(args, "patience", None) is not None and args.patience < 1:
        raise UsageError(f"--patience must be at least 1 round (got {args.patience})")
    if args.trials is None:
        return None if args.time_budget is not None else default
    if args.trials < 1:
        raise UsageError(f"--trials must be at least 1 (got {args.trials})")
    return args.trials


def tune_kernels(args, tasks: list, target, trials: int | None, log) -> list:
    """Tune ``tasks`` under one budget into ``--db`` with the measurer the options ask for, a line of progress
    per round on ``log`` (none with --quiet); their TuneResults."""
    from ..tuner import TuneOptions, tune_tasks

    measurer = measurer_from_args(args, target)  # before the database: a missing tracker creates no file
    try:
        db = open_db(args.db)
    except BaseException:
        if measurer is not None:
            measurer.close()
        raise
    reporter = ConsoleReporter(quiet=True)  # the per-round lines are ModelProgress's
    options = TuneOptions(trials=trials, batch_size=args.batch_size, seed=args.seed, time_budget=args.time_budget,
                          scheduler=args.scheduler)
    progress = ModelProgress(log, tasks, trials) if not args.quiet else None
    try:
        return tune_tasks(tasks, target, db, options, progress or reporter, measurer=measurer,
                          command=" ".join(sys.argv))
    finally:
        reporter.close()
        if measurer is not None:
            measurer.close()
        db.close()


def parse_ids(text: str, what: str, noun: str = "token ids") -> list[int]:
    """Comma-separated whole numbers, 0 or more: ``1,,2`` (an empty item), ``-1``, ``1.5`` or ``a`` is a
    UsageError in one line, never read as something else."""
    items = text.replace(" ", "").split(",")
    for item in items:
        if not item.isdecimal():
            if item.startswith("-") and item[1:].isdecimal():
                why = f"{item} is negative: {noun} are 0 or more"
            else:
                why = "an empty item between commas" if not item else f"{item!r} is not a whole number"
            raise UsageError(f"{what} '{text}' should be comma-separated {noun}, e.g. 1,2,3 ({why})")
    return [int(item) for item in items]


# ---- progress ------------------------------------------------------------------------------------
# ---- progress ------------------------------------------------------------------------------------
class ConsoleReporter:
    """Progress for ``tune``: a bar with the best so far on a terminal, a line per round always."""

    def __init__(self, quiet: bool = False):
        self.console = console(stderr=True)
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
        self.console.log(f"round {s.round:>3}  trials {s.trials:>4}  batch best {fmt_time(s.batch_best):>12}  "
                         f"best {fmt_time(s.best):>12}{perf}{fails}")
        warn_load(self.console, s)
        if self.progress is not None:
            self.progress.update(self.bar, completed=s.trials, description=f"best {fmt_time(s.best)}{perf}")

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def warn_load(console, s, timed: str | None = None) -> bool:
    """Warn of a round timed under load (``timed``: what was timed, default "round N was"); whether it warned."""
    from ..measure import LOAD_WARNING

    if s.load is None or s.load <= LOAD_WARNING:
        return False
    timed = timed or f"round {s.round} was"
    console.log(f"[yellow]warning:[/] other processes used {s.load:.0%} of the CPU while {timed} timed: the "
                "timings are slower and noisier than on a quiet machine (the load is stored with each record; "
                "`autosched db best` shows it)")
    return True


class ModelProgress:
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
        self.log.log(f"[{done}{of}] {escape(task.name)}: best {fmt_time(s.best)} after {s.trials} trials; "
                     f"model estimate {model}")
        # The kernels of one batch (every kernel's first points are measured together) share its load: one
        # warning for them, not one per kernel; again when the load changes or comes back after a quiet round.
        if s.load != self.warned_load:
            self.warned_load = s.load if warn_load(self.log, s, "these kernels were") else None


def searched_cell(result) -> str:
    """tune-model's "searched" column for a kernel's TuneResult: whether its best point was found by search, is
    the space's default point, or there is none (no trial reached it and no earlier record)."""
    if result.best_point is None:
        return "no (not measured)"
    return "yes" if result.searched else "no (default point)"


# ---- database and measurer ------------------------------------------------------------------------
def open_db(path: str, readonly: bool = False, busy_timeout: float = 60.0):
    from ..database.store import Database

    return Database(path, readonly=readonly, busy_timeout=busy_timeout)


def open_build_db(path: str | None):
    """The database a build reads its records from, or None where there is none (a build needs no database).
    Validations of records from another TVM are stored where the database can be written; a file one may
    only read (a team's shared copy) is read as it is."""
    from ..database.store import is_url

    if not path:
        return None
    if not (is_url(path) or os.path.exists(path)):
        console(stderr=True).log(f"[yellow]warning:[/] no tuning database at {path}: building with default "
                                  "schedules (tune first with `autosched tune-model MODEL --db "
                                  f"{path}`, or give --db the database you tuned into)")
        return None
    writable = is_url(path) or (os.access(path, os.W_OK) and os.access(os.path.dirname(os.path.abspath(path)), os.W_OK))
    return open_db(path, readonly=not writable)


def measurer_from_args(args, target):
    """The measurer that ``--runner``, ``--builder``, ``--tracker``, ``--key`` and ``--devices`` ask for (None:
    the tuner's default, one local runner)."""
    if args.builder == "rpc" and args.runner != "rpc":
        raise UsageError("--builder rpc goes with --runner rpc: the RPC servers build what they measure")
    if args.runner == "local" and args.devices is None:
        if args.tracker or args.key:
            raise UsageError("--tracker and --key go with --runner rpc")
        return None
    from ..measure import MeasureConfig, Measurer

    if args.runner == "rpc":
        if args.devices is not None:
            raise UsageError("--devices is for GPUs of this host; with --runner rpc start one server per GPU instead")
        if not args.tracker or not args.key:
            raise UsageError("--runner rpc needs --tracker HOST:PORT and --key KEY (the key its servers registered under)")
        from ..measure.rpc import RemoteBuilder, parse_tracker, rpc_runner

        parse_tracker(args.tracker)
        factory = rpc_runner(args.tracker, args.key)
        if args.builder == "rpc":
            return Measurer(target, MeasureConfig.for_target(target), runner=factory, builder=RemoteBuilder)
    else:
        from ..measure.parallel import device_runner, parse_devices

        devices = parse_devices(args.devices)
        if not target.is_gpu:
            raise UsageError("--devices picks GPUs (--target cuda): CPU runners would share the cores and disturb "
                             "each other's timings")
        factory = device_runner(devices)
    return Measurer(target, MeasureConfig.for_target(target), runner=factory)


# ---- arguments every command group takes ----------------------------------------------------------
def add_db_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", default=os.environ.get(DB_ENV, DEFAULT_DB),
                   help=f"tuning database: a file, or a URL such as postgresql://user@host/db "
                        f"(default: ${DB_ENV} or ./{DEFAULT_DB})")
    p.add_argument("--busy-timeout", type=float, default=60.0,
                   help="seconds to wait while another process writes the database (default 60)")


def add_measure_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runner", choices=("local", "rpc"), default="local",
                   help="where candidates are checked and timed: this host (default), or every RPC server under --key")
    p.add_argument("--tracker", help="HOST:PORT of the TVM RPC tracker (with --runner rpc)")
    p.add_argument("--key", help="the key the RPC servers registered under (with --runner rpc)")
    p.add_argument("--builder", choices=("local", "rpc"), default="local",
                   help="where candidates are compiled: this host's cores (default), or, with --runner rpc, the "
                        "server that measures each one")
    p.add_argument("--devices", help="GPUs of this host to measure on at once, e.g. 0,1 (one runner process per GPU)")


def add_format(p: argparse.ArgumentParser, choices=("table", "json", "csv")) -> None:
    p.add_argument("--format", choices=choices, default="table", help="output format (default table)")
