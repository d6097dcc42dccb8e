"""The paged KV cache's two elementwise kernels of ours: the merge of partial attention (``kv_cache_merge``)
and the q/k/v split with the rotary embedding (``kv_cache_rope``), in the calling convention of TVM's
``tir_attention_merge_state`` and ``fused_rope``.

Without a GPU: the kernels' bodies (the same macros as the GPU kernels', in loops) against float64 and, for
the rotation, bit for bit against TVM's own kernel (the default and llama3 frequencies, scaled positions, a
partial rotary dimension, ``apply_rope`` 0); the GPU kernels compile for sm_90a without spills, one 16-byte
access a run; the build's dispatch finds TVM's kernels by their place in the cache's creation call and names
ours. Every CPU generation test runs them inside TVM's runtime (a CPU build takes them too), token for token
against transformers. On the GPU (``-m gpu``): both kernels against float64 and against TVM's."""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on the PATH")

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
# (h, hkv, d, rotary_dim, theta, scale, scaling): MHA, GQA with llama3's frequencies, a partial rotary
# dimension (Phi-3's kind), linear scaling as scaled positions, one K/V head and a head dim of 80.
ROPE_CASES = [(4, 4, 64, 64, 10000.0, 1.0, {}), (8, 2, 128, 128, 500000.0, 1.0, LLAMA3),
              (4, 2, 96, 32, 10000.0, 1.0, {}), (3, 1, 80, 80, 10000.0, 0.25, {})]
ROPE_IDS = ["mha", "gqa-llama3", "partial", "linear-d80"]
POSITIONS = [0, 1, 5, 40, 1000, 3, 9000]


def _compile_cpu(func):
    import tvm

    return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target="llvm")["main"]


def rope_reference(qkv, positions, h, hkv, rotary_dim, theta, scale, scaling):
    """(q, k, v) in float64: q's and k's first ``rotary_dim`` features rotated in GPT-NeoX's halves, with
    transformers' frequencies (llama3's smoothed as ``_compute_llama3_parameters`` does)."""
    qkv = qkv.astype(np.float64)
    half = rotary_dim // 2
    inv_freq = 1.0 / theta ** (np.arange(half) * 2 / rotary_dim)
    if scaling.get("rope_type") == "llama3":
        wavelen = 2 * np.pi / inv_freq
        low = scaling["original_max_position_embeddings"] / scaling["low_freq_factor"]
        high = scaling["original_max_position_embeddings"] / scaling["high_freq_factor"]
        smooth = (scaling["original_max_position_embeddings"] / wavelen - scaling["low_freq_factor"]) / (
            scaling["high_freq_factor"] - scaling["low_freq_factor"])
        mid = (1 - smooth) * inv_freq / scaling["factor"] + smooth * inv_freq
        inv_freq = np.where(wavelen > low, inv_freq / scaling["factor"], np.where(wavelen < high, inv_freq, mid))
    angle = (np.asarray(positions, np.float64) * scale)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    rotated = qkv[:, :h + hkv].copy()
    x, y = rotated[..., :half].copy(), rotated[..., half:rotary_dim].copy()
    rotated[..., :half], rotated[..., half:rotary_dim] = x * cos - y * sin, y * cos + x * sin
    return rotated[:, :h], rotated[:, h:], qkv[:, h + hkv:]


def _run_rope(fn, qkv, positions, h, hkv, apply, device=None):
    import tvm

    device = device or tvm.cpu()
    n, _, d = qkv.shape
    args = [tvm.runtime.tensor(x, device) for x in (qkv, np.asarray(positions, "int32"),
                                                     np.zeros((n, h, d), qkv.dtype), np.zeros((n, hkv, d), qkv.dtype),
                                                     np.zeros((n, hkv, d), qkv.dtype))]
    fn(*args, apply)
    return [a.numpy() for a in args[2:]]


@pytest.mark.parametrize("h,hkv,d,rotary_dim,theta,scale,scaling", ROPE_CASES, ids=ROPE_IDS)
def test_the_rope_kernel_rotates_as_tvms_bit_for_bit_and_as_float64(h, hkv, d, rotary_dim, theta, scale, scaling):
    """fp16 q/k/v of 7 tokens at positions up to 9000: ours equals TVM's ``fused_rope`` exactly (the same
    float32 operations), is within fp16 rounding (plus float32's angle error at position 9000) of float64, and
    with ``apply_rope`` 0 copies q, k and v unchanged."""
    from tvm.relax.frontend.nn.llm.position_embedding import llama_rope_with_position_map

    from autosched.search_spaces.templates.kv_cache_rope import kv_cache_rope_kernel

    ours = _compile_cpu(kv_cache_rope_kernel(h, hkv, d, "float16", rotary_dim, theta, scale, scaling, gpu=False))
    theirs = _compile_cpu(llama_rope_with_position_map(theta, scale, d, h, hkv, "float16", scaling, rotary_dim))
    qkv = np.random.default_rng(0).standard_normal((len(POSITIONS), h + 2 * hkv, d)).astype("float16")
    mine = _run_rope(ours, qkv, POSITIONS, h, hkv, 1)
    for a, b in zip(mine, _run_rope(theirs, qkv, POSITIONS, h, hkv, 1)):
        assert np.array_equal(a, b)
    for a, ref in zip(mine, rope_reference(qkv, POSITIONS, h, hkv, rotary_dim, theta, scale, scaling)):
        assert np.abs(a.astype(np.float64) - ref).max() < 1e-2
    copied = _run_rope(ours, qkv, POSITIONS, h, hkv, 0)
    for a, b in zip(copied, (qkv[:, :h], qkv[:, h:h + hkv], qkv[:, h + hkv:])):
        assert np.array_equal(a, b)


def merge_case(n: int, h: int, d: int, dtype: str, seed: int = 0):
    """(v, s, v_other, s_other): outputs and base-2 log-sum-exps of two partial attentions, one row of each
    side without keys (TVM's zeros and -5e4)."""
    rng = np.random.default_rng(seed)
    v, v_other = (rng.standard_normal((n, h, d)).astype(dtype) for _ in range(2))
    s, s_other = ((rng.standard_normal((n, h)) * 6).astype("float32") for _ in range(2))
    v[0, 0], s[0, 0] = 0, -5e4
    v_other[-1, -1], s_other[-1, -1] = 0, -5e4
    return v, s, v_other, s_other


def merge_reference(v, s, v_other, s_other):
    m = np.maximum(s, s_other).astype(np.float64)
    a, b = np.exp2(s - m), np.exp2(s_other - m)
    out = (a[..., None] * v.astype(np.float64) + b[..., None] * v_other.astype(np.float64)) / (a + b)[..., None]
    return out, np.log2(a + b) + m


def _run_merge(fn, case, device=None):
    import tvm

    args = [tvm.runtime.tensor(x, device or tvm.cpu()) for x in case]
    fn(*args)
    return args[0].numpy(), args[1].numpy()


@pytest.mark.parametrize("h,d,dtype", [(6, 64, "float16"), (4, 128, "float32"), (3, 80, "float16")])
def test_the_merge_kernel_matches_float64(h, d, dtype):
    """Merged output within the dtype's rounding of float64, the log-sum-exp within float32's; a side without
    keys leaves the other as it is."""
    from autosched.search_spaces.templates.kv_cache_merge import kv_cache_merge_kernel

    case = merge_case(5, h, d, dtype)
    out, lse = _run_merge(_compile_cpu(kv_cache_merge_kernel(h, d, dtype, gpu=False)), case)
    ref_out, ref_lse = merge_reference(*case)
    tolerance = 2e-3 if dtype == "float16" else 1e-5
    assert np.abs(out.astype(np.float64) - ref_out).max() < tolerance * max(1.0, np.abs(ref_out).max())
    assert np.abs(lse - ref_lse).max() < 1e-4 * max(1.0, np.abs(ref_lse).max())
    assert np.array_equal(out[0, 0], case[2][0, 0]) and np.array_equal(out[-1, -1], case[0][-1, -1])


@needs_nvcc
@pytest.mark.parametrize("kernel", ["rope-llama3-fp16", "rope-partial-bf16", "merge-fp16", "merge-fp32-d256"])
def test_the_gpu_kernels_compile_for_sm90a_with_one_vector_access_a_run(kernel):
    """Each compiles without spills, and its loads of q/k/v or of the outputs are 16-byte vectors (a lane's
    runs aligned), not element gathers."""
    import tvm

    from autosched.search_spaces.templates.kv_cache_merge import kv_cache_merge_kernel
    from autosched.search_spaces.templates.kv_cache_rope import kv_cache_rope_kernel
    from autosched.target import parse_target

    from .nvcc import nvcc_compile

    func = {"rope-llama3-fp16": lambda: kv_cache_rope_kernel(32, 8, 128, "float16", 128, 500000.0, 1.0, LLAMA3),
            "rope-partial-bf16": lambda: kv_cache_rope_kernel(32, 32, 96, "bfloat16", 32, 10000.0, 1.0, {}),
            "merge-fp16": lambda: kv_cache_merge_kernel(32, 128, "float16"),
            "merge-fp32-d256": lambda: kv_cache_merge_kernel(8, 256, "float32")}[kernel]()
    target = parse_target("cuda:sm_90", require_device=False).tvm_target()
    source = tvm.compile(tvm.IRModule({"main": func}), target=target).mod.imports[0].inspect_source()
    report = nvcc_compile(source, "sm_90a")
    assert report.ok and report.spills == 0, report.log[-2000:]
    assert len(re.findall(r"\*\((uint4|float4)\*\)\(", source)) >= 2 and not re.search(r"make_(uint4|float4)\(", source)


@pytest.mark.slow
def test_a_build_finds_the_caches_merge_and_rope_by_position_and_names_ours():
    """A model with windowed and global layers (two caches): both caches' merge and rope kernels are ours
    (the windowed cache's under ``_window`` symbols, at its own theta), TVM's PrimFuncs are gone, and the
    creation calls name ours; on ``cuda:sm_90`` the kernels are the GPU ones (thread-bound, scheduled)."""
    import json

    from autosched.generation.attention import MERGE_ROLE, ROPE_ROLE, dispatch_attention
    from autosched.generation.build import lower_generation
    from autosched.target import parse_target
    from autosched.tvm_adapter import FACTS_ATTR, MERGE_ARG, SPLIT_ROTARY_ARG, kv_cache_kernels

    from .test_kv_cache_decode import _tiny

    cfg = _tiny(layers=2, sliding_window=8, sliding_layers=[0])
    for spec in ("llvm", "cuda:sm_90"):
        target = parse_target(spec, require_device=False)
        lowered, _ = lower_generation(cfg, target, (1,))
        rope = kv_cache_kernels(lowered, SPLIT_ROTARY_ARG)
        assert len(rope) == 2 and len(kv_cache_kernels(lowered, MERGE_ARG)) == 2
        thetas = {json.loads(str(lowered[name].attrs[FACTS_ATTR]))["theta"] for name in rope}
        mod, served, _ = dispatch_attention(lowered, target)
        ours = kv_cache_kernels(mod, SPLIT_ROTARY_ARG) + kv_cache_kernels(mod, MERGE_ARG)
        assert all(name.startswith(("autosched_kv_cache_rope_", "autosched_kv_cache_merge_")) for name in ours)
        assert sum(name.endswith("_window") for name in ours) == 2
        assert not set(rope) & {gv.name_hint for gv in mod.functions}
        assert served[ROPE_ROLE].count("autosched kv_cache_rope (") == 2
        assert served[MERGE_ROLE].count("autosched kv_cache_merge (") == 2
        scheduled = [bool((mod[name].attrs or {}).get("tirx.is_scheduled")) for name in ours]
        assert all(scheduled) if target.is_gpu else not any(scheduled)
        assert len(thetas) >= 1


@pytest.mark.gpu
@pytest.mark.parametrize("h,hkv,d,rotary_dim,theta,scale,scaling", ROPE_CASES, ids=ROPE_IDS)
def test_the_rope_kernel_matches_tvms_and_float64_on_the_gpu(h, hkv, d, rotary_dim, theta, scale, scaling):
    """The GPU kernel against TVM's (dlight-scheduled) on the GPU: equal within one fp16 step (CUDA's cosf
    and sinf may differ from the CPU's by an ulp), and against float64."""
    import tvm
    from tvm.relax.frontend.nn.llm.position_embedding import llama_rope_with_position_map

    from autosched.search_spaces.templates.kv_cache_rope import kv_cache_rope_kernel
    from autosched.target import compile_module, default_gpu_schedule, parse_target

    target = parse_target("cuda")
    ours = compile_module(tvm.IRModule({"main": kv_cache_rope_kernel(h, hkv, d, "float16", rotary_dim, theta, scale,
                                                                     scaling).with_attr("global_symbol", "main")}),
                          target, {})["main"]
    # TVM's kernel is written unscheduled: the build gives it dlight's schedule, as here
    theirs = tvm.IRModule({"main": llama_rope_with_position_map(theta, scale, d, h, hkv, "float16", scaling, rotary_dim)})
    theirs = compile_module(default_gpu_schedule(theirs, target), target, {})["main"]
    qkv = np.random.default_rng(1).standard_normal((len(POSITIONS), h + 2 * hkv, d)).astype("float16")
    mine = _run_rope(ours, qkv, POSITIONS, h, hkv, 1, tvm.cuda())
    for a, b, ref in zip(mine, _run_rope(theirs, qkv, POSITIONS, h, hkv, 1, tvm.cuda()),
                         rope_reference(qkv, POSITIONS, h, hkv, rotary_dim, theta, scale, scaling)):
        assert np.abs(a.astype(np.float64) - b.astype(np.float64)).max() < 4e-3
        assert np.abs(a.astype(np.float64) - ref).max() < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("h,d,dtype", [(32, 128, "float16"), (32, 128, "bfloat16"), (8, 256, "float32")])
def test_the_merge_kernel_matches_float64_on_the_gpu(h, d, dtype):
    import tvm

    from autosched.search_spaces.templates.kv_cache_merge import kv_cache_merge_kernel
    from autosched.target import compile_module, parse_target

    fn = compile_module(tvm.IRModule({"main": kv_cache_merge_kernel(h, d, dtype).with_attr("global_symbol", "main")}),
                        parse_target("cuda"), {})["main"]
    for n in (1, 5, 512):
        case = merge_case(n, h, d, "float32", seed=n)
        if dtype != "float32":
            import torch

            case = (torch.from_numpy(case[0]).to(getattr(torch, dtype)), case[1],
                    torch.from_numpy(case[2]).to(getattr(torch, dtype)), case[3])
            args = [tvm.runtime.from_dlpack(x.cuda()) if hasattr(x, "cuda") else tvm.runtime.tensor(x, tvm.cuda())
                    for x in case]
            fn(*args)
            out = torch.from_dlpack(args[0]).float().cpu().numpy()
            lse = args[1].numpy()
            inputs = (case[0].double().numpy(), case[1], case[2].double().numpy(), case[3])
        else:
            out, lse = _run_merge(fn, case, tvm.cuda())
            inputs = case
        ref_out, ref_lse = merge_reference(*inputs)
        tolerance = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-5}[dtype]
        assert np.abs(out - ref_out).max() < tolerance * max(1.0, np.abs(ref_out).max())
        assert np.abs(lse - ref_lse).max() < 1e-4 * max(1.0, np.abs(ref_lse).max())
