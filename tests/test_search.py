"""The evolutionary search, driven by a replay oracle instead of real measurements (fast and exact)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from autosched.cost_model import FeatureExtractor, RandomModel, XGBCostModel
from autosched.records import MeasureResult
from autosched.search import EvolutionarySearch, SearchConfig
from autosched.search_spaces import point_key
from autosched.task import Task
from autosched.workloads import make_workload


def _oracle(point) -> float:
    """A deterministic stand-in for a measurement: a smooth landscape over the GEMM knobs with one
    region of failures, so that a model can learn it from the schedule's features."""
    ti, tj = point["tile_i"], point["tile_j"]
    if ti[-1] * tj[-1] > 256:
        return math.inf
    return 1.0 + abs(math.log2(tj[-1]) - 4) + 0.5 * abs(math.log2(ti[-1]) - 2) + (0.0 if point["pack_b"] else 1.0) \
        + 0.1 * abs(math.log2(point["tile_k"][0]) - 3)


def _run(model, seed, trials=48, batch=8, cpu_target=None):
    task = Task.from_workload(make_workload("gemm", "m=256,n=256,k=256"))
    space = task.space(cpu_target)
    search = EvolutionarySearch(space, model, FeatureExtractor(cpu_target), seed=seed,
                                config=SearchConfig(population=32, generations=2))
    seen = set()
    while len(seen) < trials:
        points = search.propose(batch)
        assert points, "the search ran dry"
        keys = [point_key(p) for p in points]
        assert len(set(keys)) == len(keys), "duplicate proposals in one batch"
        assert not (set(keys) & seen), "a point was proposed twice"
        assert all(space.validate(p) is None for p in points)
        seen.update(keys)
        search.observe(points, [MeasureResult((_oracle(p),)) if math.isfinite(_oracle(p))
                                else MeasureResult.failed("wrong_result", "oracle") for p in points])
    return search.best()[1]


def test_proposals_are_new_valid_and_reproducible(cpu_target):
    task = Task.from_workload(make_workload("gemm", "m=64,n=64,k=64"))
    space = task.space(cpu_target)
    runs = []
    for _ in range(2):
        search = EvolutionarySearch(space, RandomModel(0), FeatureExtractor(cpu_target), seed=5)
        runs.append([point_key(p) for p in search.propose(6)])
    assert runs[0] == runs[1]


@pytest.mark.slow
def test_model_guided_search_beats_random_on_the_oracle(cpu_target):
    """Averaged over seeds, XGBoost guidance finds a better point than random ranking at equal trials."""
    seeds = [0, 1, 2]
    guided = np.mean([_run(XGBCostModel(n_estimators=60, seed=s), s, cpu_target=cpu_target) for s in seeds])
    random = np.mean([_run(RandomModel(s), s, cpu_target=cpu_target) for s in seeds])
    assert guided <= random, (guided, random)


def test_database_seeds_become_parents(cpu_target):
    task = Task.from_workload(make_workload("gemm", "m=64,n=64,k=64"))
    space = task.space(cpu_target)
    rng = np.random.default_rng(0)
    known = [space.sample(rng) for _ in range(10)]
    search = EvolutionarySearch(space, XGBCostModel(n_estimators=20), FeatureExtractor(cpu_target), seed=0,
                                config=SearchConfig(min_train=4))
    search.observe_known(known, [float(i + 1) for i in range(10)])
    assert search.best()[0] == known[0]
    proposed = {point_key(p) for p in search.propose(8)}
    assert not proposed & {point_key(p) for p in known}


def test_points_that_give_the_same_kernel_are_proposed_once(cpu_target):
    """Two points of the rows space schedule the same kernel when vector=1 (rfactor needs a vector, so its
    value does not matter there), and the space has no canonical() rule for it: the structural hash of the
    scheduled module catches them, so one kernel is not measured twice."""
    import tvm_ffi

    task = Task.from_workload(make_workload("softmax", "m=4,n=64"))
    space = task.space(cpu_target)
    search = EvolutionarySearch(space, RandomModel(), FeatureExtractor(cpu_target), seed=0)
    proposed = []
    while batch := search.propose(16):
        proposed += batch
        search.observe(batch, [MeasureResult((1e-3,))] * len(batch))
    hashes = [tvm_ffi.structural_hash(space.apply(p)) for p in proposed]
    assert len(set(hashes)) == len(hashes)
    assert search.duplicates, "the rows space has points with equal kernels; none were found"
    twins = {point_key({**p, "rfactor": not p["rfactor"]}) for p in proposed if p["vector"] == 1}
    assert not twins & {point_key(p) for p in proposed}


def test_a_point_slow_to_apply_is_applied_once_and_its_module_is_what_the_builder_gets(cpu_target, monkeypatch):
    """Tuning applies a point once, in the search (to featurise it and find twins by structural hash), and
    hands that module to the measurer, whose builder compiles it rather than applying the point again."""
    import collections
    import time

    import tvm_ffi

    from autosched.search import SEND_MODULE_AFTER
    from autosched.tuner import TuneOptions, tune

    task = Task.from_workload(make_workload("gemm", "m=64,n=64,k=64"))
    space_class = type(task.space(cpu_target))
    apply = space_class.apply
    applied: collections.Counter[str] = collections.Counter()

    def slow_counting_apply(self, point):
        applied[point_key(point)] += 1
        time.sleep(SEND_MODULE_AFTER)
        return apply(self, point)

    monkeypatch.setattr(space_class, "apply", slow_counting_apply)

    class Recorder:
        def __init__(self):
            self.given = []  # (point, module) handed to measure

        def measure(self, spec, points, cutoff=None, modules=None):
            self.given += zip(points, modules or [None] * len(points))
            return [MeasureResult((_oracle(p),)) if math.isfinite(_oracle(p))
                    else MeasureResult.failed("wrong_result", "oracle") for p in points]

    recorder = Recorder()
    options = TuneOptions(trials=24, batch_size=8, cost_model="random", search=SearchConfig(population=16, generations=2))
    tune(task, cpu_target, None, options, measurer=recorder)
    assert len(recorder.given) == 24
    for point, module in recorder.given:
        assert applied[point_key(point)] == 1, point
        assert module is not None and tvm_ffi.structural_equal(module, apply(task.space(cpu_target), point))


def test_the_task_scheduler_feeds_the_kernel_farthest_from_its_floor():
    """After their first rounds, the next round goes to the kernel whose weighted time is farthest from its
    floor (its FLOPs and bytes at the fastest rates the run has reached), not to the one that takes the
    most time: the 16 x 512 prefill's latencies on the H200, where the GEMMs are within 5% of the best
    GEMM and RoPE at a third of the bandwidth RMSNorm reaches."""
    from types import SimpleNamespace

    from autosched.tuner import _floors, _next_task

    def tuner(op, shape, calls, best_us, rounds=3):
        task = Task.from_workload(make_workload(op, shape, "float16"))
        task.weight = calls
        best = best_us * 1e-6
        return SimpleNamespace(task=task, rounds=rounds, best=best, history=[best] * 3, done_reason=None)

    gemms = [tuner("gemm", "m=8192,n=4096,k=4096", 8, 384.6), tuner("gemm", "m=8192,n=11008,k=4096", 4, 1010.2),
             tuner("gemm", "m=8192,n=4096,k=11008", 2, 975.1)]
    norm = tuner("rmsnorm", "m=8192,n=4096", 5, 35.6)
    rope = tuner("rope", "b=16,s=512,h=32,d=128", 4, 99.0)
    tuners = gemms + [norm, rope]
    floors = _floors(tuners)
    assert floors[id(gemms[2])] == pytest.approx(gemms[2].best) and floors[id(norm)] == pytest.approx(norm.best)
    assert rope.best / floors[id(rope)] > 2
    assert _next_task(tuners, "gradient") is rope
    # At its floor for three rounds, RoPE leaves the next round to the GEMM with the most time above its own.
    rope.best = floors[id(rope)]
    rope.history = [rope.best] * 3
    assert _next_task(tuners, "gradient") is gemms[0]  # 8 calls x 22 us above its floor


def test_a_raw_functions_byte_count_does_not_set_the_floors():
    """A raw function's bytes are its buffers' sizes: a gather that reads a few rows of a large table "moves"
    far more than the device can. Its rate must not become every kernel's floor (on the H200 such kernels gave
    18-69 TB/s, and every decode GEMV looked far from its floor); the workloads' rates set the floors, and
    only where there is no workload do raw functions."""
    from types import SimpleNamespace

    from tvm import te

    from autosched.tuner import _floors

    table = te.placeholder((32000, 4096), "float16", name="table")
    rows = te.compute((4, 4096), lambda i, j: table[i * 7, j], name="rows")
    gather = Task.from_func("gather", te.create_prim_func([table, rows]), weight=1)

    def tuner(task, best_us):
        best = best_us * 1e-6
        return SimpleNamespace(task=task, rounds=3, best=best, history=[best] * 3, done_reason=None)

    gemv = tuner(Task.from_workload(make_workload("gemm", "m=1,n=4096,k=4096", "float16")), 13.5)
    norm = tuner(Task.from_workload(make_workload("rmsnorm", "m=8192,n=4096", "float16")), 32.8)
    raw = tuner(gather, 3.8)
    assert raw.task.min_bytes / raw.best > 50e12  # the table counted whole
    floors = _floors([gemv, norm, raw])
    rate = norm.task.min_bytes / norm.best  # the fastest workload: ~4.1 TB/s
    assert floors[id(gemv)] == pytest.approx(gemv.task.min_bytes / rate)
    assert floors[id(gemv)] > 0.5 * gemv.best
    alone = _floors([tuner(gather, 3.8)])
    assert len(alone) == 1 and next(iter(alone.values())) == pytest.approx(3.8e-6)
