"""GPU spaces without a GPU: sampled points of every CUDA space apply, and the CUDA source TVM
generates for them compiles with nvcc for their architecture (sm_90a for the TIRx wgmma kernels of the
H200, sm_90 or sm_80 for the others). Running them is in test_gpu_run.py."""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from autosched.cuda_tools import cuda_source
from autosched.target import parse_target
from autosched.task import Task
from autosched.workloads import make_workload

from .nvcc import build_for_host, host_output, nvcc_compile, run_on_host

# (op, shape, dtype, attrs, the space the target's architecture gets, architecture)
CASES = [
    ("gemm", "m=256,n=256,k=128", "float16", "", "hopper_gemm", "sm_90"),
    ("gemm", "m=200,n=136,k=72", "bfloat16", "bias=1,act=gelu", "hopper_gemm", "sm_90"),
    ("gemm", "m=300,n=520,k=264", "float16", "act=silu", "hopper_gemm", "sm_90"),
    ("gemm", "m=72,n=1001,k=128", "float16", "bias=1", "hopper_gemm", "sm_90"),  # odd n: GPT-2's LM head
    ("swiglu_gemm", "m=300,n=264,k=192", "float16", "", "hopper_gemm", "sm_90"),
    ("swiglu_gemm", "m=520,n=1000,k=256", "bfloat16", "", "hopper_gemm", "sm_90"),
    ("gemm", "m=256,n=256,k=128", "float16", "", "gpu_matmul", "sm_80"),
    ("gemm", "m=200,n=136,k=72", "bfloat16", "bias=1,act=gelu", "gpu_matmul", "sm_80"),
    ("gemm", "m=64,n=96,k=40", "float32", "", "gpu_matmul", "sm_90"),
    ("batch_matmul", "b=2,m=64,n=64,k=64", "float16", "", "gpu_matmul", "sm_90"),
    ("gemm", "m=1,n=512,k=256", "float16", "", "gpu_gemv", "sm_90"),
    ("dequant_gemm", "m=1,n=256,k=512", "float16", "bits=4,group=128", "gpu_gemv", "sm_80"),
    ("dequant_gemm", "m=1,n=256,k=512", "float16", "bits=4,group=128", "int4_gemv", "sm_90"),
    ("dequant_gemm", "m=3,n=1000,k=352", "bfloat16", "bits=4,group=32,bias=1,act=silu", "int4_gemv", "sm_90"),
    ("dequant_gemm", "m=300,n=512,k=256", "float16", "bits=4,group=128", "hopper_dequant_gemm", "sm_90"),
    ("dequant_gemm", "m=100,n=264,k=192", "bfloat16", "bits=4,group=64,bias=1,act=silu", "hopper_dequant_gemm", "sm_90"),
    # zero points (asymmetric AWQ/GPTQ): the sm_90 int4 templates take them (a 4096x4096 layer's decode steps of
    # one and eight rows, a prefill chunk of 512)...
    ("dequant_gemm", "m=1,n=4096,k=4096", "float16", "bits=4,group=128,zeros=1", "int4_gemv", "sm_90"),
    ("dequant_gemm", "m=8,n=4096,k=4096", "float16", "bits=4,group=128,zeros=1,bias=1,act=silu", "int4_gemv", "sm_90"),
    ("dequant_gemm", "m=5,n=1000,k=352", "bfloat16", "bits=4,group=32,zeros=1", "int4_gemv", "sm_90"),
    # a decode step of 9-16 rows (a batch of 16) in fp16, groups of 128 or more: int4_gemv on tensor cores alone
    ("dequant_gemm", "m=16,n=4096,k=4096", "float16", "bits=4,group=128", "int4_gemv", "sm_90"),
    ("dequant_gemm", "m=11,n=1000,k=640", "float16", "bits=4,group=128,zeros=1,bias=1,act=silu", "int4_gemv", "sm_90"),
    ("dequant_gemm", "m=512,n=4096,k=4096", "float16", "bits=4,group=128,zeros=1", "hopper_dequant_gemm", "sm_90"),
    ("dequant_gemm", "m=80,n=264,k=192", "bfloat16", "bits=4,group=64,zeros=1,bias=1,act=silu", "hopper_dequant_gemm",
     "sm_90"),
    # ... and where the templates decline (9-16 rows in groups of 64, two groups per k step), the generic spaces
    # follow the TE
    ("dequant_gemm", "m=12,n=256,k=512", "float16", "bits=4,group=64,zeros=1", "gpu_gemv", "sm_90"),
    ("dequant_gemm", "m=96,n=264,k=192", "bfloat16", "bits=4,group=32,zeros=1,bias=1,act=silu", "gpu_matmul", "sm_90"),
    # 8-bit weights with a scale per output channel, int8 (q8f16) and float8 E4M3 codes (fp8): decode steps of up to
    # eight rows stream on sm_90 (gemv8: a 4096x4096 layer, an up and a down projection, odd n, a last partial step
    # per lane)...
    ("dequant_gemm", "m=1,n=384,k=512", "float16", "bits=8,group=512,fmt=e4m3", "gemv8", "sm_90"),
    ("dequant_gemm", "m=1,n=4096,k=4096", "bfloat16", "bits=8,group=4096", "gemv8", "sm_90"),
    ("dequant_gemm", "m=1,n=4096,k=11008", "float16", "bits=8,group=11008", "gemv8", "sm_90"),
    ("dequant_gemm", "m=1,n=11008,k=4096", "float16", "bits=8,group=4096,fmt=e4m3", "gemv8", "sm_90"),
    ("dequant_gemm", "m=8,n=4096,k=4096", "bfloat16", "bits=8,group=4096,fmt=e4m3,bias=1,act=silu", "gemv8", "sm_90"),
    ("dequant_gemm", "m=8,n=11008,k=4096", "float16", "bits=8,group=4096,bias=1,act=silu", "gemv8", "sm_90"),
    ("dequant_gemm", "m=5,n=1001,k=352", "float16", "bits=8,group=352,fmt=e4m3,bias=1,act=gelu", "gemv8", "sm_90"),
    ("dequant_gemm", "m=3,n=1001,k=4112", "bfloat16", "bits=8,group=4112", "gemv8", "sm_90"),
    # a decode step's SwiGLU (gate and up projections, SiLU·up) of up to eight rows streams on sm_90 (swiglu_gemv:
    # Llama-2-7B's and a 4096x4096 layer's, n and k that no block or step divides)
    ("swiglu_gemm", "m=1,n=11008,k=4096", "float16", "", "swiglu_gemv", "sm_90"),
    ("swiglu_gemm", "m=8,n=4096,k=4096", "bfloat16", "", "swiglu_gemv", "sm_90"),
    ("swiglu_gemm", "m=3,n=1001,k=1048", "float16", "", "swiglu_gemv", "sm_90"),
    # ... and past eight rows, and on older GPUs, the generic spaces decode them as the TE does
    ("dequant_gemm", "m=12,n=384,k=512", "float16", "bits=8,group=512,fmt=e4m3", "gpu_gemv", "sm_90"),
    ("dequant_gemm", "m=1,n=4096,k=4096", "float16", "bits=8,group=4096", "gpu_gemv", "sm_80"),
    ("dequant_gemm", "m=80,n=264,k=192", "bfloat16", "bits=8,group=192,fmt=e4m3,bias=1", "gpu_matmul", "sm_90"),
    # float8 E4M3 activations and weights (fp8_gemm): wgmma's e4m3 form on sm_90 (a prefill chunk of 512 tokens,
    # shapes no tile divides with bias and SiLU, a decode step's swapped operands), the generic spaces elsewhere
    ("fp8_gemm", "m=512,n=4096,k=4096", "float16", "", "hopper_fp8_gemm", "sm_90"),
    ("fp8_gemm", "m=300,n=1001,k=336", "bfloat16", "bias=1,act=silu", "hopper_fp8_gemm", "sm_90"),
    ("fp8_gemm", "m=16,n=520,k=272", "float16", "bias=1", "hopper_fp8_gemm", "sm_90"),
    ("fp8_gemm", "m=64,n=96,k=128", "float16", "bias=1", "gpu_matmul", "sm_80"),
    # ... and the per-token quantisation of its activations (fp8_quant_rows: amax, then the E4M3 encoding of
    # each element; a zero row, one past 448 into the subnormals, one of ties): a 512-token chunk, a short row
    ("fp8_quant_rows", "m=512,k=4096", "float16", "", "gpu_rows", "sm_90"),
    ("fp8_quant_rows", "m=7,k=1000", "bfloat16", "", "gpu_rows", "sm_90"),
    ("moe_gemm", "m=2,e=8,n=512,k=256", "float16", "", "gpu_moe_matmul", "sm_90"),  # decode: 1 token x 2 experts
    ("moe_gemm", "m=64,e=4,n=384,k=448", "bfloat16", "", "gpu_moe_matmul", "sm_90"),
    ("moe_gemm", "m=24,e=3,n=96,k=160", "float32", "", "gpu_moe_matmul", "sm_80"),
    ("moe_grouped_gemm", "m=1024,e=8,n=4096,k=14336", "bfloat16", "", "moe_grouped_gemm", "sm_90"),  # Mixtral's down
    ("rmsnorm", "m=8,n=1000", "float16", "", "gpu_rows", "sm_90"),
    ("add_rmsnorm", "m=16,n=4096", "float16", "", "gpu_rows", "sm_90"),  # a second output in global memory
    ("softmax", "m=8,n=4096", "float32", "", "gpu_rows", "sm_90"),
    ("rope", "b=1,s=16,h=4,d=64", "float16", "", "gpu_injective", "sm_90"),
    ("paged_decode_attention", "b=2,h=4,hkv=2,d=64,ctx=200,page=16", "float16", "", "gpu_rows", "sm_80"),
    ("paged_decode_attention", "b=2,h=4,hkv=2,d=64,ctx=200,page=16", "float16", "", "paged_decode", "sm_90"),
    ("paged_decode_attention", "b=3,h=8,hkv=1,d=128,ctx=300,page=16", "bfloat16", "", "paged_decode", "sm_90"),
    ("attention", "b=1,h=4,hkv=2,s=100,d=64", "float16", "causal=1", "hopper_attention", "sm_90"),
    ("attention", "b=2,h=4,s=200,d=128", "bfloat16", "causal=0", "hopper_attention", "sm_90"),
    ("attention", "b=1,h=4,hkv=1,s=100,d=96", "float16", "causal=1", "hopper_attention", "sm_90"),
    ("attention", "b=1,h=2,s=150,d=256", "bfloat16", "causal=1", "hopper_attention", "sm_90"),
    ("attention_bshd", "b=2,h=4,hkv=2,s=100,d=64", "float16", "causal=1", "hopper_attention", "sm_90"),
    ("attention_bshd", "b=2,h=4,s=130,d=96", "bfloat16", "causal=0", "hopper_attention", "sm_90"),
    ("attention", "b=1,h=4,hkv=2,s=100,d=64", "float16", "causal=1", "flash_attention", "sm_80"),
]

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on the PATH")


CASE_IDS = [f"{c[0]}-{c[2]}-{c[1]}-{c[5]}" for c in CASES]


# Calls of cuda/hopper.cuh's warpgroup turns (bar.sync / bar.arrive on named barriers 1 and 2), not their
# definitions, which every Hopper kernel's source carries.
TURN_CALLS = re.compile(r"autosched_turn_(sync|handover)\((?!int id)")

@pytest.fixture(scope="module")
def sm90():
    return parse_target("cuda:sm_90", require_device=False)


@pytest.fixture(scope="module")
def sm80():
    return parse_target("cuda:sm_80", require_device=False)


@needs_nvcc
@pytest.mark.parametrize("op,shape,dtype,attrs,space_name,arch", CASES, ids=CASE_IDS)
def test_sampled_cuda_kernels_compile(op, shape, dtype, attrs, space_name, arch):
    target = parse_target(f"cuda:{arch}", require_device=False)
    task = Task.from_workload(make_workload(op, shape, dtype, attrs))
    space = task.space(target)
    assert space.name == space_name
    rng = np.random.default_rng(0)
    points = [space.default(), space.sample(rng)]
    for point in points:
        source = cuda_source(space.apply(point), target, space.build_config(point), space.codegen)
        report = nvcc_compile(source, space.codegen.get("arch", arch))
        assert report.ok, f"{point}:\n{report.log[-2000:]}"
        assert report.registers is not None
        # their checks promise accumulators that fit in registers (gemv8, swiglu_gemv: at most 32, and 16 loads in
        # flight)
        if space.name.startswith("hopper_") or space.name in ("gemv8", "swiglu_gemv"):
            assert report.spills == 0, f"{point}: {report.spills} bytes spilled"


def test_a_small_gemm_samples_valid_hopper_points(sm90):
    """A decode-sized GEMM (tiny-llama's 16×64×128) has few valid hopper_gemm points among its knobs'
    product (about 1.5%): sampling still returns valid points, 300 times, never InvalidPoint (the search
    stopped drawing random points at the first one, and the slow pipeline test failed)."""
    space = Task.from_workload(make_workload("gemm", "m=16,n=64,k=128", "float16")).space(sm90)
    rng = np.random.default_rng(0)
    points = [space.sample(rng) for _ in range(300)]
    assert all(space.validate(p) is None for p in points)
    assert len({tuple(sorted(p.items())) for p in points}) > 10  # random, not the default over and over


def test_the_search_starts_from_the_default_and_its_multicast_pairs(sm90):
    """hopper_gemm's first candidates: the default, then the same tiles with B and with A multicast across
    a cluster of two, all valid; a decode GEMM, whose tiles leave nothing to pair, starts from the streaming
    kernel's default (two warps where k has two steps of 64), then the wgmma kernel's."""
    space = Task.from_workload(make_workload("gemm", "m=1000,n=4000,k=3000", "float16")).space(sm90)
    first = space.first_points()
    assert first[0] == space.default() and [p["multicast"] for p in first] == ["none", "b", "a"]
    assert all(space.validate(p) is None for p in first)
    assert all({**p, "multicast": "none"} == {**first[0], "group_m": p["group_m"]} for p in first)
    small = Task.from_workload(make_workload("gemm", "m=16,n=64,k=128", "float16")).space(sm90)
    assert small.default() == small.canonical({"stream": True, "stream_warps": 2, "stream_tiles": 1, "stream_unroll": 1})
    assert small.first_points() == [small.default(), small.wgmma_default()]


@needs_nvcc
@pytest.mark.slow
def test_split_k_points_launch_clusters_and_compile(sm90):
    """Split-K across a cluster: the launch carries the cluster's size, the grid one CTA per tile and
    rank, and the kernel compiles for sm_90a without spills; split-K is refused where it cannot help."""
    import dataclasses

    import tvm

    task = Task.from_workload(make_workload("gemm", "m=16,n=4096,k=4096", "float16", "bias=1"))
    space = task.space(sm90)
    base = {"consumers": 1, "wg_rows": 64, "block_n": 64, "stages": 4, "group_m": 1, "persistent": False,
            "swap_ab": False, "pingpong": False, "multicast": "none"}
    for split in (2, 4):
        point = {**base, "split_k": split}
        assert space.validate(point) is None
        hopper = dataclasses.replace(sm90, arch="sm_90a").tvm_target()
        with hopper:
            lowered = tvm.tirx.get_tir_pipeline("tirx")[0](tvm.tirx.transform.BindTarget(hopper)(space.apply(point)))
        assert '"clusterCtaIdx.x", "blockIdx.x"' in str(lowered["main"])
        assert f"main_kernel\", A_map, B_map, Bias_1.data, C_1.data, {split}, {64 * split}," in str(lowered["main"])
        report = nvcc_compile(cuda_source(space.apply(point), sm90, {}, space.codegen), "sm_90a")
        assert report.ok and report.spills == 0, report.log[-2000:]
    assert "persistent" in space.validate({**base, "split_k": 2, "persistent": True})
    big = Task.from_workload(make_workload("gemm", "m=4096,n=4096,k=4096", "float16")).space(sm90)
    assert "smaller than the multiprocessors" in big.validate({**base, "split_k": 2})


@needs_nvcc
@pytest.mark.slow
def test_pingpong_consumers_take_whole_tiles(sm90):
    """With ping-pong each consumer owns whole tiles of wg_rows rows (the A box is one consumer's rows,
    the empty barriers count one warpgroup, named barriers hand the main loop over in turn), it compiles
    for sm_90a without spills, and it is refused
    without two consumers and persistent CTAs."""
    space = Task.from_workload(make_workload("gemm", "m=4096,n=4096,k=4096", "float16")).space(sm90)
    point = {"consumers": 2, "wg_rows": 64, "block_n": 256, "stages": 4, "group_m": 8, "persistent": True,
             "split_k": 1, "swap_ab": False, "pingpong": True, "multicast": "none"}
    assert space.validate(point) is None and space.block_m(point) == 64
    source = cuda_source(space.apply(point), sm90, {}, space.codegen)
    report = nvcc_compile(source, "sm_90a")
    assert report.ok and report.spills == 0, report.log[-2000:]
    # the main loop is handed over through named barriers (without them a consumer a lap of the ring ahead
    # took a full barrier's old phase for its own and the kernel hung on the H200)
    assert {"sync", "handover"} <= set(TURN_CALLS.findall(source))
    assert not TURN_CALLS.search(cuda_source(space.apply({**point, "pingpong": False}), sm90, {}, space.codegen))
    assert "ping-pong" in space.validate({**point, "persistent": False})
    assert "ping-pong" in space.validate({**point, "consumers": 1})
    cooperative = {**point, "pingpong": False}
    assert space.block_m(cooperative) == 128 and space.validate(cooperative) is None


def test_block_n_choices_add_tiles_that_fill_whole_waves(sm90):
    """A 512-token prefill's gate/up GEMM (512×11008) in 128×192 tiles fills 1.76 waves of 132
    multiprocessors; block_n 168 is added to its choices and makes exactly two. Shapes whose standard
    tiles already fill their waves, and decode shapes, keep the standard choices."""
    from autosched.search_spaces.templates.hopper_gemm import HopperGemmSpace, wave_efficiency, whole_wave_block_ns

    assert whole_wave_block_ns(512, 11008, 132) == {168}
    assert wave_efficiency(4 * math.ceil(11008 / 192), 132) < 0.9 and wave_efficiency(4 * 66, 132) == 1.0
    assert whole_wave_block_ns(512, 4096, 132) == set() and whole_wave_block_ns(16, 4096, 132) == set()
    space = Task.from_workload(make_workload("gemm", "m=512,n=11008,k=4096", "float16")).space(sm90)
    block_ns = next(k for k in space.knobs if k.name == "block_n").choices
    assert 168 in block_ns and set(HopperGemmSpace.BLOCK_NS) <= set(block_ns) and list(block_ns) == sorted(block_ns)
    point = {"consumers": 2, "wg_rows": 64, "block_n": 168, "stages": 5, "group_m": 4, "persistent": True,
             "split_k": 1, "swap_ab": False, "pingpong": False, "multicast": "none"}
    assert space.validate(point) is None
    features = space.point_features(point)
    assert features[9] == 2.0 and features[10] == 1.0  # waves, and how full they are


@needs_nvcc
@pytest.mark.slow
def test_whole_wave_block_n_compiles_for_sm90a(sm90):
    """wgmma m64n168k16 with its 84 accumulators per m64 fragment compiles for sm_90a without spills,
    cooperative and ping-pong."""
    space = Task.from_workload(make_workload("gemm", "m=500,n=11000,k=200", "float16", "bias=1,act=silu")).space(sm90)
    base = {"consumers": 2, "wg_rows": 64, "block_n": 168, "group_m": 4, "persistent": True, "split_k": 1,
            "swap_ab": False, "multicast": "none"}
    for point in ({**base, "stages": 5, "pingpong": False}, {**base, "stages": 4, "pingpong": True}):
        assert space.validate(point) is None, space.validate(point)
        source = cuda_source(space.apply(point), sm90, {}, space.codegen)
        assert "m64n168k16" in source
        report = nvcc_compile(source, "sm_90a")
        assert report.ok and report.spills == 0, report.log[-2000:]


@needs_nvcc
@pytest.mark.slow
def test_multicast_pairs_share_one_operand_tile(sm90):
    """Multicast: two CTAs of a cluster on neighbouring tiles (an odd last one paired with a tile past the
    edge) each load half of the shared operand's tile and multicast it into both; the launch is a cluster
    of two, the stages are released in both CTAs, and the kernel compiles for sm_90a without spills,
    persistent or not. Points that cannot pair are refused with the reason."""
    import dataclasses

    import tvm

    task = Task.from_workload(make_workload("gemm", "m=2100,n=2056,k=328", "float16", "bias=1,act=gelu"))
    space = task.space(sm90)
    base = {"consumers": 2, "wg_rows": 64, "block_n": 128, "stages": 4, "group_m": 4, "split_k": 1,
            "swap_ab": False, "pingpong": False}
    hopper = dataclasses.replace(sm90, arch="sm_90a").tvm_target()
    for multicast, persistent, ctas in (("b", True, 132), ("a", False, 2 * 17 * 9)):
        point = space.canonical({**base, "multicast": multicast, "persistent": persistent})
        assert space.validate(point) is None, space.validate(point)
        with hopper:
            lowered = tvm.tirx.get_tir_pipeline("tirx")[0](tvm.tirx.transform.BindTarget(hopper)(space.apply(point)))
        assert f"C_1.data, 2, {ctas}, 384," in str(lowered["main"])  # clusters of two CTAs
        source = cuda_source(space.apply(point), sm90, {}, space.codegen)
        assert ".multicast::cluster" in source and "autosched_cluster_arrive((&(empty" in source
        report = nvcc_compile(source, "sm_90a")
        assert report.ok and report.spills == 0, report.log[-2000:]
    # a pair reads the shared operand's tile once: fewer bytes from L2 per FLOP
    cooperative = {**base, "multicast": "none", "persistent": False}
    assert space.point_features({**cooperative, "multicast": "b"})[-1] < space.point_features(cooperative)[-1]
    assert "ping-pong" in space.validate({**base, "multicast": "b", "persistent": True, "pingpong": True})
    wide = Task.from_workload(make_workload("gemm", "m=512,n=11008,k=4096", "float16")).space(sm90)
    assert "swizzle atoms" in wide.validate({**base, "block_n": 168, "multicast": "b", "persistent": True})
    assert wide.validate({**base, "block_n": 168, "multicast": "a", "persistent": True}) is None
    thin = Task.from_workload(make_workload("gemm", "m=100,n=2048,k=256", "float16")).space(sm90)
    assert "two or more row tiles" in thin.validate({**base, "multicast": "b", "persistent": False, "group_m": 1})


@needs_nvcc
def test_swapped_operands_put_a_decode_steps_tokens_on_wgmmas_n_side(sm90):
    """swap_ab computes Cᵀ = B·Aᵀ: the weights load as wgmma's 64-row operand and the tokens as its
    N = 16 operand (TMA boxes of 64 and 16 rows), it compiles without spills, with split-K too, and it
    is refused where the tokens are many; N = 16 only with swapped operands."""
    import dataclasses

    import tvm

    space = Task.from_workload(make_workload("gemm", "m=16,n=4096,k=4096", "float16", "bias=1")).space(sm90)
    base = {"consumers": 1, "wg_rows": 64, "block_n": 16, "stages": 7, "group_m": 1, "persistent": False,
            "swap_ab": True, "pingpong": False, "multicast": "none"}
    hopper = dataclasses.replace(sm90, arch="sm_90a").tvm_target()
    for split in (1, 2):
        point = {**base, "split_k": split}
        assert space.validate(point) is None
        with hopper:
            lowered = tvm.tirx.get_tir_pipeline("tirx")[0](tvm.tirx.transform.BindTarget(hopper)(space.apply(point)))
        text = str(lowered["main"])
        assert "T.tensormap_encode_tiled(A_map, A_1.data, 4096, 16, 8192, 64, 16," in text  # the tokens
        assert "T.tensormap_encode_tiled(B_map, B_1.data, 4096, 4096, 8192, 64, 64," in text  # the weights
        source = cuda_source(space.apply(point), sm90, {}, space.codegen)
        assert "wgmma.mma_async.sync.aligned.m64n16k16" in source
        report = nvcc_compile(source, "sm_90a")
        assert report.ok and report.spills == 0, report.log[-2000:]
    assert "block_n 16 is for swapped operands" in space.validate({**base, "swap_ab": False, "split_k": 1})
    prefill = Task.from_workload(make_workload("gemm", "m=512,n=4096,k=4096", "float16")).space(sm90)
    assert "for few rows" in prefill.validate({**base, "block_n": 64, "split_k": 1})


@pytest.mark.parametrize("arch,shape,dtype,space_name", [
    ("sm_90", "m=512,n=4096,k=4096", "float16", "hopper_fp8_gemm"),
    ("sm_90a", "m=16,n=4096,k=4096", "bfloat16", "hopper_fp8_gemm"),
    ("sm_80", "m=512,n=4096,k=4096", "float16", "gpu_matmul"),  # no wgmma before Hopper
    ("sm_90", "m=1,n=4096,k=4096", "float16", "gpu_gemv"),  # one row: a GEMV
    ("sm_90", "m=64,n=128,k=40", "float16", "gpu_matmul"),  # rows of 40 bytes: TMA needs 16-byte strides
])
def test_the_architecture_and_shape_choose_the_fp8_gemm_space(arch, shape, dtype, space_name):
    target = parse_target(f"cuda:{arch}", require_device=False)
    assert Task.from_workload(make_workload("fp8_gemm", shape, dtype)).space(target).name == space_name


def test_fp8_kernels_take_the_workloads_parameters_and_fp16_keeps_its_space(sm90):
    """The fp8 kernel takes the workload function's parameters in its order (A, W uint8; scale_a, scale_w float32;
    [bias]; C), with TMA maps of uint8 codes in 128-code boxes; hopper_gemm neither claims fp8_gemm nor gains
    fp8's knob, and hopper_fp8_gemm takes no fp16 gemm."""
    import dataclasses

    import tvm

    def signature(func):
        return [(str(p.dtype), tuple(int(x) for x in p.shape)) for p in func.params]

    for attrs in ("", "bias=1"):
        task = Task.from_workload(make_workload("fp8_gemm", "m=300,n=1000,k=336", "float16", attrs))
        space = task.space(sm90)
        for point in (space.default(), {**space.default(), "promote": False}):
            assert space.validate(point) is None
            assert signature(space.kernel(point)) == signature(task.func)
    hopper = dataclasses.replace(sm90, arch="sm_90a").tvm_target()
    with hopper:
        lowered = tvm.tirx.get_tir_pipeline("tirx")[0](tvm.tirx.transform.BindTarget(hopper)(space.apply(space.default())))
    text = str(lowered["main"])
    assert 'T.tensormap_encode_tiled(A_map, A_1.data, 336, 300, 336, 128, 128, 1, 1, descriptor_dtype="uint8"' in text
    gemm = Task.from_workload(make_workload("gemm", "m=300,n=1000,k=336", "float16")).space(sm90)
    assert gemm.name == "hopper_gemm" and "promote" not in {k.name for k in gemm.knobs}
    assert {k.name for k in space.knobs} == {k.name for k in gemm.knobs} | {"promote"}


def test_the_fp8_default_promotes_its_sums_in_tiles_that_fill_the_waves(sm90):
    """hopper_fp8_gemm's default promotes (fp32 sums per stage) in hopper_gemm's tiles where the partial sums fit
    beside them, else in the widest narrower tiles (from 64 columns) whose waves are within 5% of the fullest: a
    512-token chunk of a 4096-wide layer in 128 tiles of 128x128 (97% of 132 multiprocessors), not 88 of 128x192;
    16 prompts of 512 tokens in 128x192 tiles; a decode step swapped, split across a cluster, promoted."""
    def default(shape):
        return Task.from_workload(make_workload("fp8_gemm", shape, "float16")).space(sm90).default()

    assert {k: default("m=512,n=4096,k=4096")[k] for k in ("consumers", "wg_rows", "block_n", "promote")} == {
        "consumers": 2, "wg_rows": 64, "block_n": 128, "promote": True}
    assert default("m=8192,n=11008,k=4096")["block_n"] == 192 and default("m=8192,n=11008,k=4096")["promote"]
    decode = default("m=16,n=4096,k=4096")
    assert decode["swap_ab"] and decode["block_n"] == 16 and decode["split_k"] == 2 and decode["promote"]


@needs_nvcc
def test_fp8_gemm_points_compile_for_sm90a_without_spills(sm90):
    """hopper_fp8_gemm's kernels: wgmma m64nNk32.f32.e4m3.e4m3, four per 128-code stage row, with promotion (each
    stage's sums into fresh accumulators, the first wgmma with scale-d false, then added in fp32) and without,
    cooperative, ping-pong, multicast and swapped with split-K: each compiles for sm_90a without spills.
    Promotion is refused where the partial sums would not fit beside the tile's, and its absence where the tensor
    cores' own accumulation over a long K would exceed an fp16 output's tolerance (not bf16's)."""
    space = Task.from_workload(make_workload("fp8_gemm", "m=2000,n=2056,k=4096", "bfloat16", "bias=1")).space(sm90)
    default = space.default()
    assert default["promote"] and space.validate(default) is None
    assert "promote" in space.validate({**default, "block_n": 256, "promote": True})
    assert space.validate({**default, "block_n": 256, "promote": False}) is None
    fp16 = Task.from_workload(make_workload("fp8_gemm", "m=2000,n=2056,k=4096", "float16", "bias=1")).space(sm90)
    assert "tolerance" in fp16.validate({**default, "promote": False})
    short = Task.from_workload(make_workload("fp8_gemm", "m=2000,n=2056,k=1024", "float16", "bias=1")).space(sm90)
    assert short.validate({**default, "promote": False}) is None
    base = {**default, "group_m": 4}
    points = [{**base, "block_n": 192, "persistent": True, "pingpong": True},
              {**base, "block_n": 256, "promote": False, "multicast": "b", "persistent": True},
              {**base, "consumers": 1, "wg_rows": 128, "block_n": 64, "stages": 8}]
    for point in points:
        point = space.canonical(point)
        assert space.validate(point) is None, (point, space.validate(point))
        source = cuda_source(space.apply(point), sm90, {}, space.codegen)
        assert f"wgmma.mma_async.sync.aligned.m64n{point['block_n']}k32.f32.e4m3.e4m3" in source
        report = nvcc_compile(source, "sm_90a")
        assert report.ok and report.spills == 0, (point, report.log[-2000:])
    decode = Task.from_workload(make_workload("fp8_gemm", "m=16,n=4096,k=4096", "bfloat16", "bias=1")).space(sm90)
    point = decode.default()
    assert point["swap_ab"] and point["split_k"] > 1 and point["promote"], point
    report = nvcc_compile(cuda_source(decode.apply(point), sm90, {}, decode.codegen), "sm_90a")
    assert report.ok and report.spills == 0, report.log[-2000:]


def test_moe_gemm_gets_the_gpu_moe_space_whose_tiles_divide_the_loops(sm90):
    """On CUDA a moe_gemm has a space of its own (the generic GPU matmul spaces would share a weight tile
    between rows that each read their own expert's): its default fits odd shapes, and points whose tiles
    do not divide a loop, or whose staged rows of X overflow shared memory, are refused with the reason."""
    odd = Task.from_workload(make_workload("moe_gemm", "m=6,e=3,n=96,k=160", "float32")).space(sm90)
    assert odd.name == "gpu_moe_matmul" and odd.validate(odd.default()) is None
    assert "do not divide K = 160" in odd.validate({**odd.default(), "lanes": 64, "vector": 4})
    assert "4 rows per block do not divide the 6 rows" in odd.validate({**odd.default(), "rows_per_block": 4})
    assert odd.validate({**odd.default(), "rows_per_block": 2}) is None
    wide = Task.from_workload(make_workload("moe_gemm", "m=2,e=8,n=4096,k=14336", "float16")).space(sm90)
    assert wide.validate(wide.default()) is None
    assert "exceed 48 KB" in wide.validate({**wide.default(), "stage_x": True, "rows_per_block": 2})
    assert wide.validate({**wide.default(), "stage_x": True}) is None  # one row of 14336 halves: 28 KB
    from autosched.errors import SpaceError

    with pytest.raises(SpaceError, match="no schedule space"):  # K = 24: no lane count divides it
        Task.from_workload(make_workload("moe_gemm", "m=4,e=3,n=40,k=24", "float32")).space(sm90)
    rng = np.random.default_rng(0)
    sampled = [wide.sample(rng) for _ in range(40)]
    assert all(wide.validate(p) is None for p in sampled)
    assert {p["stage_x"] for p in sampled} == {False, True}


def test_tensor_core_space_offers_bf16(sm80):
    task = Task.from_workload(make_workload("gemm", "m=128,n=128,k=128", "bfloat16"))
    space = task.space(sm80)
    assert True in next(k for k in space.knobs if k.name == "tensor_core").choices
    point = space.canonical(dict(space.default(), tensor_core=True))
    source = cuda_source(space.apply(point), sm80, space.build_config(point))
    assert "wmma::mma_sync" in source and "nv_bfloat16" in source


def test_a_reshape_before_an_injective_kernel_is_inlined_not_launched(sm90):
    """RoPE after a Linear reshapes [tokens, heads * dim] to [batch, tokens, heads, dim] in two steps, the
    first over fewer dimensions than the output. That step was kept as a stage: a whole copy of the
    Linear's output, launched as a kernel of its own (100 us a call at 16 x 512 tokens on the H200). Now
    the fused function is one kernel that reads the input where the reshape would have copied it."""
    from tvm import te, topi

    x = te.placeholder((32, 64), "float16", name="x")
    heads = topi.reshape(topi.reshape(x, (2, 16, 64)), (2, 16, 4, 16))
    out = topi.multiply(topi.transpose(heads, (0, 2, 1, 3)), te.const(2.0, "float16"))
    task = Task.from_func("rope_like", te.create_prim_func([x, out]))
    space = task.space(sm90)
    assert space.name == "gpu_injective"
    source = cuda_source(space.apply(space.default()), sm90, {}, space.codegen)
    kernels = re.findall(r"__global__ void[^;{]*\{", source)  # definitions, not declarations
    assert len(kernels) == 1, source


def test_show_prints_cuda_source_without_a_gpu(tmp_path):
    from .helpers import cli

    out = cli("show", "gemm", "--shape", "m=128,n=128,k=64", "--dtype", "fp16", "--target", "cuda",
              "--db", str(tmp_path / "none.db")).stdout
    assert "__global__" in out and "default point" in out and "cuda:sm_90" in out
    cpu = cli("show", "rmsnorm", "--shape", "m=4,n=64", "--db", str(tmp_path / "none.db")).stdout
    assert "T.prim_func" in cpu and "__global__" not in cpu


@pytest.mark.parametrize("arch,shape,dtype,space_name", [
    ("sm_90", "m=64,n=128,k=64", "float16", "hopper_gemm"),
    ("sm_90a", "m=16,n=128,k=64", "bfloat16", "hopper_gemm"),
    ("sm_80", "m=64,n=128,k=64", "float16", "gpu_matmul"),  # no wgmma before Hopper
    ("sm_90", "m=1,n=128,k=64", "float16", "gpu_gemv"),  # one row: a GEMV
    ("sm_90", "m=64,n=128,k=60", "float16", "gpu_matmul"),  # rows of 120 bytes: TMA needs 16-byte strides
    ("sm_90", "m=64,n=128,k=64", "float32", "gpu_matmul"),  # wgmma here takes fp16/bf16
])
def test_the_architecture_and_shape_choose_the_gemm_space(arch, shape, dtype, space_name):
    target = parse_target(f"cuda:{arch}", require_device=False)
    assert Task.from_workload(make_workload("gemm", shape, dtype)).space(target).name == space_name


def test_hopper_space_rejects_points_before_a_build_with_the_reason(sm90):
    from autosched.search_spaces import InvalidPoint

    space = Task.from_workload(make_workload("gemm", "m=4096,n=4096,k=4096", "float16")).space(sm90)
    too_many_accumulators = dict(space.default(), consumers=1, wg_rows=128, block_n=256)
    assert "accumulator registers" in space.check(too_many_accumulators)
    too_much_shared = dict(space.default(), consumers=2, wg_rows=64, block_n=256, stages=7)
    assert "shared memory" in space.check(too_much_shared)
    with pytest.raises(InvalidPoint, match="shared memory"):
        space.apply(too_much_shared)
    rng = np.random.default_rng(0)
    assert all(space.check(space.sample(rng)) is None for _ in range(20))


def test_hopper_space_gives_the_cost_model_its_own_features(sm90):
    space = Task.from_workload(make_workload("gemm", "m=512,n=4096,k=4096", "float16")).space(sm90)
    rng = np.random.default_rng(0)
    rows = np.array([space.point_features(space.sample(rng)) for _ in range(16)])
    assert rows.shape == (16, len(space.point_features(space.default()))) and np.isfinite(rows).all()
    assert (rows.std(0) > 0).sum() >= 6  # knobs and derived quantities vary with the point


def test_device_facts_are_the_gpus_own_or_its_architectures_without_one(sm90, sm80):
    """Without a GPU, the table's row for the architecture (sm_90: the H100's and H200's 132 SMs); a target of a
    GPU gives that GPU's SMs and shared memory (an H100 PCIe's 114 SMs), its L2 from the table where the GPU
    is not at hand; an architecture the table lacks knows no SMs and only the shared memory of every block."""
    import dataclasses

    from autosched.target import CUDA_ARCH_FACTS, arch_facts, device_facts

    assert device_facts(sm90) == CUDA_ARCH_FACTS["sm_90"] == arch_facts("sm_90a") and device_facts(sm90).sms == 132
    assert device_facts(sm80).sms == 108 and sm80.max_shared_memory == device_facts(sm80).shared_memory == 166912
    pcie = dataclasses.replace(sm90, device_name="NVIDIA H100 PCIe (not here)", num_cores=114)
    facts = device_facts(pcie)
    assert (facts.sms, facts.shared_memory, facts.l2_bytes, facts.source) == (114, sm90.max_shared_memory,
                                                                              CUDA_ARCH_FACTS["sm_90"].l2_bytes, "device")
    unknown = parse_target("cuda:sm_100", require_device=False)
    assert device_facts(unknown).sms == 0 and unknown.max_shared_memory == 49152


@pytest.mark.parametrize("op,shape,dtype,attrs", [
    ("gemm", "m=512,n=4096,k=4096", "float16", ""),  # hopper_gemm
    ("dequant_gemm", "m=1,n=4096,k=4096", "float16", "bits=4,group=128"),  # int4_gemv
    ("dequant_gemm", "m=1,n=4096,k=4096", "bfloat16", "bits=8,group=4096"),  # gemv8
    ("swiglu_gemm", "m=1,n=11008,k=4096", "float16", ""),  # swiglu_gemv
    ("attention", "b=1,h=4,hkv=2,s=100,d=64", "float16", "causal=1"),  # hopper_attention
    ("paged_decode_attention", "b=2,h=4,hkv=2,d=64,ctx=200,page=16", "float16", ""),  # paged_decode
    ("moe_grouped_gemm", "m=1024,e=8,n=4096,k=14336", "bfloat16", ""),  # moe_grouped_gemm
], ids=["hopper_gemm", "int4_gemv", "gemv8", "swiglu_gemv", "hopper_attention", "paged_decode", "moe_grouped_gemm"])
def test_the_sm90_templates_fill_the_sms_of_the_target(op, shape, dtype, attrs, sm90):
    import dataclasses

    task = Task.from_workload(make_workload(op, shape, dtype, attrs))
    assert task.space(sm90).sms == 132
    pcie = dataclasses.replace(sm90, device_name="NVIDIA H100 PCIe (not here)", num_cores=114)
    assert task.space(pcie).sms == 114


def test_show_prints_the_wgmma_kernel_for_sm90a(tmp_path):
    from .helpers import cli

    out = cli("show", "gemm", "--shape", "m=256,n=256,k=256", "--dtype", "bf16", "--target", "cuda:sm_90a",
              "--db", str(tmp_path / "none.db")).stdout
    assert "wgmma.mma_async.sync.aligned.m64n" in out and "cp.async.bulk.tensor" in out and "setmaxnreg" in out


@pytest.mark.parametrize("arch,dtype,space_name", [("sm_90a", "float16", "hopper_gemm"), ("sm_90", "float32", "gpu_matmul")])
def test_a_scheduled_module_survives_the_trip_to_the_builder(arch, dtype, space_name, tmp_path):
    """The builder gets the search's module in TVM's JSON: a TIRx kernel and a TIR schedule come back equal,
    give the same CUDA source, and build in the builder's function with the space's code generation."""
    import tvm
    import tvm_ffi

    from autosched.measure._worker import build_candidate

    target = parse_target(f"cuda:{arch}", require_device=False)
    task = Task.from_workload(make_workload("gemm", "m=128,n=128,k=64", dtype))
    space = task.space(target)
    assert space.name == space_name
    point = space.default()
    module = space.apply(point)
    scheduled = tvm.ir.save_json(module)
    assert tvm_ffi.structural_equal(tvm.ir.load_json(scheduled), module)
    source = cuda_source(module, target, space.build_config(point), space.codegen)
    assert cuda_source(tvm.ir.load_json(scheduled), target, space.build_config(point), space.codegen) == source
    built = build_candidate(task.spec, target, point, str(tmp_path / "kernel.so"), scheduled)
    assert built.ok, built.error_msg


def test_int4_gemv_serves_int4_decode_steps_on_sm90_only(sm90, sm80):
    """The streaming int4 kernel takes 4-bit weights and up to eight rows on sm_90, and 9-16 rows (a decode batch
    of 16) on tensor cores where they apply (fp16, groups of 128 or more), the wgmma dequant kernel 17 rows on (one
    scale per k step), both with zero points (zeros=1: asymmetric AWQ/GPTQ) or without; int8 and float8 weights
    with a scale per output channel and up to eight rows go to the streaming 8-bit kernel (gemv8); 9-16 rows of
    bf16 or in groups under 128, groups of 32 in prefill, 8-bit weights in groups or past eight rows and older GPUs
    keep the TensorIR spaces."""

    def space(shape, attrs, target):
        return Task.from_workload(make_workload("dequant_gemm", shape, "float16", attrs)).space(target).name

    assert space("m=1,n=4096,k=4096", "bits=4", sm90) == "int4_gemv"
    assert space("m=8,n=4096,k=4096", "bits=4,group=64", sm90) == "int4_gemv"
    assert space("m=1,n=4096,k=4096", "bits=8,group=4096", sm90) == "gemv8"  # q8f16: int8, a scale per channel
    assert space("m=1,n=4096,k=4096", "bits=8", sm90) == "gpu_gemv"  # int8 in groups of 128
    for m in range(9, 17):  # a decode step of 9 to 16 rows: tensor cores, groups of 128 and 256
        assert space(f"m={m},n=4096,k=4096", "bits=4", sm90) == "int4_gemv", m
        assert space(f"m={m},n=11008,k=4096", "bits=4,group=256,zeros=1", sm90) == "int4_gemv", m
    assert space("m=16,n=4096,k=4096", "bits=4,group=64", sm90) == "gpu_gemv"  # a k-block would span two groups
    assert space("m=16,n=4096,k=4096", "bits=4", sm80) == "gpu_gemv"
    bf16 = Task.from_workload(make_workload("dequant_gemm", "m=16,n=4096,k=4096", "bfloat16", "bits=4"))
    assert bf16.space(sm90).name == "gpu_gemv"  # no tensor-core kernel for bf16
    assert space("m=17,n=4096,k=4096", "bits=4", sm90) == "hopper_dequant_gemm"  # prefill: wgmma
    assert space("m=512,n=4096,k=4096", "bits=4,group=32", sm90) == "gpu_matmul"  # two scales per k step
    assert space("m=1,n=4096,k=4096", "bits=4", sm80) == "gpu_gemv"
    assert space("m=1,n=4096,k=4096", "bits=4,zeros=1", sm90) == "int4_gemv"
    assert space("m=8,n=4096,k=4096", "bits=4,zeros=1,bias=1", sm90) == "int4_gemv"
    assert space("m=512,n=4096,k=4096", "bits=4,zeros=1", sm90) == "hopper_dequant_gemm"
    assert space("m=17,n=4096,k=4096", "bits=4,zeros=1,bias=1", sm90) == "hopper_dequant_gemm"
    assert space("m=12,n=4096,k=4096", "bits=4,zeros=1", sm90) == "int4_gemv"
    assert space("m=12,n=4096,k=4096", "bits=4,group=64,zeros=1", sm90) == "gpu_gemv"
    assert space("m=512,n=4096,k=4096", "bits=4,group=32,zeros=1", sm90) == "gpu_matmul"
    assert space("m=1,n=4096,k=4096", "bits=4,zeros=1", sm80) == "gpu_gemv"
    assert space("m=1,n=4096,k=4096", "bits=8,group=4096,fmt=e4m3", sm90) == "gemv8"  # fp8's E4M3 codes
    assert space("m=64,n=4096,k=4096", "bits=8,group=4096,fmt=e4m3", sm90) == "gpu_matmul"
    for fmt in ("", ",fmt=e4m3"):
        for m in range(1, 9):
            assert space(f"m={m},n=4096,k=11008", f"bits=8,group=11008{fmt}", sm90) == "gemv8", (m, fmt)
            assert space(f"m={m},n=4096,k=4096", f"bits=8,group=4096,bias=1,act=silu{fmt}", sm90) == "gemv8"
        assert space("m=9,n=4096,k=4096", f"bits=8,group=4096{fmt}", sm90) == "gpu_gemv"
        assert space("m=16,n=4096,k=4096", f"bits=8,group=4096{fmt}", sm90) == "gpu_gemv"
        assert space("m=17,n=4096,k=4096", f"bits=8,group=4096{fmt}", sm90) == "gpu_matmul"
        assert space("m=1,n=4096,k=4096", f"bits=8,group=4096{fmt}", sm80) == "gpu_gemv"
        assert space("m=8,n=4096,k=4096", f"bits=8,group=4096{fmt}", sm80) == "gpu_gemv"
        assert space("m=1,n=4096,k=4104", f"bits=8,group=4104{fmt}", sm90) == "gpu_gemv"  # no 16-byte chunks
    for dtype in ("float16", "bfloat16"):
        for fmt in ("", ",fmt=e4m3"):
            task = Task.from_workload(make_workload("dequant_gemm", "m=4,n=4096,k=4096", dtype, f"bits=8,group=4096{fmt}"))
            assert task.space(sm90).name == "gemv8"
    fp32 = Task.from_workload(make_workload("dequant_gemm", "m=1,n=256,k=512", "float32", "bits=8,group=512"))
    assert fp32.space(sm90).name == "gpu_gemv"


@pytest.mark.parametrize("attrs", ["bits=8,group=512", "bits=8,group=512,bias=1", "bits=8,group=512,fmt=e4m3",
                                   "bits=8,group=512,fmt=e4m3,bias=1,act=silu"])
def test_gemv8_kernels_take_the_workloads_parameters_in_its_order(attrs, sm90):
    """The 8-bit kernel takes the workload function's parameters, dtypes and shapes in its order: A, Wq (int8 codes,
    or uint8 E4M3 bits), scales [n, 1], [bias], C; for every point of its space."""

    def signature(func):
        return [(str(p.dtype), tuple(int(x) for x in p.shape)) for p in func.params]

    for shape, dtype in (("m=8,n=256,k=512", "float16"), ("m=1,n=300,k=512", "bfloat16")):
        task = Task.from_workload(make_workload("dequant_gemm", shape, dtype, attrs))
        space = task.space(sm90)
        assert space.name == "gemv8"
        points = [space.default(), {"warps": 1, "rows_per_warp": 4, "unroll": False}]
        for point in points:
            assert space.validate(point) is None
            assert signature(space.kernel(point)) == signature(task.func), point


def test_gemv8_unrolls_long_rows_in_equal_parts(sm90):
    """``unroll`` issues a lane's loads together: the most steps that divide its full steps (those in which every
    lane has a chunk) and issue at most 16 loads (a 4096 x 11008 down projection: 21 full steps a lane, unrolled 7
    at a time, then a last step for half of the lanes); where only one step would be, ``unroll`` is canonically
    off; points with more rows per block than the weights have are refused with the reason."""
    from autosched.search_spaces.templates.gemv8 import unroll_factor

    assert [unroll_factor(steps, 1) for steps in (0, 1, 8, 16, 17, 21, 28, 32)] == [1, 1, 8, 16, 1, 7, 14, 16]
    assert [unroll_factor(21, rows) for rows in (2, 4)] == [7, 3]
    down = Task.from_workload(make_workload("dequant_gemm", "m=1,n=4096,k=11008", "float16", "bits=8,group=11008"))
    space = down.space(sm90)
    assert (space.steps(), space.full_steps()) == (22, 21)
    assert space.unrolled({"warps": 4, "rows_per_warp": 1, "unroll": True}) == 7
    assert space.default() == {"warps": 4, "rows_per_warp": 2, "unroll": True}
    odd = Task.from_workload(make_workload("dequant_gemm", "m=1,n=64,k=8704", "float16", "bits=8,group=8704"))
    assert odd.space(sm90).canonical({"warps": 1, "rows_per_warp": 1, "unroll": True})["unroll"] is False  # 17
    short = Task.from_workload(make_workload("dequant_gemm", "m=8,n=8,k=256", "float16", "bits=8,group=256"))
    space = short.space(sm90)
    assert space.steps() == 1 and space.canonical({"warps": 1, "rows_per_warp": 1, "unroll": True})["unroll"] is False
    assert space.validate({"warps": 1, "rows_per_warp": 4, "unroll": False}) is None  # 32 accumulators
    assert "more rows per block" in space.validate({"warps": 8, "rows_per_warp": 4, "unroll": False})


@pytest.mark.parametrize("attrs", ["bits=4,group=128", "bits=4,group=128,bias=1", "bits=4,group=128,zeros=1",
                                   "bits=4,group=128,zeros=1,bias=1"])
def test_int4_kernels_take_the_workloads_parameters_in_its_order(attrs, sm90):
    """Each int4 kernel (CUDA cores, tensor cores, the prefill's wgmma) takes the workload function's parameters,
    dtypes and shapes in its order: A, Wq, scales, [zero points], [bias], C."""

    def signature(func):
        return [(str(p.dtype), tuple(int(x) for x in p.shape)) for p in func.params]

    for shape, points in (("m=8,n=256,k=512", [{"mma": False}, {"mma": True}]), ("m=16,n=256,k=512", [{"mma": True}]),
                          ("m=100,n=256,k=512", [{}])):
        task = Task.from_workload(make_workload("dequant_gemm", shape, "float16", attrs))
        space = task.space(sm90)
        for point in points:
            kernel = space.kernel(space.canonical(space.default() | point))
            assert signature(kernel) == signature(task.func), (space.name, point)


def test_int4_gemv_offers_tensor_cores_for_fp16_groups_of_128_and_more(sm90):
    """The ``mma`` knob exists where a k-block of 128 lies in one group and the dtype is fp16; its points
    drop the CUDA-core kernel's knobs, split k among at most as many warps as there are k-blocks, fit in
    shared memory, and come second among the search's first points, then the same kernel with its weights
    streamed into registers (``stream``: no slab, ``unroll`` k-blocks' loads in flight). A point stored before
    the ``stream`` knob bulk-copies."""

    def space(shape, attrs, dtype="float16"):
        return Task.from_workload(make_workload("dequant_gemm", shape, dtype, attrs)).space(sm90)

    def has_mma(s):
        return any(knob.name == "mma" for knob in s.knobs)

    assert has_mma(space("m=1,n=11008,k=4096", "bits=4,group=128"))
    assert has_mma(space("m=8,n=300,k=1024", "bits=4,group=256"))
    assert not has_mma(space("m=1,n=4096,k=4096", "bits=4,group=64"))  # a k-block would span two groups
    assert not has_mma(space("m=1,n=4096,k=4096", "bits=4,group=128", "bfloat16"))
    assert has_mma(space("m=8,n=4096,k=4096", "bits=4,group=128,zeros=1"))
    s = space("m=1,n=11008,k=4096", "bits=4,group=128")
    point = {"warps": 8, "rows_per_warp": 2, "unroll": True, "half_products": True, "mma": True}
    assert s.canonical(point) == point | {"unroll": False, "half_products": False, "stream": False, "row_groups": 1,
                                          "loads_first": False}
    assert s.validate(point) is None and s.complete(point)["stream"] is False
    first = s.first_points()
    # one row: CUDA cores first, half2 products, then fp32 products, then tensor cores bulk-copied and streamed
    # (neither the rows pipelined nor loads first)
    assert first[0] == s.default() and not first[0]["mma"] and first[0]["half_products"]
    assert first[1] == s.fp32_default() and not first[1]["mma"] and not first[1]["half_products"]
    bulk, streamed = first[2:]
    assert bulk["mma"] and not bulk["stream"] and streamed == {**bulk, "unroll": True, "stream": True}
    assert s.canonical({**point, "stream": True}) == point | {"half_products": False, "stream": True, "row_groups": 1,
                                                              "loads_first": False}
    assert s.canonical({**point, "mma": False, "stream": True})["stream"] is False
    assert "autosched_q4_mma" in str(s.apply(streamed)) and "_stream4" in str(s.apply(streamed))
    k_split = space("m=1,n=256,k=256", "bits=4,group=128")  # two k-blocks
    assert "warps split 2 k-blocks" in k_split.validate(point | {"warps": 4, "rows_per_warp": 1})
    wide = space("m=1,n=4096,k=11008", "bits=4,group=128")  # 88 KB of slab per 16 rows
    assert "shared memory" in wide.validate(point | {"rows_per_warp": 4})
    assert wide.validate(point | {"rows_per_warp": 2}) is None
    assert wide.validate(point | {"rows_per_warp": 4, "stream": True, "unroll": False}) is None  # no slab
    assert "registers" in wide.validate(point | {"rows_per_warp": 4, "stream": True})
    # one row of 11008: the default's 4 rows of half2 products would unroll 44 loads, so it takes fp32 products;
    # half2 products on one row a warp (11 loads) come second
    assert not wide.default()["half_products"] and wide.default()["rows_per_warp"] == 1
    assert wide.first_points()[1] == {**wide.default(), "half_products": True} and wide.validate(wide.first_points()[1]) is None
    assert len(s.first_points()) == 4  # k of 4096 (4 steps): the default is half2, no point added


def test_int4_gemv_takes_9_to_16_rows_on_tensor_cores_only(sm90):
    """A decode step of 9 to 16 rows (a batch of 16): the CUDA-core points are refused (at most 8 rows), the default
    (weights streamed into registers) and the search's first points are on tensor cores (with more tiles of 16
    weight rows a block among them), sampled points are too,
    and the warps' partial sums in shared memory count both n8 tiles of activation rows; up to 8 rows the default
    and first points are as before."""
    from autosched.search_spaces.templates.int4_gemv import mma_n_tiles, mma_smem_bytes

    def space(shape, attrs="bits=4,group=128"):
        return Task.from_workload(make_workload("dequant_gemm", shape, "float16", attrs)).space(sm90)

    assert [mma_n_tiles(m) for m in (1, 8, 9, 11, 16)] == [1, 1, 2, 2, 2]
    assert mma_smem_bytes(4096, 2, 4, 16) - mma_smem_bytes(4096, 2, 4, 8) == 4 * 2 * 4 * 32 * 4
    assert mma_smem_bytes(4096, 2, 1, 16) == mma_smem_bytes(4096, 2, 1, 8)  # one warp: no partial sums
    cuda_core = {"warps": 4, "rows_per_warp": 1, "unroll": False, "half_products": False, "mma": False}
    for m in (9, 11, 16):
        s = space(f"m={m},n=4096,k=4096")
        assert s.name == "int4_gemv"
        assert "at most 8" in s.validate(cuda_core)
        assert "at most 8" in s.validate(cuda_core | {"half_products": True, "unroll": True})
        default = s.default()  # the weights streamed, then bulk-copied
        assert default["mma"] and default["stream"] and s.validate(default) is None and s.canonical(default) == default
        # then more 16-row tiles a block sharing each k-block's activations: 2 with four k-blocks' loads in flight,
        # 4 with one (the registers of four would be 208)
        assert s.first_points() == [default, {**default, "unroll": False, "stream": False},
                                    {**default, "rows_per_warp": 2}, {**default, "rows_per_warp": 4, "unroll": False}]
        rng = np.random.default_rng(m)
        assert all(s.sample(rng)["mma"] for _ in range(20))
    zeros = space("m=16,n=11008,k=4096", "bits=4,group=256,zeros=1,bias=1")
    assert zeros.default()["mma"] and zeros.validate(zeros.default()) is None
    small = space("m=16,n=64,k=128")  # one k-block: one warp
    assert small.default() == {"warps": 1, "rows_per_warp": 1, "unroll": False, "half_products": False, "mma": True,
                               "stream": False, "row_groups": 1, "loads_first": False}
    eight = space("m=8,n=4096,k=4096")  # up to 8 rows: CUDA cores first (then with rows pipelined), then tensor cores
    assert eight.default() == {"warps": 4, "rows_per_warp": 2, "unroll": True, "half_products": False, "mma": False,
                               "stream": False, "row_groups": 1, "loads_first": False}
    assert [(p["mma"], p["stream"], p["row_groups"], p["loads_first"]) for p in eight.first_points()] == [
        (False, False, 1, False), (False, False, 4, False), (False, False, 1, True), (True, False, 1, False),
        (True, True, 1, False)]
    assert eight.validate(cuda_core) is None


@needs_nvcc
@pytest.mark.slow
def test_int4_mma_gemv_of_16_rows_compiles_for_sm90a_without_spills(sm90):
    """The tensor-core kernel with two n8 tiles of activation rows (16 rows, and 11: a partial second tile), with
    and without zero points, bias and SiLU: every point of one to eight warps and one to four 16-row tiles per block
    compiles for sm_90a without spills (where shared memory alone bounds the blocks per SM, the launch bounds let
    ptxas take the registers it needs)."""
    from autosched.cuda_tools import cuda_source

    cases = (("m=16,n=4096,k=4096", "bits=4,group=128"), ("m=11,n=11008,k=4096", "bits=4,group=128,zeros=1,bias=1,act=silu"),
             ("m=16,n=4096,k=11008", "bits=4,group=256,zeros=1"))
    compiled = 0
    for shape, attrs in cases:
        space = Task.from_workload(make_workload("dequant_gemm", shape, "float16", attrs)).space(sm90)
        assert space.name == "int4_gemv" and space.codegen.get("arch") == "sm_90a"
        for warps in (1, 2, 4, 8):
            for tiles in (1, 2, 4):
                point = space.canonical(space.default() | {"warps": warps, "rows_per_warp": tiles, "stream": False})
                if space.validate(point) is not None:  # 4 tiles of k = 11008: too much shared memory
                    continue
                source = cuda_source(space.apply(point), sm90, space.build_config(point), space.codegen)
                assert "mma.sync.aligned.m16n8k16" in source
                report = nvcc_compile(source, "sm_90a")
                assert report.ok and report.spills == 0, (shape, point, report.log[-2000:])
                compiled += 1
    assert compiled >= 30
    # The weights streamed into registers, two tiles' worth of four k-blocks in flight, at one row and at 16 (with
    # zero points): no spills either.
    for shape, attrs, tiles in (("m=16,n=4096,k=11008", "bits=4,group=128,zeros=1", 2),
                                ("m=1,n=11008,k=4096", "bits=4,group=128", 2)):
        space = Task.from_workload(make_workload("dequant_gemm", shape, "float16", attrs)).space(sm90)
        point = space.canonical(space.default() | {"mma": True, "stream": True, "unroll": True, "rows_per_warp": tiles})
        assert space.validate(point) is None, point
        source = cuda_source(space.apply(point), sm90, space.build_config(point), space.codegen)
        report = nvcc_compile(source, "sm_90a")
        assert report.ok and report.spills == 0, (shape, point, report.log[-2000:])


@pytest.mark.slow
@needs_nvcc
@pytest.mark.parametrize("zeros", [False, True], ids=["zero-point-8", "zero-points"])
def test_int4_unpacking_matches_the_workloads_nibble_order(tmp_path, zeros):
    """The kernel's chunk helpers (two nibbles per mask through half2's exponent trick, one scale per
    chunk; products in fp32, or in half2 for fp16), compiled for the host by nvcc and run on 32-weight
    chunks against the workload's definition: low nibble first, zero point 8, or with zero points (zeros=1)
    the chunk's own, 0 to 16 (AWQ's 0-15, GPTQ v1's 1-16). The half2 products are within fp16's rounding
    of it, and activations of 16000 do not overflow them."""
    import subprocess

    from autosched.search_spaces.templates._hopper import cuda_file
    from autosched.search_spaces.templates.int4_gemv import _dot_source

    cases = (("float16", "__float2half", 2, False, 1.0, 1e-4), ("bfloat16", "__float2bfloat16", 1, False, 1.0, 1e-4),
             ("float16", "__float2half", 3, True, 1.0, 2e-2), ("float16", "__float2half", 1, True, 6000.0, 1e2))
    for case, (dtype, to_type, rows, half, magnitude, bound) in enumerate(cases):
        name, source = _dot_source(dtype, rows, half, zeros)
        common = cuda_file("common.cuh")  # of the helper library, only the dtype table: the host's load below
        source = source.replace(common, common[:common.index("// Two floats as one")] + "#endif\n")
        source = source.replace("__forceinline__ void autosched_warp_sum", "inline void autosched_warp_sum")  # device only
        source = source.replace("__device__ __forceinline__", "__host__ __device__ inline")
        source = source.replace("__hfma2(", "host_hfma2(")  # a device-only intrinsic: one rounding, as on the GPU
        accs = ", ".join(f"acc[{i}]" for i in range(rows))
        program = f"""#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cmath>
#include <cstdint>
#include <cstdio>
inline uint4 autosched_ld_stream_v4(const void* p) {{ return *reinterpret_cast<const uint4*>(p); }}
float __shfl_xor_sync(unsigned, float, int);  // a device intrinsic: named by the warp sum, which the host never calls
inline __half2 host_hfma2(__half2 a, __half2 b, __half2 c) {{
  const float2 x = __half22float2(a), y = __half22float2(b), z = __half22float2(c);
  return __floats2half2_rn((float)std::fma((double)x.x, y.x, z.x), (float)std::fma((double)x.y, y.y, z.y));
}}
{source}
int main() {{
  const int M = {rows}, K = {32 * 17 if zeros else 64};  // with zero points: one chunk per zero point 0..16
  alignas(16) uint8_t wq[K / 2];
  alignas(16) decltype({to_type}(0.f)) a[M * K];
  for (int i = 0; i < K / 2; ++i) wq[i] = (uint8_t)(i * 37 + 11);
  for (int i = 0; i < M * K; ++i) a[i] = {to_type}(((i * 29) % 41 - 20) / 8.f * {magnitude}f);
  double worst = 0;
  for (int c = 0; c < K / 32; ++c) {{
    float acc[M] = {{0}};
    const int zero = {"(c * 7) % 17" if zeros else "8"};
    {name}({accs}, wq + c * 16, a + c * 32, K * 2, 0.5f{", (float)zero" if zeros else ""});
    for (int i = 0; i < M; ++i) {{
      double ref = 0;
      for (int r = c * 32; r < c * 32 + 32; ++r)
        ref += (((wq[r / 2] >> ((r % 2) * 4)) & 15) - zero) * (double)(float)a[i * K + r];
      worst = fmax(worst, fabs(ref * 0.5 - acc[i]));
    }}
  }}
  printf("%g\\n", worst);
  return 0;
}}
"""
        (tmp_path / f"case{case}.cu").write_text(program)
        exe = tmp_path / f"case{case}"
        build_for_host(tmp_path, f"case{case}.cu", str(exe), std="c++17", optimise="-O0")
        worst = float(subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout)
        # A chunk's sum is up to 32 x 8 x |a| (|a| <= 2.5 x magnitude), with zero points up to 32 x 16 x |a|:
        # the half2 bounds are ~1e-4 of it.
        limit = 2 * bound if zeros else bound
        assert worst < limit, f"{dtype} (half2 products: {half}, |a| up to {2.5 * magnitude}): off by {worst}"


@needs_nvcc
def test_8bit_codes_convert_exactly_and_gemv8_chunks_match_float64_on_the_host(tmp_path):
    """gemv8's conversions (``cuda/gemv8.cuh``), compiled for the host by nvcc and run on every code at every
    position of a 16-byte chunk: an int8 code becomes exactly its integer, an E4M3FN code exactly its value over
    256 (torch's float8_e4m3fn, and the format's definition in float64: normal and subnormal codes, signed zeros,
    NaN for 0x7F and 0xFF). The chunk helpers (1 to 8 activation rows, fp16 and bf16) add each row's product with
    the chunk to its accumulator, within fp32's rounding of float64, a NaN code making every row's sum NaN."""
    import struct
    import subprocess

    import torch

    from autosched.search_spaces.templates._hopper import cuda_file
    from autosched.search_spaces.templates.gemv8 import _dot_source

    cases = [(dtype, rows, fmt) for dtype, rows in (("float16", 1), ("bfloat16", 3), ("float16", 8))
             for fmt in ("int", "e4m3")]
    common = cuda_file("common.cuh")  # of the helper library, only the dtype table: the host's load below
    sources, calls = [], []
    for case, (dtype, rows, fmt) in enumerate(cases):
        name, source = _dot_source(dtype, rows, fmt)
        sources.append(source.replace(common, common[:common.index("// Two floats as one")] + "#endif\n"))
        scalar, to_type = ("half", "__float2half") if dtype == "float16" else ("nv_bfloat16", "__float2bfloat16")
        accs = ", ".join(f"acc[{i}]" for i in range(rows))
        calls.append(f"""  {{  // case {case}: {dtype}, {rows} rows, {fmt}
    const int M = {rows};
    std::vector<{scalar}> a(M * K);
    for (int i = 0; i < M * K; ++i) a[i] = {to_type}(((i * 29) % 41 - 20) / 8.f);
    for (int c = 0; c < K / 16; ++c) {{
      float acc[M] = {{0}};
      {name}({accs}, wq + c * 16, a.data() + c * 16, K * 2);
      for (int i = 0; i < M; ++i) {{
        double sum = 0, size = 0;
        for (int r = c * 16; r < c * 16 + 16; ++r) {{
          const double w = {"(int8_t)wq[r]" if fmt == "int" else "e4m3[wq[r]]"};
          sum += w * (double)(float)a[i * K + r]; size += std::fabs(w * (double)(float)a[i * K + r]);
        }}
        printf("dot {case} %d %d %08x %.17g %.17g\\n", c, i, host_bits(acc[i]), sum, size);
      }}
    }}
  }}
""")
    source = "".join(sources).replace("__device__ __forceinline__", "__host__ __device__ inline")
    source = source.replace("__uint_as_float(", "host_uint_as_float(")
    program = f"""#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>
inline uint4 autosched_ld_stream_v4(const void* p) {{ return *reinterpret_cast<const uint4*>(p); }}
inline float host_uint_as_float(uint32_t bits) {{ float f; std::memcpy(&f, &bits, 4); return f; }}
inline uint32_t host_bits(float f) {{ uint32_t b; std::memcpy(&b, &f, 4); return b; }}
{source}
int main() {{
  // every code at every position: chunk c holds the codes c, c + 1, ..., c + 15 (mod 256)
  alignas(16) uint8_t codes[256 * 16];
  for (int c = 0; c < 256; ++c)
    for (int i = 0; i < 16; ++i) codes[16 * c + i] = (uint8_t)(c + i);
  for (int c = 0; c < 256; ++c) {{
    float q8[16], e4m3[16];
    autosched_q8_unpack(codes + 16 * c, q8);
    autosched_e4m3_unpack(codes + 16 * c, e4m3);
    for (int i = 0; i < 16; ++i) printf("code %d %08x %08x\\n", codes[16 * c + i], host_bits(q8[i]), host_bits(e4m3[i]));
  }}
  // E4M3FN by its definition, for the rows' float64 sums; the last chunk holds a NaN code (0xFF)
  double e4m3[256];
  for (int b = 0; b < 256; ++b) {{
    const int e = (b >> 3) & 15, m = b & 7;
    e4m3[b] = (b & 128 ? -1 : 1) * (e ? std::ldexp(1 + m / 8.0, e - 7) : std::ldexp(m / 8.0, -6));
  }}
  const int K = 17 * 16;
  alignas(16) uint8_t wq[K];
  for (int r = 0; r < K; ++r) {{ wq[r] = (uint8_t)(r * 37 + 11); if ((wq[r] & 127) == 127) wq[r] ^= 1; }}
  wq[K - 5] = 0xFF;
{"".join(calls)}  return 0;
}}
"""
    (tmp_path / "host.cu").write_text(program)
    build_for_host(tmp_path, "host.cu", "host", std="c++17", optimise="-O0")
    lines = subprocess.run(["./host"], cwd=tmp_path, check=True, capture_output=True, text=True).stdout.splitlines()

    def value(bits: str) -> float:
        return struct.unpack("<f", bytes.fromhex(bits)[::-1])[0]

    converted = [line.split()[1:] for line in lines if line.startswith("code ")]
    assert len(converted) == 256 * 16 and {int(c) for c, _, _ in converted} == set(range(256))
    codes = torch.tensor([int(c) for c, _, _ in converted], dtype=torch.uint8)
    want_int = codes.view(torch.int8).double()
    want_e4m3 = codes.view(torch.float8_e4m3fn).double() / 256
    sign, exponent, mantissa = (codes >> 7).double(), ((codes >> 3) & 15).double(), (codes & 7).double()
    defined = (1 - 2 * sign) * torch.where(exponent > 0, (1 + mantissa / 8) * 2 ** (exponent - 7),
                                           mantissa / 8 * 2.0**-6) / 256
    defined[(codes & 127) == 127] = float("nan")
    got_int = torch.tensor([value(q) for _, q, _ in converted], dtype=torch.float64)
    got_e4m3 = torch.tensor([value(e) for _, _, e in converted], dtype=torch.float64)
    assert torch.equal(got_int, want_int), "int8 codes"
    assert torch.equal(got_e4m3.isnan(), (codes & 127) == 127) and torch.equal(want_e4m3.isnan(), defined.isnan())
    finite = ~got_e4m3.isnan()
    assert torch.equal(got_e4m3[finite], want_e4m3[finite]) and torch.equal(got_e4m3[finite], defined[finite])
    assert torch.equal(got_e4m3[finite].sign(), defined[finite].sign())
    assert torch.equal(torch.signbit(got_e4m3[finite]), torch.signbit(defined[finite]))  # -0 from 0x80

    dots = [line.split()[1:] for line in lines if line.startswith("dot ")]
    assert len(dots) == 17 * sum(rows for _, rows, _ in cases)
    for case, chunk, row, bits, want, size in dots:
        dtype, rows, fmt = cases[int(case)]
        got = value(bits) * (256 if fmt == "e4m3" else 1)  # the kernel scales E4M3's sums by 256 with the scale
        if fmt == "e4m3" and int(chunk) == 16:  # the chunk with the NaN code
            assert math.isnan(got), (dtype, rows, fmt, chunk, row)
        else:
            assert abs(got - float(want)) <= 1e-6 * float(size), (dtype, rows, fmt, chunk, row, got, want)


@needs_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("zeros", [False, True], ids=["zero-point-8", "zero-points"])
def test_prefill_dequantisation_writes_the_swizzled_tile_tma_would(tmp_path, zeros):
    """hopper_dequant_gemm's 8-weight helper, compiled for the host by nvcc: for every row and chunk of a
    packed 64-column tile it writes (q - 8) x scale, or with zero points (zeros=1) (q - z) x scale for the
    row's z, 0 to 16, rounded once to the half type as the workload's definition rounds it, at the
    128-byte-swizzled place that TMA would have put the fp16/bf16 tile."""
    import subprocess

    from autosched.search_spaces.templates._hopper import cuda_file
    from autosched.search_spaces.templates.hopper_dequant import _dequant_source

    for dtype, scalar in (("float16", "__half"), ("bfloat16", "__nv_bfloat16")):
        name, source = _dequant_source(dtype, zeros)
        common = cuda_file("common.cuh")  # of the helper library, only the dtype table
        source = source.replace(common, common[:common.index("// Two floats as one")] + "#endif\n")
        source = source.replace("__device__ __forceinline__", "inline").replace("__byte_perm", "host_byte_perm")
        program = f"""#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cstdint>
#include <cstdio>
#include <cstring>
inline uint32_t host_byte_perm(uint32_t x, uint32_t y, uint32_t s) {{
  const uint64_t bytes = (uint64_t)y << 32 | x;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= (uint32_t)(bytes >> (8 * ((s >> (4 * i)) & 7)) & 0xff) << (8 * i);
  return r;
}}
{source}
int main() {{
  const int ROWS = 24;
  alignas(16) uint8_t packed[ROWS * 32];
  alignas(16) {scalar} tile[ROWS * 64];
  for (int i = 0; i < ROWS * 32; ++i) packed[i] = (uint8_t)(i * 73 + 19);
  int wrong = 0;
  for (int r = 0; r < ROWS; ++r) {{
    const float scale = (float)({scalar})(0.01f * (r + 1) + 0.003f);
    const int zero = {"r % 17" if zeros else "8"};
    for (int j = 0; j < 8; ++j) {name}(tile, packed, r, j, scale{", (float)zero" if zeros else ""});
    for (int kk = 0; kk < 64; ++kk) {{
      const int q = (packed[r * 32 + kk / 2] >> (4 * (kk % 2))) & 15;
      const float want = (float)({scalar})((q - zero) * scale);
      const int chunk = (kk / 8) ^ (r % 8);
      const float got = (float)tile[r * 64 + chunk * 8 + kk % 8];
      wrong += got != want;
    }}
  }}
  printf("%d\\n", wrong);
  return 0;
}}
"""
        (tmp_path / f"{dtype}.cu").write_text(program)
        exe = tmp_path / dtype
        build_for_host(tmp_path, f"{dtype}.cu", str(exe), std="c++17", optimise="-O0")
        wrong = int(subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout)
        assert wrong == 0, f"{dtype}: {wrong} of {24 * 64} weights differ from the definition"


@needs_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("shape,attrs,warps,tiles,unroll", [
    ("m=3,n=72,k=640", "bits=4,group=128,bias=1", 2, 2, 0),
    ("m=3,n=72,k=640", "bits=4,group=128,zeros=1,bias=1", 2, 2, 0),
    ("m=8,n=48,k=512", "bits=4,group=256,zeros=1", 4, 1, 0),
    ("m=16,n=72,k=640", "bits=4,group=128,bias=1", 2, 2, 0),
    ("m=16,n=48,k=512", "bits=4,group=256,zeros=1", 4, 1, 0),
    ("m=11,n=72,k=640", "bits=4,group=128", 4, 2, 0),
    ("m=11,n=40,k=384", "bits=4,group=128,zeros=1,bias=1", 1, 4, 0),
    ("m=1,n=72,k=1152", "bits=4,group=128,bias=1", 2, 2, 4),
    ("m=16,n=40,k=1408", "bits=4,group=128,zeros=1", 1, 1, 4),
    ("m=5,n=48,k=640", "bits=4,group=128", 4, 1, 1),
], ids=["zero-point-8", "zero-points-bias", "zero-points-8-rows", "16-rows-bias", "16-rows-zero-points",
        "11-rows", "11-rows-zero-points-bias", "stream-1-row-unrolled-tail", "stream-16-rows-zero-points-unrolled",
        "stream-5-rows"])
def test_int4_mma_gemv_matches_float64_on_the_host(shape, attrs, warps, tiles, unroll, tmp_path):
    """int4_gemv's tensor-core kernel, compiled for the host by nvcc and run block by block with one thread per
    CUDA thread (the mma.sync and bulk copies emulated), against the workload's float64 reference on its own
    inputs: zero point 8, and zero points (zeros=1) folded in through the k-block's sum of x; a last tile past
    n, warps splitting the k-blocks unevenly; 16 activation rows (two n8 tiles of mma's N) and 11 (a partial
    second tile), with and without zero points and bias, one warp and several; and with the weights streamed into
    registers (``unroll`` k-blocks' loads together, then the k-blocks after the last whole group one at a time)."""
    import torch

    from autosched.search_spaces.templates._hopper import epilogue_source
    from autosched.search_spaces.templates.int4_gemv import _mma_source, mma_smem_bytes
    from autosched.workloads import get_operator

    wl = make_workload("dequant_gemm", shape, "float16", attrs)
    op, s, a = get_operator("dequant_gemm"), wl.shape_dict, wl.attrs_dict
    m, n, k, group = s["m"], s["n"], s["k"], a["group"]
    ins = op.make_inputs(wl, torch.Generator().manual_seed(0), "cpu")
    zeros = bool(a.get("zeros"))  # unkeyed at 0: absent from the attributes
    names = ["x", "wq", "scales"] + (["zeros"] if zeros else []) + (["bias"] if a["bias"] else [])
    for name, tensor in zip(names, ins):
        (tmp_path / f"{name}.bin").write_bytes(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    stream = unroll > 0
    name, source = _mma_source(m, n, k, -(-k // group), group, warps, tiles, a["bias"], "none", zeros, stream,
                               max(unroll, 1))
    _, store1, epilogue = epilogue_source("float16", "none")
    body = _host_body(source.removeprefix(epilogue))
    body = body.replace('asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(w), "r"(mask), "r"(0x64006400u));',
                        "r = (w & mask) | 0x64006400u;")
    body = body.replace("autosched_bulk_copy(smem", "host_bulk_copy(smem")
    body = body.replace("autosched_mbarrier_wait(bar, 0);", "host_syncwarp();")  # the copies above are done
    loads = "".join(f'  auto {v} = load<{"uint8_t" if v in ("wq", "zeros") else "half"}>("{v}.bin");\n' for v in names)
    program = HOST_SHIM + f"""
inline void host_bulk_copy(void* dst, const void* src, unsigned bytes, unsigned) {{ std::memcpy(dst, src, bytes); }}
inline void {store1}(__half* c, float v) {{ *c = __float2half_rn(v); }}
""" + body + f"""
template <class T> std::vector<T> load(const char* name) {{
  FILE* f = fopen(name, "rb"); fseek(f, 0, SEEK_END); long n = ftell(f); fseek(f, 0, SEEK_SET);
  std::vector<T> data(n / sizeof(T)); fread(data.data(), 1, n, f); fclose(f); return data;
}}
int main() {{
{loads}  std::vector<half> c({m * n});
""" + _host_blocks(-(-n // (16 * tiles)), warps, mma_smem_bytes(k, tiles, warps, m, stream),
                   f'{name}({", ".join(f"{v}.data()" for v in names)}, c.data(), (uint8_t*)smem.data(), bx, t)') + """
  FILE* f = fopen("out.bin", "wb"); fwrite(c.data(), sizeof(half), c.size(), f); fclose(f);
  return 0;
}
"""
    run_on_host(tmp_path, program)
    out = host_output(tmp_path, "out", torch.float16, (m, n))
    ref = op.reference(wl, ins)[0]
    err = (out.double() - ref).abs().max().item() / ref.abs().max().item()
    assert err < 4e-3, f"relative error {err}"


def test_int4_gemv_pipelines_groups_of_rows_on_cuda_cores(sm90):
    """``row_groups`` (the CUDA-core kernel's rows in groups, the next group's loads in flight during the products of
    the one before): its registers bound the rows per group by k's steps; tensor-core points keep one group; a
    pipelined point loads each group whole (``unroll``); points stored before the knob keep one group and their
    kernel; the pipelined kernel is a device function of its own, and the cost model sees the knob."""
    def space(shape, attrs="bits=4,group=128", dtype="float16"):
        return Task.from_workload(make_workload("dequant_gemm", shape, dtype, attrs)).space(sm90)

    s = space("m=1,n=12288,k=4096")
    base = {"warps": 4, "rows_per_warp": 2, "unroll": False, "half_products": True, "mma": False, "stream": False}
    piped = s.canonical(base | {"row_groups": 4})
    assert piped["unroll"] is True and s.validate(piped) is None
    assert "160 registers of two groups" in s.validate(piped | {"rows_per_warp": 4})  # 4 rows x 4 steps x 5, twice
    assert s.canonical(base | {"mma": True, "row_groups": 4})["row_groups"] == 1
    stored = dict(base)  # a record from before the knob
    assert s.complete(stored)["row_groups"] == 1 and str(s.apply(stored)) == str(s.apply(s.complete(stored)))
    assert "autosched_q4_pipelined" in str(s.apply(piped)) and "autosched_q4_pipelined" not in str(s.apply(stored))
    assert s.point_features(piped) != s.point_features(piped | {"row_groups": 2})
    wide = space("m=1,n=4096,k=11008")  # 11 steps of 32 chunks: one row a group
    assert wide.validate(wide.canonical(base | {"rows_per_warp": 1, "row_groups": 8})) is None
    assert "registers" in wide.validate(wide.canonical(base | {"row_groups": 8}))
    assert "more rows per block" in space("m=1,n=8,k=4096").validate(piped)
    # loads_first: one group in the pipelined kernel (every load of a lane's rows before its products)
    first = s.canonical(base | {"loads_first": True})
    assert first["unroll"] is True and first["row_groups"] == 1 and s.validate(first) is None
    assert "autosched_q4_pipelined" in str(s.apply(first)) and "_x1_" in str(s.apply(first))
    assert s.canonical(piped | {"loads_first": True})["loads_first"] is False  # the pipelined kernel's own loads
    assert s.complete(stored)["loads_first"] is False
    assert "registers of a group" in wide.validate(wide.canonical(base | {"rows_per_warp": 4, "loads_first": True}))
    assert wide.validate(wide.canonical(base | {"rows_per_warp": 2, "loads_first": True})) is None


@needs_nvcc
@pytest.mark.slow
def test_int4_gemv_pipelined_points_compile_without_spills(sm90):
    """The pipelined kernel's points with the most registers its check lets through (two rows a group at k = 4096
    with zero points and eight activation rows, fp32 and half2 products, bf16; one row at k = 11008; one group,
    ``loads_first``, of four rows at k = 4096 and of two at k = 11008) compile for sm_90a without spills."""
    from autosched.cuda_tools import cuda_source

    cases = (("m=8,n=4096,k=4096", "bits=4,group=128,zeros=1,bias=1", "float16", 2, True, 2),
             ("m=8,n=4096,k=4096", "bits=4,group=32,zeros=1", "bfloat16", 2, False, 2),
             ("m=2,n=4096,k=11008", "bits=4,group=128", "float16", 1, False, 2),
             ("m=1,n=12288,k=4096", "bits=4,group=128", "float16", 2, True, 2),
             ("m=1,n=12288,k=4096", "bits=4,group=128", "float16", 4, True, 1),  # loads_first: one group
             ("m=1,n=4096,k=11008", "bits=4,group=128", "float16", 2, True, 1))
    for shape, attrs, dtype, rows, half, groups in cases:
        space = Task.from_workload(make_workload("dequant_gemm", shape, dtype, attrs)).space(sm90)
        point = space.canonical(space.fp32_default() | {"rows_per_warp": rows, "row_groups": groups,
                                                        "loads_first": groups == 1}
                                | ({"half_products": half} if dtype == "float16" else {}))
        assert space.validate(point) is None, (shape, point)
        report = nvcc_compile(cuda_source(space.apply(point), sm90, space.build_config(point), space.codegen), "sm_90a")
        assert report.ok and report.spills == 0, (shape, point, report.log[-2000:])


@needs_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("shape,dtype,attrs,point", [
    ("m=1,n=72,k=1152", "float16", "bits=4,group=128", (2, 2, 4, True)),
    ("m=1,n=50,k=1152", "float16", "bits=4,group=128,zeros=1", (1, 2, 3, True)),
    ("m=3,n=72,k=640", "bfloat16", "bits=4,group=32,zeros=1,bias=1", (2, 1, 2, False)),
    ("m=5,n=40,k=2048", "float16", "bits=4,group=64,bias=1", (1, 4, 2, False)),
    ("m=1,n=70,k=1152", "float16", "bits=4,group=128", (1, 4, 1, True)),
    ("m=2,n=40,k=640", "bfloat16", "bits=4,group=64,zeros=1,bias=1", (2, 2, 1, False)),
], ids=["1-row-half-partial-step", "zero-points-half-odd-groups-tail", "bf16-zero-points-bias", "5-rows-4-per-group",
        "loads-first-half-tail", "loads-first-bf16-zero-points-bias"])
def test_int4_gemv_pipelined_matches_float64_on_the_host(shape, dtype, attrs, point, tmp_path):
    """int4_gemv's pipelined CUDA-core kernel (``row_groups``), compiled for the host by nvcc and run block by block
    with one thread per CUDA thread, against the workload's float64 reference on its own inputs: products in half2
    and in fp32, zero points, bias, bf16; a last step of fewer than 32 chunks (k = 1152, 640), an odd number of
    groups (the last loaded into the first of the two register sets), and the last block's rows past n; one group
    (``loads_first``)."""
    import torch

    from autosched.search_spaces.templates._hopper import epilogue_source
    from autosched.search_spaces.templates.int4_gemv import _pipelined_source
    from autosched.workloads import get_operator

    wl = make_workload("dequant_gemm", shape, dtype, attrs)
    op, s, a = get_operator("dequant_gemm"), wl.shape_dict, wl.attrs_dict
    m, n, k, group = s["m"], s["n"], s["k"], a["group"]
    ins = op.make_inputs(wl, torch.Generator().manual_seed(0), "cpu")
    zeros = bool(a.get("zeros"))
    names = ["x", "wq", "scales"] + (["zeros"] if zeros else []) + (["bias"] if a["bias"] else [])
    for name, tensor in zip(names, ins):
        (tmp_path / f"{name}.bin").write_bytes(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    warps, rows, row_groups, half = point
    p = {"warps": warps, "rows_per_warp": rows, "unroll": True, "row_groups": row_groups, "half_products": half}
    name, source = _pipelined_source(m, n, k, group, dtype, p, a["bias"], "none", zeros)
    _, store1, epilogue = epilogue_source(dtype, "none")
    scalar = CUDA_SCALAR_HOST[dtype]
    loads = "".join(f'  auto {v} = load<{"uint8_t" if v in ("wq", "zeros") else scalar}>("{v}.bin");\n' for v in names)
    program = HOST_SHIM + f"""
inline void {store1}({scalar}* c, float v) {{ *c = ({scalar})v; }}
""" + _host_body(source.removeprefix(epilogue)) + f"""
template <class T> std::vector<T> load(const char* name) {{
  FILE* f = fopen(name, "rb"); fseek(f, 0, SEEK_END); long n = ftell(f); fseek(f, 0, SEEK_SET);
  std::vector<T> data(n / sizeof(T)); fread(data.data(), 1, n, f); fclose(f); return data;
}}
int main() {{
{loads}  std::vector<{scalar}> c({m * n});
""" + _host_blocks(-(-n // (warps * rows * row_groups)), warps, 16,
                   f'{name}({", ".join(f"{v}.data()" for v in names)}, c.data(), bx, t)') + """
  FILE* f = fopen("out.bin", "wb"); fwrite(c.data(), 2, c.size(), f); fclose(f);
  return 0;
}
"""
    run_on_host(tmp_path, program)
    out = host_output(tmp_path, "out", getattr(torch, dtype), (m, n))
    ref = op.reference(wl, ins)[0]
    err = (out.double() - ref).abs().max().item() / ref.abs().max().item()
    assert err < (1e-2 if dtype == "bfloat16" else 4e-3), f"relative error {err}"


def test_hopper_gemm_streams_decode_steps_on_mma_sync_as_a_second_kernel(sm90):
    """A decode step's 2 to 16 rows of fp16 or bf16 over whole 128-byte lines of k: hopper_gemm also offers its
    streaming tensor-core kernel (the ``stream`` knobs); one row, more rows, fp8 and k off the lines do not. That
    kernel is the default (a gated GEMM's stays wgmma) and the wgmma default is the next first point; a point stored
    before the stream knobs (the wgmma kernel) is still valid and builds the same kernel; each kernel's canonical
    point fixes the other's knobs; the checks bound the warps by the steps of k and the registers of the loads in flight."""
    def space(shape, op="gemm", dtype="float16"):
        return Task.from_workload(make_workload(op, shape, dtype)).space(sm90)

    for shape, dtype in (("m=2,n=4096,k=4096", "float16"), ("m=16,n=11008,k=4096", "bfloat16"),
                         ("m=9,n=4096,k=11008", "float16")):
        streams = space(shape, dtype=dtype)
        assert "stream" in {k.name for k in streams.knobs}, shape
    for shape, op in (("m=1,n=4096,k=4096", "gemm"), ("m=17,n=4096,k=4096", "gemm"), ("m=16,n=4096,k=4104", "gemm"),
                      ("m=16,n=4096,k=4096", "fp8_gemm")):
        assert "stream" not in {k.name for k in space(shape, op).knobs}, (shape, op)
    decode = space("m=16,n=4096,k=4096")
    default, wgmma = decode.default(), decode.wgmma_default()
    assert default["stream"] is True and wgmma["stream"] is False and wgmma["swap_ab"] is True
    assert decode.first_points() == [default, wgmma] and decode.validate(default) is None
    stored = {k: v for k, v in wgmma.items() if not k.startswith("stream")}  # a record from before the knobs
    assert decode.validate(stored) is None and decode.complete(stored) == wgmma
    assert str(decode.apply(stored)) == str(decode.apply(wgmma))
    assert "mma_gemv" not in str(decode.apply(wgmma)) and "autosched_mma_gemv" in str(decode.apply(default))
    assert decode.mutate(stored, np.random.default_rng(0)) is not None
    streamed = decode.canonical({**wgmma, "stream": True, "stream_warps": 4, "split_k": 4, "stages": 12})
    assert streamed["split_k"] == 1 and streamed["stages"] == 2 and streamed["stream_warps"] == 4
    assert decode.canonical({**streamed, "stream": False})["stream_warps"] == 1
    assert "8 warps split 2 steps" in space("m=16,n=64,k=128").validate({**streamed, "stream_warps": 8})
    gated = space("m=16,n=11008,k=4096", "swiglu_gemm")  # its default stays the wgmma kernel's
    assert gated.default()["stream"] is False and gated.first_points()[-1]["stream"] is True
    assert "208 registers" in gated.validate({**gated.first_points()[-1], "stream_unroll": 4})


@needs_nvcc
@pytest.mark.slow
def test_mma_gemv_points_compile_without_spills_and_keep_their_loads_together(sm90):
    """The streaming kernel's points with the most registers its check lets through compile for sm_90a without
    spills, with one block per SM in their launch bounds (else ptxas interleaves the loads with the products to
    save registers, and few loads are in flight)."""
    cases = [("gemm", "m=16,n=4096,k=4096", "float16", "bias=1", (4, 1, 4)), ("gemm", "m=16,n=4096,k=11008",
             "bfloat16", "", (8, 2, 2)), ("gemm", "m=12,n=12288,k=4096", "float16", "", (1, 4, 1)),
             ("swiglu_gemm", "m=16,n=11008,k=4096", "float16", "", (2, 1, 2)),
             ("swiglu_gemm", "m=16,n=11008,k=4096", "bfloat16", "", (8, 2, 1))]
    for op, shape, dtype, attrs, (warps, tiles, unroll) in cases:
        space = Task.from_workload(make_workload(op, shape, dtype, attrs)).space(sm90)
        point = space.canonical({**space.default(), "stream": True, "stream_warps": warps, "stream_tiles": tiles,
                                 "stream_unroll": unroll})
        assert space.validate(point) is None, (shape, point)
        source = cuda_source(space.apply(point), sm90, {}, space.codegen)
        assert f"__launch_bounds__({32 * warps}, 1)" in source
        report = nvcc_compile(source, "sm_90a")
        assert report.ok and report.spills == 0, (shape, point, report.log[-2000:])


@needs_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("op,shape,dtype,attrs,point", [
    ("gemm", "m=16,n=40,k=640", "float16", "bias=1,act=silu", (4, 1, 2)),
    ("gemm", "m=9,n=72,k=576", "bfloat16", "", (2, 2, 2)),
    ("gemm", "m=2,n=48,k=1024", "float16", "act=gelu", (1, 1, 4)),
    ("gemm", "m=5,n=24,k=512", "bfloat16", "bias=1", (8, 2, 1)),
    ("swiglu_gemm", "m=16,n=40,k=640", "float16", "", (4, 1, 1)),
    ("swiglu_gemm", "m=3,n=24,k=448", "bfloat16", "", (2, 2, 2)),
], ids=["16-rows-bias-silu-last-tile", "9-rows-bf16-tiles-unrolled-tail", "2-rows-one-warp-gelu",
        "5-rows-8-warps-tile-past-n", "gated-16-rows", "gated-3-rows-bf16-tiles"])
def test_mma_gemv_matches_float64_on_the_host(op, shape, dtype, attrs, point, tmp_path):
    """hopper_gemm's streaming tensor-core kernel, compiled for the host by nvcc and run block by block with one
    thread per CUDA thread (mma.sync emulated), against the workload's float64 reference on its own inputs: one
    and two n8 tiles of activation rows (a partial second one), a last tile past n, warps splitting the steps of k
    unevenly, the unrolled groups and the steps after them, bias and activations, and swiglu_gemm's gate and up
    tiles."""
    import torch

    from autosched.search_spaces.templates import mma_gemv
    from autosched.search_spaces.templates._hopper import epilogue_source
    from autosched.workloads import get_operator

    wl = make_workload(op, shape, dtype, attrs)
    op_, s, a = get_operator(op), wl.shape_dict, wl.attrs_dict
    m, n, k = s["m"], s["n"], s["k"]
    gated, bias, act = op == "swiglu_gemm", bool(a.get("bias")), a.get("act", "none")
    warps, tiles, unroll = point
    p = {"stream": True, "stream_warps": warps, "stream_tiles": tiles, "stream_unroll": unroll}
    assert mma_gemv.check(m, n, k, gated, p) is None
    ins = op_.make_inputs(wl, torch.Generator().manual_seed(0), "cpu")
    names = ["x", "w"] + (["bias"] if bias else [])
    for name, tensor in zip(names, ins):
        (tmp_path / f"{name}.bin").write_bytes(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    name, source = mma_gemv.source(m, n, k, dtype, p, bias, act, gated)
    _, store1, epilogue = epilogue_source(dtype, act)
    body = _host_body(source.removeprefix(epilogue))
    scalar = CUDA_SCALAR_HOST[dtype]
    activation = {"none": "v", "silu": "v / (1.0f + std::exp(-v))",
                  "gelu": "0.5f * v * (1.0f + std::erf(v * 0.70710678118654752f))"}[act]
    program = HOST_SHIM + f"""
inline float host_expf(float v) {{ return std::exp(v); }}
inline void {store1}({scalar}* c, float v) {{ *c = ({scalar})({activation}); }}
""" + body.replace("__expf(", "host_expf(") + f"""
std::vector<{scalar}> load(const char* name) {{
  FILE* f = fopen(name, "rb"); fseek(f, 0, SEEK_END); long n = ftell(f); fseek(f, 0, SEEK_SET);
  std::vector<{scalar}> data(n / sizeof({scalar})); fread(data.data(), 1, n, f); fclose(f); return data;
}}
int main() {{
{"".join(f'  auto {v} = load("{v}.bin");' + chr(10) for v in names)}  std::vector<{scalar}> c({m * n});
""" + _host_blocks(-(-n // (16 * tiles)), warps, mma_gemv.smem_bytes(m, tiles, warps, gated),
                   f'{name}({", ".join(f"{v}.data()" for v in names)}, c.data(), (float*)smem.data(), bx, t)') + f"""
  FILE* f = fopen("out.bin", "wb"); fwrite(c.data(), sizeof({scalar}), c.size(), f); fclose(f);
  return 0;
}}
"""
    run_on_host(tmp_path, program)
    out = host_output(tmp_path, "out", ins[0].dtype, (m, n))
    ref = op_.reference(wl, ins)[0]
    err = (out.double() - ref).abs().max().item() / ref.abs().max().item()
    assert err < op_.tolerance(wl), f"relative error {err}"


@needs_nvcc
@pytest.mark.slow
def test_paged_decode_splits_a_sequence_across_a_cluster(sm90):
    """Few sequences: the pages of one are split between the CTAs of a cluster (the launch carries the
    cluster's size), every split compiles for sm_90a without spills (products on CUDA or tensor cores),
    and a split is refused where the (sequence, head) pairs already fill the GPU; older GPUs keep the
    TensorIR rows space."""
    import dataclasses

    import tvm

    task = Task.from_workload(make_workload("paged_decode_attention", "b=1,h=32,hkv=8,d=128,ctx=32768,page=16",
                                            "float16"))
    space = task.space(sm90)
    assert space.name == "paged_decode" and space.default()["split"] == 8  # 8 pairs: the most it may split
    hopper = dataclasses.replace(sm90, arch="sm_90a").tvm_target()
    for split, mma in ((2, False), (8, False), (2, True), (8, True)):  # tensor cores: one 16-token tile a step
        point = {"warps": 4, "unroll": 1 if mma else 2, "split": split, "mma": mma, "prefetch": int(mma),
                 "ctas_per_sm": 1, "tma_stages": 0}
        assert space.validate(point) is None
        with hopper:
            lowered = tvm.tirx.get_tir_pipeline("tirx")[0](tvm.tirx.transform.BindTarget(hopper)(space.apply(point)))
        assert '"clusterCtaIdx.x", "blockIdx.x"' in str(lowered["main"])
        report = nvcc_compile(cuda_source(space.apply(point), sm90, {}, space.codegen), "sm_90a")
        assert report.ok and report.spills == 0, report.log[-2000:]
    full = Task.from_workload(make_workload("paged_decode_attention", "b=16,h=32,d=128,ctx=4096,page=16", "float16"))
    assert "overfill 264 resident CTAs" in full.space(sm90).validate(
        {"warps": 4, "unroll": 2, "split": 2, "ctas_per_sm": 1})
    older = parse_target("cuda:sm_80", require_device=False)
    assert task.space(older).name == "gpu_rows"


@needs_nvcc
@pytest.mark.slow
def test_paged_decode_caps_registers_for_more_ctas_per_sm(sm90):
    """ctas_per_sm asks nvcc (through __launch_bounds__'s minimum) for registers that let that many CTAs
    share an SM, so a split of GQA 8:1 decode keeps 16 warps resident; a cap under 128 registers is
    refused before a build, and so is a split past the resident CTAs."""
    task = Task.from_workload(make_workload("paged_decode_attention", "b=16,h=32,hkv=4,d=128,ctx=4096,page=16",
                                            "float16"))
    space = task.space(sm90)
    point = {"warps": 8, "unroll": 1, "split": 4, "mma": True, "prefetch": 1, "ctas_per_sm": 2, "tma_stages": 0}
    assert space.validate(point) is None
    source = cuda_source(space.apply(point), sm90, {}, space.codegen)
    assert "__launch_bounds__(256, 2)" in source
    report = nvcc_compile(source, "sm_90a")
    assert report.ok and report.registers <= 128, report.log[-2000:]
    # Three CTAs of four warps: at most 170 registers, where the loop needs 178 uncapped.
    three = {**point, "warps": 4, "ctas_per_sm": 3}
    assert space.validate(three) is None
    report = nvcc_compile(cuda_source(space.apply(three), sm90, {}, space.codegen), "sm_90a")
    assert report.ok and report.registers <= 170, report.log[-2000:]
    assert "64 registers per thread" in space.validate({**point, "ctas_per_sm": 4})
    # 64 (sequence, head) pairs split 8 ways: 512 CTAs, resident at four per SM, not at two.
    assert space.validate({**point, "warps": 2, "split": 8, "ctas_per_sm": 4}) is None
    assert "overfill 264 resident CTAs" in space.validate({**point, "warps": 2, "split": 8, "ctas_per_sm": 2})


# A CUDA body run on the host: one OS thread per CUDA thread of one cluster's CTAs, warp shuffles, block
# and cluster barriers emulated with std::barrier, each CTA's shared memory a host buffer that the others
# can read (distributed shared memory). Enough for kernels whose body is our own CUDA (not TVM's generated
# code): it checks their indexing and arithmetic without a GPU, not their speed or their memory model.
HOST_SHIM = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>
using std::min;
struct HostDim { int x = 0, y = 0, z = 0; };
thread_local HostDim host_thread;
thread_local int host_rank;  // the CTA's rank in its cluster
static int host_warps_per_cta;
static std::barrier<>* host_cluster_barrier;
static std::vector<std::barrier<>*> host_block_barriers;  // per CTA
static std::vector<std::barrier<>*> host_warp_barriers;   // per CTA and warp
static std::vector<float*> host_smem;                      // per CTA
static float host_warp_lanes[512][32];
inline void host_syncthreads() { host_block_barriers[host_rank]->arrive_and_wait(); }
inline void host_syncwarp() { host_warp_barriers[host_rank * host_warps_per_cta + host_thread.x / 32]->arrive_and_wait(); }
inline void host_cluster_sync() { host_cluster_barrier->arrive_and_wait(); }
inline float host_remote(const float* local, int rank) { return host_smem[rank][local - host_smem[host_rank]]; }
inline float host_shfl_xor(unsigned, float v, int offset) {
  const int w = host_rank * host_warps_per_cta + host_thread.x / 32, l = host_thread.x % 32;
  host_warp_barriers[w]->arrive_and_wait();
  host_warp_lanes[w][l] = v;
  host_warp_barriers[w]->arrive_and_wait();
  return host_warp_lanes[w][l ^ offset];
}
inline float host_int_as_float(unsigned bits) { float f; std::memcpy(&f, &bits, 4); return f; }
inline unsigned long long host_cvta(const void*) { return 0; }
inline uint32_t host_byte_perm(uint32_t x, uint32_t y, uint32_t s) {
  const uint64_t bytes = (uint64_t)y << 32 | x;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= (uint32_t)(bytes >> (8 * ((s >> (4 * i)) & 7)) & 0xff) << (8 * i);
  return r;
}
// mma.sync m16n8k16 (row.col, fp32 accumulators): each lane posts its fragments, then computes its own
// accumulators from the warp's, by the PTX ISA's fragment layouts.
static uint32_t host_mma_regs[512][32][6];
template <class T> inline float host_elem(uint32_t reg, int high) {
  const uint16_t bits = high ? reg >> 16 : reg & 0xffff;
  T v; std::memcpy(&v, &bits, 2); return (float)v;
}
template <class T> inline void host_mma(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                        uint32_t b1) {
  const int w = host_rank * host_warps_per_cta + host_thread.x / 32, l = host_thread.x % 32;
  host_warp_barriers[w]->arrive_and_wait();
  const uint32_t mine[6] = {a0, a1, a2, a3, b0, b1};
  std::memcpy(host_mma_regs[w][l], mine, sizeof mine);
  host_warp_barriers[w]->arrive_and_wait();
  for (int i = 0; i < 4; ++i) {
    const int row = l / 4 + 8 * (i / 2), col = 2 * (l % 4) + i % 2;
    double acc = 0;
    for (int k = 0; k < 16; ++k) {
      const uint32_t a = host_mma_regs[w][(row % 8) * 4 + (k % 8) / 2][row / 8 + 2 * (k / 8)];
      const uint32_t b = host_mma_regs[w][col * 4 + (k % 8) / 2][4 + k / 8];
      acc += (double)host_elem<T>(a, k % 2) * host_elem<T>(b, k % 2);
    }
    c[i] += (float)acc;
  }
  host_warp_barriers[w]->arrive_and_wait();
}
// __hfma2 is device-only: one rounding of the exact a·b + c (exact in double for halves).
inline __half2 host_hfma2(__half2 a, __half2 b, __half2 c) {
  const float2 x = __half22float2(a), y = __half22float2(b), z = __half22float2(c);
  return __halves2half2(__double2half((double)x.x * y.x + z.x), __double2half((double)x.y * y.y + z.y));
}
inline void host_cp_async(void* dst, const void* src, bool valid) {
  if (valid) std::memcpy(dst, src, 16); else std::memset(dst, 0, 16);
}
"""

# The CUDA names the body uses, and the host shim's stand-ins (nvcc reserves the CUDA names for the device).
HOST_NAMES = {"threadIdx": "host_thread", "__syncthreads": "host_syncthreads", "__shfl_xor_sync": "host_shfl_xor",
              "__int_as_float": "host_int_as_float", "__cvta_generic_to_shared": "host_cvta",
              "__byte_perm": "host_byte_perm", "autosched_mma_m16n8k16<": "host_mma<",
              "autosched_cp_async(": "host_cp_async(", "__hfma2(": "host_hfma2(",
              "__syncwarp()": "host_syncwarp()"}


def _host_body(source: str) -> str:
    """Our kernel body's CUDA source made host C++: the CUDA names and PTX replaced by the shim's."""
    import re

    source = source.replace("__device__ __forceinline__", "inline")
    source = source.replace("autosched_cluster_sync();", "host_cluster_sync();")
    source = source.replace("autosched_remote_f32(&", "host_remote(&")
    # the shim's instead
    source = re.sub(r"template <> inline void autosched_mma_m16n8k16<\w+>\(.*?\n}\n", "", source, flags=re.S)
    source = re.sub(r"template <typename T> inline void autosched_mma_m16n8k16\(.*?\);\n", "", source, flags=re.S)
    source = re.sub(r"inline void autosched_cp_async\(.*?\n}\n", "", source, flags=re.S)
    for cuda_name, host_name in HOST_NAMES.items():
        source = source.replace(cuda_name, host_name)
    source = re.sub(r"asm\(\"ld\.global.*?\);\n", "v = *reinterpret_cast<const uint4*>(p);\n", source, flags=re.S)
    return re.sub(r"asm volatile\(.*?\);", ";", source, flags=re.S)


CUDA_SCALAR_HOST = {"float16": "half", "bfloat16": "nv_bfloat16"}


def _host_blocks(blocks: int, warps: int, smem_bytes: int, call: str) -> str:
    """C++ that runs ``call`` (a CUDA thread's call of a device function that runs a whole block; it sees ``smem``,
    the block's ``smem_bytes`` of shared memory as a uint4 vector, ``bx`` and ``t``) in ``blocks`` blocks of ``warps``
    warps, one host thread per CUDA thread, each block's threads meeting at its block and warp barriers."""
    return f"""  const int threads = {warps * 32};
  host_warps_per_cta = {warps};
  host_rank = 0;
  for (int bx = 0; bx < {blocks}; ++bx) {{
    std::vector<uint4> smem({smem_bytes} / 16 + 1);
    std::barrier<> block(threads);
    host_block_barriers = {{&block}};
    host_warp_barriers.clear();
    for (int w = 0; w < {warps}; ++w) host_warp_barriers.push_back(new std::barrier<>(32));
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {{
        host_thread.x = t;
        {call};
      }});
    for (auto& th : pool) th.join();
    for (auto* b : host_warp_barriers) delete b;
  }}"""


def _run_streaming_gemv(tmp_path, program: str, args: str, blocks: int, warps: int, scalar: str, op, wl, ins):
    """Run a streaming GEMV's host ``program`` (the shim, the kernel as ``main_kernel`` and a ``main`` that has
    loaded its inputs and made ``C``, left open here): each CTA of ``blocks`` as ``warps`` warps of threads that
    meet at their warp's barrier, ``main_kernel(args)`` in each; then C against the workload's float64
    reference within its tolerance."""
    program += f"""  host_warps_per_cta = {warps};
  host_rank = 0;
  for (int bx = 0; bx < {blocks}; ++bx) {{
    host_warp_barriers.clear();
    for (int w = 0; w < {warps}; ++w) host_warp_barriers.push_back(new std::barrier<>(32));
    std::vector<std::thread> pool;
    for (int t = 0; t < {warps * 32}; ++t)
      pool.emplace_back([&, t] {{
        host_thread.x = t;
        host_block.x = bx;
        main_kernel({args});
      }});
    for (auto& th : pool) th.join();
    for (auto* b : host_warp_barriers) delete b;
  }}
  FILE* f = fopen("out.bin", "wb"); fwrite(C.data(), sizeof({scalar}), C.size(), f); fclose(f);
  return 0;
}}
"""
    run_on_host(tmp_path, program)
    m, n = wl.shape_dict["m"], wl.shape_dict["n"]
    out = host_output(tmp_path, "out", ins[0].dtype, (m, n))
    ref = op.reference(wl, ins)[0]
    err = (out.double() - ref).abs().max().item() / ref.abs().max().item()
    assert err < op.tolerance(wl), f"relative error {err}"


@needs_nvcc
@pytest.mark.parametrize("shape,dtype,attrs,point", [
    ("m=3,n=37,k=3152", "float16", "bits=8,group=3152,fmt=e4m3,bias=1,act=silu",
     {"warps": 2, "rows_per_warp": 4, "unroll": True}),
    ("m=8,n=21,k=1040", "bfloat16", "bits=8,group=1040,bias=1,act=gelu", {"warps": 1, "rows_per_warp": 2, "unroll": False}),
    ("m=1,n=50,k=512", "float16", "bits=8,group=512", {"warps": 4, "rows_per_warp": 2, "unroll": True}),
    ("m=5,n=24,k=8192", "bfloat16", "bits=8,group=8192,fmt=e4m3", {"warps": 8, "rows_per_warp": 1, "unroll": True}),
], ids=["e4m3-fp16-silu-tail-odd-n", "int8-bf16-gelu-8-rows", "int8-fp16-one-step", "e4m3-bf16-unrolled-16"])
def test_gemv8_kernel_matches_float64_on_the_host(shape, dtype, attrs, point, tmp_path):
    """gemv8's whole kernel as TVM generates it (its indexing, the loop's unrolled parts and last partial step, the
    last block's rows past n read again and not stored, the scale, E4M3's 256, bias and activation), compiled for
    the host by nvcc and run block by block with one thread per CUDA thread (warp shuffles emulated), against the
    workload's float64 reference on its own inputs."""
    import torch

    from autosched.search_spaces.templates._hopper import cuda_file
    from autosched.search_spaces.templates.gemv8 import _dot_source
    from autosched.workloads import get_operator

    sm90 = parse_target("cuda:sm_90", require_device=False)
    wl = make_workload("dequant_gemm", shape, dtype, attrs)
    op, s, a = get_operator("dequant_gemm"), wl.shape_dict, wl.attrs_dict
    m, n = s["m"], s["n"]
    task = Task.from_workload(wl)
    space = task.space(sm90)
    assert space.name == "gemv8" and space.validate(point) is None
    source = cuda_source(space.apply(point), sm90, {}, space.codegen)
    params, body = re.search(r"main_kernel\(([^)]*)\) \{\n(.*)\}\n\s*$", source, flags=re.S).groups()
    names = [p.split()[-1].removesuffix("_ptr") for p in params.split(",")]
    assert set(names) == {"A", "Wq", "S", "C"} | ({"Bias"} if a["bias"] else set()), names
    ins = op.make_inputs(wl, torch.Generator().manual_seed(0), "cpu")
    for name, tensor in zip(["A", "Wq", "S"] + (["Bias"] if a["bias"] else []), ins):
        (tmp_path / f"{name}.bin").write_bytes(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    fmt = a.get("fmt", "int")
    dot, dot_helper = _dot_source(dtype, m, fmt)
    common = cuda_file("common.cuh")  # of the helper library, only the dtype table: the host's load below
    dot_helper = dot_helper.replace(common, common[:common.index("// Two floats as one")] + "#endif\n")
    dot_helper = dot_helper.replace("__device__ __forceinline__", "inline").replace("__uint_as_float(", "host_uint_as_float(")
    scalar = CUDA_SCALAR_HOST[dtype]
    act = {"none": "x", "silu": "x / (1.0f + std::exp(-x))",
           "gelu": "0.5f * x * (1.0f + std::erf(x * 0.70710678118654752f))"}[a["act"]]
    tag = f"{'f16' if dtype == 'float16' else 'bf16'}_{a['act']}"
    body = _host_body(body).replace("blockIdx", "host_block").replace("__shfl_sync(", "host_shfl_idx(")
    types = {"A": scalar, "Wq": "int8_t" if fmt == "int" else "uint8_t", "S": scalar, "Bias": scalar, "C": scalar}
    program = HOST_SHIM + f"""
typedef unsigned char uchar;
thread_local HostDim host_block;
inline int host_shfl_idx(unsigned, int v, int, int) {{ return v; }}  // the warp's own index: the same in every lane
inline float host_uint_as_float(uint32_t bits) {{ float f; std::memcpy(&f, &bits, 4); return f; }}
inline uint4 autosched_ld_stream_v4(const void* p) {{ return *reinterpret_cast<const uint4*>(p); }}
inline void autosched_warp_sum(float& x) {{ for (int o = 16; o > 0; o >>= 1) x += host_shfl_xor(0xffffffffu, x, o); }}
inline void autosched_store1_{tag}({scalar}* c, float x) {{ *c = ({scalar})({act}); }}
{dot_helper}
void main_kernel({params}) {{
{body}}}
template <class T> std::vector<T> load(const char* name) {{
  FILE* f = fopen(name, "rb"); fseek(f, 0, SEEK_END); long n = ftell(f); fseek(f, 0, SEEK_SET);
  std::vector<T> data(n / sizeof(T)); fread(data.data(), 1, n, f); fclose(f); return data;
}}
int main() {{
{"".join(f'  auto {v} = load<{types[v]}>("{v}.bin");' + chr(10) for v in names if v != "C")}  std::vector<{scalar}> C({m * n});
"""
    _run_streaming_gemv(tmp_path, program, f'{", ".join(f"({types[v]}*){v}.data()" for v in names)}',
                        -(-n // (point["warps"] * point["rows_per_warp"])), point["warps"], scalar, op, wl, ins)



def test_swiglu_gemv_serves_decode_steps_of_swiglu_gemm_on_sm90_only(sm90):
    """The streaming SwiGLU kernel takes swiglu_gemm's one to eight rows of fp16 or bf16 on sm_90 where k is whole
    16-byte chunks; nine rows on stay hopper_gemm's. Its checks bound the accumulators (two per row and column, at
    most 32) and the columns per block, and ``unroll`` is canonically off where one step would be unrolled."""

    def space(shape, dtype="float16"):
        return Task.from_workload(make_workload("swiglu_gemm", shape, dtype)).space(sm90)

    for m in range(1, 9):
        for dtype in ("float16", "bfloat16"):
            assert space(f"m={m},n=11008,k=4096", dtype).name == "swiglu_gemv", (m, dtype)
    assert space("m=9,n=11008,k=4096").name == "hopper_gemm"
    assert space("m=128,n=11008,k=4096").name == "hopper_gemm"
    decode = space("m=8,n=4096,k=4096")
    assert (decode.steps(), decode.full_steps()) == (16, 16)
    assert decode.default() == {"warps": 4, "cols_per_warp": 1, "unroll": True}
    assert decode.unrolled(decode.default()) == 8 and decode.unrolled({"warps": 1, "cols_per_warp": 2, "unroll": True}) == 4
    assert decode.validate({"warps": 1, "cols_per_warp": 2, "unroll": True}) is None  # 32 accumulators
    assert "40 accumulators" in space("m=5,n=4096,k=4096").validate({"warps": 1, "cols_per_warp": 4, "unroll": True})
    assert "more columns per block" in space("m=1,n=8,k=256").validate({"warps": 8, "cols_per_warp": 4, "unroll": False})
    assert space("m=1,n=64,k=200").canonical({"warps": 1, "cols_per_warp": 1, "unroll": True})["unroll"] is False


@needs_nvcc
@pytest.mark.parametrize("shape,dtype,point", [
    ("m=1,n=37,k=1048", "float16", {"warps": 2, "cols_per_warp": 4, "unroll": True}),
    ("m=8,n=21,k=3144", "bfloat16", {"warps": 1, "cols_per_warp": 2, "unroll": True}),
    ("m=8,n=50,k=200", "float16", {"warps": 4, "cols_per_warp": 1, "unroll": False}),
    ("m=1,n=24,k=4096", "bfloat16", {"warps": 8, "cols_per_warp": 1, "unroll": True}),
], ids=["m1-fp16-tail-odd-n", "m8-bf16-tail-unrolled", "m8-fp16-one-step", "m1-bf16-unrolled-8"])
def test_swiglu_gemv_kernel_matches_float64_on_the_host(shape, dtype, point, tmp_path):
    """swiglu_gemv's whole kernel as TVM generates it (its indexing of the gate and up rows, the loop's unrolled parts
    and last partial step, the last block's columns past n read again and not stored, SiLU(gate) · up), compiled
    for the host by nvcc and run block by block with one thread per CUDA thread (warp shuffles emulated), against
    the workload's float64 reference on its own inputs."""
    import torch

    from autosched.search_spaces.templates._hopper import cuda_file
    from autosched.search_spaces.templates.swiglu_gemv import _dot_source
    from autosched.workloads import get_operator

    sm90 = parse_target("cuda:sm_90", require_device=False)
    wl = make_workload("swiglu_gemm", shape, dtype)
    op, s = get_operator("swiglu_gemm"), wl.shape_dict
    m, n = s["m"], s["n"]
    space = Task.from_workload(wl).space(sm90)
    assert space.name == "swiglu_gemv" and space.validate(point) is None and space.canonical(point) == point
    source = cuda_source(space.apply(point), sm90, {}, space.codegen)
    params, body = re.search(r"main_kernel\(([^)]*)\) \{\n(.*)\}\n\s*$", source, flags=re.S).groups()
    names = [p.split()[-1].removesuffix("_ptr") for p in params.split(",")]
    assert set(names) == {"A", "W", "C"}, names
    ins = op.make_inputs(wl, torch.Generator().manual_seed(0), "cpu")
    for name, tensor in zip(["A", "W"], ins):
        (tmp_path / f"{name}.bin").write_bytes(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    _, dot_helper = _dot_source(dtype, m)
    common = cuda_file("common.cuh")  # of the helper library, the dtype table and unpack8: the host's load below
    dot_helper = dot_helper.replace(common, common[:common.index("// Loads 16 bytes that are read once")] + "#endif\n")
    dot_helper = dot_helper.replace("__device__ __forceinline__", "inline")
    scalar = CUDA_SCALAR_HOST[dtype]
    tag = f"{'f16' if dtype == 'float16' else 'bf16'}_none"
    body = _host_body(body).replace("blockIdx", "host_block").replace("__shfl_sync(", "host_shfl_idx(")
    program = HOST_SHIM + f"""
thread_local HostDim host_block;
inline int host_shfl_idx(unsigned, int v, int, int) {{ return v; }}  // the warp's own index: the same in every lane
inline uint4 autosched_ld_stream_v4(const void* p) {{ return *reinterpret_cast<const uint4*>(p); }}
inline void autosched_warp_sum(float& x) {{ for (int o = 16; o > 0; o >>= 1) x += host_shfl_xor(0xffffffffu, x, o); }}
inline void autosched_store1_{tag}({scalar}* c, float x) {{ *c = ({scalar})x; }}
{dot_helper}
void main_kernel({params}) {{
{body}}}
std::vector<{scalar}> load(const char* name) {{
  FILE* f = fopen(name, "rb"); fseek(f, 0, SEEK_END); long n = ftell(f); fseek(f, 0, SEEK_SET);
  std::vector<{scalar}> data(n / sizeof({scalar})); fread(data.data(), 1, n, f); fclose(f); return data;
}}
int main() {{
  auto A = load("A.bin");
  auto W = load("W.bin");
  std::vector<{scalar}> C({m * n});
"""
    _run_streaming_gemv(tmp_path, program, ", ".join(f"{v}.data()" for v in names),
                        -(-n // (point["warps"] * point["cols_per_warp"])), point["warps"], scalar, op, wl, ins)


@needs_nvcc
def test_paged_decode_tma_loop_is_the_gqa_default_and_compiles(sm90):
    """GQA 8:1 decode defaults to the TMA-fed loop in one wave (split 2 for 64 pairs on 132 SMs, a ring of 16
    pages); its source has the producer's tensor-map loads and the in-register transposes, one more warp
    than its consumers, and compiles for sm_90a without spills in fewer registers than the register-fed
    loop's 178. Rings shorter than the consumer warps, and groups the single n-tile cannot hold, are
    refused."""
    space = Task.from_workload(make_workload("paged_decode_attention", "b=16,h=32,hkv=4,d=128,ctx=4096,page=16",
                                             "float16")).space(sm90)
    point = space.default()
    assert (point["tma_stages"], point["split"], point["warps"]) == (16, 2, 4)
    source = cuda_source(space.apply(point), sm90, {}, space.codegen)
    assert "cp.async.bulk.tensor.3d" in source and "movmatrix.sync.aligned.m8n8.trans.b16" in source
    assert "__launch_bounds__(160" in source
    report = nvcc_compile(source, "sm_90a")
    assert report.ok and report.spills == 0 and report.registers < 178, report.log[-2000:]
    assert "tma_stages must be at least warps" in space.validate({**point, "warps": 8, "tma_stages": 4})
    assert "tensor-core loop of its own" in space.validate({**point, "prefetch": 1})
    for shape in ("b=2,h=32,hkv=2,d=128,ctx=256,page=16", "b=2,h=8,hkv=4,d=256,ctx=256,page=16"):
        wide = Task.from_workload(make_workload("paged_decode_attention", shape, "float16")).space(sm90)
        assert "tma_stages" not in {knob.name for knob in wide.knobs}

@needs_nvcc
@pytest.mark.parametrize("shape,dtype,point", [
    ("b=3,h=8,hkv=2,d=128,ctx=150,page=16", "float16", {"warps": 4, "unroll": 4, "split": 1}),
    ("b=2,h=4,hkv=4,d=64,ctx=100,page=16", "bfloat16", {"warps": 2, "unroll": 1, "split": 1}),
    ("b=2,h=2,hkv=1,d=256,ctx=70,page=16", "float16", {"warps": 2, "unroll": 2, "split": 1}),
    ("b=2,h=8,hkv=2,d=128,ctx=300,page=16", "float16", {"warps": 2, "unroll": 2, "split": 4}),
    ("b=1,h=2,hkv=1,d=64,ctx=40,page=16", "bfloat16", {"warps": 2, "unroll": 1, "split": 8}),
    ("b=3,h=16,hkv=2,d=128,ctx=150,page=16", "float16", {"warps": 4, "unroll": 1, "split": 1, "mma": True}),
    ("b=2,h=16,hkv=1,d=64,ctx=100,page=16", "bfloat16", {"warps": 2, "unroll": 2, "split": 1, "mma": True}),
    ("b=2,h=8,hkv=4,d=128,ctx=300,page=16", "float16", {"warps": 2, "unroll": 1, "split": 4, "mma": True}),
    ("b=3,h=16,hkv=2,d=128,ctx=230,page=16", "float16", {"warps": 2, "unroll": 3, "split": 2, "mma": True}),
    ("b=3,h=16,hkv=2,d=128,ctx=230,page=16", "float16",
     {"warps": 2, "unroll": 1, "split": 2, "mma": True, "prefetch": 2}),
], ids=["gqa4-d128-fp16", "mha-d64-bf16", "gqa2-d256-fp16", "gqa4-split4", "split8-more-ctas-than-pages",
        "mma-gqa8-d128-fp16", "mma-ring2-gqa16-d64-bf16", "mma-gqa2-split4", "mma-ring3-split2",
        "mma-prefetch2-split2"])
def test_paged_decode_body_matches_the_reference_on_the_host(shape, dtype, point, tmp_path):
    """The paged-decode kernel's body, compiled for the host by nvcc and run CTA by CTA with one thread
    per CUDA thread, against the workload's float64 reference on its own inputs (a shorter last
    sequence, shuffled pages)."""
    import torch

    from autosched.search_spaces.templates.paged_decode import body_config, body_source, ring_stages, smem_floats
    from autosched.workloads import get_operator

    wl = make_workload("paged_decode_attention", shape, dtype)
    op = get_operator("paged_decode_attention")
    ins = op.make_inputs(wl, torch.Generator().manual_seed(0), "cpu")
    s = wl.shape_dict
    pps = -(-s["ctx"] // s["page"])
    split = point["split"]
    words = smem_floats(s["h"] // s["hkv"], s["d"], point["warps"], pps, split, ring_stages(point))
    body = body_source("paged_decode_body", dtype, body_config(s["h"], s["hkv"], s["d"], s["page"], pps, point))
    for name, tensor in zip(("q", "k", "v", "table", "lens"), ins):
        (tmp_path / f"{name}.bin").write_bytes(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    scalar = "half" if dtype == "float16" else "nv_bfloat16"
    program = HOST_SHIM + _host_body(body) + f"""
template <class T> std::vector<T> load(const char* name) {{
  FILE* f = fopen(name, "rb"); fseek(f, 0, SEEK_END); long n = ftell(f); fseek(f, 0, SEEK_SET);
  std::vector<T> data(n / sizeof(T)); fread(data.data(), 1, n, f); fclose(f); return data;
}}
int main() {{
  auto q = load<{scalar}>("q.bin"); auto k = load<{scalar}>("k.bin"); auto v = load<{scalar}>("v.bin");
  auto table = load<int>("table.bin"); auto lens = load<int>("lens.bin");
  std::vector<{scalar}> out(q.size());
  const int threads = {point["warps"]} * 32, split = {split};
  host_warps_per_cta = {point["warps"]};
  for (int pair = 0; pair < {s["b"] * s["hkv"]}; ++pair) {{  // one cluster at a time
    std::barrier<> cluster(threads * split);
    host_cluster_barrier = &cluster;
    std::vector<std::vector<float>> smem(split, std::vector<float>({words}, -1.f));
    host_block_barriers.clear(); host_warp_barriers.clear(); host_smem.clear();
    for (int r = 0; r < split; ++r) {{
      host_block_barriers.push_back(new std::barrier<>(threads));
      host_smem.push_back(smem[r].data());
      for (int w = 0; w < {point["warps"]}; ++w) host_warp_barriers.push_back(new std::barrier<>(32));
    }}
    std::vector<std::thread> pool;
    for (int t = 0; t < threads * split; ++t)
      pool.emplace_back([&, t] {{
        host_rank = t / threads;
        host_thread.x = t % threads;
        paged_decode_body(q.data(), k.data(), v.data(), table.data(), lens.data(), out.data(), host_smem[host_rank],
                          pair, host_rank);
      }});
    for (auto& th : pool) th.join();
    for (auto* b : host_block_barriers) delete b;
    for (auto* b : host_warp_barriers) delete b;
  }}
  FILE* f = fopen("out.bin", "wb"); fwrite(out.data(), sizeof({scalar}), out.size(), f); fclose(f);
  return 0;
}}
"""
    run_on_host(tmp_path, program)
    out = host_output(tmp_path, "out", ins[0].dtype, ins[0].shape)
    ref = op.reference(wl, ins)[0]
    err = (out.double() - ref).abs().max().item() / ref.abs().max().item()
    assert err < 1e-2, f"relative error {err}"



@pytest.mark.slow
@needs_nvcc
def test_pingpong_attention_takes_turns_through_named_barriers(sm90):
    """hopper_attention's ping-pong, alone, with the overlapped loop and with the widest KV tile, compiles
    for sm_90a without spills, syncs on a warpgroup's own named barrier and arrives on the other's, and is
    refused with one consumer."""
    task = Task.from_workload(make_workload("attention", "b=1,h=4,hkv=2,s=200,d=128", "float16", "causal=1"))
    space = task.space(sm90)
    point = {**space.default(), "pingpong": True}
    assert space.validate(point) is None
    source = cuda_source(space.apply(point), sm90, {}, space.codegen)
    assert {"sync", "handover"} <= set(TURN_CALLS.findall(source))
    report = nvcc_compile(source, "sm_90a")
    assert report.ok and report.spills == 0, report.log[-2000:]
    assert "ping-pong" in space.validate({**point, "consumers": 1})
    for kv in (point["block_kv"], 176):
        both = {**point, "overlap": True, "block_kv": kv}
        assert space.validate(both) is None
        source = cuda_source(space.apply(both), sm90, {}, space.codegen)
        assert "sync" in TURN_CALLS.findall(source) and "wgmma.wait_group.sync.aligned 1" in source
        assert f"m64n{kv}k16" in source
        report = nvcc_compile(source, "sm_90a")
        assert report.ok and report.spills == 0, report.log[-2000:]
    serial = cuda_source(space.apply(space.default()), sm90, {}, space.codegen)
    assert not TURN_CALLS.search(serial)


@needs_nvcc
@pytest.mark.slow
def test_overlapped_softmax_compiles_and_leaves_the_serial_kernel_as_it_was(sm90):
    """The overlap knob issues tile j's QKᵀ and tile j - 1's P·V together (two wgmma groups in flight,
    the first waited with wait_group 1); it compiles for sm_90a without spills, and without it the
    kernel waits for every group (wait_group 0 only)."""
    task = Task.from_workload(make_workload("attention", "b=1,h=4,hkv=2,s=200,d=128", "float16", "causal=1"))
    space = task.space(sm90)
    serial, overlapped = ({**space.default(), "overlap": flag} for flag in (False, True))
    for point in (serial, overlapped):
        assert space.validate(point) is None
    sources = {flag: cuda_source(space.apply(p), sm90, {}, space.codegen) for flag, p in ((False, serial),
                                                                                         (True, overlapped))}
    assert "wgmma.wait_group.sync.aligned 1" not in sources[False]
    assert "wgmma.wait_group.sync.aligned 1" in sources[True]
    report = nvcc_compile(sources[True], "sm_90a")
    assert report.ok and report.spills == 0, report.log[-2000:]


# Workloads of each template space on which, together, it offers every knob it has a valid choice for.
TEMPLATE_CASES = {
    "hopper_gemm": [("gemm", "m=16,n=4096,k=4096", "float16", ""), ("gemm", "m=64,n=4096,k=4096", "float16", ""),
                    ("gemm", "m=2048,n=4096,k=1024", "float16", "")],
    "hopper_fp8_gemm": [("fp8_gemm", "m=16,n=4096,k=4096", "float16", ""), ("fp8_gemm", "m=2048,n=4096,k=1024", "float16", "")],
    "int4_gemv": [("dequant_gemm", "m=8,n=2048,k=1024", "float16", "bits=4,group=128")],
    "gemv8": [("dequant_gemm", "m=4,n=2048,k=4096", "bfloat16", "bits=8,group=4096,fmt=e4m3")],
    "swiglu_gemv": [("swiglu_gemm", "m=4,n=2048,k=4096", "bfloat16", "")],
    "hopper_dequant_gemm": [("dequant_gemm", "m=2048,n=4096,k=256", "float16", "bits=4,group=128")],
    "paged_decode": [("paged_decode_attention", "b=2,h=16,hkv=2,d=128,ctx=600,page=16", "float16", "")],
    "hopper_attention": [("attention", "b=1,h=4,hkv=2,s=300,d=64", "float16", "causal=1")],
    "moe_grouped_gemm": [("moe_grouped_gemm", "m=1024,e=8,n=4096,k=4096", "float16", "")],
}


@pytest.mark.parametrize("space_name", sorted(TEMPLATE_CASES))
def test_every_knob_of_a_template_changes_its_point_features(space_name, sm90):
    """The cost model sees a template's point only through ``point_features``: two valid points that differ in
    one knob, any knob, must not look the same to it."""
    from autosched.search_spaces import space_classes
    from autosched.search_spaces.templates._hopper import HopperTemplate

    assert set(TEMPLATE_CASES) == {name for name, cls in space_classes().items() if issubclass(cls, HopperTemplate)}
    seen = set()
    for op, shape, dtype, attrs in TEMPLATE_CASES[space_name]:
        space = Task.from_workload(make_workload(op, shape, dtype, attrs)).space(sm90)
        assert space.name == space_name
        rng = np.random.default_rng(0)
        bases = [space.default()] + [space.sample(rng) for _ in range(200)]
        for knob in space.knobs:
            pairs = [(p, space.canonical({**p, knob.name: v})) for p in bases for v in knob.choices if v != p[knob.name]]
            for p, q in pairs:
                if q[knob.name] != p[knob.name] and space.validate(q) is None:
                    seen.add(knob.name)
                    assert space.point_features(p) != space.point_features(q), f"{knob.name}: {p} -> {q}"
    knobs = {knob.name for op, shape, dtype, attrs in TEMPLATE_CASES[space_name]
             for knob in Task.from_workload(make_workload(op, shape, dtype, attrs)).space(sm90).knobs}
    assert seen == knobs, f"{space_name}: no valid pair of points differs in {sorted(knobs - seen)} alone"


def test_a_bug_in_a_templates_generator_stops_the_build_with_its_traceback(sm90, tmp_path, monkeypatch):
    """A Python exception inside a template's kernel generator is raised as TemplateBugError (naming the space
    and carrying the generator's traceback), not returned as one more failed candidate; a point the space
    refuses stays a failed candidate."""
    from autosched.errors import TemplateBugError
    from autosched.measure._worker import build_candidate
    from autosched.search_spaces.templates import paged_decode

    task = Task.from_workload(make_workload("paged_decode_attention", "b=2,h=4,hkv=2,d=64,ctx=200,page=16", "float16"))
    point = task.space(sm90).default()

    def broken(h, hkv, d, page, pps, p):
        return {"D": d} | {"SPLIT": p["no such knob"]}

    monkeypatch.setattr(paged_decode, "body_config", broken)
    with pytest.raises(TemplateBugError) as raised:
        build_candidate(task.spec, sm90, point, str(tmp_path / "kernel.so"))
    message = str(raised.value)
    assert "template space 'paged_decode'" in message and "in broken" in message and "KeyError" in message
    refused = build_candidate(task.spec, sm90, {**point, "warps": 3}, str(tmp_path / "kernel.so"))
    assert refused.artifact is None and refused.error_kind == "space"


@needs_nvcc
@pytest.mark.parametrize("name", sorted(p.name for p in
                                        (Path(__file__).resolve().parent.parent / "search_spaces/templates/cuda").iterdir()
                                        if p.suffix in (".cuh", ".cu")))
def test_each_cuda_file_of_the_templates_compiles_on_its_own(name, tmp_path):
    """Each CUDA file of the kernel templates compiles alone with nvcc for sm_90a (its includes found beside it),
    and as the text a kernel carries (includes inlined)."""
    import subprocess

    from autosched.search_spaces.templates._hopper import CUDA_DIR, cuda_file

    for source, flags in ((CUDA_DIR / name, ["-I", str(CUDA_DIR)]), (tmp_path / "inlined.cu", [])):
        if not source.exists():
            source.write_text(cuda_file(name) + cuda_file(name))  # twice: the include guards hold
        proc = subprocess.run(["nvcc", "-c", "-x", "cu", "-gencode=arch=compute_90a,code=sm_90a", *flags,
                               "-o", str(tmp_path / "out.o"), str(source)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
