"""Programmatic dependent launch (``autosched.pipeline.launch``): every GPU kernel of the main module first waits
for the grid before it, then releases the next, and carries TVM's launch attribute."""

from __future__ import annotations

import re

import pytest

from autosched.errors import UsageError
from autosched.pipeline.launch import LAUNCH_PARAMS_ATTR, PDL_TAG, WeightPrefetch, with_programmatic_launch
from autosched.target import parse_target


def _two_kernels():
    from tvm.script import tirx as T

    @T.prim_func
    def func(A: T.Buffer((256,), "float32"), B: T.Buffer((256,), "float32"), n: T.int32):
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        if n > 0:
            for bx in T.thread_binding(2, thread="blockIdx.x"):
                for tx in T.thread_binding(128, thread="threadIdx.x"):
                    B[bx * 128 + tx] = A[bx * 128 + tx] * T.float32(2)
        for bx in T.thread_binding(2, thread="blockIdx.x"):
            for tx in T.thread_binding(128, thread="threadIdx.x"):
                A[bx * 128 + tx] = B[bx * 128 + tx] + T.float32(1)

    return func


def test_each_kernel_waits_for_the_grid_before_it_then_releases_the_next():
    func = with_programmatic_launch(_two_kernels())
    assert list(func.attrs[LAUNCH_PARAMS_ATTR]) == [PDL_TAG]
    text = func.script()
    # Both launch loops (one under a condition) start with the wait, then the trigger, before any access.
    syncs = re.findall(r'for bx in T.thread_binding\(2, thread="blockIdx.x"\):\n\s+T.ptx.griddepcontrol\("wait", ""\)\n'
                       r'\s+T.ptx.griddepcontrol\("launch_dependents", ""\)\n\s+for tx', text)
    assert len(syncs) == 2, text
    assert with_programmatic_launch(func).same_as(func)  # the attribute set already: untouched


def test_the_pass_rewrites_only_the_kernels_it_is_given():
    import tvm

    from autosched.pipeline.launch import programmatic_launch

    mod = tvm.IRModule({"one": _two_kernels().with_attr("global_symbol", "one"),
                        "two": _two_kernels().with_attr("global_symbol", "two")})
    out = programmatic_launch(frozenset({"two"}))(mod)
    assert LAUNCH_PARAMS_ATTR not in out["one"].attrs and list(out["two"].attrs[LAUNCH_PARAMS_ATTR]) == [PDL_TAG]
    assert all(LAUNCH_PARAMS_ATTR in f.attrs for f in programmatic_launch()(mod).functions.values())


@pytest.mark.slow  # a whole model lowered for sm_90: room in the fast tier
def test_the_kernels_of_small_decode_steps_are_those_no_other_function_calls():
    """programmatic_rows=N in a generation build: the kernels of decode_b<n> (n <= N) that no other function
    calls (the batch-1 step's GEMVs, not the batch-4 step's GEMMs nor kernels both share)."""
    from autosched.examples.hf import TINY, _config
    from autosched.generation.build import lower_generation, small_decode_kernels
    from autosched.generation.decoder import config_from_hf
    from autosched.pipeline.tasks import kernel_calls

    target = parse_target("cuda:sm_90a", require_device=False)
    lowered, _ = lower_generation(config_from_hf(_config("llama", TINY)[0], "float16"), target, decode_batches=(1, 4),
                                  prefill_chunks=(32,))
    small = small_decode_kernels(lowered, 1)
    b1, b4 = (set(kernel_calls(lowered, lambda name, n=n: name == f"decode_b{n}")) for n in (1, 4))
    others = set(kernel_calls(lowered, lambda name: name not in ("decode_b1", "decode_b4")))
    assert small and small <= b1 and not small & (b4 | others)
    assert b1 - small <= b4 | others  # every kernel of the batch-1 step left out is called elsewhere too
    assert small_decode_kernels(lowered, 4) >= small | (b4 - b1 - others)

    # Of those, the GEMMs prefetch their weight (the second input): not the embedding lookup nor the norms.
    from autosched.generation.build import weight_prefetches

    prefetch = weight_prefetches(lowered, 1 << 20, small)
    gemms = {name for name in small if name.startswith("autosched_gemm")}
    assert gemms and set(prefetch) == gemms, (prefetch, small)
    assert all(p == WeightPrefetch(1, 1 << 20) for p in prefetch.values())
    assert set(weight_prefetches(lowered, 1 << 20)) >= gemms | {n for n in b4 if n.startswith("autosched_gemm")}


def _gemv():
    from tvm.script import tirx as T

    @T.prim_func
    def func(A: T.Buffer((1, 64), "float16"), W: T.Buffer((1000, 64), "float16"), C: T.Buffer((1, 1000), "float32")):
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        for bx in T.thread_binding(125, thread="blockIdx.x"):
            for ty in T.thread_binding(8, thread="threadIdx.y"):
                for tx in T.thread_binding(32, thread="threadIdx.x"):
                    if tx == 0:
                        C[0, bx * 8 + ty] = T.float32(0)
                        for k in range(64):
                            C[0, bx * 8 + ty] += T.Cast("float32", A[0, k] * W[bx * 8 + ty, k])

    return func


def test_a_gemv_asks_l2_for_its_blocks_share_of_the_weight_before_it_waits():
    """With a WeightPrefetch, thread 0 of each block prefetches the block's share of the weight (the blocks'
    equal shares in order: block b's 8 rows of 128 bytes), at most the budget over all blocks, before the wait;
    a budget under 16 bytes a block prefetches nothing."""
    text = with_programmatic_launch(_gemv(), WeightPrefetch(1, 125 * 1024)).script()
    prefetch = re.search(r'for bx in T.thread_binding\(125, thread="blockIdx.x"\):\n'
                         r'\s+for prefetch_threadIdx_y in T.thread_binding\(8, thread="threadIdx.y"\):\n'
                         r'\s+for prefetch_threadIdx_x in T.thread_binding\(32, thread="threadIdx.x"\):\n'
                         r'\s+if prefetch_threadIdx_y == 0 and prefetch_threadIdx_x == 0:\n'
                         r'\s+if bx \* 1024 \+ 16 <= 128000:\n'
                         r'\s+T.ptx.cp\(T.address_of\(W\[bx \* 512 // 64 % 1000, bx \* 512 % 64\]\), '
                         r'T.Cast\("uint32", T.min\(1024, \(128000 - bx \* 1024\) // 16 \* 16\)\), "async", "bulk", '
                         r'"prefetch", "L2", "global", "", ""\)\n'
                         r'\s+T.ptx.griddepcontrol\("wait", ""\)', text)
    assert prefetch, text
    capped = with_programmatic_launch(_gemv(), WeightPrefetch(1, 125 * 256)).script()
    assert "T.min(256, (128000 - bx * 1024) // 16 * 16)" in capped, capped
    unfetched = with_programmatic_launch(_gemv(), WeightPrefetch(1, 125 * 8)).script()
    assert "prefetch" not in unfetched and 'griddepcontrol("wait"' in unfetched


def test_a_tirx_gemv_prefetches_from_its_first_thread_before_it_waits():
    """int4_gemv's CUDA-core kernel (a TIRx kernel: its CTA and thread ids in its preamble): thread 0 of each CTA
    prefetches the CTA's 4 packed rows (4 x 2048 bytes) of Wq, then every thread waits."""
    from autosched.search_spaces.templates.int4_gemv import int4_gemv_kernel

    point = {"warps": 1, "rows_per_warp": 4, "unroll": True, "half_products": True}
    kernel = int4_gemv_kernel(1, 4096, 4096, 128, "float16", False, "none", point)
    text = with_programmatic_launch(kernel, WeightPrefetch(1, 64 << 20)).script()
    head = text[:text.index('T.ptx.griddepcontrol("wait"')]
    assert re.search(r"if tx == 0:\n\s+if bx \* 8192 \+ 16 <= 8388608:\n\s+T.ptx.cp\(T.address_of\(Wq\[bx \* 8192 // 2048 "
                     r"% 4096, bx \* 8192 % 2048\]\), T.Cast\(\"uint32\", T.min\(8192, ", head), head[-1500:]


def test_a_function_without_kernels_is_untouched():
    from tvm.script import tirx as T

    @T.prim_func
    def host(A: T.Buffer((4,), "float32")):
        for i in range(4):
            A[i] = T.float32(0)

    assert with_programmatic_launch(host).same_as(host)


def test_a_target_without_programmatic_launch_is_refused_in_one_line():
    from autosched.pipeline.build import build_pipeline

    for target in ("llvm", "cuda:sm_80"):
        with pytest.raises(UsageError, match="programmatic dependent launch needs a Hopper GPU"):
            build_pipeline(parse_target(target, require_device=False), programmatic_launch=True)


@pytest.mark.slow
def test_every_kernel_of_a_generation_build_for_sm_90_waits_first():
    """A tiny Llama's q4f16 generation build for sm_90a (no GPU here), its GEMMs prefetching their weights: each
    kernel, of the main module (ours, dlight's, the cache's) and of the TIRx kernels compiled apart (decode
    attention, int4_gemv, hopper_gemm), opens with griddepcontrol.wait in the CUDA that TVM generates, each
    GEMM's prefetch of its weight before it (the decode steps' int4 GEMVs and the LM head's dlight GEMV among
    them), and nvcc compiles every module's CUDA for sm_90a."""
    from dataclasses import replace

    from autosched.examples.hf import TINY, _config
    from autosched.generation.build import lower_generation, schedule_generation, weight_prefetches
    from autosched.generation.decoder import config_from_hf
    from autosched.pipeline.build import build_pipeline, compile_separate
    from autosched.target import compile_module

    from .nvcc import nvcc_compile

    target = parse_target("cuda:sm_90a", require_device=False)
    config = replace(config_from_hf(_config("llama", TINY)[0], "float16"), quantize="q4f16")
    lowered, _ = lower_generation(config, target, decode_batches=(1, 4))
    prefetch = weight_prefetches(lowered, 1 << 20)
    scheduled, _, applied = schedule_generation(lowered, None, target)
    executable = compile_module(scheduled, target, {"relax.backend.use_cuda_graph": True},
                                relax_pipeline=build_pipeline(target, True, prefetch=prefetch))
    assert applied.separate  # TIRx kernels compiled on their own
    executable = compile_separate(executable, applied, target, True, prefetch=prefetch)

    def cuda_sources(module):
        return ([module.inspect_source()] if module.kind == "cuda" else []) + [
            source for child in module.imports for source in cuda_sources(child)]

    sources = cuda_sources(executable.mod)
    kernel = (r'extern "C" __global__ void (?:__launch_bounds__\(\d+(?:, \d+)?\) )?(\w+)\([^;{]*\)\s*\{\n'
              r'(.*?)\n\}\n')  # (name, body) of each kernel's definition
    kernels = [k for source in sources for k in re.findall(kernel, source, flags=re.S)]
    names = {name for name, _ in kernels}
    assert len(kernels) > 20 and any("kv_cache_decode" in n for n in names), names
    prefetched = set()
    for name, body in kernels:
        wait = body.find("tvm_builtin_ptx_griddepcontrol_wait();")
        assert wait >= 0, (name, body[:800])
        fetch = body.find("cp_async_bulk_prefetch")
        if fetch >= 0:
            assert fetch < wait, (name, body[:wait + 200])
            prefetched.add(name.removesuffix("_kernel"))
    assert prefetched == set(prefetch), (prefetched, set(prefetch))
    apart = prefetched & set(applied.separate)
    assert apart and prefetched - apart, prefetched  # TIRx kernels compiled apart and dlight's in the main module
    for source in sources:
        report = nvcc_compile(source, "sm_90a")
        assert report.ok, report.log[-2000:]


@pytest.mark.gpu
def test_a_build_with_programmatic_launch_generates_the_same_tokens_on_the_gpu():
    """A 2-layer Llama (hidden 1024, 16:8 heads), random weights scaled so greedy choices are not near-ties,
    fp16 on the GPU: with programmatic launch the static decode steps (CUDA graphs) and the prefill chunk give the
    tokens of the same build without it, for prompts of 7 and 40 tokens, and transformers' (up to a near-tie); so
    does the build whose GEMMs prefetch their weights before they wait."""
    import transformers

    from .helpers import assert_gpu_greedy_matches, gpu_generator, random_on_gpu

    model = random_on_gpu(transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_attention_heads=16,
                                                   num_key_value_heads=8, num_hidden_layers=2, vocab_size=8000))
    prompts = [[(37 * i + 11) % 8000 for i in range(7)], [(101 * i + 5) % 8000 for i in range(40)]]
    plain, _ = gpu_generator(model, "llama-2-layers", 128, (1, 2), prefill_chunks=(32,))
    overlapped, _ = gpu_generator(model, "llama-2-layers", 128, (1, 2), prefill_chunks=(32,), programmatic_launch=True)
    expected = [r.tokens for r in plain.generate(prompts, 16)]
    results = overlapped.generate(prompts, 16)
    assert [r.tokens for r in results] == expected
    assert [r.tokens for r in overlapped.generate(prompts[:1], 16)] == expected[:1]  # the batch-1 step
    assert_gpu_greedy_matches(model, prompts, results, 16, max_margin=0.1)
    prefetched, _ = gpu_generator(model, "llama-2-layers", 128, (1, 2), prefill_chunks=(32,), programmatic_launch=True,
                                  prefetch_weights=4 << 20)
    assert [r.tokens for r in prefetched.generate(prompts, 16)] == expected
    assert [r.tokens for r in prefetched.generate(prompts[:1], 16)] == expected[:1]
