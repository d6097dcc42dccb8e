"""GEMM on Hopper (sm_90a): TMA-fed, warp-specialised wgmma kernels written in TVM 0.27's TIRx.

A template space: each point is a complete kernel, generated here as TIRx and compiled with
``tir_pipeline="tirx"``. The structure is the one Hopper GEMMs share (CUTLASS's warp-specialised
kernels, DeepGEMM, FlashAttention-3):

* one *producer* warpgroup; one elected thread of it issues TMA loads (``cp.async.bulk.tensor``,
  128-byte swizzle) of A and B tiles into a ring of ``stages`` shared-memory buffers, each with a
  *full* mbarrier that the copy engine completes;
* one or two *consumer* warpgroups, each owning ``wg_rows`` rows of the block tile, wait on the full
  barrier, issue ``wgmma.mma_async m64nBNk16`` straight from shared memory (descriptors), keep one
  wgmma group in flight, and release the previous stage through its *empty* mbarrier;
* register reallocation (``setmaxnreg``): the producer gives its registers to the consumers, whose
  accumulators take up to 128 registers per thread;
* a grouped rasterisation of the block tiles (``group_m`` row tiles share the same B columns in L2),
  optionally persistent CTAs that walk the tiles with a stride of the grid, so that one tile's
  epilogue overlaps the next tile's loads;
* the epilogue (bias, activation, cast) from registers, two elements per 4-byte store (one per 2-byte
  store where an odd n puts every other row at an odd address);
* for grids smaller than the GPU (decode GEMMs, m of 2-64), split-K across a thread-block cluster of 2
  or 4 CTAs: each takes a slice of K for the same tile, and the first adds the others' accumulators
  in through distributed shared memory before the epilogue;
* ping-pong (``pingpong``, persistent CTAs): the two consumers take every other tile of the CTA instead
  of half of each tile's rows, so that one's epilogue overlaps the other's main loop; two named
  barriers hand the main loop over in turn (a consumer that ran ahead by a lap of the stage ring would
  take an mbarrier phase a lap old for its own);
* TMA multicast (``multicast``): a cluster of two CTAs on neighbouring tiles that
  share the B tile (two row tiles, "b") or the A tile (two column tiles, "a"); each producer loads half
  of the shared tile and multicasts it into both CTAs, so L2 serves it once per pair. Both CTAs' consumer
  warps release each stage in both CTAs (one lane per warp and CTA, through the cluster's shared window);
* block_n, beyond the standard widths, takes per shape the widths that fill whole waves of the
  multiprocessors (``whole_wave_block_ns``);
* for the same few rows, swapped operands (``swap_ab``): Cᵀ = B · Aᵀ puts the weights on wgmma's
  64-row side and the tokens on its N side (from 16), so a decode step's 16 tokens are not padded to 64
  rows in every stage; the stages shrink and the ring can be deeper. Its epilogue stores transposed,
  one element at a time;
* float8 E4M3 operands (``fp8``, the ``fp8_gemm`` workload, space ``hopper_fp8_gemm``): the same stages of
  128-byte rows, now of 128 codes (TMA boxes of uint8), ``wgmma m64nNk32.f32.e4m3.e4m3`` four times per row,
  the epilogue multiplying by the row's (token's) and the column's (output channel's) float32 scales; with
  ``promote`` each stage's products go to fresh accumulators that are added to the tile's in fp32 on the CUDA
  cores, as cuBLAS and CUTLASS do by default (the tensor cores' fp8 accumulation keeps about 14 bits);
* for a decode step's 2 to 16 rows of fp16 or bf16, a second kernel (``stream`` and its knobs,
  :mod:`.mma_gemv`): the weights streamed from global memory straight into ``mma.sync`` fragments, with
  no TMA ring, barriers or cluster, the warps of a block splitting k.

Operands are C[m, n] = A[m, k] · B[n, k]ᵀ (the ``gemm`` workload: torch.nn.Linear's layout, both
operands K-major, which wgmma reads without transposition). Shapes no tile divides need no padding:
TMA fills out-of-bounds boxes with zeros and the epilogue is predicated.
"""

from __future__ import annotations

import math

from autosched.target import device_facts

from .._analysis import operand_shapes
from .._knobs import Knob, Point
from . import mma_gemv
from ._hopper import (
    BK,
    FP8_BK,
    HOPPER_ARCHS,
    PTX_TYPE,
    SMEM_LIMIT,
    HopperTemplate,
    canonical_group_m,
    epilogue_source,
    grouped_raster,
)
from ._pipeline import (
    FENCE_NAME,
    FENCE_SOURCE,
    HOPPER_HELPERS,
    TURN_HANDOVER,
    TURN_HANDOVER_SOURCE,
    TURN_SYNC,
    TURN_SYNC_SOURCE,
    fence_accumulators,
    init_stage_barriers,
    pipeline_buffers,
    tile_walk_scalars,
    zero_accumulators,
)

# Deferred imports: tvm (imported where used: `autosched --help` stays fast).

WGMMA_N = (64, 96, 128, 160, 192, 224, 256)


# Split-K across a thread-block cluster: the CTAs of one cluster share an output tile, each over its own
# slice of K; every CTA but the first leaves its fp32 accumulators in its shared memory, laid out by
# thread ([register][thread]), and the first CTA adds them in through distributed shared memory (mapa +
# ld.shared::cluster), then stores the tile. The barrier carries release/acquire semantics and a memory
# clobber, so that nvcc keeps the shared-memory accesses on their side of it.
CLUSTER_SYNC, PART_STORE, PART_ADD = "autosched_cluster_sync", "autosched_partial_store", "autosched_partial_add_remote"
CLUSTER_SYNC_SOURCE = PART_STORE_SOURCE = PART_ADD_SOURCE = HOPPER_HELPERS

# TMA multicast across a cluster of two CTAs: each CTA's empty barrier counts the consumer warps of both
# (a stage of either CTA is written by both producers), and one lane of each warp releases a stage in
# CTA 0 and another in CTA 1, through its address in the cluster's shared window. The arrive keeps the
# default CTA-scope release (as CUTLASS's cluster barrier does): the warp's wgmma reads of the stage are
# complete at wgmma.wait_group, so no cluster-scope fence is owed; v4's .release.cluster paid for one.
CLUSTER_ARRIVE = "autosched_cluster_arrive"
CLUSTER_ARRIVE_SOURCE = HOPPER_HELPERS
# The other CTA's producer may multicast into this CTA's stages as soon as the cluster barrier after the
# barriers' initialisation lets it: the initialisation is released to the cluster first.
BARRIER_INIT_FENCE = "autosched_barrier_init_fence"
BARRIER_INIT_FENCE_SOURCE = HOPPER_HELPERS
MULTICAST_LOAD = ("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                  ".multicast::cluster")


def hopper_gemm_kernel(m: int, n: int, k: int, dtype: str, bias: bool, act: str, p: Point, gated: bool = False,
                       fp8: bool = False):
    """The TIRx kernel of point ``p`` for C[m, n] = act(A[m, k] · B[n, k]ᵀ + bias[n]); ``gated``: for
    C = SiLU(A · B[:n]ᵀ) ⊙ (A · B[n:]ᵀ), B[2n, k] (``swiglu_gemm``); ``fp8``: for A and B the uint8 bits of
    float8 E4M3FN numbers and C = act((A · Bᵀ) · scale_a[m] · scale_w[n] + bias[n]) of ``dtype`` (``fp8_gemm``:
    the same stages of 128-byte rows, each of 128 elements, and ``wgmma ... k32.f32.e4m3.e4m3``)."""
    from tvm.script import tirx as T

    consumers, wg_rows, bn, stages = p["consumers"], p["wg_rows"], p["block_n"], p["stages"]
    group_m, persistent = p["group_m"], p["persistent"]
    split_k = p.get("split_k", 1)  # CTAs of a cluster that share one output tile, each over 1/split_k of K
    # Swapped operands compute Cᵀ = B · Aᵀ: the weights' rows fill wgmma's 64-row side and the few tokens
    # of a decode step its N side (from 16), instead of padding the tokens to 64 rows.
    swap = p.get("swap_ab", False)
    # Ping-pong: each consumer warpgroup owns whole tiles (every other one of the CTA's), so that one's
    # epilogue runs while the other's main loop has the tensor cores; otherwise they split each tile's rows.
    pingpong = p.get("pingpong", False)
    # Multicast: a cluster of two CTAs on neighbouring tiles that share one operand's tile ("b": two row
    # tiles share B's; "a": two column tiles share A's); each CTA's producer loads half of the shared tile
    # and multicasts it into both CTAs' stages, so L2 serves that operand once per pair.
    multicast = p.get("multicast", "none")
    paired = multicast != "none"
    # The extents of wgmma's M and N sides. Gated, each N-side tile is bn / 2 gate rows of B over the same
    # bn / 2 up rows (every thread holds a column of both: accumulators i and i + bn / 4), and tiles as if
    # B's 2n rows were one operand.
    rows, cols = (n, m) if swap else (m, 2 * n if gated else n)
    assert not (gated and (swap or bias or act != "none")), "gated tiles are prefill tiles with no epilogue of their own"
    assert not (gated and fp8), "fp8 operands are not gated"
    bm = wg_rows if pingpong else consumers * wg_rows
    m_frags = wg_rows // 64  # wgmma m64 instructions per consumer per k step
    acc_n = bn // 2  # fp32 accumulator registers per thread per m64 fragment
    threads = 128 * (consumers + 1)
    # Bytes per operand element, elements per 128-byte stage row (one swizzle row), and K per wgmma (32 bytes).
    elem, bk, k_mma = (1, FP8_BK, 32) if fp8 else (2, BK, 16)
    operand = "uint8" if fp8 else dtype  # A's and B's dtype; C's (and the bias's) is dtype
    a_stage, b_stage = bm * bk * elem, bn * bk * elem
    stage_bytes = a_stage + b_stage
    tiles_m, tiles_n = math.ceil(rows / bm), math.ceil(cols / bn)
    # Units of work: tiles, or with multicast the pairs of tiles of one cluster (an odd last row or column
    # tile pairs with one past the edge, which TMA fills with zeros and the epilogue does not store).
    units_m = math.ceil(tiles_m / 2) if multicast == "b" else tiles_m
    units_n = math.ceil(tiles_n / 2) if multicast == "a" else tiles_n
    tiles = units_m * units_n
    k_iters = math.ceil(k / bk)
    grid = min(tiles, p["sms"] // (2 if paired else 1)) if persistent else tiles  # CTAs, or clusters
    assert split_k == 1 or (not persistent and k_iters >= split_k), "split-K needs one tile per cluster"
    assert not (paired and (split_k > 1 or swap or pingpong)), "multicast is for cooperative prefill tiles"
    group_m = min(group_m, units_m)
    # Rows of the A box and the B box: a shared operand's box is half its tile.
    a_box = (bm // 2 if multicast == "a" else bm)
    b_box = (bn // 2 if multicast == "b" or gated else bn)
    # fp8: each stage's four wgmma (K = 128) into fresh accumulators, added into the tile's fp32 sums on the CUDA
    # cores (the tensor cores' own fp8 accumulation keeps about 14 bits: CUTLASS's and DeepGEMM's promotion).
    promote = fp8 and p.get("promote", False)
    if fp8:  # K-major operands only: no transpose immediates
        mma, mma_imms = f"wgmma.mma_async.sync.aligned.m64n{bn}k32.f32.e4m3.e4m3", (1, 1)
    else:
        mma, mma_imms = f"wgmma.mma_async.sync.aligned.m64n{bn}k16.f32.{PTX_TYPE[dtype]}.{PTX_TYPE[dtype]}", (1, 1, 0, 0)
    store2, store1, epi_source = epilogue_source(dtype, act)
    # The shared buffer: [stage][A tile | B tile], each tile 1024-byte aligned (swizzle atoms).
    smem_elems = stages * stage_bytes // elem
    a_off, b_off = 0, a_stage // elem  # element offsets inside one stage
    acc_len = m_frags * acc_n
    # Arrivals that release a stage: every consumer thread of the CTA, or with multicast one lane per
    # consumer warp of either CTA.
    empty_count = 2 * consumers * 4 if paired else 128 if pingpong else consumers * 128

    def accs(acc, f, base=0):  # fragment f's accumulators; with promotion, base acc_len: the stage's partial sums
        return [acc[base + f * acc_n + i] for i in range(acc_n)]

    def stored(acc, Bias, S, i, row, col):  # accumulator i of output (row, col): fp8's scales (S), the bias
        x = acc[i] * S[0][row] * S[1][col] if fp8 else acc[i]
        return x + T.Cast("float32", Bias[col]) if bias else x

    unit_m, unit_n = grouped_raster(units_m, units_n, group_m)

    def tile_m(unit, rank):  # the row and column tile of a CTA of rank `rank` in its cluster
        return unit_m(unit) * 2 + rank if multicast == "b" else unit_m(unit)

    def tile_n(unit, rank):
        return unit_n(unit) * 2 + rank if multicast == "a" else unit_n(unit)

    def launch_ids():  # (the CTA's first unit, its rank in the cluster)
        if paired:
            return T.cluster_id([grid]), T.cta_id_in_cluster([2])
        if split_k == 1:
            return T.cta_id([grid]), 0
        return T.cluster_id([tiles]), T.cta_id_in_cluster([split_k])

    def k_rank(rank):  # the rank's slice of K: its cluster rank with split-K, else the whole of K
        return rank if split_k > 1 else 0

    def k_begin(rank):  # the first K step of a rank's slice; every rank gets at least one
        return rank * k_iters // split_k

    def k_steps(rank):
        return (rank + 1) * k_iters // split_k - rank * k_iters // split_k

    # fmt: off
    def first_row(wg):  # the consumer's first row in the block tile
        return 0 if pingpong else (wg - 1) * wg_rows

    def swiglu(acc, i):  # gate column i's SiLU times its up column's
        return acc[i] / (T.float32(1) + T.exp(-acc[i])) * acc[i + bn // 4]

    @T.macro
    def gated_epilogue(acc, C, tm, tn, wg, tx):
        for f in T.unroll(m_frags):
            for j in T.unroll(bn // 16):
                for h in T.unroll(2):
                    row = T.meta_var(tm * bm + first_row(wg) + f * 64 + ((tx % 128) // 32) * 16
                                     + (tx % 32) // 4 + h * 8)
                    col = T.meta_var(tn * (bn // 2) + j * 8 + (tx % 4) * 2)
                    i = T.meta_var(f * acc_n + j * 4 + h * 2)
                    if row < m and col < n:
                        if n % 2 == 0:
                            T.cuda.func_call(store2, C.access_ptr("w", offset=row * n + col), swiglu(acc, i),
                                             swiglu(acc, i + 1), source_code=epi_source)
                        else:
                            T.cuda.func_call(store1, C.access_ptr("w", offset=row * n + col), swiglu(acc, i),
                                             source_code=epi_source)
                            if col + 1 < n:
                                T.cuda.func_call(store1, C.access_ptr("w", offset=row * n + col + 1),
                                                 swiglu(acc, i + 1), source_code=epi_source)

    @T.macro
    def plain_epilogue(acc, Bias, S, C, tm, tn, wg, tx):
        for f in T.unroll(m_frags):
            for j in T.unroll(bn // 8):
                for h in T.unroll(2):
                    row = T.meta_var(tm * bm + first_row(wg) + f * 64 + ((tx % 128) // 32) * 16
                                     + (tx % 32) // 4 + h * 8)
                    col = T.meta_var(tn * bn + j * 8 + (tx % 4) * 2)
                    i = T.meta_var(f * acc_n + j * 4 + h * 2)  # the pair (i, i + 1): columns col, col + 1
                    if swap:  # (row, col) of Cᵀ: output column row, output rows col and col + 1
                        if row < n and col < m:
                            T.cuda.func_call(store1, C.access_ptr("w", offset=col * n + row),
                                             stored(acc, Bias, S, i, col, row), source_code=epi_source)
                            if col + 1 < m:
                                T.cuda.func_call(store1, C.access_ptr("w", offset=(col + 1) * n + row),
                                                 stored(acc, Bias, S, i + 1, col + 1, row), source_code=epi_source)
                    elif row < m and col < n:
                        if n % 2 == 0:
                            T.cuda.func_call(store2, C.access_ptr("w", offset=row * n + col),
                                             stored(acc, Bias, S, i, row, col), stored(acc, Bias, S, i + 1, row, col + 1),
                                             source_code=epi_source)
                        else:  # odd rows start at odd addresses: one column per store
                            T.cuda.func_call(store1, C.access_ptr("w", offset=row * n + col),
                                             stored(acc, Bias, S, i, row, col), source_code=epi_source)
                            if col + 1 < n:
                                T.cuda.func_call(store1, C.access_ptr("w", offset=row * n + col + 1),
                                                 stored(acc, Bias, S, i + 1, row, col + 1), source_code=epi_source)

    @T.macro
    def epilogue(acc, Bias, S, C, tm, tn, wg, tx):
        if gated:
            gated_epilogue(acc, C, tm, tn, wg, tx)
        else:
            plain_epilogue(acc, Bias, S, C, tm, tn, wg, tx)

    @T.macro
    def load(smem, full, stage, tmap, kt, row, offset, box, shared, rank, half_rows=None):
        # One operand's tile of k step kt into the stage: wgmma's M-side tile at a_off, its N-side tile at
        # b_off. A tile shared by a multicast pair: this CTA's half (box rows), into both CTAs' stages;
        # ``half_rows``: the operand's rows from the tile's first half to its second (else box).
        if shared:
            T.ptx[MULTICAST_LOAD](
                smem.access_ptr("w", offset=stage * (stage_bytes // elem) + offset + rank * box * bk),
                T.address_of(tmap), kt * bk, row + rank * (box if half_rows is None else half_rows),
                T.address_of(full[stage]), T.uint16(3))
        else:
            T.ptx["cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"](
                smem.access_ptr("w", offset=stage * (stage_bytes // elem) + offset), T.address_of(tmap), kt * bk,
                row, T.address_of(full[stage]))

    @T.macro
    def release(empty, stage, tx):  # the consumer is done reading a stage: its producers may refill it
        if paired:
            if tx % 32 < 2:  # lane r releases the stage in the cluster's CTA r
                T.cuda.func_call(CLUSTER_ARRIVE, T.address_of(empty[stage]), tx % 32, source_code=CLUSTER_ARRIVE_SOURCE)
        else:
            T.ptx.mbarrier.arrive.shared.b64(T.address_of(empty[stage]))

    @T.macro
    def body(A, B, S, Bias, C):  # S: fp8's (scale_a, scale_w), else None
        A_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        T.tensormap_encode_tiled(A_map, A.data, k, m, k * elem, bk, bn if swap else a_box, 1, 1,
                                 descriptor_dtype=operand, rank=2, swizzle=3)
        B_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        T.tensormap_encode_tiled(B_map, B.data, k, 2 * n if gated else n, k * elem, bk, bm if swap else b_box, 1, 1,
                                 descriptor_dtype=operand, rank=2, swizzle=3)
        T.device_entry()
        bx, rank = launch_ids()
        tx = T.thread_id([threads])
        # With promotion the accumulators are the tile's sums, then a stage's partial sums.
        smem, full, empty, acc = pipeline_buffers(smem_elems, operand, stages, 2 * acc_len if promote else acc_len)
        desc_a, desc_b, it, tile, tm, tn = tile_walk_scalars()
        phase: T.int32
        turn: T.int32  # ping-pong: the CTA's tiles so far (whose turn the next is)
        wg = T.meta_var(tx // 128)

        if tx == 0:
            init_stage_barriers(full, empty, stages, empty_count)
            if paired:
                T.cuda.func_call(BARRIER_INIT_FENCE, source_code=BARRIER_INIT_FENCE_SOURCE)
        if paired:
            T.cuda.func_call(CLUSTER_SYNC, source_code=CLUSTER_SYNC_SOURCE)
        else:
            T.cuda.cta_sync()

        it = 0
        if wg == 0:
            if split_k == 1:  # with split-K the producer runs the cluster's barriers after its loop, on
                # registers it would have given away; its consumers' 64 accumulators need no more anyway
                T.ptx["setmaxnreg.dec.sync.aligned.u32"](40)
            if tx == 0:
                tile = bx
                while tile < tiles:
                    tm = tile_m(tile, rank)
                    tn = tile_n(tile, rank)
                    for ks in T.serial(k_steps(k_rank(rank))):
                        kt = T.meta_var(k_begin(k_rank(rank)) + ks)
                        if it >= stages:
                            T.cuda.mbarrier_wait(T.address_of(empty[it % stages]), ((it // stages) + 1) % 2)
                        T.ptx.mbarrier.arrive.expect_tx.shared.b64(T.address_of(full[it % stages]), T.uint32(stage_bytes))
                        # wgmma's M-side tile (a_off) and N-side tile (b_off): A and B, or B and A if swapped
                        load(smem, full, it % stages, B_map if swap else A_map, kt, tm * bm, a_off, a_box,
                             multicast == "a", rank)
                        if gated:  # the gate's rows, then the up projection's, n rows further
                            if multicast == "b":
                                load(smem, full, it % stages, B_map, kt, tn * b_box, b_off, b_box, True, rank, n)
                            else:
                                for half in T.unroll(2):
                                    load(smem, full, it % stages, B_map, kt, tn * b_box + half * n,
                                         b_off + half * b_box * bk, b_box, False, rank)
                        else:
                            load(smem, full, it % stages, A_map if swap else B_map, kt, tn * bn, b_off, b_box,
                                 multicast == "b", rank)
                        it = it + 1
                    tile = tile + grid
        else:
            if split_k == 1:
                T.ptx["setmaxnreg.inc.sync.aligned.u32"](232)
            tile = bx
            turn = 0
            while tile < tiles:
                if pingpong and turn % 2 != wg - 1:
                    it = it + k_steps(k_rank(rank))  # the other warpgroup's tile: its stages are not ours
                else:
                    tm = tile_m(tile, rank)
                    tn = tile_n(tile, rank)
                    zero_accumulators(acc, acc_len)
                    if pingpong and turn > 0:
                        # The other warpgroup's main loop has waited on every stage before ours: only then
                        # does each full barrier's phase parity name our stage and not one a lap earlier.
                        T.cuda.func_call(TURN_SYNC, wg, source_code=TURN_SYNC_SOURCE)
                    for ks in T.serial(k_steps(k_rank(rank))):
                        phase = (it // stages) % 2
                        T.cuda.mbarrier_wait(T.address_of(full[it % stages]), phase)
                        T.ptx.wgmma.fence.sync.aligned()
                        for kk in T.unroll(bk // k_mma):  # four wgmma k steps of 32 bytes per 128-byte row
                            for f in T.unroll(m_frags):
                                T.cuda.wgmma.encode_matrix_descriptor(
                                    T.address_of(desc_a),
                                    smem.access_ptr("r", offset=(it % stages) * (stage_bytes // elem) + a_off
                                                    + (first_row(wg) + f * 64) * bk + kk * k_mma), 1, 64, 3)
                                T.cuda.wgmma.encode_matrix_descriptor(
                                    T.address_of(desc_b),
                                    smem.access_ptr("r", offset=(it % stages) * (stage_bytes // elem) + b_off
                                                    + kk * k_mma), 1, 64, 3)
                                if promote:  # the stage's first wgmma overwrites the partial sums
                                    T.ptx[mma](*accs(acc, f, acc_len), desc_a, desc_b, kk > 0, *mma_imms)
                                else:
                                    T.ptx[mma](*accs(acc, f), desc_a, desc_b, T.bool(True), *mma_imms)
                        T.ptx.wgmma.commit_group.sync.aligned()
                        if promote:  # the stage's sums into the tile's, in fp32
                            T.ptx.wgmma.wait_group.sync.aligned(0)
                            release(empty, it % stages, tx)
                            for i in T.unroll(acc_len):
                                T.cuda.func_call(FENCE_NAME, acc[acc_len + i], source_code=FENCE_SOURCE)
                                acc[i] = acc[i] + acc[acc_len + i]
                        else:
                            T.ptx.wgmma.wait_group.sync.aligned(1)
                            if ks > 0:
                                release(empty, (it + stages - 1) % stages, tx)
                        it = it + 1
                    if pingpong and tile + grid < tiles:  # the other's next tile follows: its turn
                        T.cuda.func_call(TURN_HANDOVER, 3 - wg, source_code=TURN_HANDOVER_SOURCE)
                    if not promote:
                        T.ptx.wgmma.wait_group.sync.aligned(0)
                        release(empty, (it + stages - 1) % stages, tx)
                        fence_accumulators(acc, acc_len)
                    if split_k == 1:
                        epilogue(acc, Bias, S, C, tm, tn, wg, tx)
                tile = tile + grid
                turn = turn + 1
        if split_k > 1:
            # Every pipeline stage is consumed (the wgmma reads are complete): the ring's memory takes the
            # partial tiles. The first barrier keeps a CTA from overwriting a stage its other consumer
            # still reads; the last keeps the other CTAs' shared memory alive until the first has read it.
            T.cuda.func_call(CLUSTER_SYNC, source_code=CLUSTER_SYNC_SOURCE)
            if wg > 0 and rank > 0:
                for i in T.unroll(acc_len):
                    T.cuda.func_call(PART_STORE, smem.access_ptr("w"), i * (consumers * 128) + tx - 128, acc[i],
                                     source_code=PART_STORE_SOURCE)
            T.cuda.func_call(CLUSTER_SYNC, source_code=CLUSTER_SYNC_SOURCE)
            if wg > 0 and rank == 0:
                for r in T.serial(1, split_k):
                    for i in T.unroll(acc_len):
                        T.cuda.func_call(PART_ADD, acc[i], smem.access_ptr("r"), i * (consumers * 128) + tx - 128,
                                         T.uint32(r), source_code=PART_ADD_SOURCE)
                epilogue(acc, Bias, S, C, tm, tn, wg, tx)
            T.cuda.func_call(CLUSTER_SYNC, source_code=CLUSTER_SYNC_SOURCE)
        if paired:  # the other CTA may still release stages of this one: its shared memory stays until then
            T.cuda.func_call(CLUSTER_SYNC, source_code=CLUSTER_SYNC_SOURCE)

    attrs = {"global_symbol": "main", "tirx.noalias": True, "tirx.launch_bounds_min_blocks_per_sm": 1}
    if fp8:
        return _fp8_main(body, m, n, k, dtype, bias, attrs)
    if bias:
        @T.prim_func
        def main(A: T.Buffer((m, k), dtype, align=16), B: T.Buffer((n, k), dtype, align=16),
                 Bias: T.Buffer((n,), dtype, align=16), C: T.Buffer((m, n), dtype, align=16)):
            T.func_attr(attrs)
            body(A, B, None, Bias, C)
    else:
        @T.prim_func
        def main(A: T.Buffer((m, k), dtype, align=16), B: T.Buffer((2 * n if gated else n, k), dtype, align=16),
                 C: T.Buffer((m, n), dtype, align=16)):
            T.func_attr(attrs)
            body(A, B, None, None, C)
    # fmt: on
    return main


def _fp8_main(body, m: int, n: int, k: int, dtype: str, bias: bool, attrs: dict):
    """The ``fp8_gemm`` workload's signature (A, W, scale_a, scale_w[, bias], C) around the kernel's body."""
    from tvm.script import tirx as T

    # fmt: off
    @T.prim_func
    def main(A: T.Buffer((m, k), "uint8", align=16), W: T.Buffer((n, k), "uint8", align=16),
             Sa: T.Buffer((m,), "float32"), Sw: T.Buffer((n,), "float32"), Bias: T.Buffer((n,), dtype),
             C: T.Buffer((m, n), dtype, align=16)):
        T.func_attr(attrs)
        body(A, W, (Sa, Sw), Bias if bias else None, C)
    # fmt: on
    if bias:
        return main
    # The body never names the bias it was given as None: the same function less that parameter.
    from tvm import tirx

    return tirx.PrimFunc([p for i, p in enumerate(main.params) if i != 4], main.body, main.ret_type, main.attrs,
                         main.span)


class HopperGemmSpace(HopperTemplate):
    """The ``gemm`` workload on sm_90: the TIRx kernel above, every structural choice a knob."""

    name = "hopper_gemm"
    version = 5  # 2: split-K across a cluster (split_k) and swapped operands for few rows (swap_ab); 3: pingpong;
    # 4: multicast; 5: multicast's stage release at CTA scope
    families = ("matmul", "swiglu_gemm")
    # From two rows on the tensor cores win: rows past m are zeros that TMA fills in, and at m = 16 the
    # kernel is faster than the GEMV space on the H200. One row stays a GEMV.
    MIN_M = 2
    SWAP_MAX_M = 64  # swapped operands put the tokens on wgmma's N side: a decode step's few rows
    BLOCK_NS = (16, 32, 64, 128, 192, 256)  # and, per shape, whole_wave_block_ns

    @classmethod
    def matches(cls, func) -> bool:
        return _gemm_shape(func) is not None

    @classmethod
    def suits(cls, func, target, hints) -> bool:
        op = (hints or {}).get("op")
        if target.arch not in HOPPER_ARCHS or op not in ("gemm", "swiglu_gemm"):
            return False
        shape = _gemm_shape(func, gated=op == "swiglu_gemm")
        if shape is None:
            return False
        m, n, k, dtype = shape
        return cls.serves(m, k, dtype)

    @classmethod
    def serves(cls, m: int, k: int, dtype: str) -> bool:
        """Whether the kernel takes a GEMM of ``m`` rows over ``k`` in ``dtype``: TMA needs 16-byte row strides
        (k); any n (an odd n, e.g. GPT-2's 50257-token LM head, stores one column at a time)."""
        return dtype in PTX_TYPE and m >= cls.MIN_M and k % 8 == 0

    FP8 = False  # operands of float8 E4M3 codes (HopperFp8GemmSpace)
    BK = BK  # K elements per stage: one 128-byte row

    def __init__(self, func, target, hints=None):
        super().__init__(func, target, hints)
        self.gated = self.hints.get("op") == "swiglu_gemm"
        self.m, self.n, self.k, self.dtype = self.taken(*self._shape(func))
        self.bias = bool(self.hints.get("bias", False))
        self.act = str(self.hints.get("act", "none"))
        self.sms = device_facts(target).sms
        self.knobs = [
            Knob("consumers", (1, 2)),
            Knob("wg_rows", (64, 128)),
            Knob("block_n", tuple(sorted({*self.BLOCK_NS, *whole_wave_block_ns(self.m, self.n_side, self.sms)}))),
            Knob("stages", (2, 3, 4, 5, 6, 7, 8, 10, 12)),  # deep rings: decode tiles are small
            Knob("group_m", (1, 4, 8, 16)),
            Knob("persistent", (False, True), ordered=False),
            Knob("split_k", (1, 2, 4)),
            Knob("swap_ab", (False, True), ordered=False),
            Knob("pingpong", (False, True), ordered=False),
            Knob("multicast", ("none", "a", "b"), ordered=False),
        ]
        # A decode step's 2 to 16 rows: the streaming tensor-core kernel too (mma_gemv.py). Its knobs came after
        # points of this version were stored; those points are of the wgmma kernel (``added``).
        self.streams = not self.FP8 and mma_gemv.serves(self.m, self.k, self.dtype)
        if self.streams:
            self.knobs.extend(mma_gemv.KNOBS)
            self.added = dict(mma_gemv.OFF)

    def _shape(self, func):
        """((m, n, k, dtype) or None, what the space takes) for ``taken``."""
        return (_gemm_shape(func, self.gated),
                "C[m, n] = A[m, k] · B[n, k]ᵀ (+ bias) (for swiglu_gemm: C[m, n] from A[m, k], W[2n, k])")

    @staticmethod
    def block_m(p: Point) -> int:
        """The block tile's extent on wgmma's M side: one consumer's rows with ping-pong, else all of theirs."""
        return p["wg_rows"] if p.get("pingpong", False) else p["consumers"] * p["wg_rows"]

    def unit_tiles(self, p: Point) -> tuple[int, int]:
        """Row and column tiles of the units of work: tiles, or with multicast the clusters' pairs of tiles."""
        rows, cols = self.extents(p)
        tiles_m, tiles_n = math.ceil(rows / self.block_m(p)), math.ceil(cols / p["block_n"])
        multicast = p.get("multicast", "none")
        return (math.ceil(tiles_m / 2) if multicast == "b" else tiles_m,
                math.ceil(tiles_n / 2) if multicast == "a" else tiles_n)

    def extents(self, p: Point) -> tuple[int, int]:
        """The extents of wgmma's M side (tiled by consumers x wg_rows) and N side (tiled by block_n)."""
        return (self.n, self.m) if p.get("swap_ab", False) else (self.m, self.n_side)

    @property
    def n_side(self) -> int:
        """The rows of B that wgmma's N side covers: n, or the gate's and the up projection's 2n."""
        return 2 * self.n if self.gated else self.n

    def check(self, p: Point) -> str | None:
        if p.get("stream", False):
            return mma_gemv.check(self.m, self.n, self.k, self.gated, p)
        bm, bn = self.block_m(p), p["block_n"]
        rows, cols = self.extents(p)
        if self.gated and (p.get("swap_ab", False) or bn % 16):
            return "a gated tile is a gate half over an up half of whole 8-row swizzle atoms (no swapped operands)"
        if p.get("pingpong", False):
            if p["consumers"] != 2 or not p["persistent"]:
                return "ping-pong alternates two consumers' tiles: two consumers and persistent CTAs"
            if p["split_k"] > 1 or p.get("swap_ab", False):
                return "ping-pong is for prefill tiles (no split-K, no swapped operands)"
        multicast = p.get("multicast", "none")
        if multicast != "none":
            if p["pingpong"] or p["split_k"] > 1 or p.get("swap_ab", False):
                return "multicast pairs cooperative prefill tiles (no ping-pong, split-K or swapped operands)"
            if multicast == "b" and bn % 16:
                return f"multicast halves of a {bn}-column B tile are not whole 8-row swizzle atoms"
            tiles_m, tiles_n = math.ceil(rows / bm), math.ceil(cols / bn)
            if (tiles_m if multicast == "b" else tiles_n) < 2:
                return f"multicast of {multicast.upper()} needs two or more {'row' if multicast == 'b' else 'column'} tiles"
        if p.get("swap_ab", False) and self.m > self.SWAP_MAX_M:
            return f"swapped operands are for few rows (m={self.m}, at most {self.SWAP_MAX_M})"
        if bn < 32 and not p.get("swap_ab", False):
            return f"block_n {bn} is for swapped operands (a few tokens on wgmma's N side)"
        acc = p["wg_rows"] // 64 * bn // 2
        if acc > 128:
            return f"{acc} accumulator registers per thread (at most 128 fit without spilling)"
        smem = p["stages"] * (bm + bn) * BK * 2 + 1024
        if smem > SMEM_LIMIT:
            return f"{smem} bytes of shared memory (limit {SMEM_LIMIT})"
        for extent, tile in ((rows, bm), (cols, bn)):
            if tile > 64 and math.ceil(extent / tile) * tile > 1.5 * extent:
                name = "m" if extent == self.m else "n"
                return f"block tile {tile} pads {name}={extent} by more than half"
        tiles = math.ceil(rows / bm) * math.ceil(cols / bn)
        units_m, units_n = self.unit_tiles(p)
        slots = self.sms // (1 if multicast == "none" else 2)  # CTAs, or clusters of two, at once
        if p["persistent"] and units_m * units_n <= slots:
            return f"persistent CTAs need more tiles ({units_m * units_n}) than multiprocessors ({slots})"
        if p["group_m"] > 1 and units_m < 2:
            return "grouped rasterisation needs two or more row tiles"
        split = p["split_k"]
        if split > 1:
            if p["persistent"]:
                return "split-K gives each cluster one tile: not with persistent CTAs"
            if acc > 64:  # 128 spill (nvcc 13.0): the reduction and epilogue need the rest of the registers
                return f"split-K with {acc} accumulator registers per thread (at most 64)"
            if tiles >= self.sms:
                return f"split-K is for grids smaller than the multiprocessors ({tiles} tiles for {self.sms})"
            if math.ceil(self.k / self.BK) < split:
                return f"split-K {split} needs at least {split} K steps of {self.BK} (k={self.k})"
            if bm * bn * 4 > p["stages"] * (bm + bn) * BK * 2:
                return f"the {bm}x{bn} fp32 partial tile does not fit in the {p['stages']}-stage ring"
        return None

    def canonical(self, p: Point) -> Point:
        if self.streams:  # the other kernel's knobs at fixed values
            p = self.complete(p)
            if p["stream"]:
                return {**p, **{k.name: k.choices[0] for k in self.knobs if k.name not in mma_gemv.OFF}}
            p = {**p, **mma_gemv.OFF}
        return canonical_group_m(p, self.unit_tiles(p)[0])

    def default(self) -> Point:
        if self.streams and not self.gated:  # a decode step's 2 to 16 rows: the streaming kernel (mma_gemv.py)
            point = self.canonical(mma_gemv.default(self.m, self.n, self.k, self.gated))
            if self.check(point) is None:
                return point
        return self.wgmma_default()

    def wgmma_default(self) -> Point:
        if self.m <= self.SWAP_MAX_M and not self.gated:
            point = self._decode_default()
            if point is not None:
                return point
        for point in ({"consumers": 2, "wg_rows": 64, "block_n": 256, "stages": 4, "group_m": 8, "persistent": False,
                       "split_k": 1},
                      {"consumers": 2, "wg_rows": 64, "block_n": 128, "stages": 4, "group_m": 1, "persistent": False,
                       "split_k": 1},
                      {"consumers": 1, "wg_rows": 64, "block_n": 64, "stages": 7, "group_m": 1, "persistent": False,
                       "split_k": 1}):
            point = self.canonical({**point, "swap_ab": False, "pingpong": False, "multicast": "none"})
            if self.check(point) is None:
                return point
        return super().default()

    def _decode_default(self) -> Point | None:
        """A decode step's few rows: operands swapped (the weights' rows on wgmma's M side, the tokens in
        the narrowest N tile that holds them), a deep ring, and K split across a cluster as far as the grid
        still fits one wave; None if no such point is valid."""
        block_n = next((bn for bn in self.BLOCK_NS if bn >= self.m), None)
        if block_n is None:
            return None
        tiles = math.ceil(self.n / 64)
        for split in (4, 2, 1):
            if split > 1 and tiles * split > self.sms:
                continue
            point = {"consumers": 1, "wg_rows": 64, "block_n": block_n, "stages": 8, "group_m": 1,
                     "persistent": False, "split_k": split, "swap_ab": True, "pingpong": False, "multicast": "none"}
            point = self.canonical(point)
            if self.check(point) is None:
                return point
        return None

    def first_points(self) -> list[Point]:
        """The default, the wgmma kernel's default and its tiles with either operand multicast across a cluster
        of two, then the streaming kernel's default: a short search weighs the two kernels of a decode step. At
        one wave of L2-bound tiles (1000×4000×3000) multicast B is much faster than the same tiles without, and a
        short search that samples points at random does not meet it."""
        wgmma = self.wgmma_default()
        candidates = [wgmma] + [self.canonical({**wgmma, "multicast": multicast}) for multicast in ("b", "a")]
        if self.streams:
            candidates.append(self.canonical({**wgmma, **mma_gemv.default(self.m, self.n, self.k, self.gated)}))
        first = super().first_points()
        for point in candidates:
            if point not in first and self.check(point) is None:
                first.append(point)
        return first

    def kernel(self, p: Point):
        if p.get("stream", False):
            return mma_gemv.mma_gemv_kernel(self.m, self.n, self.k, self.dtype, self.bias, self.act, p, self.gated)
        return hopper_gemm_kernel(self.m, self.n, self.k, self.dtype, self.bias, self.act, {**p, "sms": self.sms},
                                  self.gated, self.FP8)

    def point_features(self, p: Point) -> list[float]:
        """The knobs and what they imply for the hardware: the cost model's view of a TIRx kernel, whose
        loop nest TVM's per-store features do not see."""
        bm, bn = self.block_m(p), p["block_n"]
        rows, cols = self.extents(p)
        tiles = math.ceil(rows / bm) * math.ceil(cols / bn)
        waves = tiles / self.sms
        ctas = min(tiles, self.sms) if p["persistent"] else tiles * p["split_k"]
        smem = p["stages"] * (bm + bn) * BK * 2
        useful = rows * cols / (tiles * bm * bn)
        return [p["consumers"], p["wg_rows"], bn, p["stages"], p["group_m"], float(p["persistent"]), bm, bm * bn,
                math.log2(tiles), waves, waves / max(1, math.ceil(waves)), ctas / self.sms, smem / SMEM_LIMIT,
                useful, (bm + bn) / (bm * bn), p["wg_rows"] // 64 * bn // 2, math.ceil(self.k / self.BK) / p["stages"],
                p["split_k"], math.ceil(self.k / self.BK) / p["split_k"], float(p.get("swap_ab", False)),
                float(p.get("pingpong", False)), float(p.get("multicast", "none") == "a"),
                float(p.get("multicast", "none") == "b"), *mma_gemv.features(self.m, self.n, self.k, self.gated,
                                                                              self.sms, p),
                self._l2_bytes_per_flop(p)]

    def _l2_bytes_per_flop(self, p: Point) -> float:
        """Bytes the CTAs read from L2 per FLOP: each tile reads its A and B tiles for every k step, and a
        multicast pair reads the shared operand's tile once for both tiles."""
        bm, bn = self.block_m(p), p["block_n"]
        a_rows = bm / 2 if p.get("multicast", "none") == "a" else bm
        b_rows = bn / 2 if p.get("multicast", "none") == "b" else bn
        return (a_rows + b_rows) / (bm * bn)


class HopperFp8GemmSpace(HopperGemmSpace):
    """The ``fp8_gemm`` workload on sm_90: ``hopper_gemm``'s kernel and knobs on float8 E4M3 operands (``fp8``).

    A stage's rows are the same 128 bytes, of 128 elements, so tiles, rings, shared memory, persistence, ping-pong,
    multicast, split-K and swapped operands are those of fp16 over half as many K steps; wgmma is
    ``m64nNk32.f32.e4m3.e4m3`` (four per stage row), and the epilogue multiplies each accumulator by its row's and
    its column's scale (the token's and the output channel's) before the bias, activation and cast.

    ``promote``: the tensor cores accumulate fp8 products in about 14 bits (DeepSeek-V3's measurement: up to 2%
    relative error at K = 4096), so each stage's four wgmma go to fresh accumulators (the first with scale-d
    false) that the consumer adds to the tile's fp32 sums once they are complete (wait_group 0): cuBLAS's and
    CUTLASS's default for fp8 (CUTLASS's "FastAccum" kernels skip it, as ``promote`` False does; that is refused
    for an fp16 output past ``FAST_ACCUM_MAX_K``). It costs a second set of accumulator registers and the overlap
    of one stage's wgmma with the next one's issue."""

    name = "hopper_fp8_gemm"
    version = 1
    families = ("matmul",)
    FP8 = True
    BK = FP8_BK

    @classmethod
    def matches(cls, func) -> bool:
        return _fp8_shape(func) is not None

    @classmethod
    def suits(cls, func, target, hints) -> bool:
        if target.arch not in HOPPER_ARCHS or (hints or {}).get("op") != "fp8_gemm":
            return False
        shape = _fp8_shape(func)
        return shape is not None and cls.serves(shape[0], shape[2], shape[3])

    @classmethod
    def serves(cls, m: int, k: int, dtype: str) -> bool:
        """TMA needs 16-byte row strides: k a multiple of 16 codes; the output fp16 or bf16."""
        return dtype in PTX_TYPE and m >= cls.MIN_M and k % 16 == 0

    MAX_PROMOTED_ACC = 96  # accumulator registers per thread with promotion (twice as many in all)
    # The longest K whose sums the tensor cores may accumulate alone (promote False) into an fp16 output: their
    # truncated ~14-bit accumulation loses about 2^-14 of the sum per wgmma, some 5e-3 relative over 128 of them
    # (K = 4096), past fp16's tolerance (4e-3) and within bf16's (3e-2). An estimate, not yet measured: the GPU
    # benchmark's --hand-points fp8 reports each point's error.
    FAST_ACCUM_MAX_K = {"float16": 1024}

    def __init__(self, func, target, hints=None):
        super().__init__(func, target, hints)
        self.knobs.append(Knob("promote", (True, False), ordered=False))

    def _shape(self, func):
        return _fp8_shape(func), "C[m, n] = (A[m, k] · W[n, k]ᵀ) · scale_a[m] · scale_w[n] (+ bias), A and W float8 codes"

    def check(self, p: Point) -> str | None:
        acc = p["wg_rows"] // 64 * p["block_n"] // 2
        if p.get("promote", False) and acc > self.MAX_PROMOTED_ACC:
            return (f"{acc} accumulator registers per thread and as many partial sums (promote: at most "
                    f"{self.MAX_PROMOTED_ACC} each)")
        longest = self.FAST_ACCUM_MAX_K.get(self.dtype)
        # (hopper_gemm's default() weighs tiles without the knob: their promotion is chosen after)
        if p.get("promote", True) is False and longest is not None and self.k > longest:
            return (f"k={self.k} summed by the tensor cores alone (about 14 bits) exceeds {self.dtype}'s tolerance "
                    f"past k={longest}: promote")
        return super().check(p)

    def default(self) -> Point:
        """hopper_gemm's choice with promotion, or where its tiles leave no room for the partial sums, a narrower
        block_n (64 or more) that does: of those whose waves are nearly as full as the fullest (within 5%), the widest (a
        512-token chunk of a 4096-wide layer: 128 tiles of 128 columns fill 97% of 132 multiprocessors, 88 of
        192 columns 67%). hopper_gemm's choice without promotion where none is valid."""
        base = super().default()
        widths = next(knob.choices for knob in self.knobs if knob.name == "block_n")
        candidates = [self.canonical({**base, "block_n": bn, "promote": True})  # from 64 (decode: its own width)
                      for bn in sorted(widths, reverse=True) if min(64, base["block_n"]) <= bn <= base["block_n"]]
        candidates = [p for p in candidates if self.check(p) is None]
        if not candidates:
            point = self.canonical({**base, "promote": False})
            return point if self.check(point) is None else super(HopperGemmSpace, self).default()

        def fill(p: Point) -> float:
            units_m, units_n = self.unit_tiles(p)
            return wave_efficiency(units_m * units_n, self.sms)

        best = max(fill(p) for p in candidates)
        return next(p for p in candidates if fill(p) >= best - 0.05)

    def point_features(self, p: Point) -> list[float]:
        """hopper_gemm's, and whether the stages' sums are promoted (a wait per stage, CUDA-core adds)."""
        return super().point_features(p) + [float(p.get("promote", False))]


def wave_efficiency(tiles: int, sms: int) -> float:
    """The share of the multiprocessors' rounds that do work: tiles over whole waves of ``sms`` tiles."""
    return tiles / (math.ceil(tiles / sms) * sms)


def whole_wave_block_ns(m: int, n: int, sms: int, least: float = 0.97) -> set[int]:
    """block_n values, beyond HopperGemmSpace.BLOCK_NS, that cut n into tiles filling whole waves.

    A 512-token prefill's 512×11008 output in 128×192 tiles is 232 tiles, 1.76 waves on 132
    multiprocessors: the second wave is three quarters full. block_n 168 makes 264 tiles, two whole
    waves of smaller tiles. wgmma takes any N that is a multiple of 8 (up to 256), and TMA boxes and
    128-byte swizzle atoms take any multiple of 8 rows. For each block_m (64, 128 and 256 rows) the
    widest such block_n whose waves are at least ``least`` full is added where no standard block_n
    at least as wide is as full.
    """
    def fills(bm: int, bn: int) -> bool:
        tiles = math.ceil(m / bm) * math.ceil(n / bn)
        return tiles >= sms and math.ceil(n / bn) * bn <= 1.5 * n and wave_efficiency(tiles, sms) >= least

    extra = set()
    for bm, widest in ((64, 256), (128, 256), (256, 128)):  # 256 rows fit 128 accumulator registers at n 128
        fitting = [bn for bn in range(64, widest + 1, 8) if fills(bm, bn)]
        if fitting and not any(fills(bm, bn) for bn in HopperGemmSpace.BLOCK_NS if fitting[-1] <= bn <= widest):
            extra.add(fitting[-1])
    return extra


def _gemm_shape(func, gated: bool = False) -> tuple[int, int, int, str] | None:
    """(m, n, k, dtype) of a function whose parameters are A[m, k], B[n, k], optional bias[n], C[m, n]
    (``gated``: A[m, k], B[2n, k], C[m, n])."""
    found = operand_shapes(func, (3, 4))
    if found is None:
        return None
    params = list(func.params)
    (a, b, _), ((m, k), (n, k2), (m2, n2)) = found
    if gated:
        if len(params) != 3 or n != 2 * n2:
            return None
        n = n2
    if k != k2 or m != m2 or n != n2 or str(a.dtype) != str(b.dtype):
        return None
    if len(params) == 4 and [int(x) for x in params[2].shape] != [n]:
        return None
    return m, n, k, str(a.dtype)


def _fp8_shape(func) -> tuple[int, int, int, str] | None:
    """(m, n, k, output dtype) of a function whose parameters are A[m, k] and W[n, k] of uint8, scale_a[m] and
    scale_w[n] of float32, optional bias[n], C[m, n] (``fp8_gemm``)."""
    found = operand_shapes(func, (5, 6))
    if found is None:
        return None
    params = list(func.params)
    (a, b, c), ((m, k), (n, k2), (m2, n2)) = found
    if k != k2 or m != m2 or n != n2 or str(a.dtype) != "uint8" or str(b.dtype) != "uint8":
        return None
    scales = [(str(p.dtype), [int(x) for x in p.shape]) for p in params[2:4]]
    if scales != [("float32", [m]), ("float32", [n])]:
        return None
    if len(params) == 6 and [int(x) for x in params[4].shape] != [n]:
        return None
    return m, n, k, str(c.dtype)
