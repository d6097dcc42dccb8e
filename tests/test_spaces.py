"""Schedule spaces: every sampled or mutated point applies, builds and computes the right answer,
on several shapes including ones no tile divides; points replay exactly from JSON."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm_ffi
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autosched.search_spaces import InvalidPoint, Knob, Space, create_space, point_from_json, point_key
from autosched.task import Task
from autosched.workloads import get_operator, make_workload

from .helpers import check_point

CASES = [
    ("gemm", "m=64,n=64,k=64", "float32", ""),
    ("gemm", "m=97,n=130,k=67", "float32", ""),  # nothing divides
    ("gemm", "m=1,n=96,k=80", "float16", "bias=1,act=silu"),  # decode GEMV shape
    ("batch_matmul", "b=3,m=17,n=33,k=31", "float32", ""),
    ("dequant_gemm", "m=5,n=48,k=96", "float16", "bits=4,group=32"),
    ("rmsnorm", "m=13,n=100", "float32", ""),
    ("softmax", "m=9,n=77", "float16", ""),
    ("rope", "b=1,s=7,h=3,d=16", "float32", ""),
    ("attention", "b=1,h=2,s=13,d=8", "float32", "causal=1"),
    ("attention", "b=1,h=4,hkv=2,s=48,d=16", "float32", "causal=1"),  # blocks of query rows, K transposed
    ("attention", "b=2,h=2,s=16,d=8", "float32", "causal=0"),  # two sequences: the rows space
    ("paged_decode_attention", "b=2,h=4,hkv=2,d=8,ctx=21,page=4", "float32", ""),
    ("moe_gemm", "m=9,e=3,n=40,k=24", "float32", ""),  # a weight gathered per row
    ("add_rmsnorm", "m=5,n=100", "float32", ""),  # two outputs
    ("dequant_gemm", "m=3,n=40,k=96", "float16", "bits=4,group=32,zeros=1"),  # int4 zero points (asymmetric)
    ("dequant_gemm", "m=2,n=40,k=80", "float16", "bits=8,group=80,fmt=e4m3"),  # float8 E4M3 codes, per channel
]

SETTINGS = settings(max_examples=4, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def _task_space(case, target):
    op, shape, dtype, attrs = case
    task = Task.from_workload(make_workload(op, shape, dtype, attrs))
    return task, task.space(target)


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
@SETTINGS
@given(seed=st.integers(0, 2**31 - 1))
def test_sampled_points_are_correct(case, seed, cpu_target):
    task, space = _task_space(case, cpu_target)
    rng = np.random.default_rng(seed)
    point = space.sample(rng)
    assert space.validate(point) is None
    err = check_point(task, space, point, cpu_target, seed=seed % 1000)
    assert err < task.spec.checker(task.func).tolerance, f"{point}: relative error {err}"


@pytest.mark.parametrize("case", CASES[:6], ids=[f"{c[0]}-{c[1]}" for c in CASES[:6]])
@SETTINGS
@given(seed=st.integers(0, 2**31 - 1))
def test_mutated_points_stay_valid_and_correct(case, seed, cpu_target):
    task, space = _task_space(case, cpu_target)
    rng = np.random.default_rng(seed)
    point = space.sample(rng)
    child = space.mutate(point, rng)
    # Every case here has knobs with several choices, so a valid neighbour always exists.
    assert child is not None, f"no mutation of {point}"
    assert child != point and space.validate(child) is None
    err = check_point(task, space, child, cpu_target)
    assert err < task.spec.checker(task.func).tolerance


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_default_point_is_valid_and_correct(case, cpu_target):
    task, space = _task_space(case, cpu_target)
    point = space.default()
    assert space.validate(point) is None
    assert check_point(task, space, point, cpu_target) < task.spec.checker(task.func).tolerance


def test_points_replay_exactly_from_json(cpu_target):
    task, space = _task_space(CASES[1], cpu_target)
    point = space.sample(np.random.default_rng(3))
    again = point_from_json(point_key(point))
    assert again == point
    assert tvm_ffi.structural_equal(space.apply(point), space.apply(again))


def test_invalid_points_are_rejected_with_a_reason(cpu_target):
    task, space = _task_space(CASES[0], cpu_target)
    with pytest.raises(InvalidPoint, match="missing"):
        space.apply({"tile_i": (1, 1, 1)})
    point = space.default()
    point["unroll"] = 12345
    assert "not one of its choices" in space.validate(point)
    # A register tile larger than the register file is refused by the space's constraints.
    point = dict(space.default(), tile_i=(1, 1, 16), tile_j=(1, 1, 64))
    reason = space.check(point)
    assert reason and "vector registers" in reason


def test_space_is_chosen_by_structure_for_foreign_functions(cpu_target):
    """A function without an operator (as Relax produces) finds its family by structure."""
    for op, family in [("gemm", "matmul"), ("softmax", "rows"), ("rope", "injective")]:
        wl = make_workload(op, "m=8,n=8,k=8" if op == "gemm" else ("m=4,n=8" if op == "softmax" else "s=2,h=2,d=8"))
        func = get_operator(op).build(wl)
        assert create_space(Task.from_func("f", func).func, cpu_target).name == family


def test_sampling_is_reproducible(cpu_target):
    _, space = _task_space(CASES[1], cpu_target)
    a = [space.sample(np.random.default_rng(7)) for _ in range(3)]
    b = [space.sample(np.random.default_rng(7)) for _ in range(3)]
    assert a == b


class _SplitSpace(Space):
    """A one-knob space over an elementwise function, whose ``schedule`` can be made wrong on purpose."""

    name = "split-test"
    typo = False

    def __init__(self, func, target, hints=None):
        super().__init__(func, target, hints)
        self.knobs = [Knob("split", (3, 4, 8))]

    def schedule(self, sch, point):
        i, _ = sch.get_loops(sch.get_sblock("B"))
        factor = point["spilt" if self.typo else "split"]
        # 3 does not divide 64: the explicit factors [3, 3] do not cover the loop, which TVM refuses.
        sch.split(i, [factor, factor] if factor == 3 else [None, factor])


def test_a_space_without_valid_points_says_so(cpu_target):
    """No knob combination passes check and the space has no default of its own: sampling and the default
    both raise InvalidPoint with the reason (the sampler's fallback to the default point does not loop)."""

    class _Empty(_SplitSpace):
        def check(self, point):
            return "no split fits"

    space = _Empty(_split_space(cpu_target, typo=False).func, cpu_target)
    with pytest.raises(InvalidPoint, match="no split fits"):
        space.sample(np.random.default_rng(0))
    with pytest.raises(InvalidPoint, match="no split fits"):
        space.default()


def _split_space(cpu_target, typo: bool) -> _SplitSpace:
    from tvm import te

    a = te.placeholder((64, 64), "float32", name="A")
    b = te.compute((64, 64), lambda i, j: a[i, j] * 2, name="B")
    space = _SplitSpace(te.create_prim_func([a, b]), cpu_target)
    space.typo = typo
    return space


def test_a_point_tvm_refuses_is_an_invalid_point_with_the_reason(cpu_target):
    space = _split_space(cpu_target, typo=False)
    assert space.apply({"split": 4}) is not None
    with pytest.raises(InvalidPoint, match="ScheduleError.*product of factors"):
        space.apply({"split": 3})


def test_a_bug_in_a_space_is_raised_not_recorded(cpu_target):
    """Regression: Space.apply turned KeyError into InvalidPoint, so a misspelled knob in schedule() ended a
    search with "no new valid points left in the space" instead of failing."""
    from autosched.cost_model import FeatureExtractor, RandomModel
    from autosched.search import EvolutionarySearch

    space = _split_space(cpu_target, typo=True)
    with pytest.raises(KeyError, match="spilt"):
        space.apply({"split": 4})
    search = EvolutionarySearch(space, RandomModel(), FeatureExtractor(cpu_target), seed=0)
    with pytest.raises(KeyError, match="spilt"):
        search.propose(2)
    assert not search.rejected


@pytest.mark.parametrize("op", ["rmsnorm", "softmax"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_rows_no_vector_divides_keep_their_vectorised_reduction(op, dtype, cpu_target):
    """Regression: at n = 777 the rows space fell back to a scalar reduction (7x slower per element than
    n = 768) while the point, and so `show` and `db best`, said rfactor=True, vector=16; rfactor over the
    guarded split then lost its guard in compute_at and read past the row."""
    import tvm
    from tvm import s_tir, tirx

    task, space = _task_space((op, "m=5,n=777", dtype, ""), cpu_target)
    for vec in (4, 8, 16, 32):
        point = dict(space.default(), vector=vec, rfactor=True)
        mod = space.apply(point)
        sch = s_tir.Schedule(mod)
        rf = [b for b in sch.get_child_blocks(sch.get_sblock("root")) if sch.get(b).name_hint.endswith("_rf")]
        assert rf, f"vector={vec}: no rfactor block"
        assert check_point(task, space, point, cpu_target) < task.spec.checker(task.func).tolerance, f"vector={vec}"
    # Lowered with the space's pass options, the reduction runs on whole vectors plus one shorter tail vector.
    point = dict(space.default(), vector=16, rfactor=True)
    mod = space.apply(point)
    with tvm.transform.PassContext(opt_level=3, config=space.build_config(point)):
        lowered = tvm.ir.transform.Sequential([
            s_tir.transform.LowerInitBlock(), s_tir.transform.ConvertBlocksToOpaque(), s_tir.transform.LowerOpaqueBlock(),
            tirx.transform.FlattenBuffer(), s_tir.transform.LoopPartition(), tirx.transform.VectorizeLoop(True)])(mod)
    text = lowered.script()
    assert re.search(r"_rf\[.*\] = .*T\.Ramp\([^)]*, 1, 16\)", text), "the partial sums are not 16-wide vectors"
    assert re.search(r"_rf\[.*\] = .*T\.Ramp\([^)]*, 1, 9\)", text), "the 9-element tail is not one vector"
    assert "_s in" not in text, "a loop was scalarised"


def test_cpu_attention_runs_in_blocks_of_query_rows_for_one_sequence(cpu_target):
    """One sequence: the blocked space (whole-head row blocks, so the blocks divide the query length);
    two: the rows space, since TVM cannot place the stages under a block of the fused batch loop."""
    _, space = _task_space(CASES[9], cpu_target)
    assert space.name == "cpu_attention" and space.knobs[0].choices == (6, 8, 12, 16, 24, 48)
    assert _task_space(CASES[10], cpu_target)[1].name == "rows"


def test_cpu_attention_keeps_register_tiles_over_the_reductions(cpu_target):
    """tile_rows=8: QKᵀ and PV each load a K (V) vector once for 8 rows' accumulators, their inits
    hoisted out of the reduction, and the result is right; a tile that does not divide the block is
    refused with its reason."""
    task, space = _task_space(CASES[9], cpu_target)
    point = {**space.default(), "rows_per_task": 24, "tile_rows": 8, "vector": 8}
    text = space.apply(point).script()
    assert "qk_init" in text and "pv_init" in text
    assert re.search(r"for ax4 in range\(16\):\s+for \w+ in T\.unroll\(8\):", text), "no 8-row tile under QKᵀ's reduction"
    assert check_point(task, space, point, cpu_target) < task.spec.checker(task.func).tolerance
    assert "does not divide rows_per_task" in space.validate({**point, "rows_per_task": 6})


@pytest.mark.slow
def test_dequant_gemm_with_zero_points_tunes_on_the_cpu(tmp_path):
    """``autosched tune dequant_gemm --attrs ...,zeros=1``: the generated matmul space follows the TE with its
    zero-point input, every candidate passes the float64 check, and the record is keyed with zeros=1."""
    import json

    from .helpers import cli

    out = json.loads(cli("tune", "dequant_gemm", "--shape", "m=3,n=40,k=96", "--dtype", "float16", "--attrs",
                         "bits=4,group=32,zeros=1", "--trials", "4", "--batch-size", "4", "--db", str(tmp_path / "t.db"),
                         "--format", "json").stdout)
    assert out["space"].startswith("matmul@") and out["attrs"]["zeros"] == 1
    assert out["failures"] == {} and out["latency_us"] > 0
