"""The split of a fused QKV projection into q, k and v with the rotary embedding applied to q and k, in TVM's
paged-KV-cache calling convention: the kernel that generation's cache calls for "rotary embedding and q/k/v
split" in place of TVM's ``fused_rope`` (``llama_rope_with_position_map``).

The runtime (``paged_kv_cache.cc``) calls it once per layer and step, before it appends k and v to the pages,
as ``(qkv [n, h + 2·hkv, d], position_map [n] int32, q [n, h, d], k [n, hkv, d], v [n, hkv, d],
apply_rope int64)``: with ``apply_rope`` > 0 the first ``rotary_dim`` features of each q and k head rotate in
GPT-NeoX's halves (feature ``j`` with ``j + rotary_dim/2`` by the angle ``position · scale · inv_freq(j)``), the
rest are copied. The frequencies are TVM's own (``switch_rope_freq_func``: the default, ``llama3``), so the
result is the one TVM's kernel computes, in the same float32 operations.

Each thread owns a few such pairs of one head: one load of each half, the angle's cosine and sine computed
once for both (TVM's kernel computes them for every element), one store of each half. Plain TIR (no CUDA
file), compiled with the model's other kernels. Not a search space: the generation build puts it in the cache
through :func:`autosched.generation.attention.dispatch_attention`, with the rotary facts that
``autosched.tvm_adapter.tir_paged_kv_cache`` attached to TVM's kernel.
"""

from __future__ import annotations

import math

from .kv_cache_merge import THREADS, vector

# Deferred imports: tvm, numpy (imported where used: `autosched --help` stays fast).

SCALINGS = (None, "llama3")  # rope_type of the frequencies served (None: the default)


def unsupported(h: int, hkv: int, d: int, dtype: str, rotary_dim: int, scaling: dict, **_) -> str | None:
    """Why the kernel cannot serve this cache configuration, or None."""
    from .kv_cache_merge import unsupported as merge_unsupported

    reason = merge_unsupported(h, d, dtype)
    if reason:
        return reason
    if scaling.get("rope_type") not in SCALINGS:
        return f"rotary scaling '{scaling.get('rope_type')}' (the default and llama3 only)"
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > d:
        return f"a rotary dimension of {rotary_dim} in heads of {d}"
    return None


def kv_cache_rope_kernel(h: int, hkv: int, d: int, dtype: str, rotary_dim: int, theta: float, scale: float,
                         scaling: dict, gpu: bool = True):
    """The PrimFunc, with the signature of TVM's ``fused_rope`` for ``h`` query and ``hkv`` K/V heads of
    dimension ``d``, rotating the first ``rotary_dim`` features at ``theta`` with positions scaled by ``scale``
    and the frequencies of ``scaling`` (a transformers ``rope_scaling`` dict as TVM reads it); ``gpu``: bound
    to CUDA threads (else the same body in loops, for the CPU's compiler: the tests run it there)."""
    from tvm import tirx
    from tvm.relax.frontend.nn.llm.position_embedding import switch_rope_freq_func
    from tvm.script import tirx as T

    heads = h + 2 * hkv
    half, rest = rotary_dim // 2, (d - rotary_dim) // 2
    vec = vector(dtype, *(e for e in (half, rest) if e))
    lanes = (half + rest) // vec  # a lane owns ``vec`` pairs: (j, j + half) rotated, or two copied runs
    per_block = max(1, min(heads, THREADS // lanes))
    blocks = math.ceil(heads / per_block)
    frequency = switch_rope_freq_func(scaling)
    position_scale = tirx.const(scale, "float32")
    symbol = f"autosched_kv_cache_rope_h{h}_hkv{hkv}_d{d}_r{rotary_dim}_{dtype}"

    def angle(position, j):
        """(cos, sin) of pair ``j``'s angle at ``position``, as TVM's kernel computes them (float32)."""
        cos, sin, lets = frequency(position * position_scale, j, rotary_dim, theta, "float32")
        for var, value in lets.items():
            cos, sin = tirx.Let(var, value, cos), tirx.Let(var, value, sin)
        return cos, sin

    @T.macro
    def pairs(qkv, position_map, q, k, v, apply_rope, s, head, lane):
        x = T.alloc_buffer((vec,), dtype, scope="local")  # the first of each pair
        y = T.alloc_buffer((vec,), dtype, scope="local")  # the second
        cos = T.alloc_buffer((vec,), "float32", scope="local")
        sin = T.alloc_buffer((vec,), "float32", scope="local")
        # where the lane's two runs start, in vectors (so that each run is one aligned vector access)
        runs = T.alloc_buffer((2,), "int32", scope="local")
        runs[0] = T.if_then_else(lane * vec < half, lane, (rotary_dim - half) // vec + lane)
        runs[1] = runs[0] + T.if_then_else(lane * vec < half, half // vec, rest // vec)
        for i in T.vectorized(vec):
            x[i] = qkv[s, head, runs[0] * vec + i]
        for i in T.vectorized(vec):
            y[i] = qkv[s, head, runs[1] * vec + i]
        if apply_rope > 0 and lane * vec < half and head < h + hkv:
            for i in T.unroll(vec):
                cos[i] = angle(position_map[s], lane * vec + i)[0]
                sin[i] = angle(position_map[s], lane * vec + i)[1]
                # TVM's float32 operations: cos·x + sin·(−y), cos·y + sin·x
                rotated_first = (cos[i] * x[i].astype("float32") + sin[i] * (-y[i]).astype("float32")).astype(dtype)
                y[i] = (cos[i] * y[i].astype("float32") + sin[i] * x[i].astype("float32")).astype(dtype)
                x[i] = rotated_first
        if head < h:
            for i in T.vectorized(vec):
                q[s, head, runs[0] * vec + i] = x[i]
            for i in T.vectorized(vec):
                q[s, head, runs[1] * vec + i] = y[i]
        elif head < h + hkv:
            for i in T.vectorized(vec):
                k[s, head - h, runs[0] * vec + i] = x[i]
            for i in T.vectorized(vec):
                k[s, head - h, runs[1] * vec + i] = y[i]
        else:
            for i in T.vectorized(vec):
                v[s, head - h - hkv, runs[0] * vec + i] = x[i]
            for i in T.vectorized(vec):
                v[s, head - h - hkv, runs[1] * vec + i] = y[i]

    if gpu:
        @T.prim_func(private=True)
        def rope(var_qkv: T.handle, var_position_map: T.handle, var_q: T.handle, var_k: T.handle,
                 var_v: T.handle, apply_rope: T.int64):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            n = T.int32()
            offset = T.int32()
            qkv = T.match_buffer(var_qkv, (n, heads, d), dtype)
            q = T.match_buffer(var_q, (n, h, d), dtype)
            k = T.match_buffer(var_k, (n, hkv, d), dtype)
            v = T.match_buffer(var_v, (n, hkv, d), dtype)
            position_map = T.match_buffer(var_position_map, (n,), "int32", elem_offset=offset)
            for s in T.thread_binding(n, thread="blockIdx.x"):
                for hb in T.thread_binding(blocks, thread="blockIdx.y"):
                    for ty in T.thread_binding(per_block, thread="threadIdx.y"):
                        for lane in T.thread_binding(lanes, thread="threadIdx.x"):
                            if hb * per_block + ty < heads:
                                pairs(qkv, position_map, q, k, v, apply_rope, s, hb * per_block + ty, lane)
    else:
        @T.prim_func(private=True)
        def rope(var_qkv: T.handle, var_position_map: T.handle, var_q: T.handle, var_k: T.handle,
                 var_v: T.handle, apply_rope: T.int64):
            T.func_attr({"tirx.noalias": True})
            n = T.int32()
            offset = T.int32()
            qkv = T.match_buffer(var_qkv, (n, heads, d), dtype)
            q = T.match_buffer(var_q, (n, h, d), dtype)
            k = T.match_buffer(var_k, (n, hkv, d), dtype)
            v = T.match_buffer(var_v, (n, hkv, d), dtype)
            position_map = T.match_buffer(var_position_map, (n,), "int32", elem_offset=offset)
            for s in T.serial(n):
                for head in T.serial(heads):
                    for lane in T.serial(lanes):
                        pairs(qkv, position_map, q, k, v, apply_rope, s, head, lane)

    return rope.with_attr("global_symbol", symbol)
