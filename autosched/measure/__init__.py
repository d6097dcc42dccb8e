"""Measurement: build candidates in parallel, then check and time each one on the device.

Builder workers and the runner process are started once and reused for every batch, so that TVM's
import cost (seconds, more with torch) is paid once per process rather than once per batch, which is
what makes MetaSchedule's own builder time out on small machines. A build that hangs or a kernel that
crashes its process is killed, recorded as failed, and the process restarted.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import math
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from autosched.errors import TemplateBugError
from autosched.records import REFERENCE_FAILED, BuildResult, MeasureResult
from autosched.target import device_facts
from autosched.tvm_adapter import popen_pool, popen_worker

from ._worker import build_candidate, build_reference, init_worker, prepare_task, run_candidate

if TYPE_CHECKING:
    from tvm import IRModule

    from autosched.search_spaces import Point
    from autosched.target import TargetSpec
    from autosched.task import TaskSpec

# Deferred imports: tvm, psutil (imported where used: `autosched --help` stays fast).

__all__ = ["Builder", "LOAD_WARNING", "LoadMeter", "MeasureConfig", "MeasureRequest", "Measurer", "Runner",
           "SLOW_CUTOFF"]

# Other processes using more than this share of the machine's CPU while a batch is timed: its timings
# are taken under load (slower, and noisier), and the tuner says so.
LOAD_WARNING = 0.25

# A candidate slower than this many times the best known in a short probe is timed no further: its rank
# is settled, and on a CPU slow candidates would otherwise take most of the tuning time.
SLOW_CUTOFF = 2.0


@dataclass(frozen=True)
class MeasureConfig:
    """How candidates are timed.

    Args:
        repeat: number of timed repeats; the median over them is the candidate's latency.
        number: runs per repeat (raised automatically to last at least ``min_repeat_ms``).
        min_repeat_ms: minimum duration of one repeat, so that short kernels are timed over many runs.
        flush_bytes: bytes through the caches before each repeat to flush them (on a GPU: read; 0: no flush).
        build_timeout: seconds one candidate may take to build.
        run_timeout: seconds one candidate may take to check and time.
        prepare_timeout: seconds the inputs and reference outputs of a task may take.
    """

    repeat: int = 5
    number: int = 1
    min_repeat_ms: int = 20
    flush_bytes: int = 0
    build_timeout: float = 120.0
    run_timeout: float = 120.0
    prepare_timeout: float = 900.0

    @classmethod
    def for_target(cls, target: TargetSpec, **overrides) -> MeasureConfig:
        if target.is_gpu:
            # One run per repeat with the L2 flushed before each (a read of four times its size, of 256 MB at
            # least), so that memory-bound kernels are not timed out of the cache; many repeats for a stable
            # median.
            flush = max(256 << 20, 4 * device_facts(target).l2_bytes)
            base = cls(repeat=20, number=1, min_repeat_ms=0, flush_bytes=flush, build_timeout=60, run_timeout=30)
        else:
            base = cls()
        return cls(**{**asdict(base), **overrides})


class LoadMeter:
    """The share of this machine's CPU time that processes other than this one and its children (the
    runner, the builders) used between :meth:`start` and :meth:`stop`: 0 on a quiet machine, 0.5 when
    others kept half the cores busy. Timings taken under such load are slower than the kernel is."""

    MIN_SECONDS = 0.05  # shorter intervals are below the kernel's CPU accounting resolution

    def start(self) -> None:
        import psutil

        self._t0, self._busy0, self._own0 = time.monotonic(), self._busy(psutil.cpu_times()), self._own()

    def stop(self) -> float | None:
        import psutil

        wall = time.monotonic() - self._t0
        if wall < self.MIN_SECONDS:
            return None
        busy = self._busy(psutil.cpu_times()) - self._busy0
        own = sum(seconds - self._own0.get(pid, 0.0) for pid, seconds in self._own().items())
        return min(1.0, max(0.0, busy - own) / (wall * (psutil.cpu_count() or 1)))

    @staticmethod
    def _busy(times) -> float:
        fields = times._asdict()
        # guest time is already counted in user time
        return sum(fields.values()) - sum(fields.get(k, 0.0) for k in ("idle", "iowait", "guest", "guest_nice"))

    @staticmethod
    def _own() -> dict[int, float]:
        import psutil

        me = psutil.Process()
        seconds = {}
        for proc in [me, *me.children(recursive=True)]:
            try:
                times = proc.cpu_times()
            except psutil.Error:
                continue
            seconds[proc.pid] = times.user + times.system
        return seconds


def _worker_log(directory: str, name: str):
    return open(os.path.join(directory, name), "ab")


@functools.cache
def _torchless_path() -> str:
    """A folder holding a ``torch`` package that refuses to import, made once a process. First on a builder's
    ``PYTHONPATH``, it keeps tvm_ffi from importing torch, which it does whenever it can (seconds and some
    hundred MB a process): builders only compile; the runner, whose references are torch's, imports it."""
    folder = tempfile.mkdtemp(prefix="autosched-torchless-")
    os.makedirs(os.path.join(folder, "torch"))
    with open(os.path.join(folder, "torch", "__init__.py"), "w") as f:
        f.write('raise ImportError("torch is left out of autosched\'s builder processes")\n')
    atexit.register(shutil.rmtree, folder, True)
    return folder


def _builder_pool(workers: int, timeout: float, initializer, stdout, stderr):
    """TVM's ``PopenPoolExecutor`` whose workers start without torch (:func:`_torchless_path`)."""
    path = os.environ.get("PYTHONPATH")
    env = {"PYTHONPATH": _torchless_path() + (os.pathsep + path if path else "")}
    return popen_pool(workers, timeout, initializer, env, stdout=stdout, stderr=stderr)


class _Reference:
    """A task's reference compiling in the builder pool: waited for, never a build result."""

    def __init__(self, future):
        self.future = future

    def wait(self) -> None:
        try:
            self.future.result()
        except Exception:  # noqa: BLE001 - failed, timed out or the worker died: the runner compiles it
            pass  # and reports its own error


class Builder:
    """Compiles candidates in a pool of persistent worker processes."""

    def __init__(self, target: TargetSpec, workers: int | None = None, timeout: float = 120.0,
                 workdir: str | None = None):
        self.target = target
        self.workers = workers or max(1, min(os.cpu_count() or 1, 16))
        self.timeout = timeout
        self.dir = workdir or tempfile.mkdtemp(prefix="autosched-build-")
        self._log = _worker_log(self.dir, "builder.log")
        self._pool = _builder_pool(self.workers, timeout, init_worker, subprocess.DEVNULL, self._log)
        self._count = 0
        self._references: set[str] = set()  # tasks whose reference was sent to the pool

    def build(self, spec: TaskSpec, points: list[Point], modules: list[IRModule | None] | None = None
              ) -> list[BuildResult]:
        """``modules``: the scheduled module of each point where the caller has it (the search does), which
        the worker compiles as is; the worker applies the other points itself."""
        return self.collect(self.submit(spec, points, modules))

    def submit(self, spec: TaskSpec, points: list[Point], modules: list[IRModule | None] | None = None) -> list:
        """Start building ``points`` in the pool without waiting; :meth:`collect` waits for them. Several
        tasks' builds submitted before the first is collected are compiled side by side, and so is the
        reference of a raw function (a fused kernel of a model), the first time its task comes."""
        import tvm

        futures = []
        if spec.workload is None and spec.key not in self._references:
            self._references.add(spec.key)
            futures.append(_Reference(self._pool.submit(build_reference, spec, self.target)))
        for point, module in zip(points, modules or [None] * len(points), strict=True):
            self._count += 1
            path = os.path.join(self.dir, f"candidate_{self._count}.so")
            scheduled = None if module is None else tvm.ir.save_json(module)
            futures.append(self._pool.submit(build_candidate, spec, self.target, point, path, scheduled))
        return futures

    def collect(self, futures: list) -> list[BuildResult]:
        """The build results of :meth:`submit`'s futures, in order."""
        results = []
        for fut in futures:
            if isinstance(fut, _Reference):
                fut.wait()
                continue
            start = time.perf_counter()
            try:
                results.append(fut.result())
            except TimeoutError:
                results.append(BuildResult(None, self.timeout, "build_timeout", f"build took over {self.timeout:.0f} s"))
            except ChildProcessError:
                results.append(BuildResult(None, time.perf_counter() - start, "build",
                                           "the builder process died (see builder.log in the work directory)"))
            except TemplateBugError:
                raise  # a bug in a template's generator stops the run
            except Exception as exc:  # noqa: BLE001 - an error of the worker machinery itself
                results.append(BuildResult(None, time.perf_counter() - start, "build", f"{type(exc).__name__}: {exc}"))
        return results

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self._log.close()


class Runner:
    """Checks and times built candidates one at a time in a persistent runner process.

    ``initializer(*initargs)`` prepares the process (default: import TVM); ``env``: variables the process
    starts with, e.g. ``CUDA_VISIBLE_DEVICES`` to pin it to one GPU.
    """

    def __init__(self, target: TargetSpec, config: MeasureConfig, workdir: str | None = None,
                 initializer=None, initargs: tuple = (), log_name: str = "runner.log",
                 env: dict[str, str] | None = None):
        self.target = target
        self.config = config
        self.dir = workdir or tempfile.mkdtemp(prefix="autosched-run-")
        self._log = _worker_log(self.dir, log_name)
        self._worker = popen_worker(initializer or init_worker, initargs, env or {},
                                    stdout=subprocess.DEVNULL, stderr=self._log)
        self._prepared: str | None = None  # key of the task whose reference the worker holds

    def run(self, spec: TaskSpec, builds: list[BuildResult], cutoff: float | None = None) -> list[MeasureResult]:
        """Check and time each successful build; ``cutoff`` (seconds): a candidate whose first timed run
        is slower is timed only once."""
        cfg = {k: getattr(self.config, k) for k in ("repeat", "number", "min_repeat_ms", "flush_bytes")}
        results = []
        best = math.inf
        for build in builds:
            # The cutoff tightens with the best candidate of this batch, so even the first,
            # model-less batch does not spend seconds timing hopeless candidates.
            cfg["cutoff"] = min(cutoff if cutoff is not None else math.inf, SLOW_CUTOFF * best)
            cfg["cutoff"] = None if math.isinf(cfg["cutoff"]) else cfg["cutoff"]
            if not build.ok:
                results.append(MeasureResult.failed(build.error_kind, build.error_msg, build.seconds))
                continue
            unprepared = self._prepare(spec)  # no-op unless the task is new or the worker restarted
            if unprepared is not None:
                results.append(MeasureResult.failed("run", unprepared, build.seconds))
                continue
            start = time.perf_counter()
            try:
                self._worker.send(run_candidate, (spec, self.target, build.artifact, cfg), timeout=self.config.run_timeout)
                res = self._worker.recv()
            except TimeoutError:
                res = MeasureResult.failed("run_timeout", f"check and timing took over {self.config.run_timeout:.0f} s")
                self._prepared = None
            except ChildProcessError:
                res = MeasureResult.failed("run", "the kernel crashed the runner process (segfault or abort)",
                                           run_seconds=time.perf_counter() - start)
                self._prepared = None
            if self.target.is_gpu and res.error_kind in ("run", "run_timeout"):
                # A faulting kernel can leave the CUDA context unusable: start a fresh runner.
                self._worker.kill()
                self._prepared = None
            results.append(MeasureResult(res.latencies, res.error_kind, res.error_msg, build.seconds,
                                         res.run_seconds, res.rel_error))
            best = min(best, results[-1].median)
        return results

    def _prepare(self, spec: TaskSpec) -> str | None:
        """Inputs and reference of a new task, computed once, outside the candidates' run timeout."""
        if spec.key == self._prepared:
            return None
        try:
            self._worker.send(prepare_task, (spec, self.target), timeout=self.config.prepare_timeout)
            reason = self._worker.recv()
        except TimeoutError:
            reason = f"computing the reference took over {self.config.prepare_timeout:.0f} s"
        except ChildProcessError:
            reason = "the runner process died while computing the reference"
        if reason is None:
            self._prepared = spec.key
            return None
        self._prepared = None
        return f"{REFERENCE_FAILED}: {reason}"

    def close(self) -> None:
        self._worker.kill()
        self._log.close()


@dataclass
class MeasureRequest:
    """One task's candidates for :meth:`Measurer.measure_batch` (the arguments of :meth:`Measurer.measure`)."""

    spec: TaskSpec
    points: list[Point]
    cutoff: float | None = None
    modules: list[IRModule | None] | None = None


class Measurer:
    """Builder plus runner for one target: ``measure(spec, points)`` returns one result per point.

    ``runner``: ``"local"`` (one runner process on this host's first device), or a factory
    ``runner(target, config, workdir)`` of an object with the :class:`Runner`'s ``run`` and ``close``,
    such as :func:`autosched.measure.rpc.rpc_runner` or :func:`autosched.measure.parallel.device_runner`.
    ``builder``: ``"local"`` (a pool of this host's cores), or a factory of an object with the
    :class:`Builder`'s ``build`` and ``close``, such as :class:`autosched.measure.rpc.RemoteBuilder`.
    """

    def __init__(self, target: TargetSpec, config: MeasureConfig | None = None, build_workers: int | None = None,
                 runner="local", builder="local"):
        self.target = target
        # This host's load matters where its runner times candidates, not where remote servers do.
        self.load_meter = LoadMeter() if runner == "local" else None
        self.config = config or MeasureConfig.for_target(target)
        self.workdir = tempfile.mkdtemp(prefix="autosched-")
        self.builder = (Builder(target, build_workers, self.config.build_timeout, self.workdir) if builder == "local"
                        else builder(target, self.config, self.workdir))
        try:
            self.runner = (Runner if runner == "local" else runner)(target, self.config, self.workdir)
        except BaseException:
            self.builder.close()
            shutil.rmtree(self.workdir, ignore_errors=True)
            raise

    def measure(self, spec: TaskSpec, points: list[Point], cutoff: float | None = None,
                modules: list[IRModule | None] | None = None) -> list[MeasureResult]:
        """``modules``: the points' scheduled modules where already made (see :meth:`Builder.build`)."""
        return self._run(spec, self.builder.build(spec, points, modules), cutoff)

    def measure_batch(self, requests: list[MeasureRequest]) -> list[list[MeasureResult]]:
        """Several tasks' candidates at once: every build is submitted to the pool first, so kernels compile
        side by side across tasks (a model's first measurements are one point per kernel); then each task's
        builds are checked and timed, one task after another, with no compiler running beside them."""
        if not hasattr(self.builder, "submit"):  # e.g. the RPC servers build each point themselves
            return [self.measure(r.spec, r.points, r.cutoff, r.modules) for r in requests]
        pending = [self.builder.submit(r.spec, r.points, r.modules) for r in requests]
        builds = [self.builder.collect(futures) for futures in pending]
        return [self._run(r.spec, b, r.cutoff) for r, b in zip(requests, builds, strict=True)]

    def _run(self, spec: TaskSpec, builds: list[BuildResult], cutoff: float | None) -> list[MeasureResult]:
        if self.load_meter is not None:
            self.load_meter.start()
        results = self.runner.run(spec, builds, cutoff)
        load = self.load_meter.stop() if self.load_meter is not None else None
        if load is not None:
            results = [dataclasses.replace(r, load=round(load, 3)) for r in results]
        for b in builds:
            if b.artifact and os.path.exists(b.artifact):
                os.remove(b.artifact)
        return results

    def close(self) -> None:
        self.builder.close()
        self.runner.close()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Measurer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
