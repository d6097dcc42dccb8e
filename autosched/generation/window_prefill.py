"""The CPU attention of a prefill call's queries to a windowed cache's pages, for TVM's paged KV cache.

A windowed cache's layers are TVM's sliding layers: a prefill call attends to its own new tokens (the ragged
kernel, causal) and to the cached pages (this kernel), whose keys the window masks per query: the query ``r``
tokens into the call sees the last ``window - r - 1`` cached keys. TVM 0.27's CPU kernel for it
(``batch_prefill_paged_kv_cpu_sliding_window``) keeps a stale running maximum where a key is masked, and
its rows come out wrong (NaN) as soon as a call past the first tokens masks one; this one replaces it, in
the same calling convention (``attn_backend.h``): scores in base 2 (``sm_scale · log2 e``), the row's
log-sum-exp in base 2, and a row with no visible key writes zeros and a log-sum-exp of -5e4, so that the
merge with the ragged part leaves that part as it is. RoPE is applied before caching (our windowed caches
rotate q and k as they append): the kernel does not rotate (``rotary_mode`` is 0 for them).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tvm import IRModule

TVM_SYMBOL = "batch_prefill_paged_kv_cpu_sliding_window"  # and "<symbol>_window" in a model's second cache
EMPTY_LSE = -5e4
KERNEL_ATTR = "autosched.kernel"  # names our kernel in the build's report


def window_prefill_cpu_kernel(h_q: int, h_kv: int, d: int, page_size: int, dtype: str, window: int, symbol: str):
    """The PrimFunc, for ``h_q`` query heads over ``h_kv`` K/V heads of dimension ``d``, pages of ``page_size``."""
    from tvm.script import tirx as T

    group = h_q // h_kv
    log2e = math.log2(math.e)

    # fmt: off
    @T.prim_func(s_tir=True)
    def kernel(var_q: T.handle, var_q_indptr: T.handle, var_pages: T.handle, var_page_indptr: T.handle,
               var_page_values: T.handle, var_length_info: T.handle, var_k_rope_pos_offset: T.handle,
               var_q_rope_position: T.handle, var_output: T.handle, var_lse: T.handle, causal: T.int32,
               rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32):
        T.func_attr({"global_symbol": symbol, "tirx.is_scheduled": True, KERNEL_ATTR: "window_prefill"})
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
        length_info = T.match_buffer(var_length_info, (3, batch_size), "int32", elem_offset=length_info_offset)
        T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32", elem_offset=rope_offset_offset)
        T.match_buffer(var_q_rope_position, (total_len,), "int32", elem_offset=rope_position_offset)
        output = T.match_buffer(var_output, (total_len, h_q, d), dtype)
        lse = T.match_buffer(var_lse, (total_len, h_q), "float32")
        for b in T.serial(batch_size):
            for h in T.serial(h_q):
                with T.sblock("attend"):
                    acc = T.sblock_alloc_buffer((d,), "float32")
                    state = T.sblock_alloc_buffer((3,), "float32")  # running maximum, sum, the score
                    bounds = T.sblock_alloc_buffer((2,), "int32")  # cached keys, the first one visible
                    first_page: T.let[T.int32] = page_indptr[b]
                    num_pages: T.let[T.int32] = page_indptr[b + 1] - first_page
                    # (pages - 1) · page + last page's length - the window's offset + the sink's length
                    bounds[0] = T.if_then_else(num_pages > 0, (num_pages - 1) * page_size + length_info[0, b]
                                               - length_info[1, b] + length_info[2, b], 0)
                    for r in T.serial(q_indptr[b + 1] - q_indptr[b]):
                        row: T.let[T.int32] = q_indptr[b] + r
                        bounds[1] = T.if_then_else(causal > 0, T.max(bounds[0] - T.max(window - r - 1, 0), 0), 0)
                        state[0] = T.float32(EMPTY_LSE)
                        state[1] = T.float32(0)
                        for i in T.serial(d):
                            acc[i] = T.float32(0)
                        for col in T.serial(bounds[0]):
                            if col >= bounds[1]:
                                # the slot in the pages: past the attention sink, shifted by the window's offset
                                pos: T.let[T.int32] = T.if_then_else(col < length_info[2, b], col,
                                                                     col - length_info[2, b] + length_info[1, b])
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


def replace_window_prefill_cpu(mod: IRModule, window: int) -> IRModule:
    """``mod`` with each of TVM's CPU sliding-window prefill kernels (one per windowed cache) replaced by ours,
    under the same global name, for a model whose windowed layers attend over ``window`` tokens."""
    import tvm
    from tvm import tirx

    out = mod
    for gv, func in mod.functions.items():
        if not isinstance(func, tirx.PrimFunc) or func.attrs is None or "global_symbol" not in func.attrs:
            continue
        symbol = str(func.attrs["global_symbol"])
        if not symbol.startswith(TVM_SYMBOL):
            continue
        q, pages = func.params[0], func.params[2]  # buffer parameters: their shapes and dtypes
        _, h_q, d = (int(x) if isinstance(x, tirx.IntImm) else x for x in q.shape)
        _, _, h_kv, page_size, _ = (int(x) if isinstance(x, tirx.IntImm) else x for x in pages.shape)
        ours = window_prefill_cpu_kernel(h_q, h_kv, d, page_size, str(q.dtype), window, symbol)
        if out is mod:
            out = tvm.IRModule(dict(mod.functions), attrs=mod.attrs)
        out[gv] = ours
    return out
