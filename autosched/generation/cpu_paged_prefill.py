"""The CPU attention of a prefill call's queries to the cached pages, for TVM's paged KV cache.

A prefill call attends to its own new tokens (the ragged kernel, causal) and to the cached pages (this kernel);
the merge of the two gives each query its attention. TVM 0.27's CPU kernels for the pages are replaced, in
the same calling convention (``attn_backend.h``): scores in base 2 (``sm_scale · log2 e``), the row's
log-sum-exp in base 2, and a row with no visible key writes zeros and a log-sum-exp of -5e4, so that the merge
with the ragged part leaves that part as it is.

- ``batch_prefill_paged_kv_cpu`` (a cache without a window) rescales its accumulator by ``scale_O[d_idx]``, a
  one-element buffer read past its end: what it computes depends on how LLVM compiles that undefined read (right
  at -O3, NaN at -O0).
- ``batch_prefill_paged_kv_cpu_sliding_window`` (a windowed cache, whose layers are TVM's sliding layers) keeps
  a stale running maximum where a key is masked, and its rows come out wrong (NaN) as soon as a call past the
  first tokens masks one. Its window masks cached keys per query: the query ``r`` tokens into the call sees the
  last ``window - r - 1`` cached keys.

RoPE is applied before caching (our caches rotate q and k as they append, ``RopeMode`` normal or none): the
kernel does not rotate (``rotary_mode`` is 0 for them).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tvm import IRModule

# Deferred imports: tvm (imported where used: `autosched --help` stays fast).

TVM_SYMBOL = "batch_prefill_paged_kv_cpu"  # "..._sliding_window" windowed; "<symbol>_window" in a second cache
WINDOWED_SUFFIX = "_sliding_window"
EMPTY_LSE = -5e4
KERNEL_ATTR = "autosched.kernel"  # names our kernel in the build's report
KERNEL_NAME = "cpu_paged_prefill"


def cpu_paged_prefill_kernel(h_q: int, h_kv: int, d: int, page_size: int, dtype: str, window: int, symbol: str):
    """The PrimFunc, for ``h_q`` query heads over ``h_kv`` K/V heads of dimension ``d``, pages of ``page_size``;
    ``window``: the windowed cache's window (its ``length_info`` is [3, batch]), 0 for a cache without one
    (``length_info`` [batch], each sequence's last page's length)."""
    from tvm.script import tirx as T

    group = h_q // h_kv
    log2e = math.log2(math.e)

    def length_info_buffer(var, batch_size, offset):
        return T.match_buffer(var, (3, batch_size) if window else (batch_size,), "int32", elem_offset=offset)

    def cached_keys(length_info, b, num_pages):
        """The keys a sequence has in the pages: (pages - 1) · page + the last page's length, in a window less
        its offset plus the attention sink's length."""
        if not window:
            return (num_pages - 1) * page_size + length_info[b]
        return (num_pages - 1) * page_size + length_info[0, b] - length_info[1, b] + length_info[2, b]

    def first_visible(causal, cached, r):
        """In a window, the query ``r`` tokens into a causal call sees the last ``window - r - 1`` cached keys."""
        if not window:
            return 0
        return T.if_then_else(causal > 0, T.max(cached - T.max(window - r - 1, 0), 0), 0)

    def end_visible(causal, cached, r, new):
        """Without a window, a causal call's query ``r`` of ``new`` sees the keys before ``cached - new + r + 1``,
        as in TVM's kernel (a cache that appends before attention has the call's tokens last in the pages; ours
        append after and call it without ``causal``: every cached key)."""
        if window:
            return cached
        return T.if_then_else(causal > 0, T.max(T.min(cached - new + r + 1, cached), 0), cached)

    def slot_position(length_info, b, col):
        """A cached key's place in the pages: past a window's attention sink, shifted by the window's offset."""
        if not window:
            return col
        return T.if_then_else(col < length_info[2, b], col, col - length_info[2, b] + length_info[1, b])

    # fmt: off
    @T.prim_func(s_tir=True)
    def kernel(var_q: T.handle, var_q_indptr: T.handle, var_pages: T.handle, var_page_indptr: T.handle,
               var_page_values: T.handle, var_length_info: T.handle, var_k_rope_pos_offset: T.handle,
               var_q_rope_position: T.handle, var_output: T.handle, var_lse: T.handle, causal: T.int32,
               rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32):
        T.func_attr({"global_symbol": symbol, "tirx.is_scheduled": True, KERNEL_ATTR: KERNEL_NAME})
        batch_size = T.int32()
        total_len = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        q_indptr_offset = T.int32()
        page_indptr_offset = T.int32()
        page_values_offset = T.int32()
        rope_offset_offset = T.int32()
        rope_position_offset = T.int32()
        length_info_offset = T.int32()
        q = T.match_buffer(var_q, (total_len, h_q, d), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_offset)
        pages = T.match_buffer(var_pages, (max_num_pages, 2, h_kv, page_size, d), dtype)
        page_indptr = T.match_buffer(var_page_indptr, (batch_size + 1,), "int32", elem_offset=page_indptr_offset)
        page_values = T.match_buffer(var_page_values, (nnz_pages,), "int32", elem_offset=page_values_offset)
        length_info = length_info_buffer(var_length_info, batch_size, length_info_offset)
        T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32", elem_offset=rope_offset_offset)
        T.match_buffer(var_q_rope_position, (total_len,), "int32", elem_offset=rope_position_offset)
        output = T.match_buffer(var_output, (total_len, h_q, d), dtype)
        lse = T.match_buffer(var_lse, (total_len, h_q), "float32")
        for b in T.serial(batch_size):
            for h in T.serial(h_q):
                with T.sblock("attend"):
                    acc = T.sblock_alloc_buffer((d,), "float32")
                    state = T.sblock_alloc_buffer((3,), "float32")  # running maximum, sum, the score
                    bounds = T.sblock_alloc_buffer((3,), "int32")  # cached keys; the first visible, the end
                    first_page: T.let[T.int32] = page_indptr[b]
                    num_pages: T.let[T.int32] = page_indptr[b + 1] - first_page
                    bounds[0] = T.if_then_else(num_pages > 0, cached_keys(length_info, b, num_pages), 0)
                    for r in T.serial(q_indptr[b + 1] - q_indptr[b]):
                        row: T.let[T.int32] = q_indptr[b] + r
                        bounds[1] = first_visible(causal, bounds[0], r)
                        bounds[2] = end_visible(causal, bounds[0], r, q_indptr[b + 1] - q_indptr[b])
                        state[0] = T.float32(EMPTY_LSE)
                        state[1] = T.float32(0)
                        for i in T.serial(d):
                            acc[i] = T.float32(0)
                        for col in T.serial(bounds[2]):
                            if col >= bounds[1]:
                                pos: T.let[T.int32] = slot_position(length_info, b, col)
                                page: T.let[T.int32] = page_values[first_page + pos // page_size]
                                slot: T.let[T.int32] = pos % page_size
                                state[2] = T.float32(0)
                                for i in T.serial(d):
                                    state[2] = state[2] + T.Cast("float32", q[row, h, i]) * T.Cast(
                                        "float32", pages[page, 0, h // group, slot, i])
                                state[2] = state[2] * sm_scale * T.float32(log2e)
                                new_max: T.let[T.float32] = T.max(state[0], state[2])
                                rescale: T.let[T.float32] = T.exp2(state[0] - new_max)
                                weight: T.let[T.float32] = T.exp2(state[2] - new_max)
                                state[1] = state[1] * rescale + weight
                                for i in T.serial(d):
                                    acc[i] = acc[i] * rescale + weight * T.Cast("float32", pages[page, 1, h // group,
                                                                                                  slot, i])
                                state[0] = new_max
                        for i in T.serial(d):
                            output[row, h, i] = T.Cast(dtype, T.if_then_else(state[1] > 0, acc[i] / state[1],
                                                                              T.float32(0)))
                        lse[row, h] = T.if_then_else(state[1] > 0, state[0] + T.log2(state[1]), T.float32(EMPTY_LSE))
    # fmt: on
    return kernel


def replace_cpu_paged_prefill(mod: IRModule, window: int) -> IRModule:
    """``mod`` with each of TVM's CPU prefill kernels over cached pages (one per cache, windowed or not) replaced
    by ours, under the same global name; ``window``: the model's window, where its windowed layers have one."""
    import tvm
    from tvm import tirx

    out = mod
    for gv, func in mod.functions.items():
        if not isinstance(func, tirx.PrimFunc) or func.attrs is None or "global_symbol" not in func.attrs:
            continue
        symbol = str(func.attrs["global_symbol"])
        if symbol != TVM_SYMBOL and not symbol.startswith(TVM_SYMBOL + "_"):
            continue
        windowed = symbol.startswith(TVM_SYMBOL + WINDOWED_SUFFIX)
        if windowed and not window:  # a variant the cache holds but never calls without a window: TVM's, unread
            continue
        q, pages = func.params[0], func.params[2]  # buffer parameters: their shapes and dtypes
        _, h_q, d = (int(x) if isinstance(x, tirx.IntImm) else x for x in q.shape)
        _, _, h_kv, page_size, _ = (int(x) if isinstance(x, tirx.IntImm) else x for x in pages.shape)
        ours = cpu_paged_prefill_kernel(h_q, h_kv, d, page_size, str(q.dtype), window if windowed else 0, symbol)
        if out is mod:
            out = tvm.IRModule(dict(mod.functions), attrs=mod.attrs)
        out[gv] = ours
    return out
