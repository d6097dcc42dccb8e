"""Programmatic dependent launch (``autosched.pipeline.launch``): every GPU kernel of the main module first waits
for the grid before it, then releases the next, and carries TVM's launch attribute."""

from __future__ import annotations

import re

import pytest

from autosched.errors import UsageError
from autosched.pipeline.launch import LAUNCH_PARAMS_ATTR, PDL_TAG, with_programmatic_launch
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
    """A tiny Llama's generation build for sm_90a (no GPU here): each kernel, of the main module (ours, dlight's,
    the cache's) and of the TIRx kernels compiled apart (decode attention, hopper_gemm), opens with
    griddepcontrol.wait in the CUDA that TVM generates."""
    from autosched.examples.hf import TINY, _config
    from autosched.generation.build import lower_generation, schedule_generation
    from autosched.generation.decoder import config_from_hf
    from autosched.pipeline.build import build_pipeline, compile_separate
    from autosched.target import compile_module

    target = parse_target("cuda:sm_90a", require_device=False)
    lowered, _ = lower_generation(config_from_hf(_config("llama", TINY)[0], "float16"), target, decode_batches=(1, 4))
    scheduled, _, applied = schedule_generation(lowered, None, target)
    executable = compile_module(scheduled, target, {"relax.backend.use_cuda_graph": True},
                                relax_pipeline=build_pipeline(target, programmatic_launch=True))
    assert applied.separate  # TIRx kernels compiled on their own
    executable = compile_separate(executable, applied, target, programmatic_launch=True)

    def cuda_sources(module):
        return ([module.inspect_source()] if module.kind == "cuda" else []) + [
            source for child in module.imports for source in cuda_sources(child)]

    sources = cuda_sources(executable.mod)
    kernel = (r'extern "C" __global__ void (?:__launch_bounds__\(\d+(?:, \d+)?\) )?(\w+)\([^;{]*\)\s*\{\n'
              r'(.*?)\n\}\n')  # (name, body) of each kernel's definition
    kernels = [k for source in sources for k in re.findall(kernel, source, flags=re.S)]
    names = {name for name, _ in kernels}
    assert len(kernels) > 20 and any("kv_cache_decode" in n for n in names), names
    for name, body in kernels:
        assert "tvm_builtin_ptx_griddepcontrol_wait();" in body, (name, body[:800])


@pytest.mark.gpu
def test_a_build_with_programmatic_launch_generates_the_same_tokens_on_the_gpu():
    """A 2-layer Llama (hidden 1024, 16:8 heads), random weights scaled so greedy choices are not near-ties,
    fp16 on the GPU: with programmatic launch the static decode steps (CUDA graphs) and the prefill chunk give the
    tokens of the same build without it, for prompts of 7 and 40 tokens, and transformers' (up to a near-tie)."""
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
