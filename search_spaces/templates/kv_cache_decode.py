"""Decode attention in TVM's paged-KV-cache calling convention, for sm_90: the kernel that generation's
cache calls for "decode over cached pages" in place of TVM's ``batch_decode_paged_kv``.

The runtime (``attn_backend.h``, ``TIRPagedDecodeFunc::MHA``) calls it as
``(q, pages, page_indptr, page_indices, length_info, k_rope_pos_offset, q_rope_position, output, lse,
rotary_mode, rotary_scale, rotary_theta, sm_scale)``, with

* ``q`` and ``output`` ``[batch, h, d]``; ``pages`` ``[num_pages, 2, hkv, page, d]`` (K then V);
* ``page_indptr`` ``[batch + 1]`` into ``page_indices`` (each sequence's pages, in order), and
  ``length_info`` ``[batch]``, the tokens of each sequence's last page (the cache without sliding windows):
  a sequence of ``n`` pages holds ``(n - 1) · page + length_info[i]`` tokens. These index tensors are views
  into one workspace, so they carry element offsets;
* ``lse`` ``[batch, h]`` float32, base 2 (``m + log2(sum)`` with scores scaled by ``sm_scale · log2(e)``), as
  TVM's kernels write it and its merge kernel reads it; a sequence without tokens gets an output of zeros
  and -5e4, as TVM's kernel gives;
* batch, pages and index lengths symbolic; heads, head dim and the page size fixed (TVM's kernel fixes the
  page at 16 too).

Only ``rotary_mode`` 0 is served (RoPE applied before K is cached, or none): the kernel asserts it on the
host side before launching. The body is ``cuda/kv_cache_decode.cuh`` (flash-decoding on CUDA cores: one
cluster of ``split`` CTAs per (sequence, K/V head), the group's query heads sharing every 16-byte K/V load,
online softmax in base 2, merge through distributed shared memory). This is not a search space: the
generation build puts it in the cache through :func:`autosched.generation.attention.dispatch_attention`.
"""

from __future__ import annotations

from autosched.target import arch_facts

from ._hopper import CUDA_SCALAR, SMEM_LIMIT, device_function

# Deferred imports: tvm (imported where used: `autosched --help` stays fast).

HEAD_DIMS = (32, 64, 128, 256)
PAGE_SIZES = (16,)  # the page TVM's decode kernel fixes (the cache's buffer shape names it)
MAX_GROUP = 8  # query heads per K/V head the registers hold (q and o: 16 floats a head per lane)
# The SMs the default split fills at batch 1, where no GPU is at hand: sm_90's (autosched.target's table); a
# generation build passes its GPU's (``sms``).
SMS = arch_facts("sm_90").sms
MAX_SPLIT = 8  # the portable cluster size


def default_split(hkv: int, batch: int = 1, sms: int = SMS) -> int:
    """CTAs per (sequence, K/V head) for a step whose pairs are too few to fill the GPU: the largest power of
    two, at most 8, whose ``batch · hkv · split`` CTAs fill the SMs at most twice (batch 1, 32 or 8 K/V heads:
    8, each CTA a few pages of one sequence, merged in the cluster)."""
    split = 1
    while split < MAX_SPLIT and batch * hkv * split <= sms:
        split *= 2
    return split


# CTAs a cluster holds where the step's pairs spread (each CTA a pair of its own, whole): clusters of 2 place
# on the SMs better than clusters of the split's 8 (``benchmarks/decode_attention_benchmark.py``).
SPREAD_SPLIT = 2


def default_config(group: int, hkv: int, d: int, sms: int = SMS) -> dict:
    """The kernel's knobs: ``split``, the CTAs splitting one (sequence, K/V head) pair's pages where a step's
    pairs are too few to fill the GPU (batch 1), ``spread_split``, the cluster size where they are enough,
    both chosen at launch from the step's batch; ``warps``, ``unroll``; ``blocks``, the CTAs an SM is compiled
    to hold (without GQA, so that a batch of 16 runs in one wave); ``fill``, whether a CTA takes several pairs
    where they are many (:func:`pair_warps`)."""
    warps, unroll = default_warps(group, d), default_unroll(group)
    return {"split": default_split(hkv, sms=sms), "spread_split": SPREAD_SPLIT, "warps": warps, "unroll": unroll,
            "blocks": default_blocks(group, d, warps, unroll), "fill": warps == 16}


def default_warps(group: int, d: int) -> int:
    """Warps per CTA: the most of 16 (with GQA only), 8 and 4 whose partial results fit the 48 KB of shared
    memory a kernel gets without asking: more warps keep more K/V loads in flight per SM. Without GQA, 4 CTAs
    an SM of 8 warps each (``default_blocks``) beat 2 of 16 (``benchmarks/decode_attention_benchmark.py``)."""
    choices = (16, 8, 4) if group > 1 else (8, 4)
    return next(w for w in choices if w == 4 or 4 * smem_floats(group, d, w) <= 48 * 1024)


def spreads(pairs, sms: int = SMS):
    """Whether ``pairs`` (sequence, K/V head) pairs fill nine tenths of the SMs or more by themselves: then
    each CTA of a cluster takes a pair of its own, whole, rather than a share of one pair's pages (a split
    chosen for batch 1 would only add CTAs and merges at batch 16). Python ints or TIR expressions."""
    return pairs * 10 >= sms * 9


def pair_warps(pairs, warps: int, sms: int = SMS):
    """Warps per (sequence, K/V head) pair where the pairs spread, for a kernel of ``warps`` warps a CTA (one
    CTA an SM) that fills: all of them up to one pair an SM, half up to two, a quarter (at least 4) beyond, each
    CTA then taking ``warps / pair_warps`` pairs, so that the pairs of a large batch (Llama 3 at batch 64: 512)
    run at once, not in waves of one pair an SM (``benchmarks/decode_attention_benchmark.py``). Python ints or
    TIR expressions."""
    choices = [w for w in (warps, warps // 2, warps // 4) if w >= 4]
    chosen = choices[-1]
    for i in reversed(range(len(choices) - 1)):
        if isinstance(pairs, int):
            chosen = choices[i] if pairs <= sms << i else chosen
        else:
            from tvm.script import tirx as T

            chosen = T.Select(pairs <= sms << i, choices[i], chosen)
    return chosen


def default_unroll(group: int) -> int:
    """Steps of K/V loads in flight per warp: fewer as the group's registers (q, o, scores) grow."""
    return 4 if group <= 2 else 2 if group <= 4 else 1


def default_blocks(group: int, d: int, warps: int, unroll: int) -> int | None:
    """CTAs per SM the kernel is compiled to fit (``__launch_bounds__``' second argument: the registers a
    thread may use), or None to leave the registers to the compiler. Without GQA (a group of one head) the
    body fits in 64 registers a thread without spills (``tests/test_kv_cache_decode.py``); then the (sequence,
    K/V head) pairs of a batch of 16 with 32 K/V heads run on the GPU at once rather than in two waves."""
    if group > 1 or unroll > 4:
        return None
    return min(32 // warps, 48 * 1024 // (4 * smem_floats(group, d, warps)))


def smem_floats(group: int, d: int, warps: int) -> int:
    """Shared memory of the body, in 4-byte words: each warp's (output, max, sum) per head, then the CTA's."""
    return (warps + 1) * group * (d + 2)


def unsupported(h: int, hkv: int, d: int, dtype: str, page: int) -> str | None:
    """Why the kernel cannot serve this cache configuration, or None."""
    if dtype not in CUDA_SCALAR:
        return f"dtype {dtype} (fp16 and bf16 only)"
    if d not in HEAD_DIMS:
        return f"head dim {d} (one of {', '.join(map(str, HEAD_DIMS))})"
    if page not in PAGE_SIZES:
        return f"page size {page} (16 only)"
    if hkv < 1 or h % hkv:
        return f"{h} query heads over {hkv} K/V heads"
    if h // hkv > MAX_GROUP:
        return f"GQA groups of {h // hkv} query heads (at most {MAX_GROUP})"
    return None


def kernel_name(h: int, hkv: int, d: int, dtype: str, page: int, split: int, warps: int, unroll: int,
                blocks: int | None = None, spread_split: int = SPREAD_SPLIT, fill: bool = False) -> str:
    fit = f"_blocks{blocks}" if blocks else ""
    spread = f"_spread{spread_split}" + ("fill" if fill else "") if split > 1 else ""
    return (f"autosched_kv_cache_decode_h{h}_hkv{hkv}_d{d}_page{page}_split{split}{spread}_warps{warps}"
            f"_unroll{unroll}{fit}_{dtype}")


def body_source(name: str, dtype: str, config: dict) -> str:
    """The body as the device function ``name`` for the constants of ``config``."""
    return device_function("kv_cache_decode.cuh", "AUTOSCHED_KV_CACHE_DECODE", name, dtype, config)


def kv_cache_decode_kernel(h: int, hkv: int, d: int, dtype: str, page: int = 16, split: int | None = None,
                           warps: int | None = None, unroll: int | None = None, blocks: int | None = None,
                           spread_split: int | None = None, fill: bool | None = None, sms: int = SMS):
    """The TIRx PrimFunc, with the signature of TVM's ``batch_decode_paged_kv`` (no sliding window).
    ``split``, ``spread_split``, ``warps``, ``unroll``, ``blocks`` (CTAs per SM to fit in the registers; 0: the
    compiler's choice), ``fill``: :func:`default_config`'s unless given; ``sms``: the GPU's multiprocessors
    (``autosched.target.device_facts``), which the default split and the spreading of pairs fill."""
    from tvm.script import tirx as T

    reason = unsupported(h, hkv, d, dtype, page)
    if reason:
        raise ValueError(f"kv_cache_decode cannot serve {reason}")
    g = h // hkv
    knobs = default_config(g, hkv, d, sms)
    split = knobs["split"] if split is None else split
    spread_split = min(knobs["spread_split"] if spread_split is None else spread_split, split)
    warps = knobs["warps"] if warps is None else warps
    unroll = knobs["unroll"] if unroll is None else unroll
    blocks = (knobs["blocks"] if blocks is None else blocks) or None
    fill = (knobs["fill"] if fill is None else fill) and split > 1
    if (split not in (1, 2, 4, 8) or spread_split not in (1, 2, 4, 8) or warps not in (1, 2, 4, 8, 16) or unroll < 1
            or 4 * smem_floats(g, d, warps) > SMEM_LIMIT):
        raise ValueError(f"split {split}, spread_split {spread_split}, warps {warps}, unroll {unroll}")
    name = kernel_name(h, hkv, d, dtype, page, split, warps, unroll, blocks, spread_split, fill)
    config = {"H": h, "HKV": hkv, "G": g, "D": d, "PAGE": page, "WARPS": warps, "UNROLL": unroll, "SPLIT": split,
              "SPREAD_SPLIT": spread_split, "FILL": int(fill)}
    source = body_source(name, dtype, config)
    threads = 32 * warps
    words = smem_floats(g, d, warps)

    def launch(pairs):  # (cluster, rank in it, whether CTAs take pairs of their own, warps a pair), at run time
        if split == 1:
            return T.cta_id([pairs]), 0, 0, warps
        # The cluster's size is a launch parameter: ``split`` CTAs share a pair, or ``spread_split`` take their own
        # (one each, or with ``fill`` one each ``pair_warps`` warps where the pairs are many).
        spread = spreads(pairs, sms)
        per_pair = pair_warps(pairs, warps, sms) if fill else warps
        ctas = (pairs + warps // per_pair - 1) // (warps // per_pair)
        cluster = T.cluster_id([T.Select(spread, (ctas + spread_split - 1) // spread_split, pairs)])
        # The body reads the warps a pair only where the CTAs are spread.
        return (cluster, T.cta_id_in_cluster([T.Select(spread, spread_split, split)]), T.Select(spread, 1, 0),
                per_pair)

    # fmt: off
    @T.prim_func
    def batch_decode_paged_kv(
        q_handle: T.handle, pages_handle: T.handle, indptr_handle: T.handle, indices_handle: T.handle,
        length_info_handle: T.handle, k_rope_pos_offset_handle: T.handle, q_rope_position_handle: T.handle,
        output_handle: T.handle, lse_handle: T.handle, rotary_mode: T.int32, rotary_scale: T.float32,
        rotary_theta: T.float32, sm_scale: T.float32,
    ):
        T.func_attr({"global_symbol": name, "tirx.noalias": True})
        B = T.int32()
        num_pages = T.int32()
        nnz_pages = T.int32()
        pages_offset = T.int64()
        indptr_offset = T.int32()
        indices_offset = T.int32()
        length_info_offset = T.int32()
        k_rope_offset = T.int32()
        q_rope_offset = T.int32()
        Q = T.match_buffer(q_handle, (B, h, d), dtype, align=16)
        pages = T.match_buffer(pages_handle, (num_pages, 2, hkv, page, d), dtype, elem_offset=pages_offset,
                               offset_factor=8, align=16)
        indptr = T.match_buffer(indptr_handle, (B + 1,), "int32", elem_offset=indptr_offset)
        indices = T.match_buffer(indices_handle, (nnz_pages,), "int32", elem_offset=indices_offset)
        length_info = T.match_buffer(length_info_handle, (B,), "int32", elem_offset=length_info_offset)
        k_rope_pos_offset = T.match_buffer(k_rope_pos_offset_handle, (B,), "int32", elem_offset=k_rope_offset)  # noqa: F841
        q_rope_position = T.match_buffer(q_rope_position_handle, (B,), "int32", elem_offset=q_rope_offset)  # noqa: F841
        output = T.match_buffer(output_handle, (B, h, d), dtype, align=16)
        lse = T.match_buffer(lse_handle, (B, h), "float32")
        assert rotary_mode == 0, "autosched's paged decode kernel applies no rotary embedding (rotary_mode 0 only)"
        T.device_entry()
        if blocks is not None:
            T.attr({"tirx.launch_bounds_min_blocks_per_sm": blocks})
        cluster, rank, spread, per_pair = launch(B * hkv)
        tx = T.thread_id([threads])  # noqa: F841 (declares the block's threads)
        smem = T.alloc_buffer((words,), "float32", scope="shared.dyn", align=16)
        T.cuda.func_call(name, Q.access_ptr("r"), pages.access_ptr("r"), indptr.access_ptr("r"),
                         indices.access_ptr("r"), length_info.access_ptr("r"), output.access_ptr("w"),
                         lse.access_ptr("w"), smem.access_ptr("rw"), cluster, rank, B * hkv, spread, per_pair, sm_scale,
                         source_code=source)
    # fmt: on
    return batch_decode_paged_kv
