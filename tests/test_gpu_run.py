"""GPU spaces on a real GPU: sampled kernels of every CUDA space are correct against torch, and a short
tuning run stores records that carry the GPU's name and driver. Skipped without a CUDA device."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from autosched.measure import MeasureConfig, Measurer
from autosched.task import Task
from autosched.workloads import make_workload

from .test_gpu_spaces import CASE_IDS, CASES

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def measurers(gpu_target):
    """A measurer per architecture: code for older GPUs (sm_80) runs on the H200 too. These tests check
    results, not speed, in many processes at once: tuning's build and run limits (a minute, half a minute)
    would fail a correct kernel on a loaded machine, so the limits here are the test's own."""
    made = {}

    def get(arch):
        if arch not in made:
            target = dataclasses.replace(gpu_target, arch=arch)
            made[arch] = (target, Measurer(target, MeasureConfig.for_target(target, repeat=3, build_timeout=240,
                                                                                run_timeout=240)))
        return made[arch]

    yield get
    for _, m in made.values():
        m.close()


def valid_points(space, candidates: list[dict]) -> list[dict]:
    """The candidates that ``space`` accepts, each once, in order."""
    return [p for i, p in enumerate(candidates) if space.validate(p) is None and p not in candidates[:i]]


def assert_correct(measurer, task, points: list[dict], label: str = "") -> None:
    """Every point of ``task`` built and run on the GPU, each matching its float64 reference."""
    for point, res in zip(points, measurer.measure(task.spec, points)):
        assert res.ok, f"{label} {point}: {res.error_kind}: {res.error_msg}".lstrip()


@pytest.mark.parametrize("op,shape,dtype,attrs,space_name,arch", CASES, ids=CASE_IDS)
def test_sampled_kernels_are_correct_on_the_gpu(op, shape, dtype, attrs, space_name, arch, measurers):
    target, measurer = measurers(arch)
    task = Task.from_workload(make_workload(op, shape, dtype, attrs))
    space = task.space(target)
    assert space.name == space_name
    rng = np.random.default_rng(1)
    points = [space.default()] + [space.sample(rng) for _ in range(3)]
    results = measurer.measure(task.spec, points)
    assert results[0].ok, f"default point failed: {results[0].error_kind}: {results[0].error_msg}"
    for point, res in zip(points, results):
        # A sampled point may fail to build (e.g. too many registers), but never with a wrong answer.
        assert res.error_kind != "wrong_result", f"{point}: {res.error_msg}"


def test_split_k_across_a_cluster_is_correct_on_the_gpu(measurers):
    """A decode GEMM (m = 16) whose tiles are split over K between the CTAs of a cluster (2 and 4), with a
    bias and an odd K-step count per CTA, against the same kernel unsplit: every point checks out."""
    target, measurer = measurers("sm_90")
    task = Task.from_workload(make_workload("gemm", "m=16,n=1024,k=1344", "float16", "bias=1"))
    space = task.space(target)
    base = {"consumers": 1, "wg_rows": 64, "block_n": 64, "stages": 4, "group_m": 1, "persistent": False,
            "pingpong": False, "multicast": "none"}
    points = [{**base, "split_k": split, "swap_ab": False} for split in (1, 2, 4)]
    # Swapped operands (Cᵀ = B·Aᵀ, the tokens on wgmma's N side), alone and with split-K.
    points += [{**base, "block_n": bn, "split_k": split, "swap_ab": True} for bn in (16, 32) for split in (1, 2)]
    assert all(space.validate(p) is None for p in points)
    results = measurer.measure(task.spec, points)
    for point, res in zip(points, results):
        assert res.ok, f"{point}: {res.error_kind}: {res.error_msg}"


def test_whole_wave_block_n_is_correct_on_the_gpu(measurers):
    """block_n 168 (a multiple of 8 that no standard tile uses, chosen to fill whole waves): wgmma n168,
    its TMA box and swizzled stages, and the predicated epilogue where n (11000) is no multiple of it,
    cooperative and ping-pong, with bias and SiLU: every point checks out."""
    target, measurer = measurers("sm_90")
    task = Task.from_workload(make_workload("gemm", "m=500,n=11000,k=200", "float16", "bias=1,act=silu"))
    space = task.space(target)
    base = {"consumers": 2, "wg_rows": 64, "block_n": 168, "group_m": 4, "persistent": True, "split_k": 1,
            "swap_ab": False, "multicast": "none"}
    points = [{**base, "stages": 5, "pingpong": False}, {**base, "stages": 4, "pingpong": True}]
    assert all(space.validate(p) is None for p in points), [space.validate(p) for p in points]
    assert_correct(measurer, task, points)


def test_multicast_pairs_are_correct_on_the_gpu(measurers):
    """TMA multicast in clusters of two: B shared by two row tiles, A by two column tiles, persistent or
    not, with odd tile counts (the last pair's second tile past the edge), bias and GELU: every point
    checks out."""
    target, measurer = measurers("sm_90")
    task = Task.from_workload(make_workload("gemm", "m=2100,n=2056,k=328", "float16", "bias=1,act=gelu"))
    space = task.space(target)
    base = {"consumers": 2, "wg_rows": 64, "block_n": 128, "stages": 4, "group_m": 4, "split_k": 1,
            "swap_ab": False, "pingpong": False}
    points = [space.canonical({**base, "multicast": mc, "persistent": persistent})
              for mc in ("b", "a") for persistent in (False, True)]
    points.append(space.canonical({**base, "multicast": "b", "persistent": True, "block_n": 256, "group_m": 1}))
    assert all(space.validate(p) is None for p in points), [space.validate(p) for p in points]
    assert_correct(measurer, task, points)


def test_swapped_operands_are_correct_at_shapes_no_tile_divides(measurers):
    """Five tokens, an odd n and a K of two and a bit steps: the swapped kernel's zero-filled token rows
    and its per-element transposed stores (with the bias of each output column) check out."""
    target, measurer = measurers("sm_90")
    task = Task.from_workload(make_workload("gemm", "m=5,n=1001,k=136", "float16", "bias=1,act=silu"))
    space = task.space(target)
    base = {"consumers": 1, "wg_rows": 64, "group_m": 1, "persistent": False, "stages": 4, "swap_ab": True,
            "pingpong": False, "multicast": "none"}
    points = [{**base, "block_n": 16, "split_k": 1}, {**base, "block_n": 16, "split_k": 2},
              {**base, "wg_rows": 128, "block_n": 32, "split_k": 1}]
    assert all(space.validate(p) is None for p in points)
    assert_correct(measurer, task, points)



def test_streaming_mma_gemv_is_correct_on_the_gpu(measurers):
    """hopper_gemm's streaming mma.sync kernel for decode steps: Llama-2-7B's batch-16 projections (QKV, and the
    down projection's k = 11008, whose warps' shares of the steps are uneven), 2 and 9 rows (a partial n8 tile),
    n that no block of 16-row tiles divides, bias and SiLU, bf16, and swiglu_gemm's gate and up tiles (9 to 16 rows:
    fewer are swiglu_gemv's); blocks of 1 to 8 warps, 1 to 4 tiles, 1 to 4 steps in flight: every point matches the
    float64 reference."""
    target, measurer = measurers("sm_90")
    cases = (("gemm", "m=16,n=12288,k=4096", "float16", ""), ("gemm", "m=16,n=4096,k=11008", "float16", ""),
             ("gemm", "m=2,n=1000,k=1024", "bfloat16", "bias=1,act=silu"), ("gemm", "m=9,n=4104,k=4096", "float16", ""),
             ("swiglu_gemm", "m=16,n=11008,k=4096", "float16", ""), ("swiglu_gemm", "m=12,n=1000,k=1088", "bfloat16", ""))
    for op, shape, dtype, attrs in cases:
        task = Task.from_workload(make_workload(op, shape, dtype, attrs))
        space = task.space(target)
        assert space.name == "hopper_gemm"
        points = [next(p for p in space.first_points() if p["stream"])] + [
            space.canonical({**space.wgmma_default(), "stream": True, "stream_warps": w, "stream_tiles": t, "stream_unroll": u})
            for w, t, u in ((8, 1, 4), (1, 4, 1), (4, 2, 2), (2, 1, 1), (8, 1, 1), (2, 2, 1), (4, 1, 2))]
        points = valid_points(space, points)
        assert len(points) >= 4, shape
        assert_correct(measurer, task, points, f"{op} {shape} {dtype}")


def test_pingpong_consumers_are_correct_on_the_gpu(measurers):
    """Ping-pong: the two consumer warpgroups of a persistent CTA take every other tile (an odd number of
    tiles per CTA included, m and n that no tile divides, bias and GELU): every point checks out."""
    target, measurer = measurers("sm_90")
    base = {"consumers": 2, "persistent": True, "split_k": 1, "swap_ab": False, "pingpong": True, "multicast": "none",
            "group_m": 4}
    cases = {  # tiles per CTA: 1 or 2 (one warpgroup idle in some CTAs), 3 or 4
        "m=1000,n=2056,k=328": [{**base, "wg_rows": 128, "block_n": 128, "stages": 3},
                                {**base, "wg_rows": 64, "block_n": 192, "stages": 5, "group_m": 1}],
        "m=1000,n=1576,k=328": [{**base, "wg_rows": 64, "block_n": 64, "stages": 4}],
    }
    for shape, points in cases.items():
        task = Task.from_workload(make_workload("gemm", shape, "float16", "bias=1,act=gelu"))
        space = task.space(target)
        assert all(space.validate(p) is None for p in points), [space.validate(p) for p in points]
        assert_correct(measurer, task, points, shape)


def test_paged_decode_is_correct_for_every_split_on_the_gpu(measurers):
    """Flash-decoding over a paged cache with GQA (4 query heads per K/V head), a last sequence half as
    long as the others (a partly filled last page), and the pages of a sequence split 1, 2, 4 and 8 ways
    across a cluster, the products on CUDA cores and on tensor cores: every point matches the float64
    reference."""
    target, measurer = measurers("sm_90")
    task = Task.from_workload(make_workload("paged_decode_attention", "b=3,h=8,hkv=2,d=128,ctx=520,page=16",
                                            "float16"))
    space = task.space(target)
    assert space.name == "paged_decode"
    points = [{"warps": 4, "unroll": 4, "split": 1}, {"warps": 2, "unroll": 1, "split": 2},
              {"warps": 8, "unroll": 2, "split": 4}, {"warps": 4, "unroll": 8, "split": 8}]
    # The same on tensor cores (the group's heads as mma.sync's M side): one 16-token tile per step in
    # registers, or rings of 2-8 tiles per warp in shared memory filled by cp.async.
    # With prefetch, the warp's tile one or two steps ahead is fetched into L2 while it computes.
    points = [{**p, "mma": False, "prefetch": 0} for p in points] + [
        {"warps": w, "unroll": u, "split": split, "mma": True, "prefetch": pf}
        for w, u, split, pf in ((4, 1, 1, 0), (2, 1, 2, 0), (8, 1, 4, 0), (4, 1, 8, 0), (4, 4, 1, 0), (2, 2, 2, 0),
                                (2, 8, 4, 0), (8, 1, 2, 1), (4, 1, 1, 2), (2, 1, 8, 2))]
    # Registers capped for two to four CTAs per SM (the tensor-core loop spills at 128).
    points = [{**p, "ctas_per_sm": 1} for p in points] + [
        {"warps": w, "unroll": u, "split": split, "mma": mma, "prefetch": pf, "ctas_per_sm": ctas}
        for w, u, split, mma, pf, ctas in ((8, 1, 4, True, 1, 2), (4, 1, 8, True, 1, 4), (4, 1, 4, True, 1, 3),
                                           (4, 4, 2, False, 0, 2))]
    # The TMA loop: a producer warp feeding rings of 4-16 pages, the products transposed.
    points = [{**p, "tma_stages": 0} for p in points] + [tma_point(w, split, st, ctas)
                                                          for w, split, st, ctas in ((4, 1, 4, 1), (2, 2, 8, 1),
                                                                                     (8, 4, 16, 1), (4, 8, 4, 2))]
    assert all(space.validate(p) is None for p in points), [space.validate(p) for p in points]
    assert_correct(measurer, task, points)
    # bf16, head dim 64, eight query heads per K/V head, on tensor cores; pages of 32 tokens.
    task = Task.from_workload(make_workload("paged_decode_attention", "b=2,h=32,hkv=4,d=64,ctx=300,page=16",
                                            "bfloat16"))
    points = [{"warps": 4, "unroll": u, "split": split, "mma": True, "prefetch": pf, "ctas_per_sm": ctas,
               "tma_stages": 0} for u, split, pf, ctas in ((2, 1, 0, 1), (1, 4, 0, 1), (1, 2, 1, 1), (1, 4, 1, 4))]
    points += [tma_point(w, split, st, 1) for w, split, st in ((4, 1, 4), (2, 4, 8), (8, 2, 16))]
    assert all(task.space(target).validate(p) is None for p in points)
    assert_correct(measurer, task, points, "bf16 d=64")
    task = Task.from_workload(make_workload("paged_decode_attention", "b=3,h=8,hkv=2,d=128,ctx=520,page=32",
                                            "float16"))
    points = [tma_point(4, 2, 4, 1), tma_point(2, 1, 8, 1)]
    assert all(task.space(target).validate(p) is None for p in points)
    assert_correct(measurer, task, points, "page 32")


def tma_point(warps: int, split: int, stages: int, ctas_per_sm: int) -> dict:
    """A point of paged_decode's TMA loop."""
    return {"warps": warps, "unroll": 1, "split": split, "mma": True, "prefetch": 0, "ctas_per_sm": ctas_per_sm,
            "tma_stages": stages}


def test_int4_gemv_half_products_are_correct_on_the_gpu(measurers):
    """int4 decode GEMVs with the products taken in half2: one row and five, groups of 128 and 32, a bias
    and SiLU, every block shape, unrolled or not, against the float64 reference."""
    target, measurer = measurers("sm_90")
    for shape, attrs in (("m=1,n=1000,k=4096", "bits=4,group=128"), ("m=5,n=300,k=352", "bits=4,group=32,bias=1,act=silu")):
        task = Task.from_workload(make_workload("dequant_gemm", shape, "float16", attrs))
        space = task.space(target)
        assert space.name == "int4_gemv"
        mma = {"mma": False} if any(knob.name == "mma" for knob in space.knobs) else {}
        points = [{"warps": w, "rows_per_warp": r, "unroll": u, "half_products": True} | mma
                  for w in (1, 4) for r in (1, 2, 4) for u in (False, True)]
        points = valid_points(space, points)
        assert len(points) >= 6
        assert_correct(measurer, task, points, shape)


def test_int4_gemv_pipelined_rows_are_correct_on_the_gpu(measurers):
    """int4 decode GEMVs on CUDA cores with a warp's rows in pipelined groups (``row_groups``): Llama-2-7B's QKV
    projection at one row, five rows with zero points, bias and SiLU over a k whose last step has fewer than 32
    chunks, bf16; products in half2 and fp32; 2 to 8 groups a warp, and one group with its loads first
    (``loads_first``), the last block's rows past n: every point matches the float64 reference."""
    target, measurer = measurers("sm_90")
    cases = (("m=1,n=12288,k=4096", "bits=4,group=128", "float16"),
             ("m=5,n=1000,k=1152", "bits=4,group=128,zeros=1,bias=1,act=silu", "float16"),
             ("m=3,n=300,k=640", "bits=4,group=32", "bfloat16"))
    for shape, attrs, dtype in cases:
        task = Task.from_workload(make_workload("dequant_gemm", shape, dtype, attrs))
        space = task.space(target)
        assert space.name == "int4_gemv"
        halves = (False, True) if dtype == "float16" else (False,)
        points = [space.canonical(space.fp32_default() | {"warps": w, "rows_per_warp": r, "row_groups": g,
                                                          "loads_first": g == 1}
                                  | ({"half_products": h} if dtype == "float16" else {}))
                  for w, r, g in ((4, 2, 4), (1, 1, 8), (2, 2, 2), (4, 1, 2), (1, 4, 1), (4, 2, 1)) for h in halves]
        points = valid_points(space, points)
        assert len(points) >= 6 and any(p["loads_first"] for p in points), shape
        assert_correct(measurer, task, points, f"{shape} {attrs} {dtype}")


def test_int4_gemv_on_tensor_cores_is_correct_on_the_gpu(measurers):
    """The int4 decode GEMV on mma.sync, its weights bulk-copied into shared memory: one activation row and
    eight, n that no 16-row tile divides, groups of 128 and 256, a bias and SiLU; warps splitting k from 1
    to 8 (unevenly where they do not divide it), 1 to 4 tiles per block: every point matches the float64
    reference."""
    target, measurer = measurers("sm_90")
    for shape, attrs in (("m=1,n=1000,k=4096", "bits=4,group=128"), ("m=8,n=300,k=1024", "bits=4,group=256"),
                         ("m=3,n=72,k=640", "bits=4,group=128,bias=1,act=silu")):
        task = Task.from_workload(make_workload("dequant_gemm", shape, "float16", attrs))
        space = task.space(target)
        assert space.name == "int4_gemv"
        points = [{"warps": w, "rows_per_warp": r, "unroll": False, "half_products": False, "mma": True}
                  for w, r in ((1, 1), (4, 1), (8, 1), (2, 2), (4, 4), (1, 4))]
        points = valid_points(space, points)
        assert len(points) >= 5, shape
        assert_correct(measurer, task, points, shape)


@pytest.mark.gpu
def test_int4_gemv_of_16_rows_on_tensor_cores_is_correct_on_the_gpu(measurers):
    """A decode step of 9 to 16 rows (a batch of 16) on the tensor-core kernel, two n8 tiles of activation rows: a
    Llama-2-7B layer's projections at 16 rows (4096x4096, the up projection's 22016 rows, the down projection's k =
    11008), 11 and 9 rows (a partial second tile), zero points, groups of 256, n that no 16-row tile divides, a bias
    and SiLU; warps splitting k from 1 to 8, 1 to 4 tiles per block, and the default: every point matches the float64
    reference, and the CUDA-core points are refused."""
    target, measurer = measurers("sm_90")
    cases = (("m=16,n=4096,k=4096", "bits=4,group=128"), ("m=16,n=22016,k=4096", "bits=4,group=128"),
             ("m=16,n=4096,k=11008", "bits=4,group=128,zeros=1"), ("m=11,n=300,k=1024", "bits=4,group=256,bias=1,act=silu"),
             ("m=9,n=72,k=640", "bits=4,group=128,zeros=1,bias=1,act=silu"))
    for shape, attrs in cases:
        task = Task.from_workload(make_workload("dequant_gemm", shape, "float16", attrs))
        space = task.space(target)
        assert space.name == "int4_gemv"
        assert space.validate({"warps": 4, "rows_per_warp": 1, "unroll": True, "half_products": False, "mma": False})
        points = [space.default()] + [{"warps": w, "rows_per_warp": r, "unroll": False, "half_products": False,
                                        "mma": True} for w, r in ((1, 1), (8, 1), (2, 2), (4, 4), (1, 4))]
        points = valid_points(space, points)
        assert len(points) >= 4, shape
        assert_correct(measurer, task, points, f"{shape} {attrs}")


def test_int4_gemv_streamed_into_tensor_cores_is_correct_on_the_gpu(measurers):
    """The int4 tensor-core kernel with its weights streamed from global memory into registers (``stream``): one row
    (Llama-2-7B's up projection), 16 (its down projection's k = 11008, with zero points) and 9 (a partial second n8
    tile), n that no 16-row tile divides, a bias and SiLU; warps splitting k from 1 to 8, 1 to 4 tiles per block,
    four k-blocks' loads in flight or one: every point matches the float64 reference."""
    target, measurer = measurers("sm_90")
    cases = (("m=1,n=11008,k=4096", "bits=4,group=128"), ("m=16,n=4096,k=11008", "bits=4,group=128,zeros=1"),
             ("m=9,n=300,k=1024", "bits=4,group=256,bias=1,act=silu"), ("m=3,n=72,k=1152", "bits=4,group=128"))
    for shape, attrs in cases:
        task = Task.from_workload(make_workload("dequant_gemm", shape, "float16", attrs))
        space = task.space(target)
        assert space.name == "int4_gemv"
        points = [next(p for p in space.first_points() if p.get("stream"))] + [
            space.canonical(space.default() | {"warps": w, "rows_per_warp": r, "unroll": u, "mma": True, "stream": True})
            for w, r, u in ((1, 1, True), (8, 1, False), (2, 2, True), (4, 4, False), (1, 2, False))]
        points = valid_points(space, points)
        assert len(points) >= 4, shape
        assert_correct(measurer, task, points, f"{shape} {attrs}")


def test_int4_gemv_with_zero_points_is_correct_on_the_gpu(measurers):
    """int4 decode GEMVs with a zero point per group and output channel (zeros=1: asymmetric AWQ/GPTQ): a 4096x4096
    layer's decode steps of one and eight rows, n that no block or 16-row tile divides, groups of 128 and 32, a
    bias and SiLU, fp16 and bf16; on CUDA cores (products in fp32 and, for fp16, in half2) and on tensor cores:
    every point matches the float64 reference."""
    target, measurer = measurers("sm_90")
    cases = (("m=1,n=4096,k=4096", "float16", "bits=4,group=128,zeros=1"),
             ("m=8,n=4096,k=4096", "float16", "bits=4,group=128,zeros=1"),
             ("m=3,n=72,k=640", "float16", "bits=4,group=128,zeros=1,bias=1,act=silu"),
             ("m=5,n=300,k=352", "bfloat16", "bits=4,group=32,zeros=1,bias=1,act=silu"))
    for shape, dtype, attrs in cases:
        task = Task.from_workload(make_workload("dequant_gemm", shape, dtype, attrs))
        space = task.space(target)
        assert space.name == "int4_gemv"
        knobs = {knob.name for knob in space.knobs}
        mma = {"mma": False} if "mma" in knobs else {}
        products = [{"half_products": False}, {"half_products": True}] if "half_products" in knobs else [{}]
        points = [{"warps": w, "rows_per_warp": r, "unroll": u} | h | mma
                  for w, r, u in ((4, 2, True), (1, 4, False), (8, 1, False)) for h in products]
        if mma:
            points += [{"warps": w, "rows_per_warp": r, "unroll": False, "half_products": False, "mma": True}
                       for w, r in ((1, 1), (4, 1), (8, 1), (2, 2), (4, 4))]
        points = valid_points(space, points)
        assert len(points) >= 3, shape
        assert_correct(measurer, task, points, f"{shape} {dtype}")


def test_gemv8_is_correct_on_the_gpu(measurers):
    """8-bit decode GEMVs with a scale per output channel, int8 codes (q8f16) and float8 E4M3 codes (fp8): a 4096x4096
    layer's decode steps of one and eight rows, a down projection (k = 11008: unrolled parts, then a last step for
    half of the lanes), n that no block divides, a bias with SiLU and GELU, fp16 and bf16; blocks of 1 to 8 warps and
    1 to 4 rows per warp, unrolled or not: every point matches the float64 reference."""
    target, measurer = measurers("sm_90")
    cases = (("m=1,n=4096,k=4096", "float16", "bits=8,group=4096"),
             ("m=1,n=4096,k=4096", "bfloat16", "bits=8,group=4096,fmt=e4m3"),
             ("m=8,n=4096,k=4096", "float16", "bits=8,group=4096,fmt=e4m3"),
             ("m=8,n=4096,k=4096", "bfloat16", "bits=8,group=4096,bias=1,act=silu"),
             ("m=1,n=4096,k=11008", "float16", "bits=8,group=11008,fmt=e4m3"),
             ("m=4,n=4096,k=11008", "float16", "bits=8,group=11008"),
             ("m=5,n=1001,k=352", "float16", "bits=8,group=352,fmt=e4m3,bias=1,act=silu"),
             ("m=3,n=300,k=4112", "bfloat16", "bits=8,group=4112,bias=1,act=gelu"))
    for shape, dtype, attrs in cases:
        task = Task.from_workload(make_workload("dequant_gemm", shape, dtype, attrs))
        space = task.space(target)
        assert space.name == "gemv8"
        points = [space.canonical({"warps": w, "rows_per_warp": r, "unroll": u})
                  for w, r, u in ((4, 2, True), (1, 4, False), (8, 1, True), (2, 4, True), (4, 1, False))]
        points = valid_points(space, points)
        assert len(points) >= 4, shape
        assert_correct(measurer, task, points, f"{shape} {dtype} {attrs}")


def test_swiglu_gemv_is_correct_on_the_gpu(measurers):
    """A decode step's SwiGLU in one streaming kernel (swiglu_gemm on swiglu_gemv): Llama-2-7B's gate and up projections
    at one and eight rows, a down-sized layer whose k leaves a last step for part of the lanes (k = 1048), n that no
    block divides, fp16 and bf16; blocks of 1 to 8 warps and 1 to 4 columns per warp, unrolled or not: every point
    matches the float64 reference (SiLU(gate) · up)."""
    target, measurer = measurers("sm_90")
    cases = (("m=1,n=11008,k=4096", "float16"), ("m=1,n=11008,k=4096", "bfloat16"),
             ("m=8,n=11008,k=4096", "bfloat16"), ("m=4,n=14336,k=4096", "float16"),
             ("m=3,n=1001,k=1048", "float16"), ("m=8,n=300,k=4112", "bfloat16"))
    for shape, dtype in cases:
        task = Task.from_workload(make_workload("swiglu_gemm", shape, dtype))
        space = task.space(target)
        assert space.name == "swiglu_gemv"
        points = [space.canonical({"warps": w, "cols_per_warp": c, "unroll": u})
                  for w, c, u in ((4, 1, True), (1, 2, False), (8, 1, True), (2, 4, True), (4, 2, False))]
        points = valid_points(space, points)
        assert len(points) >= 3, shape
        assert_correct(measurer, task, points, f"{shape} {dtype}")


def test_moe_gemv_points_are_correct_on_the_gpu(measurers):
    """gpu_moe_matmul at Mixtral's decode and a prefill's shapes (cut in N): each routed row by its own
    expert's weight, with one to four rows per block, X staged in shared memory or read from global memory,
    narrow and wide loads, fp16, bf16 and fp32: every point matches the float64 reference."""
    target, measurer = measurers("sm_90")
    for shape, dtype in (("m=2,e=8,n=1024,k=4096", "float16"), ("m=64,e=8,n=512,k=1792", "bfloat16"),
                         ("m=12,e=3,n=96,k=160", "float32")):
        task = Task.from_workload(make_workload("moe_gemm", shape, dtype))
        space = task.space(target)
        assert space.name == "gpu_moe_matmul"
        points = [space.default()] + [
            {"outputs_per_block": outs, "rows_per_block": rows, "lanes": lanes, "vector": vec, "stage_x": staged,
             "unroll": 16}
            for outs, rows, lanes, vec, staged in ((1, 1, 32, 1, False), (4, 2, 64, 4, True), (8, 4, 128, 2, True),
                                                   (2, 1, 256, 4, False), (16, 2, 32, 2, True), (2, 4, 32, 1, True))]
        points = valid_points(space, points)
        assert len(points) >= 3, shape
        assert_correct(measurer, task, points, shape)


@pytest.mark.parametrize("shape,dtype", [("m=1024,e=8,n=2048,k=4096", "float16"),  # Mixtral's prefill, cut in n
                                         ("m=4096,e=128,n=1536,k=2048", "bfloat16"),  # Qwen3-MoE's gate and up
                                         ("m=77,e=5,n=130,k=200", "float16")])  # nothing divides
def test_moe_grouped_gemm_points_are_correct_on_the_gpu(shape, dtype, measurers):
    """moe_grouped_gemm (a prefill's routed rows sorted by expert, on mma.sync): the default point and others of
    every row tile, column tile, stage count and warp count match the float64 reference (the workload's random routing:
    experts of many rows, of few, of none)."""
    target, measurer = measurers("sm_90")
    task = Task.from_workload(make_workload("moe_grouped_gemm", shape, dtype))
    space = task.space(target)
    assert space.name == "moe_grouped_gemm"
    points = [space.default()] + [{"block_m": bm, "block_n": bn, "stages": s, "warps": w}
                                  for bm, bn, s, w in ((32, 64, 2, 4), (64, 128, 3, 8), (128, 128, 4, 4),
                                                       (128, 128, 3, 8), (128, 32, 4, 4))]
    points = valid_points(space, points)
    assert len(points) >= 4, shape
    assert_correct(measurer, task, points, shape)


def test_int4_prefill_dequantised_for_wgmma_is_correct_on_the_gpu(measurers):
    """hopper_dequant_gemm: int4 weights dequantised in shared memory for wgmma, fp16 and bf16, a bias and
    SiLU, m and n that no tile divides, groups of 64 and 128, one and two consumers, persistent CTAs: every
    point matches the float64 reference."""
    _check_dequant_wgmma_points(*measurers("sm_90"), (
        ("m=1000,n=1032,k=576", "float16", "bits=4,group=128"),  # a short last group
        ("m=77,n=264,k=192", "bfloat16", "bits=4,group=64,bias=1,act=silu")))


def test_int4_prefill_with_zero_points_is_correct_on_the_gpu(measurers):
    """hopper_dequant_gemm with a zero point per group and output channel (zeros=1: asymmetric AWQ/GPTQ): a
    4096x4096 layer's prefill chunk of 512 rows, m and n that no tile divides, a short last group, groups of 64
    and 128, fp16 and bf16, a bias and SiLU, one and two consumers, persistent CTAs: every point matches the
    float64 reference."""
    _check_dequant_wgmma_points(*measurers("sm_90"), (
        ("m=512,n=4096,k=4096", "float16", "bits=4,group=128,zeros=1"),
        ("m=1000,n=1032,k=576", "float16", "bits=4,group=128,zeros=1"),  # a short last group
        ("m=77,n=264,k=192", "bfloat16", "bits=4,group=64,zeros=1,bias=1,act=silu")))


def _check_dequant_wgmma_points(target, measurer, cases) -> None:
    """hopper_dequant_gemm serves each (shape, dtype, attrs) of ``cases``, and its default point and three
    others (one and two consumers, persistent CTAs), those valid there, match the float64 reference."""
    for shape, dtype, attrs in cases:
        task = Task.from_workload(make_workload("dequant_gemm", shape, dtype, attrs))
        space = task.space(target)
        assert space.name == "hopper_dequant_gemm"
        points = [space.default(),
                  {"consumers": 1, "wg_rows": 64, "block_n": 64, "stages": 2, "group_m": 1, "persistent": False},
                  {"consumers": 2, "wg_rows": 64, "block_n": 128, "stages": 3, "group_m": 4, "persistent": False},
                  {"consumers": 1, "wg_rows": 64, "block_n": 64, "stages": 4, "group_m": 4, "persistent": True}]
        points = [space.canonical(p) for p in points]
        points = valid_points(space, points)
        assert len(points) >= 2, shape
        assert_correct(measurer, task, points, f"{shape} {dtype}")


def test_fp8_gemm_on_fp8_tensor_cores_is_correct_on_the_gpu(measurers):
    """hopper_fp8_gemm (wgmma's e4m3 form, per-token and per-channel scales in the epilogue) against the float64
    reference, A's and W's first rows holding every finite E4M3FN code: a 512-token prefill chunk of a 4096x4096
    layer with promotion (each 128-code stage's sums added in fp32), cooperative, ping-pong, persistent, multicast;
    m, n and k that no tile divides with bias and SiLU in bf16, promoted or not; a decode step's few rows with
    swapped operands and split-K. Every point matches."""
    target, measurer = measurers("sm_90")
    prefill = {"consumers": 2, "wg_rows": 64, "block_n": 128, "stages": 4, "group_m": 4, "persistent": False,
               "split_k": 1, "swap_ab": False, "pingpong": False, "multicast": "none", "promote": True}
    cases = {
        ("m=512,n=4096,k=4096", "float16", ""): [
            None, prefill, {**prefill, "block_n": 192, "stages": 5, "persistent": True, "pingpong": True},
            {**prefill, "multicast": "b", "persistent": True, "block_n": 64, "stages": 8},
            {**prefill, "consumers": 1, "wg_rows": 128, "block_n": 64, "stages": 6}],
        ("m=1000,n=1001,k=336", "bfloat16", "bias=1,act=silu"): [
            None, {**prefill, "promote": False, "block_n": 256}, {**prefill, "multicast": "a"},
            {**prefill, "persistent": True, "pingpong": True, "block_n": 64, "promote": False}],
        ("m=5,n=1001,k=272", "float16", "bias=1"): [
            None, {**prefill, "consumers": 1, "block_n": 16, "group_m": 1, "swap_ab": True, "stages": 6},
            {**prefill, "consumers": 1, "block_n": 16, "group_m": 1, "swap_ab": True, "split_k": 2, "promote": False},
            {**prefill, "consumers": 1, "block_n": 64, "group_m": 1, "split_k": 2}],
    }
    for (shape, dtype, attrs), points in cases.items():
        task = Task.from_workload(make_workload("fp8_gemm", shape, dtype, attrs))
        space = task.space(target)
        assert space.name == "hopper_fp8_gemm"
        points = [space.canonical(space.default() if p is None else p) for p in points]
        assert all(space.validate(p) is None for p in points), [space.validate(p) for p in points]
        assert_correct(measurer, task, points, f"{shape} {dtype}")


def test_fp8_quant_rows_is_correct_on_the_gpu(measurers):
    """fp8_quant_rows on gpu_rows (its default and points across warps, vectors, unrolling and a staged input)
    against the float64 reference, whose first rows are a zero row, one past 448 reaching E4M3's subnormals and
    one of exact ties: every code the reference's (one step off only within float32's rounding of a tie), every
    scale within float32's rounding. A 512-token chunk of a 4096-wide layer, an 11008-wide one in bf16, a short
    row no vector divides."""
    target, measurer = measurers("sm_90")
    for shape, dtype in (("m=512,k=4096", "float16"), ("m=64,k=11008", "bfloat16"), ("m=9,k=1001", "float16")):
        task = Task.from_workload(make_workload("fp8_quant_rows", shape, dtype))
        space = task.space(target)
        assert space.name == "gpu_rows"
        points = [space.default(), {"warps": 4, "vector": 1, "unroll": 0, "stage_input": False},
                  {"warps": 16, "vector": 2, "unroll": 64, "stage_input": True},
                  {"warps": 32, "vector": 4, "unroll": 256, "stage_input": False}]
        assert_correct(measurer, task, points, f"{shape} {dtype}")


def test_a_w8a8_projection_of_a_prefill_chunk_is_correct_on_the_gpu(gpu_target, tmp_path):
    """What an fp8 build's prefill chunk runs for one projection, on the GPU at the spaces' default points: a
    512-token chunk of float16 activations (a zero row, an outlier row) quantised per token by fp8_quant_rows,
    then fp8_gemm on those codes and the layer's E4M3 weight codes (--quantize fp8's, float16 scales per output
    channel cast to float32). Against the float64 product of the same per-token quantisation: within float16's
    tolerance; against weight-only fp8 (the activations unquantised): within 5% (E4M3's rounding of the
    activations, about 2^-4/√3 of each)."""
    import torch
    import tvm

    from autosched.generation.quantize import quantize_weight
    from autosched.target import compile_module
    from autosched.workloads import get_operator

    from .helpers import dequantize_weight
    from .test_quantize import _quantize_rows

    target = dataclasses.replace(gpu_target, arch="sm_90")
    m, n, k = 512, 4096, 4096
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((m, k), generator=gen).half()
    x[0] = 0
    x[1, ::7] *= 300
    codes_w, scales_w = quantize_weight(torch.randn((n, k), generator=gen) / k**0.5, "fp8", "float16")

    def kernel(op, shape, name):
        task = Task.from_workload(make_workload(op, shape, "float16"))
        space = task.space(target)
        assert space.name == name
        point = space.default()
        path = str(tmp_path / f"{op}.so")
        compile_module(space.apply(point), target, space.build_config(point), space.codegen).export_library(path)
        return tvm.runtime.load_module(path)["main"]

    quant = kernel("fp8_quant_rows", f"m={m},k={k}", "gpu_rows")
    gemm = kernel("fp8_gemm", f"m={m},n={n},k={k}", "hopper_fp8_gemm")
    dev = torch.device("cuda")
    codes_a = torch.full((m, k), 0xFF, dtype=torch.uint8, device=dev)
    scale_a = torch.full((m,), float("nan"), device=dev)
    out = torch.full((m, n), float("nan"), dtype=torch.float16, device=dev)
    args = [x.to(dev), codes_a, scale_a]
    quant(*[tvm.runtime.from_dlpack(t) for t in args])
    args = [codes_a, codes_w.to(dev), scale_a, scales_w.float().reshape(n).to(dev), out]
    gemm(*[tvm.runtime.from_dlpack(t) for t in args])
    torch.cuda.synchronize()
    wl = make_workload("fp8_quant_rows", f"m={m},k={k}", "float16")
    refs = get_operator("fp8_quant_rows").reference(wl, [x])
    assert get_operator("fp8_quant_rows").errors(wl, [x], [codes_a.cpu(), scale_a.cpu()], refs)[0] == 0
    w = dequantize_weight(codes_w, scales_w, "fp8", k, "float16")
    w8a8, weight_only = _quantize_rows(x.double()) @ w.T, x.double() @ w.T
    got = out.double().cpu()
    assert not got.isnan().any() and not got[0].any()
    assert float((got - w8a8).norm() / w8a8.norm()) < 4e-3
    assert float((got - weight_only).norm() / weight_only.norm()) < 0.05


@pytest.mark.parametrize("op,shape,dtype,causal", [
    ("attention", "b=1,h=4,hkv=2,s=1000,d=128", "float16", 1), ("attention", "b=2,h=2,s=700,d=128", "bfloat16", 0),
    ("attention", "b=1,h=2,hkv=1,s=300,d=64", "float16", 1), ("attention", "b=1,h=2,s=260,d=256", "bfloat16", 0),
    # the model's layout: rows of a head b·s apart, a batch's last tile reading into the next batch's rows
    ("attention_bshd", "b=2,h=4,hkv=2,s=1000,d=128", "float16", 1),
    ("attention_bshd", "b=3,h=2,s=260,d=256", "bfloat16", 0),
])
def test_overlapped_softmax_attention_is_correct_on_the_gpu(op, shape, dtype, causal, measurers):
    """hopper_attention with the softmax of each KV tile overlapped with the previous tile's P·V: causal
    and not, GQA, lengths no tile divides, head dims 64 to 256, both layouts, against the float64
    reference."""
    target, measurer = measurers("sm_90")
    task = Task.from_workload(make_workload(op, shape, dtype, f"causal={causal}"))
    space = task.space(target)
    points = [{**space.default(), "overlap": True},
              {"consumers": 1, "block_kv": 64, "stages": 3, "overlap": True, "pingpong": False}]
    points = valid_points(space, points)
    assert points
    assert_correct(measurer, task, points)

@pytest.mark.parametrize("shape,dtype,causal", [
    ("b=1,h=4,hkv=2,s=1000,d=128", "float16", 1), ("b=2,h=2,s=700,d=128", "bfloat16", 0),
    ("b=1,h=2,hkv=1,s=300,d=64", "float16", 1), ("b=1,h=2,s=260,d=256", "bfloat16", 0),
])
def test_pingpong_attention_is_correct_on_the_gpu(shape, dtype, causal, measurers):
    """hopper_attention with the two consumers taking turns on the tensor cores (named barriers), alone and
    with the overlapped loop, KV tiles of 64 to 176: causal and not, GQA, lengths no tile divides, head
    dims 64 to 256 (a causal CTA's two warpgroups visit the same tiles, so their turns pair up), against
    the float64 reference."""
    target, measurer = measurers("sm_90")
    task = Task.from_workload(make_workload("attention", shape, dtype, f"causal={causal}"))
    space = task.space(target)
    points = [{"consumers": 2, "block_kv": kv, "stages": 2, "overlap": overlap, "pingpong": True}
              for kv, overlap in ((128, False), (64, False), (128, True), (176, True), (160, False))]
    points = valid_points(space, points)
    assert points
    assert_correct(measurer, task, points)


def test_tuning_on_the_gpu_records_the_device(gpu_target, db_path):
    from autosched.database.store import Database
    from autosched.tuner import TuneOptions, tune

    task = Task.from_workload(make_workload("gemm", "m=512,n=512,k=512", "float16"))
    with Database(db_path) as db:
        result = tune(task, gpu_target, db, TuneOptions(trials=16, batch_size=8))
        assert result.trials == 16 and np.isfinite(result.best_latency)
        row = db.summary()[0]
    assert row["device"] == gpu_target.device_name and row["target"].startswith("cuda:sm_")


@pytest.mark.parametrize("model_name,tokens", [("tiny-llama", 1), ("tiny-llama", 16), ("tiny-llama", 64),
                                               ("small-llama", 80)],
                         ids=["decode-gemv", "decode16-hopper", "prefill-hopper", "prefill-hopper-fused"])
def test_tiny_model_tunes_builds_and_matches_torch_on_the_gpu(gpu_target, tmp_path, model_name, tokens):
    """prefill-hopper-fused: head dim 64 and 80 rows, so attention_bshd and swiglu_gemm (sm_90) run too."""
    import torch

    from autosched.database.store import Database
    from autosched.pipeline import build_model, export_artifact, extract_tasks, load_model, prepare, split_tunable
    from autosched.runmodel import run_artifact
    from autosched.tuner import TuneOptions, tune_tasks

    model = load_model(model_name, tokens=tokens, dtype=torch.float16)
    tasks, _ = split_tunable(extract_tasks(prepare(model, gpu_target)[0]), gpu_target)
    with Database(tmp_path / "model.db") as db:
        tune_tasks(tasks, gpu_target, db, TuneOptions(trials=2 * len(tasks), batch_size=8, seed=0))
        executable, params, report = build_model(model, gpu_target, db)
    # Kernels from the database, the rest from dlight; a record that dlight's schedule beat when both were
    # measured at build time is not used, and is counted among the defaults.
    assert report.tuned or report.slower_than_default
    assert set(report.slower_than_default) <= set(report.default)
    out = export_artifact(tmp_path / "tuned", executable, params, model, gpu_target, report, None)
    result = run_artifact(str(out), repeat=5)
    assert result["matches_torch"] is True, result
