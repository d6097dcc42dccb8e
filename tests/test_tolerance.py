"""A candidate's check fits the precision it computes in: half-precision GEMMs over a long reduction and a
half-precision LM head written as float32 pass at their default points, and a kernel that is off by 2% fails.

(Tuning generation's decode step on the GPU once rejected every candidate: an fp16 product accumulated
in fp16 over K = 11008 was judged at fp16's output tolerance, an fp16 LM head cast to float32 at float32's.)"""

from __future__ import annotations

import pytest
import tvm
from tvm import te

from autosched.measure import MeasureConfig, Measurer
from autosched.task import SELF_CHECK_TOLERANCE, Task, precision_tolerance
from autosched.workloads import make_workload

K = 11008


def _product(m: int, n: int, k: int, accumulate: str, out: str, scale: float = 1.0):
    """x[m, k] · W[n, k]ᵀ of fp16 operands, summed in ``accumulate`` and written as ``out`` (times ``scale``)."""
    a = te.placeholder((m, k), "float16", name="A")
    b = te.placeholder((n, k), "float16", name="B")
    r = te.reduce_axis((0, k), name="k")
    acc = te.compute((m, n), lambda i, j: te.sum(a[i, r].astype(accumulate) * b[j, r].astype(accumulate), axis=r),
                     name="matmul")
    c = te.compute((m, n), lambda i, j: (acc[i, j] * scale).astype(out), name="C")
    return te.create_prim_func([a, b, c])


def test_tolerance_follows_the_precision_computed_in_not_the_output_dtype():
    # fp16 operands written as float32 carry fp16's error: not float32's 1e-4.
    assert precision_tolerance(_product(1, 64, 4096, "float32", "float32")) == SELF_CHECK_TOLERANCE["float16"]
    # A sum of K = 11008 terms kept in fp16 drifts by about u·√K: far past fp16's output rounding.
    drifting = precision_tolerance(_product(1, 64, K, "float16", "float16"))
    assert 0.04 < drifting < 0.06
    # Float32 throughout stays at float32's tolerance, however long the sum.
    a = te.placeholder((4, K), "float32", name="A")
    r = te.reduce_axis((0, K), name="k")
    total = te.compute((4,), lambda i: te.sum(a[i, r], axis=r), name="total")
    assert precision_tolerance(te.create_prim_func([a, total])) == SELF_CHECK_TOLERANCE["float32"]


@pytest.fixture(scope="module")
def measurer(cpu_target):
    with Measurer(cpu_target, MeasureConfig(repeat=1, min_repeat_ms=1), build_workers=1) as m:
        yield m


@pytest.mark.slow
def test_half_precision_products_pass_at_their_default_points_and_a_wrong_one_fails(cpu_target, measurer):
    """Checked and run for real on this CPU: each kernel's default point against its reference."""
    accumulated_in_half = Task.from_func("decode_gemm", _product(1, 64, K, "float16", "float16"))
    lm_head = Task.from_func("lm_head", _product(1, 256, 4096, "float16", "float32"))
    gemm = Task.from_workload(make_workload("gemm", {"m": 4, "n": 64, "k": K}, "float16"))
    for task in (accumulated_in_half, lm_head, gemm):
        (result,) = measurer.measure(task.spec, [task.space(cpu_target).default()])
        assert result.ok, f"{task.name}: {result.error_msg}"
    # The gemm workload's reference is float64 torch: a kernel 2% off is wrong.
    point = gemm.space(cpu_target).default()
    off = tvm.IRModule({"main": _product(4, 64, K, "float32", "float16", scale=1.02)})
    (wrong,) = measurer.measure(gemm.spec, [point], modules=[off])
    assert wrong.error_kind == "wrong_result" and "relative error" in wrong.error_msg
