"""The merge of two partial attention results in TVM's paged-KV-cache calling convention: the kernel that
generation's cache calls for "merge of partial attention" in place of TVM's ``tir_attention_merge_state``.

A prefill chunk or a speculative verify step attends to its own new tokens (the ragged kernel) and to the
tokens cached before it (the paged kernel), each giving an output and a base-2 log-sum-exp per (token, head);
the runtime (``paged_kv_cache.cc``) merges the second into the first in place, once per layer, as
``(v [n, h, d], s [n, h] float32, v_other, s_other)``:

    m = max(s, s_other);  a = 2^(s − m);  b = 2^(s_other − m)
    v ← (a·v + b·v_other) / (a + b);  s ← log2(a + b) + m

Each (token, head) is ``d / vector`` threads, each one 16-byte load of ``v`` and of ``v_other`` and one store,
mixed in float32; the log-sum-exp is written once per head after every thread of the block has read it.
Plain TIR (no CUDA file), compiled with the model's other kernels. Not a search space: the generation build
puts it in the cache through :func:`autosched.generation.attention.dispatch_attention`.
"""

from __future__ import annotations

import math

from ._hopper import CUDA_SCALAR

# Deferred imports: tvm (imported where used: `autosched --help` stays fast).

THREADS = 128  # threads a block: heads x lanes
VECTOR_BYTES = 16
ELEMENT_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


def vector(dtype: str, *extents: int) -> int:
    """Elements a thread moves at once: up to 16 bytes, dividing every extent."""
    width = VECTOR_BYTES // ELEMENT_BYTES[dtype]
    while width > 1 and any(e % width for e in extents):
        width //= 2
    return width


def unsupported(h: int, d: int, dtype: str) -> str | None:
    """Why the kernel cannot serve this cache configuration, or None."""
    if dtype not in CUDA_SCALAR and dtype != "float32":
        return f"dtype {dtype} (fp16, bf16 and fp32 only)"
    if d < 1 or h < 1:
        return f"{h} heads of dimension {d}"
    return None


def kv_cache_merge_kernel(h: int, d: int, dtype: str, gpu: bool = True):
    """The PrimFunc, with the signature of TVM's ``tir_attention_merge_state`` for ``h`` heads of dimension
    ``d``; ``gpu``: bound to CUDA threads (else the same body in loops, for the CPU's compiler: the tests run
    it there against float64)."""
    from tvm.script import tirx as T

    vec = vector(dtype, d)
    lanes = d // vec
    per_block = max(1, min(h, THREADS // lanes))
    blocks = math.ceil(h / per_block)
    symbol = f"autosched_kv_cache_merge_h{h}_d{d}_{dtype}"

    @T.macro
    def weights(S, S_other, n, head, w):
        """w = (m, a, b) of the row (token n, head)."""
        w[0] = T.max(S[n, head], S_other[n, head])
        w[1] = T.exp2(S[n, head] - w[0])
        w[2] = T.exp2(S_other[n, head] - w[0])

    @T.macro
    def mix(V, V_other, n, head, lane, w):
        x = T.alloc_buffer((vec,), dtype, scope="local")
        y = T.alloc_buffer((vec,), dtype, scope="local")
        for i in T.vectorized(vec):
            x[i] = V[n, head, lane * vec + i]
        for i in T.vectorized(vec):
            y[i] = V_other[n, head, lane * vec + i]
        for i in T.unroll(vec):
            x[i] = ((x[i].astype("float32") * w[1] + y[i].astype("float32") * w[2]) / (w[1] + w[2])).astype(dtype)
        for i in T.vectorized(vec):
            V[n, head, lane * vec + i] = x[i]

    if gpu:
        @T.prim_func(private=True)
        def merge(var_v: T.handle, var_s: T.handle, var_v_other: T.handle, var_s_other: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            n_rows = T.int32()
            V = T.match_buffer(var_v, (n_rows, h, d), dtype)
            S = T.match_buffer(var_s, (n_rows, h), "float32")
            V_other = T.match_buffer(var_v_other, (n_rows, h, d), dtype)
            S_other = T.match_buffer(var_s_other, (n_rows, h), "float32")
            for n in T.thread_binding(n_rows, thread="blockIdx.x"):
                for hb in T.thread_binding(blocks, thread="blockIdx.y"):
                    for ty in T.thread_binding(per_block, thread="threadIdx.y"):
                        for lane in T.thread_binding(lanes, thread="threadIdx.x"):
                            w = T.alloc_buffer((3,), "float32", scope="local")
                            if hb * per_block + ty < h:
                                weights(S, S_other, n, hb * per_block + ty, w)
                                mix(V, V_other, n, hb * per_block + ty, lane, w)
                            # every thread of the head has read s before one of them overwrites it
                            T.tvm_storage_sync("shared")
                            if hb * per_block + ty < h and lane == 0:
                                S[n, hb * per_block + ty] = T.log2(w[1] + w[2]) + w[0]
    else:
        @T.prim_func(private=True)
        def merge(var_v: T.handle, var_s: T.handle, var_v_other: T.handle, var_s_other: T.handle):
            T.func_attr({"tirx.noalias": True})
            n_rows = T.int32()
            V = T.match_buffer(var_v, (n_rows, h, d), dtype)
            S = T.match_buffer(var_s, (n_rows, h), "float32")
            V_other = T.match_buffer(var_v_other, (n_rows, h, d), dtype)
            S_other = T.match_buffer(var_s_other, (n_rows, h), "float32")
            for n in T.serial(n_rows):
                for head in T.serial(h):
                    w = T.alloc_buffer((3,), "float32", scope="local")
                    weights(S, S_other, n, head, w)
                    for lane in T.serial(lanes):
                        mix(V, V_other, n, head, lane, w)
                    S[n, head] = T.log2(w[1] + w[2]) + w[0]

    return merge.with_attr("global_symbol", symbol)
