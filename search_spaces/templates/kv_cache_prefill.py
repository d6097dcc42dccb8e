"""Prefill attention in TVM's paged-KV-cache calling convention, for sm_90: the kernels that generation's cache
calls for "prefill over new tokens (ragged)" in place of TVM's ``batch_prefill_ragged_kv`` and for "prefill
over cached pages" in place of its ``batch_prefill_paged_kv``.

The runtime (``attn_backend.h``, the TIR ragged prefill function) calls it as
``(q, q_indptr, k, v, kv_indptr, q_rope_position, k_rope_pos_offset, output, lse, causal, rotary_mode,
rope_scale, rope_theta, sm_scale)``, with

* ``q`` and ``output`` ``[total_q, h, d]``, ``k`` and ``v`` ``[total_kv, hkv, d]``, each sequence's tokens
  given by ``q_indptr`` and ``kv_indptr`` ``[batch + 1]``: index views into one workspace, so they (and the
  unread RoPE positions) carry element offsets; the token tensors do not;
* ``causal``: a sequence's queries are the last tokens of its kv range (query ``i`` of ``qlen`` sees kv
  ``j <= kvlen - qlen + i``);
* ``lse`` ``[total_q, h]`` float32, base 2 (``m + log2(sum)`` with scores scaled by ``sm_scale · log2(e)``),
  the convention of TVM's kernels and of the merge with the attention over cached pages; a row that sees no
  key gets an output of zeros and -5e4, as TVM's kernel gives;
* batch and token counts symbolic; heads and head dim fixed.

Over the cached pages (:func:`kv_cache_prefill_paged_kernel`) the runtime calls it as ``(q, q_indptr, pages,
page_indptr, page_indices, length_info, k_rope_pos_offset, q_rope_position, output, lse, causal, rotary_mode,
rotary_scale, rotary_theta, sm_scale)``, the keys and values in ``pages`` ``[num_pages, 2, hkv, page, d]`` as
the decode kernel reads them (``kv_cache_decode``), ``length_info`` ``[batch]`` the tokens of each sequence's
last page (the cache without sliding windows). The cache calls it for the cached part of a prefill or of a
speculative verify step (not causal: the cached tokens precede every query), then merges it with the part
over the new tokens.

Only ``rotary_mode`` 0 is served (RoPE applied before attention, or none): the kernel asserts it on the host
side before launching. The body is ``cuda/kv_cache_prefill.cuh`` (FlashAttention-2 on mma.sync, one CTA per
(tile of query rows, K/V head, sequence), the GQA group's heads in one tile). The launch holds one more tile
per sequence than the rows may need (the tiles per sequence are only known on the device); the spare CTAs
return at once. This is not a search space: the generation build puts it in the cache through
:func:`autosched.generation.attention.dispatch_attention`.
"""

from __future__ import annotations

from ._hopper import CUDA_SCALAR, SMEM_LIMIT, device_function

# Deferred imports: tvm (imported where used: `autosched --help` stays fast).

HEAD_DIMS = (64, 128)
BLOCK_M = 64  # query rows ((token, head) pairs) per CTA: four warps of 16
BLOCK_N = 64  # keys per K/V tile
PAGE_SIZES = (16,)  # the page TVM's kernels fix


def smem_elements(d: int, block_m: int = BLOCK_M, block_n: int = BLOCK_N) -> int:
    """Shared memory of the body, in elements: the Q tile, then two K and two V tiles."""
    return (block_m + 4 * block_n) * d


def unsupported(h: int, hkv: int, d: int, dtype: str, page: int | None = None) -> str | None:
    """Why the kernel cannot serve this cache configuration (``page``: over cached pages of that size), or None."""
    if page is not None and page not in PAGE_SIZES:
        return f"page size {page} (16 only)"
    if dtype not in CUDA_SCALAR:
        return f"dtype {dtype} (fp16 and bf16 only)"
    if d not in HEAD_DIMS:
        return f"head dim {d} ({' or '.join(map(str, HEAD_DIMS))})"
    if hkv < 1 or h % hkv:
        return f"{h} query heads over {hkv} K/V heads"
    return None


def kernel_name(h: int, hkv: int, d: int, dtype: str, block_m: int, block_n: int, page: int | None = None) -> str:
    paged = f"_paged{page}" if page else ""
    return f"autosched_kv_cache_prefill{paged}_h{h}_hkv{hkv}_d{d}_bm{block_m}_bn{block_n}_{dtype}"


def body_source(name: str, dtype: str, config: dict) -> str:
    """The body as the device function ``name`` for the constants of ``config``: over the cached pages where
    ``config`` names a ``PAGE``, else over the new tokens."""
    macro = "AUTOSCHED_KV_CACHE_PREFILL_PAGED" if "PAGE" in config else "AUTOSCHED_KV_CACHE_PREFILL"
    return device_function("kv_cache_prefill.cuh", macro, name, dtype, config)


def _checked(h: int, hkv: int, d: int, dtype: str, block_m: int, block_n: int, page: int | None = None) -> None:
    reason = unsupported(h, hkv, d, dtype, page)
    if reason:
        raise ValueError(f"kv_cache_prefill cannot serve {reason}")
    if block_m not in (64, 128) or block_n not in (32, 64) or 2 * smem_elements(d, block_m, block_n) > SMEM_LIMIT:
        raise ValueError(f"block_m {block_m}, block_n {block_n}")


def kv_cache_prefill_kernel(h: int, hkv: int, d: int, dtype: str, block_m: int = BLOCK_M, block_n: int = BLOCK_N):
    """The TIRx PrimFunc, with the signature of TVM's ``batch_prefill_ragged_kv``."""
    from tvm.script import tirx as T

    _checked(h, hkv, d, dtype, block_m, block_n)
    g = h // hkv
    name = kernel_name(h, hkv, d, dtype, block_m, block_n)
    config = {"H": h, "HKV": hkv, "G": g, "D": d, "BM": block_m, "BN": block_n}
    source = body_source(name, dtype, config)
    threads = 2 * block_m  # a warp per 16 rows
    elements = smem_elements(d, block_m, block_n)

    # fmt: off
    @T.prim_func
    def batch_prefill_ragged_kv(
        q_handle: T.handle, q_indptr_handle: T.handle, k_handle: T.handle, v_handle: T.handle,
        kv_indptr_handle: T.handle, q_rope_position_handle: T.handle, k_rope_pos_offset_handle: T.handle,
        output_handle: T.handle, lse_handle: T.handle, causal: T.int32, rotary_mode: T.int32,
        rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32,
    ):
        T.func_attr({"global_symbol": name, "tirx.noalias": True})
        batch_size = T.int32()
        qo_len = T.int32()
        kv_len = T.int32()
        q_indptr_offset = T.int32()
        kv_indptr_offset = T.int32()
        q_rope_offset = T.int32()
        k_rope_offset = T.int32()
        Q = T.match_buffer(q_handle, (qo_len, h, d), dtype, align=16)
        q_indptr = T.match_buffer(q_indptr_handle, (batch_size + 1,), "int32", elem_offset=q_indptr_offset)
        K = T.match_buffer(k_handle, (kv_len, hkv, d), dtype, align=16)
        V = T.match_buffer(v_handle, (kv_len, hkv, d), dtype, align=16)
        kv_indptr = T.match_buffer(kv_indptr_handle, (batch_size + 1,), "int32", elem_offset=kv_indptr_offset)
        q_rope_position = T.match_buffer(q_rope_position_handle, (qo_len,), "int32", elem_offset=q_rope_offset)  # noqa: F841
        k_rope_pos_offset = T.match_buffer(k_rope_pos_offset_handle, (batch_size,), "int32", elem_offset=k_rope_offset)  # noqa: F841
        output = T.match_buffer(output_handle, (qo_len, h, d), dtype, align=16)
        lse = T.match_buffer(lse_handle, (qo_len, h), "float32")
        assert rotary_mode == 0, "autosched's ragged prefill kernel applies no rotary embedding (rotary_mode 0 only)"
        T.device_entry()
        cta = T.cta_id([((qo_len * g + block_m - 1) // block_m + batch_size) * hkv])
        tx = T.thread_id([threads])  # noqa: F841 (declares the block's threads)
        smem = T.alloc_buffer((elements,), dtype, scope="shared.dyn", align=128)
        T.cuda.func_call(name, Q.access_ptr("r"), q_indptr.access_ptr("r"), K.access_ptr("r"), V.access_ptr("r"),
                         kv_indptr.access_ptr("r"), output.access_ptr("w"), lse.access_ptr("w"),
                         smem.access_ptr("rw"), cta, batch_size, causal, sm_scale, source_code=source)
    # fmt: on
    return batch_prefill_ragged_kv


def kv_cache_prefill_paged_kernel(h: int, hkv: int, d: int, dtype: str, page: int = 16, block_m: int = BLOCK_M,
                                  block_n: int = BLOCK_N):
    """The TIRx PrimFunc, with the signature of TVM's ``batch_prefill_paged_kv`` (no sliding window)."""
    from tvm.script import tirx as T

    _checked(h, hkv, d, dtype, block_m, block_n, page)
    g = h // hkv
    name = kernel_name(h, hkv, d, dtype, block_m, block_n, page)
    config = {"H": h, "HKV": hkv, "G": g, "D": d, "BM": block_m, "BN": block_n, "PAGE": page}
    source = body_source(name, dtype, config)
    threads = 2 * block_m  # a warp per 16 rows
    elements = smem_elements(d, block_m, block_n)

    # fmt: off
    @T.prim_func
    def batch_prefill_paged_kv(
        q_handle: T.handle, q_indptr_handle: T.handle, pages_handle: T.handle, page_indptr_handle: T.handle,
        indices_handle: T.handle, length_info_handle: T.handle, k_rope_pos_offset_handle: T.handle,
        q_rope_position_handle: T.handle, output_handle: T.handle, lse_handle: T.handle, causal: T.int32,
        rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32,
    ):
        T.func_attr({"global_symbol": name, "tirx.noalias": True})
        batch_size = T.int32()
        qo_len = T.int32()
        num_pages = T.int32()
        nnz_pages = T.int32()
        pages_offset = T.int64()
        q_indptr_offset = T.int32()
        page_indptr_offset = T.int32()
        indices_offset = T.int32()
        length_info_offset = T.int32()
        k_rope_offset = T.int32()
        q_rope_offset = T.int32()
        Q = T.match_buffer(q_handle, (qo_len, h, d), dtype, align=16)
        q_indptr = T.match_buffer(q_indptr_handle, (batch_size + 1,), "int32", elem_offset=q_indptr_offset)
        pages = T.match_buffer(pages_handle, (num_pages, 2, hkv, page, d), dtype, elem_offset=pages_offset,
                               offset_factor=8, align=16)
        page_indptr = T.match_buffer(page_indptr_handle, (batch_size + 1,), "int32", elem_offset=page_indptr_offset)
        indices = T.match_buffer(indices_handle, (nnz_pages,), "int32", elem_offset=indices_offset)
        length_info = T.match_buffer(length_info_handle, (batch_size,), "int32", elem_offset=length_info_offset)
        k_rope_pos_offset = T.match_buffer(k_rope_pos_offset_handle, (batch_size,), "int32", elem_offset=k_rope_offset)  # noqa: F841
        q_rope_position = T.match_buffer(q_rope_position_handle, (qo_len,), "int32", elem_offset=q_rope_offset)  # noqa: F841
        output = T.match_buffer(output_handle, (qo_len, h, d), dtype, align=16)
        lse = T.match_buffer(lse_handle, (qo_len, h), "float32")
        assert rotary_mode == 0, "autosched's paged prefill kernel applies no rotary embedding (rotary_mode 0 only)"
        T.device_entry()
        cta = T.cta_id([((qo_len * g + block_m - 1) // block_m + batch_size) * hkv])
        tx = T.thread_id([threads])  # noqa: F841 (declares the block's threads)
        smem = T.alloc_buffer((elements,), dtype, scope="shared.dyn", align=128)
        T.cuda.func_call(name, Q.access_ptr("r"), q_indptr.access_ptr("r"), pages.access_ptr("r"),
                         page_indptr.access_ptr("r"), indices.access_ptr("r"), length_info.access_ptr("r"),
                         output.access_ptr("w"), lse.access_ptr("w"), smem.access_ptr("rw"), cta, batch_size, causal,
                         sm_scale, source_code=source)
    # fmt: on
    return batch_prefill_paged_kv
