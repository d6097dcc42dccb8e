"""The tuning loop: propose, measure, store, learn, until a stop rule fires, for one task or for all
the kernels of a model under one trial budget.

Every batch is written to the database as soon as it is measured, so an interrupted run (Ctrl-C,
SIGTERM, a crash) keeps every measurement made before the interruption; the run itself is marked
``interrupted``.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from .cost_model import FeatureExtractor, create_cost_model
from .errors import UsageError
from .measure import SLOW_CUTOFF, MeasureConfig, Measurer, MeasureRequest
from .search import EvolutionarySearch, SearchConfig
from .warm_start import transfer_points

if TYPE_CHECKING:
    from autosched.database.store import Database
    from autosched.search_spaces import Point, Space
    from autosched.target import TargetSpec
    from autosched.task import Task

# Deferred imports: numpy (imported where used: `autosched --help` stays fast).

# Kernels whose first points are built together before any of them is run (see _first_measurements).
FIRST_ROUND_GROUP = 16


@dataclass(frozen=True)
class TuneOptions:
    """Args:
        trials: new candidates to measure in this run (for a model: over all its tasks); None: no limit
            (``time_budget`` or ``patience`` stops the run).
        batch_size: candidates measured per round.
        seed: seed of the search (sampling, mutation, exploration).
        time_budget: stop after this many seconds (None: no limit).
        patience: stop a task after this many rounds without a better schedule (None: never).
        cost_model: ``xgb`` or ``random``.
        use_database: seed the search with the task's records already in the database.
        scheduler: how a model's trial budget is spread over its tasks: ``gradient`` or ``round-robin``.
        transfer: for a workload without records, start from the nearest tuned shapes' decisions.
    """

    trials: int | None = 64
    batch_size: int = 16
    seed: int = 0
    time_budget: float | None = None
    patience: int | None = None
    cost_model: str = "xgb"
    use_database: bool = True
    scheduler: str = "gradient"
    transfer: bool = True
    search: SearchConfig = field(default_factory=SearchConfig)

    def __post_init__(self):
        check_seed(self.seed)


def check_seed(seed: int, option: str = "seed") -> None:
    """A seed is a whole number, 0 or more (numpy's generators take no negative seed)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise UsageError(f"{option} must be a whole number, 0 or more (got {seed})")


@dataclass
class RoundStats:
    round: int
    trials: int  # measured in this run so far (for this task)
    batch_ok: int
    batch_failed: int
    batch_best: float  # seconds, inf if the whole batch failed
    best: float  # best so far including database seeds, seconds
    elapsed: float
    failures: dict[str, int]
    load: float | None = None  # other processes' share of the CPU while the batch was timed (None: unknown)


@dataclass
class TuneResult:
    task_key: str
    target_label: str
    space: str
    best_point: Point | None
    best_latency: float  # seconds; inf if nothing succeeded
    trials: int
    failures: dict[str, int]
    rounds: int
    seconds: float
    run_id: int | None
    stop_reason: str
    seeded_from_database: int
    flops: float
    min_bytes: float
    searched: bool = True  # False: the best point is the space's default (measured first, not found by search)

    @property
    def gflops(self) -> float | None:
        return self.flops / self.best_latency / 1e9 if self.flops and math.isfinite(self.best_latency) else None

    @property
    def gbps(self) -> float | None:
        return self.min_bytes / self.best_latency / 1e9 if self.min_bytes and math.isfinite(self.best_latency) else None


class Reporter(Protocol):
    """Receives progress; the command line draws it, tests and benchmarks may ignore it."""

    def on_start(self, task: Task, space: Space, trials: int, seeded: int) -> None: ...

    def on_round(self, task: Task, stats: RoundStats) -> None: ...


class SilentReporter:
    def on_start(self, task, space, trials, seeded) -> None:
        pass

    def on_round(self, task, stats) -> None:
        pass


class TaskTuner:
    """The search state of one task; :meth:`step` measures one batch and stores it."""

    def __init__(self, task: Task, target: TargetSpec, db: Database | None, options: TuneOptions,
                 run_id: int | None, reporter: Reporter):
        self.task, self.target, self.db, self.options, self.run_id = task, target, db, options, run_id
        self.reporter = reporter
        self.start = time.perf_counter()
        self.space = task.space(target)
        self.search = EvolutionarySearch(self.space, create_cost_model(options.cost_model, options.seed),
                                         FeatureExtractor(target), seed=options.seed, config=options.search)
        self.seeded = 0
        self.transferred: list = []
        self.workload_id = self.target_id = None
        if db is not None:
            self.workload_id = db.ensure_workload(task)
            self.target_id = db.ensure_target(target)
            if options.use_database:
                known = db.records_for(task.key, target, space=self.space.id)
                self.search.observe_known([r.point for r in known], [r.median for r in known])
                self.seeded = len(known)
                if not known and options.transfer:
                    # A shape nobody tuned: start from the decisions of the nearest tuned shapes.
                    self.transferred = transfer_points(db, task, target, self.space)
                    self.search.propose_first([p for p, _, _ in self.transferred])
        # The space's default point (and any variants it names) is measured first, so a tuned kernel is
        # never slower than the untuned build's (which uses that point on the CPU).
        self.search.propose_first(self.space.first_points())
        self.failures: collections.Counter[str] = collections.Counter()
        self.trials = self.rounds = self.stale = 0
        self.history: list[float] = [self.best]  # best latency after each round
        self.done_reason: str | None = None

    @property
    def best(self) -> float:
        best = self.search.best()
        return best[1] if best else math.inf

    def step(self, measurer: Measurer, budget: int) -> int:
        """Measure up to ``budget`` new candidates; returns how many were measured (0: space exhausted)."""
        request = self.propose(budget)
        if request is None:
            return 0
        return self.observe(request.points, measurer.measure(request.spec, request.points, request.cutoff,
                                                             request.modules))

    def propose(self, budget: int) -> MeasureRequest | None:
        """The next up to ``budget`` candidates, to be measured and handed to :meth:`observe`; None when
        the space has no new valid point left."""
        points = self.search.propose(min(self.options.batch_size, budget))
        if not points:
            self.done_reason = "no new valid points left in the space"
            return None
        before = self.best
        cutoff = SLOW_CUTOFF * before if math.isfinite(before) else None
        return MeasureRequest(self.task.spec, points, cutoff, self.search.modules(points))

    def observe(self, points: list, results: list) -> int:
        """Store and learn from the measurements of proposed ``points``; returns how many there were."""
        before = self.best
        if self.db is not None:
            self.db.add_records(self.workload_id, self.target_id, self.run_id, self.space.id, points, results)
        self.search.observe(points, results)
        self.trials += len(points)
        self.rounds += 1
        self.failures.update(r.error_kind for r in results if not r.ok)
        now = self.best
        self.stale = 0 if now < before * 0.999 else self.stale + 1
        self.history.append(now)
        self.reporter.on_round(self.task, RoundStats(
            self.rounds, self.trials, sum(r.ok for r in results), sum(not r.ok for r in results),
            min((r.median for r in results), default=math.inf), now, time.perf_counter() - self.start,
            dict(self.failures), max((r.load for r in results if r.load is not None), default=None)))
        if self.options.patience is not None and self.stale >= self.options.patience:
            self.done_reason = f"no improvement in {self.options.patience} rounds"
        if results and all(r.reference_failed for r in results) and not math.isfinite(now):
            # The task itself cannot be checked: more candidates would fail the same way.
            self.done_reason = results[0].error_msg
        return len(points)

    def result(self, stop_reason: str) -> TuneResult:
        best = self.search.best()
        return TuneResult(self.task.key, self.target.label, self.space.id, best[0] if best else None,
                          best[1] if best else math.inf, self.trials, dict(self.failures), self.rounds,
                          time.perf_counter() - self.start, self.run_id, self.done_reason or stop_reason,
                          self.seeded, self.task.flops, self.task.min_bytes, self._searched(best))

    def _searched(self, best) -> bool:
        from autosched.search_spaces import point_key

        try:
            return best is None or point_key(best[0]) != point_key(self.space.default())
        except Exception:  # noqa: BLE001 - a space without a default point has nothing to compare with
            return True


def tune(task: Task, target: TargetSpec, db: Database | None, options: TuneOptions | None = None,
         reporter: Reporter | None = None, measurer: Measurer | None = None, run_id: int | None = None,
         command: str = "") -> TuneResult:
    """Tune ``task`` for ``target``, storing every measurement in ``db`` (if given).

    Args:
        task: what to tune.
        target: where to measure.
        db: the tuning database; None keeps results in memory only.
        options: trial budget, batch size, seed and stop rules.
        reporter: progress callbacks.
        measurer: a measurer to reuse across tasks (one is created and closed otherwise).
        run_id: an existing run to add the records to (a new run is started otherwise).
        command: the command line, stored with a new run for provenance.
    """
    return tune_tasks([task], target, db, options, reporter, measurer, run_id, command)[0]


def tune_tasks(tasks: list[Task], target: TargetSpec, db: Database | None, options: TuneOptions | None = None,
               reporter: Reporter | None = None, measurer: Measurer | None = None, run_id: int | None = None,
               command: str = "") -> list[TuneResult]:
    """Tune several tasks under one trial budget (``options.trials`` in total), spread by the task
    scheduler: ``round-robin``, or ``gradient`` (as in Ansor: the next round goes to the task where the
    weighted latency is expected to drop most, judged by its recent improvement and its distance from
    its floor)."""
    options = options or TuneOptions()
    if options.trials is None and options.time_budget is None and options.patience is None:
        raise ValueError("TuneOptions without trials needs a time_budget or patience to stop")
    reporter = reporter or SilentReporter()
    limit = math.inf if options.trials is None else options.trials
    start = time.perf_counter()
    own_run = db is not None and run_id is None
    if own_run:
        run_id = db.start_run(command, options.seed)
    own_measurer = measurer is None
    measurer = measurer or Measurer(target, MeasureConfig.for_target(target))
    tuners: list[TaskTuner] = []
    stop_reason, status = "trial budget reached", "finished"
    try:
        for task in tasks:
            tuner = TaskTuner(task, target, db, options, run_id, reporter)
            per_task = (options.trials if len(tasks) == 1 or options.trials is None
                        else max(1, options.trials // len(tasks)))
            reporter.on_start(task, tuner.space, per_task, tuner.seeded)
            tuners.append(tuner)
        used = _first_measurements(tuners, measurer, options, start)
        while used < limit:
            if options.time_budget is not None and time.perf_counter() - start >= options.time_budget:
                stop_reason = f"time budget of {options.time_budget:.0f} s reached"
                break
            live = [t for t in tuners if t.done_reason is None]
            if not live:
                stop_reason = "every task stopped"
                break
            tuner = _next_task(live, options.scheduler)
            used += tuner.step(measurer, int(min(limit - used, options.batch_size)))
    except BaseException:
        status = "interrupted"
        raise
    finally:
        if own_measurer:
            measurer.close()
        if own_run:
            db.finish_run(run_id, status)
    return [t.result(stop_reason) for t in tuners]


def _first_measurements(tuners: list[TaskTuner], measurer: Measurer, options: TuneOptions, start: float) -> int:
    """Before the scheduler concentrates trials: a first small round for every task, heaviest first,
    measuring the points it proposes first (decisions transferred from tuned shapes, then the space's
    default), at most the budget's even share each. A full batch per task would spend a small budget on
    the first few tasks (64 trials in batches of 16: 4 of 14 kernels measured). Returns the trials used."""
    if len(tuners) < 2:
        return 0
    limit = math.inf if options.trials is None else options.trials
    share = options.batch_size if options.trials is None else max(1, options.trials // len(tuners))
    used = 0
    order = sorted(tuners, key=lambda t: _heaviness(t.task), reverse=True)
    # In groups, so the builds of several kernels compile side by side (on the GPU a build takes longer
    # than a run), while the time budget is still checked often.
    for group_start in range(0, len(order), FIRST_ROUND_GROUP):
        if used >= limit or (options.time_budget is not None
                                      and time.perf_counter() - start >= options.time_budget):
            break
        proposed = []
        for tuner in order[group_start:group_start + FIRST_ROUND_GROUP]:
            first = int(min(options.batch_size, share, 1 + len(tuner.transferred), limit - used))
            request = tuner.propose(first) if first > 0 else None
            if request is not None:
                proposed.append((tuner, request))
                used += len(request.points)
        results = measurer.measure_batch([request for _, request in proposed])
        for (tuner, request), measured in zip(proposed, results, strict=True):
            tuner.observe(request.points, measured)
    return used


def _floors(tuners: list[TaskTuner]) -> dict[int, float]:
    """Each task's floor in seconds: its FLOPs at the highest FLOP rate, and its bytes at the highest byte
    rate, that any task has reached so far (whichever takes longer). Measured rates, not the device's
    datasheet: the best kernels of the run stand for what the device gives, on any device.

    The rates come from our workloads' kernels, whose FLOP and byte counts model what they must compute and
    move; a raw function's counts are its buffers' sizes, which a gather or a slice does not read whole (such
    a kernel seems to move bytes many times faster than the device can, every other floor falls near zero,
    and the search spends its rounds by time alone). Only without any workload do raw functions set them."""
    done = [t for t in tuners if math.isfinite(t.best) and t.best > 0]
    rated = [t for t in done if t.task.workload is not None] or done
    flop_rate = max((t.task.flops / t.best for t in rated), default=0.0)
    byte_rate = max((t.task.min_bytes / t.best for t in rated), default=0.0)
    return {id(t): max(t.task.flops / flop_rate if flop_rate > 0 else 0.0,
                       t.task.min_bytes / byte_rate if byte_rate > 0 else 0.0) for t in tuners}


def _priority(task: Task) -> float:
    """What a second of the task's kernel is worth to the model: its calls, times its bucket's share."""
    return task.weight * task.share


def _heaviness(task: Task) -> float:
    """Which task to measure first: its work in the model, times its bucket's share."""
    return task.work * task.share


def _next_task(tuners: list[TaskTuner], scheduler: str) -> TaskTuner:
    """Round-robin over the tasks that have had the fewest rounds first; then, with ``gradient``, the
    task whose weighted time is expected to drop most: its recent improvement plus what separates it from
    its floor (shrinking with its rounds, so none is starved). A kernel's floor is its FLOPs and bytes at
    the fastest rates any task of the run reached (:func:`_floors`). Judged by its time alone, the task
    scheduler gave nearly every measurement of a prefill to its GEMMs, already close to cuBLAS, while
    attention and RoPE, far from their floors, had almost none."""
    fewest = min(t.rounds for t in tuners)
    if scheduler == "round-robin":
        return next(t for t in tuners if t.rounds == fewest)
    if fewest == 0:
        # First round of each task, heaviest first (calls x work), in case the budget ends before all.
        return max((t for t in tuners if t.rounds == 0),
                   key=lambda t: _heaviness(t.task))
    floors = _floors(tuners)

    def expected_gain(t: TaskTuner) -> float:
        if not math.isfinite(t.best):
            return math.inf  # nothing works yet: keep trying
        recent = t.history[-3:]
        first = recent[0] if math.isfinite(recent[0]) else t.best
        slope = max(first - t.best, 0.0) / len(recent)
        return _priority(t.task) * (slope + max(t.best - floors[id(t)], 0.0) / (1 + t.rounds))

    return max(tuners, key=expected_gain)
