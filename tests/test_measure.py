"""The builder and runner: correct candidates get times; wrong, unwritten, crashing and hanging
candidates become failed results with their reason, and the workers survive them."""

from __future__ import annotations

import types

import numpy as np
import pytest
import tvm
from tvm.script import tirx as T

from autosched.measure import Builder, MeasureConfig, Measurer, MeasureRequest, Runner
from autosched.records import BuildResult
from autosched.task import Task
from autosched.workloads import make_workload

N = 64


@T.prim_func(s_tir=True)
def _not_transposed(A: T.Buffer((N, N), "float32"), B: T.Buffer((N, N), "float32"), C: T.Buffer((N, N), "float32")):
    for i, j, k in T.grid(N, N, N):
        with T.sblock("C"):
            vi, vj, vk = T.axis.remap("SSR", [i, j, k])
            with T.init():
                C[vi, vj] = T.float32(0)
            C[vi, vj] = C[vi, vj] + A[vi, vk] * B[vk, vj]  # A·B, not A·Bᵀ


@T.prim_func(s_tir=True)
def _half_written(A: T.Buffer((N, N), "float32"), B: T.Buffer((N, N), "float32"), C: T.Buffer((N, N), "float32")):
    for i, j, k in T.grid(N // 2, N, N):
        with T.sblock("C"):
            vi, vj, vk = T.axis.remap("SSR", [i, j, k])
            with T.init():
                C[vi, vj] = T.float32(0)
            C[vi, vj] = C[vi, vj] + A[vi, vk] * B[vj, vk]


@T.prim_func(s_tir=True)
def _wild_write(A: T.Buffer((N, N), "float32"), B: T.Buffer((N, N), "float32"), C: T.Buffer((N, N), "float32")):
    for i in range(N):
        with T.sblock("C"):
            vi = T.axis.remap("S", [i])
            C[0, vi * 20000000 + 100000000] = A[vi, 0]  # gigabytes past the buffer: the process dies


def _artifact(func, tmp_path, name):
    path = str(tmp_path / f"{name}.so")
    tvm.compile(func, target={"kind": "llvm"}).export_library(path)
    return BuildResult(path)


@pytest.fixture(scope="module")
def gemm_task():
    return Task.from_workload(make_workload("gemm", f"m={N},n={N},k={N}"))


REPEAT = 5


@pytest.fixture(scope="module")
def measurer(cpu_target):
    """One measurer for the module (its builder pool and runner each import TVM once): two build workers, so
    that a batch of five is larger than its pool; five timed runs a candidate, which the cutoff tests count."""
    with Measurer(cpu_target, MeasureConfig(repeat=REPEAT, min_repeat_ms=5), build_workers=2) as m:
        yield m


@pytest.mark.slow
def test_wrong_unwritten_and_crashing_kernels_are_failed_results(gemm_task, tmp_path, measurer):
    builds = [_artifact(_not_transposed, tmp_path, "wrong"), _artifact(_half_written, tmp_path, "half"),
              _artifact(_wild_write, tmp_path, "crash"), _artifact(_not_transposed, tmp_path, "again")]
    wrong, half, crash, again = measurer.runner.run(gemm_task.spec, builds)
    assert wrong.error_kind == "wrong_result" and "relative error" in wrong.error_msg and not wrong.ok
    assert half.error_kind == "wrong_result" and "NaN" in half.error_msg
    assert crash.error_kind == "run" and "crashed" in crash.error_msg
    # The runner process was restarted after the crash and still works.
    assert again.error_kind == "wrong_result"
    assert wrong.median == float("inf")


@pytest.mark.slow
def test_hanging_run_times_out(cpu_target, tmp_path):
    task = Task.from_workload(make_workload("gemm", "m=768,n=768,k=768"))
    unscheduled = _artifact(task.func, tmp_path, "slow")  # ~0.5 s a call without a schedule
    runner = Runner(cpu_target, MeasureConfig(repeat=50, min_repeat_ms=2000, run_timeout=3))
    try:
        (res,) = runner.run(task.spec, [unscheduled])
    finally:
        runner.close()
    assert res.error_kind == "run_timeout"


def test_measurer_times_good_candidates_and_records_space_errors(gemm_task, cpu_target, measurer):
    space = gemm_task.space(cpu_target)
    points = [space.default(), space.sample(np.random.default_rng(1)), {"not": "a point"}]
    # One call per point: within a batch a candidate over SLOW_CUTOFF x the batch's best is timed briefly.
    a, b, bad = (measurer.measure(gemm_task.spec, [p])[0] for p in points)
    for res in (a, b):
        assert res.ok and len(res.latencies) == REPEAT and all(t > 0 for t in res.latencies)
        assert res.rel_error < 1e-5 and res.build_seconds > 0
    assert bad.error_kind == "space" and "does not fit" in bad.error_msg


def test_builder_compiles_the_module_it_is_given_instead_of_applying_the_point(gemm_task, cpu_target, measurer):
    """The search's scheduled module is what gets built: given one, the worker compiles it as is (here a kernel
    that writes half of C, so the check tells which kernel ran); without one, it applies the point."""
    point = gemm_task.space(cpu_target).default()
    given, applied = measurer.measure(gemm_task.spec, [point, point],
                                            modules=[tvm.IRModule({"main": _half_written}), None])
    assert given.error_kind == "wrong_result" and "NaN" in given.error_msg
    assert applied.ok


def test_a_batch_of_tasks_gives_each_task_its_own_results(gemm_task, cpu_target, measurer):
    """measure_batch builds every task's points in one pool, then checks each task against its own reference:
    a kernel checked against another task's reference would fail (or a wrong one pass)."""
    rms = Task.from_workload(make_workload("rmsnorm", "m=8,n=256"))
    gemm_default = gemm_task.space(cpu_target).default()
    (gemm_ok, gemm_wrong), (rms_ok,) = measurer.measure_batch([
        MeasureRequest(gemm_task.spec, [gemm_default, gemm_default], modules=[None, tvm.IRModule({"main": _half_written})]),
        MeasureRequest(rms.spec, [rms.space(cpu_target).default()]),
    ])
    assert gemm_ok.ok and rms_ok.ok and rms_ok.rel_error < 1e-5
    assert gemm_wrong.error_kind == "wrong_result"


def test_builder_survives_a_batch_larger_than_its_pool(gemm_task, cpu_target, measurer):
    space = gemm_task.space(cpu_target)
    rng = np.random.default_rng(0)
    assert measurer.builder.workers == 2
    results = measurer.builder.build(gemm_task.spec, [space.sample(rng) for _ in range(5)])
    assert all(r.ok for r in results) and len({r.artifact for r in results}) == 5


class _Clock:
    """The runner's clock: each reading is ``step`` seconds after the one before, so the check's single
    (cold) call reads ``step`` seconds."""

    def __init__(self, step: float):
        self.now, self.step = 0.0, step

    def perf_counter(self) -> float:
        self.now += self.step
        return self.now


class _GivenTimes:
    """A loaded kernel that runs (the check compares its output) but whose timed repeats read ``times`` in turn."""

    def __init__(self, lib, times):
        self.lib, self.times = lib, iter(times)

    def __getitem__(self, name):
        return self.lib[name]

    def time_evaluator(self, name, dev, number=1, repeat=1, **kwargs):
        return lambda *args: types.SimpleNamespace(results=[next(self.times) for _ in range(repeat)])


@pytest.mark.parametrize("check, times, cutoff, expected", [
    # No cutoff: every repeat is timed.
    (0.050, [3e-4] * 5, None, [3e-4] * 5),
    # The cold first call already reads far above the cutoff (and above COLD_CALL_SLACK): settled by it.
    (0.050, [], 0.9e-3, [0.050]),
    # A short kernel's cold first call reads 8 ms (3-8 ms for a 0.3 ms attention kernel on a 2-core VM) with
    # a cutoff of 0.9 ms: below COLD_CALL_SLACK, no evidence of a slow kernel; the fastest of the probe's
    # three repeats (one stalled) meets the cutoff, so it is timed in full.
    (0.008, [4e-3, 3e-4, 3.1e-4, 3e-4, 3e-4], 0.9e-3, [4e-3, 3e-4, 3.1e-4, 3e-4, 3e-4]),
    # A candidate slower than the cutoff in all three probe repeats is timed no further.
    (0.001, [2e-3, 3e-3, 2.5e-3], 0.9e-3, [2e-3, 3e-3, 2.5e-3]),
], ids=["no-cutoff", "settled-by-first-call", "cold-first-call-of-a-short-kernel", "settled-by-probe"])
def test_the_cutoff_decides_by_the_timings(gemm_task, cpu_target, tmp_path, monkeypatch, check, times, cutoff, expected):
    """How many repeats a candidate gets under a cutoff, on synthetic timings (the runner's clock and its
    timer are ours; the kernel itself runs and is checked): a loaded machine changes the timings, never
    what this test sees."""
    from autosched.measure import _worker

    path = _artifact(gemm_task.func, tmp_path, "plain").artifact
    load_module = tvm.runtime.load_module
    monkeypatch.setattr(tvm.runtime, "load_module", lambda p: _GivenTimes(load_module(p), times))
    monkeypatch.setattr(_worker, "time", _Clock(check))
    config = {"repeat": REPEAT, "number": 1, "min_repeat_ms": 0, "flush_bytes": 0, "cutoff": cutoff}
    result = _worker.run_candidate(gemm_task.spec, cpu_target, path, config)
    assert result.ok and result.rel_error < 1e-5, result
    assert list(result.latencies) == pytest.approx(expected)


def _norm_of_given_squares():
    """A fused kernel as Relax makes it: its input is a mean of squares, which normal noise makes
    negative, and rsqrt of a negative number is NaN."""
    from tvm import te, tirx

    sq = te.placeholder((8, 64), "float32", name="sq")
    x = te.placeholder((8, 64), "float32", name="x")
    k = te.reduce_axis((0, 64), name="k")
    total = te.compute((8,), lambda i: te.sum(sq[i, k], axis=k), name="total")
    out = te.compute((8, 64), lambda i, j: x[i, j] * tirx.rsqrt(total[i] / 64.0 + 1e-5), name="out")
    return te.create_prim_func([sq, x, out])


def test_kernel_of_a_narrower_input_domain_is_checked_on_positive_inputs(cpu_target, measurer):
    import torch

    task = Task.from_func("norm_of_squares", _norm_of_given_squares())
    checker = task.spec.checker(task.func)
    normal = checker.make_inputs(torch.Generator().manual_seed(task.spec.seed), "cpu")
    assert not torch.isfinite(checker.reference(normal)[0]).all()  # the trap this test is about
    inputs, refs = checker.inputs_and_reference(torch.Generator().manual_seed(task.spec.seed), "cpu")
    assert (inputs[0] > 0).all() and torch.isfinite(refs[0]).all()
    space = task.space(cpu_target)
    results = measurer.measure(task.spec, [space.default(), space.sample(np.random.default_rng(0))])
    assert all(r.ok and r.rel_error < 1e-5 for r in results), results


@pytest.mark.slow  # a builder pool and two measurers of its own (their cache folder is the test's)
def test_a_fused_kernels_reference_is_compiled_by_the_builder_and_loaded_by_the_runner(cpu_target, tmp_path,
                                                                                      monkeypatch):
    """The builder pool compiles a raw function's reference beside its candidates, into the reference cache;
    the runner loads it from there instead of compiling it between candidates. Shown by swapping the cached
    library for another function's: the same candidate is then judged wrong."""
    from tvm import te

    monkeypatch.setenv("AUTOSCHED_CACHE", str(tmp_path))
    task = Task.from_func("norm_of_squares", _norm_of_given_squares())
    cached = task.spec.checker(task.func).reference_path("cpu")
    point = task.space(cpu_target).default()
    builder = Builder(cpu_target, workers=2)
    try:
        (built,) = builder.build(task.spec, [point])
        # Builders start without torch (tvm_ffi would import it: seconds and memory a process), and build.
        import importlib

        with pytest.raises(ImportError, match="left out of autosched's builder processes"):
            builder._pool.submit(importlib.import_module, "torch").result()
    finally:
        builder.close()
    assert built.ok and cached.exists() and cached.parent == tmp_path / "references"
    with Measurer(cpu_target, MeasureConfig(repeat=1, min_repeat_ms=1)) as m:
        (first,) = m.measure(task.spec, [point])
    assert first.ok

    sq, x = te.placeholder((8, 64), "float32", name="sq"), te.placeholder((8, 64), "float32", name="x")
    other = te.compute((8, 64), lambda i, j: x[i, j] * 2.0 + sq[i, j], name="out")
    tvm.compile(te.create_prim_func([sq, x, other]), target={"kind": "llvm"}).export_library(str(cached))
    with Measurer(cpu_target, MeasureConfig(repeat=1, min_repeat_ms=1)) as m:
        (second,) = m.measure(task.spec, [point])
    assert second.error_kind == "wrong_result", second


class _Slot:
    """A device for the scheduling test below: ``opens`` says whether a session can be had."""

    def __init__(self, name: str, opens: bool):
        self.name, self.opens, self.measured = name, opens, 0

    def open(self) -> bool:
        if not self.opens:
            import time

            time.sleep(0.2)  # as a slot waiting on the tracker for a server that never frees
        return self.opens

    def measure(self, spec, build, cutoff):
        from autosched.records import MeasureResult

        self.measured += 1
        return MeasureResult(latencies=(1e-3,))

    def close(self) -> None:
        pass


def test_a_slot_that_cannot_open_holds_back_no_candidate():
    """A slot waiting for a session (its server hung) comes first in the slot order; the open slot
    still measures every candidate (it once kept the batch's last one, round after round)."""
    from autosched.errors import DeviceError
    from autosched.measure.parallel import ParallelRunner

    stuck, healthy = _Slot("stuck", opens=False), _Slot("healthy", opens=True)

    class Runner2(ParallelRunner):
        def slots(self):
            return [stuck, healthy]

        def no_slot_accepted(self, stalled):
            raise DeviceError("no slot accepted a candidate")

    builds = [BuildResult(f"/nonexistent/{i}.so") for i in range(5)]
    for _ in range(3):
        results = Runner2().run(None, builds)
        assert all(r.ok for r in results) and healthy.measured % 5 == 0 and stuck.measured == 0
