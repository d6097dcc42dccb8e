"""The tuning loop of one task: propose, measure, store, learn, until a stop rule fires.

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
from .measure import SLOW_CUTOFF, MeasureConfig, Measurer
from .search import EvolutionarySearch, SearchConfig

if TYPE_CHECKING:
    from autosched.database.store import Database
    from autosched.search_spaces import Point, Space
    from autosched.target import TargetSpec
    from autosched.task import Task


@dataclass(frozen=True)
class TuneOptions:
    """Args:
        trials: new candidates to measure in this run.
        batch_size: candidates measured per round.
        seed: seed of the search (sampling, mutation, exploration).
        time_budget: stop after this many seconds (None: no limit).
        patience: stop after this many rounds without a better schedule (None: never).
        cost_model: ``xgb`` or ``random``.
        use_database: seed the search with this workload's records already in the database.
    """

    trials: int = 64
    batch_size: int = 16
    seed: int = 0
    time_budget: float | None = None
    patience: int | None = None
    cost_model: str = "xgb"
    use_database: bool = True
    search: SearchConfig = field(default_factory=SearchConfig)


@dataclass
class RoundStats:
    round: int
    trials: int  # measured in this run so far
    batch_ok: int
    batch_failed: int
    batch_best: float  # seconds, inf if the whole batch failed
    best: float  # best so far including database seeds, seconds
    elapsed: float
    failures: dict[str, int]


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
    options = options or TuneOptions()
    reporter = reporter or SilentReporter()
    start = time.perf_counter()
    space = task.space(target)
    search = EvolutionarySearch(space, create_cost_model(options.cost_model, options.seed),
                                FeatureExtractor(target), seed=options.seed, config=options.search)

    workload_id = target_id = None
    own_run = False
    seeded = 0
    if db is not None:
        workload_id = db.ensure_workload(task)
        target_id = db.ensure_target(target)
        if options.use_database:
            known = db.records_for(task.key, target, space=space.id)
            search.observe_known([r.point for r in known], [r.median for r in known])
            seeded = len(known)
        if run_id is None:
            run_id = db.start_run(command, options.seed)
            own_run = True

    own_measurer = measurer is None
    measurer = measurer or Measurer(target, MeasureConfig.for_target(target))
    reporter.on_start(task, space, options.trials, seeded)
    failures: collections.Counter[str] = collections.Counter()
    trials = rounds = stale = 0
    best_before = search.best()[1] if search.best() else math.inf
    stop_reason, status = "trial budget reached", "finished"
    try:
        while trials < options.trials:
            if options.time_budget is not None and time.perf_counter() - start >= options.time_budget:
                stop_reason = f"time budget of {options.time_budget:.0f} s reached"
                break
            points = search.propose(min(options.batch_size, options.trials - trials))
            if not points:
                stop_reason = "no new valid points left in the space"
                break
            cutoff = SLOW_CUTOFF * best_before if math.isfinite(best_before) else None
            results = measurer.measure(task.spec, points, cutoff)
            if db is not None:
                db.add_records(workload_id, target_id, run_id, space.id, points, results)
            search.observe(points, results)
            trials += len(points)
            rounds += 1
            failures.update(r.error_kind for r in results if not r.ok)
            best_now = search.best()[1] if search.best() else math.inf
            stale = 0 if best_now < best_before * 0.999 else stale + 1
            best_before = min(best_before, best_now)
            reporter.on_round(task, RoundStats(
                rounds, trials, sum(r.ok for r in results), sum(not r.ok for r in results),
                min((r.median for r in results), default=math.inf), best_now, time.perf_counter() - start,
                dict(failures)))
            if options.patience is not None and stale >= options.patience:
                stop_reason = f"no improvement in {options.patience} rounds"
                break
    except BaseException:
        status = "interrupted"
        raise
    finally:
        if own_measurer:
            measurer.close()
        if db is not None and own_run:
            db.finish_run(run_id, status)
    best = search.best()
    return TuneResult(task.key, target.label, space.id, best[0] if best else None, best[1] if best else math.inf,
                      trials, dict(failures), rounds, time.perf_counter() - start, run_id, stop_reason, seeded,
                      task.flops, task.min_bytes)
