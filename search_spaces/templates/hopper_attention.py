"""Prefill attention on Hopper (sm_90a): a FlashAttention-3-style TIRx template.

One CTA takes ``64 · consumers`` query rows of one head. A producer warpgroup (one elected thread) loads
the Q tile once and streams K and V tiles of ``block_kv`` keys by TMA (128-byte swizzle) through a ring of
``stages`` buffers, each with its own full barriers for K and for V, so S = QKᵀ can start before V lands.
Each consumer warpgroup owns 64 query rows and, per KV tile:

* computes S = Q·Kᵀ with ``wgmma`` from shared memory (both operands K-major over the head dimension);
* applies the causal or sequence-end mask, only on the tiles that cross the diagonal or the end;
* updates the online softmax in registers (base-2 exponentials, running max and sum per row, the row's
  four threads combined with warp shuffles) and rescales its output accumulator;
* keeps P in registers: a ``wgmma`` accumulator fragment of S is exactly the A-operand fragment of the
  next product, so P·V is a register-shared ``wgmma`` with V read from shared memory (MN-major);
* releases the stage through its empty barrier.

With ``overlap`` (FlashAttention-3's intra-warpgroup pipelining) a consumer issues tile j's QKᵀ and tile
j - 1's P·V together and computes tile j's softmax while the tensor cores still accumulate P·V; the output
is rescaled once that product has landed.

With ``pingpong`` (FlashAttention-3's inter-warpgroup scheduling, two consumers) the warpgroups take turns
on the tensor cores through two named barriers: one's softmax runs while the other's products do. With
both, as in FlashAttention-3, a turn issues QKᵀ(j) and P·V(j - 1) together.

Causal CTAs skip every tile above the diagonal, and the grid starts with the longest (last) query blocks.
Grouped-query attention reads the K/V head of the query head's group. Sequence lengths no tile divides
are masked; the epilogue is predicated. A head dimension that is not a multiple of 64 (96: Phi-3, 80) is
laid out in shared memory at the next multiple: TMA fills the columns past the tensor's width with
zeros, which add nothing to QKᵀ and give output columns that are not stored.
"""

from __future__ import annotations

import math

from autosched.target import device_facts

from .._knobs import Knob, Point
from ._hopper import CUDA_SCALAR, HOPPER_ARCHS, PTX_TYPE, SMEM_LIMIT, HopperTemplate
from ._pipeline import (
    FENCE_NAME,
    FENCE_SOURCE,
    HOPPER_HELPERS,
    TURN_HANDOVER,
    TURN_HANDOVER_SOURCE,
    TURN_SYNC,
    TURN_SYNC_SOURCE,
)

# Deferred imports: tvm (imported where used: `autosched --help` stays fast).

LOG2E = 1.4426950408889634


def _helpers(dtype: str) -> dict[str, tuple[str, str]]:
    """The register-level helpers, each as (name, CUDA source; TIRx emits a source once per name): pack two
    floats into one 32-bit register of two 16-bit values, store such a pair, the quad (row) reductions over
    warp shuffles, and exp2."""
    tag = PTX_TYPE[dtype]
    guard = f"AUTOSCHED_ATTENTION_PAIR_{tag.upper()}"  # cuda/hopper.cuh
    pair_source = (HOPPER_HELPERS + f"#ifndef {guard}\n#define {guard}\n"
                   f"AUTOSCHED_ATTENTION_PAIR({tag}, {CUDA_SCALAR[dtype]})\n#endif\n")
    sources = {
        "pack": (f"autosched_pack_{tag}", pair_source),
        "store": (f"autosched_store_pair_{tag}", pair_source),
        "qmax": ("autosched_quad_max", HOPPER_HELPERS),
        "qsum": ("autosched_quad_sum", HOPPER_HELPERS),
        "turn": (TURN_SYNC, TURN_SYNC_SOURCE),  # named barriers 1 and 2: see hopper_gemm
        "handover": (TURN_HANDOVER, TURN_HANDOVER_SOURCE),
        "exp2": ("autosched_exp2", HOPPER_HELPERS),
    }
    return sources


def hopper_attention_kernel(b: int, h: int, hkv: int, s: int, d: int, dtype: str, causal: bool, p: Point,
                            model_layout: bool = False):
    """The TIRx kernel of point ``p`` for O = softmax(QKᵀ/√d [causal]) V, Q[b,h,s,d], K/V[b,hkv,s,d]; with
    ``model_layout``, Q/O[b,s,h,d] and K/V[b,s,hkv,d], as a Linear's output viewed as heads is laid out."""
    from tvm.script import tirx as T

    consumers, bkv, stages = p["consumers"], p["block_kv"], p["stages"]
    overlap = p.get("overlap", False)  # FlashAttention-3's intra-warpgroup overlap of softmax and P·V
    # FlashAttention-3's inter-warpgroup ping-pong: the two consumers take turns on the tensor cores, so that
    # one's softmax runs while the other's products do.
    pingpong = p.get("pingpong", False)
    bm = 64 * consumers
    threads = 128 * (consumers + 1)
    group = h // hkv
    dp = padded_head_dim(d)  # the head dimension as laid out in shared memory
    cblocks = dp // 64  # 64-element (128-byte) column blocks of the head dimension
    q_blocks = math.ceil(s / bm)
    grid = q_blocks * b * h
    s_acc, o_acc = bkv // 2, dp // 2  # accumulator registers per thread
    tile_elems = bkv * dp
    q_elems = bm * dp
    smem_elems = q_elems + 2 * stages * tile_elems
    tile_bytes = tile_elems * 2
    scale_log2 = LOG2E / math.sqrt(d)
    ptype = PTX_TYPE[dtype]
    qk_mma = f"wgmma.mma_async.sync.aligned.m64n{bkv}k16.f32.{ptype}.{ptype}"
    pv_mma = f"wgmma.mma_async.sync.aligned.m64n{dp}k16.f32.{ptype}.{ptype}"
    fn = _helpers(dtype)
    neg_inf = T.float32(-math.inf)
    # TMA reads [rows, d] tiles of one head: rows of a flat [b·heads·s, d] matrix, or, in the model's layout,
    # rows b·s apart by heads (a rank-3 map over [b·s, heads, d]); the box and shared tile are the same.
    rank = 3 if model_layout else 2
    tma_load = f"cp.async.bulk.tensor.{rank}d.shared::cluster.global.mbarrier::complete_tx::bytes"

    def tma_map(heads, rows):
        """Global sizes, byte strides, box and element strides of a map over a tensor of ``heads`` heads."""
        if model_layout:
            return d, heads, b * s, d * 2, heads * d * 2, 64, 1, rows, 1, 1, 1
        return d, b * heads * s, d * 2, 64, rows, 1, 1

    def tma_at(head, batch, heads, row):
        """Coordinates (after the column's) of row ``row`` of head ``head`` of ``heads`` in batch ``batch``."""
        return (head, batch * s + row) if model_layout else ((batch * heads + head) * s + row,)

    q_shape = (b, s, h, d) if model_layout else (b, h, s, d)

    def out_row(head, query):
        """The row of O (of d elements) that query ``query`` of flat head ``head`` (batch · h + head) fills."""
        return ((head // h) * s + query) * h + head % h if model_layout else head * s + query
    kv_shape = (b, s, hkv, d) if model_layout else (b, hkv, s, d)

    def kv_tiles(qb):
        """KV tiles a query block visits: up to its last query when causal, else all of them."""
        return (T.min(qb * bm + bm, s) + bkv - 1) // bkv if causal else (s + bkv - 1) // bkv

    # fmt: off
    @T.macro
    def qk_issue(S, smem, k_full, desc_a, desc_b, j, wg):
        """S = Q Kᵀ of KV tile j over the head dimension, 16 at a time (issued and committed, not waited)."""
        T.cuda.mbarrier_wait(T.address_of(k_full[j % stages]), (j // stages) % 2)
        T.ptx.wgmma.fence.sync.aligned()
        for kk in T.unroll(dp // 16):
            T.cuda.wgmma.encode_matrix_descriptor(
                T.address_of(desc_a),
                smem.access_ptr("r", offset=((wg - 1) * cblocks + kk // 4) * 64 * 64 + (kk % 4) * 16), 1, 64, 3)
            T.cuda.wgmma.encode_matrix_descriptor(
                T.address_of(desc_b),
                smem.access_ptr("r", offset=q_elems + (j % stages) * 2 * tile_elems + (kk // 4) * bkv * 64
                                + (kk % 4) * 16), 1, 64, 3)
            T.ptx[qk_mma](*[S[i] for i in range(s_acc)], desc_a, desc_b, T.bool(kk > 0), 1, 1, 0, 0)
        T.ptx.wgmma.commit_group.sync.aligned()

    @T.macro
    def softmax(S, row_max, row_sum, tile_max, alpha, j, qb, wg, tx):
        """Tile j's scores (complete) become exp2(S - max): the row maxima, their rescale factor alpha and
        the running sums are updated; the output is not touched (a P·V may still be accumulating it)."""
        for i in T.unroll(s_acc):
            T.cuda.func_call(FENCE_NAME, S[i], source_code=FENCE_SOURCE)
        # Mask keys after the query (causal) and past the sequence, on the tiles that need it.
        if (causal and j * bkv + bkv > qb * bm) or j * bkv + bkv > s:
            for i in T.unroll(s_acc):
                key = T.meta_var(j * bkv + (i // 4) * 8 + (tx % 4) * 2 + i % 2)
                query = T.meta_var(qb * bm + (wg - 1) * 64 + ((tx % 128) // 32) * 16 + (tx % 32) // 4
                                   + ((i % 4) // 2) * 8)
                if key >= s or (causal and key > query):
                    S[i] = neg_inf
        # The row maxima over the raw scores, scaled once (the scale is positive): no multiply per score.
        for r in T.unroll(2):
            tile_max[r] = neg_inf
        for i in T.unroll(s_acc):
            tile_max[(i % 4) // 2] = T.max(tile_max[(i % 4) // 2], S[i])
        for r in T.unroll(2):
            tile_max[r] = T.max(row_max[r], T.cuda.func_call(fn["qmax"][0], tile_max[r], source_code=fn["qmax"][1],
                                                             return_type="float32") * T.float32(scale_log2))
            alpha[r] = T.cuda.func_call(fn["exp2"][0], row_max[r] - tile_max[r], source_code=fn["exp2"][1],
                                        return_type="float32")
            row_max[r] = tile_max[r]
            row_sum[r] = row_sum[r] * alpha[r]
        for i in T.unroll(s_acc):
            S[i] = T.cuda.func_call(fn["exp2"][0], S[i] * T.float32(scale_log2) - row_max[(i % 4) // 2],
                                    source_code=fn["exp2"][1], return_type="float32")
            row_sum[(i % 4) // 2] = row_sum[(i % 4) // 2] + S[i]

    @T.macro
    def pack_and_rescale(S, P, Oacc, alpha):
        """P = S as 16-bit pairs (the next P·V's A operand), and the output rescaled to the new maxima."""
        for i in T.unroll(bkv // 4):
            P[i] = T.cuda.func_call(fn["pack"][0], S[2 * i], S[2 * i + 1], source_code=fn["pack"][1],
                                    return_type="uint32")
        for i in T.unroll(o_acc):
            Oacc[i] = Oacc[i] * alpha[(i % 4) // 2]
            T.cuda.func_call(FENCE_NAME, Oacc[i], source_code=FENCE_SOURCE)

    @T.macro
    def pv_issue(Oacc, P, smem, v_full, desc_b, j):
        """O += P V of tile j: P from registers, V (keys x head dim, MN-major) from shared memory."""
        T.cuda.mbarrier_wait(T.address_of(v_full[j % stages]), (j // stages) % 2)
        T.ptx.wgmma.fence.sync.aligned()
        for t in T.unroll(bkv // 16):
            T.cuda.wgmma.encode_matrix_descriptor(
                T.address_of(desc_b),
                smem.access_ptr("r", offset=q_elems + (j % stages) * 2 * tile_elems + tile_elems + t * 16 * 64),
                bkv * 8, 64, 3)
            T.ptx[pv_mma](*[Oacc[i] for i in range(o_acc)], P[4 * t], P[4 * t + 1], P[4 * t + 2], P[4 * t + 3],
                          desc_b, T.bool(True), 1, 1, 1)
        T.ptx.wgmma.commit_group.sync.aligned()

    @T.macro
    def pv_done(Oacc, empty, j):
        """Tile j's P·V has completed: its stage goes back to the producer."""
        for i in T.unroll(o_acc):
            T.cuda.func_call(FENCE_NAME, Oacc[i], source_code=FENCE_SOURCE)
        T.ptx.mbarrier.arrive.shared.b64(T.address_of(empty[j % stages]))

    @T.macro
    def take_turn(wg):
        """With ping-pong: wait for this warpgroup's turn on the tensor cores (its own named barrier)."""
        if pingpong:
            T.cuda.func_call(fn["turn"][0], wg, source_code=fn["turn"][1])

    @T.macro
    def hand_over(to):
        """With ping-pong: give the turn to warpgroup ``to`` (arrive on its named barrier)."""
        if pingpong:
            T.cuda.func_call(fn["handover"][0], to, source_code=fn["handover"][1])

    @T.prim_func
    def main(Q: T.Buffer(q_shape, dtype, align=16), K: T.Buffer(kv_shape, dtype, align=16),
             V: T.Buffer(kv_shape, dtype, align=16), O: T.Buffer(q_shape, dtype, align=16)):
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        Q_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        T.tensormap_encode_tiled(Q_map, Q.data, *tma_map(h, 64), descriptor_dtype=dtype, rank=rank, swizzle=3)
        K_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        T.tensormap_encode_tiled(K_map, K.data, *tma_map(hkv, bkv), descriptor_dtype=dtype, rank=rank, swizzle=3)
        V_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        T.tensormap_encode_tiled(V_map, V.data, *tma_map(hkv, bkv), descriptor_dtype=dtype, rank=rank, swizzle=3)
        T.device_entry()
        T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", 1)
        bx = T.cta_id([grid])
        tx = T.thread_id([threads])
        smem = T.alloc_buffer((smem_elems,), dtype, scope="shared.dyn", align=1024)
        q_full = T.alloc_shared((1,), "uint64", align=8)
        k_full = T.alloc_shared((stages,), "uint64", align=8)
        v_full = T.alloc_shared((stages,), "uint64", align=8)
        empty = T.alloc_shared((stages,), "uint64", align=8)
        S = T.alloc_local((s_acc,), "float32")
        P = T.alloc_local((bkv // 4,), "uint32")
        Oacc = T.alloc_local((o_acc,), "float32")
        row_max = T.alloc_local((2,), "float32")
        row_sum = T.alloc_local((2,), "float32")
        tile_max = T.alloc_local((2,), "float32")
        alpha = T.alloc_local((2,), "float32")
        desc_a: T.uint64
        desc_b: T.uint64
        # Heaviest causal blocks (the last query rows) first.
        qb = T.meta_var(q_blocks - 1 - bx // (b * h))
        head = T.meta_var(bx % (b * h))
        batch = T.meta_var(head // h)
        kv_head = T.meta_var((head % h) // group)  # within the batch
        n_tiles = T.meta_var(kv_tiles(qb))
        wg = T.meta_var(tx // 128)

        if tx == 0:
            T.ptx.mbarrier.init.shared.b64(T.address_of(q_full[0]), T.uint32(1))
            for st in T.unroll(stages):
                T.ptx.mbarrier.init.shared.b64(T.address_of(k_full[st]), T.uint32(1))
                T.ptx.mbarrier.init.shared.b64(T.address_of(v_full[st]), T.uint32(1))
                T.ptx.mbarrier.init.shared.b64(T.address_of(empty[st]), T.uint32(consumers * 128))
            T.ptx.fence.proxy.async_.shared__cta()
        T.cuda.cta_sync()

        if wg == 0:
            T.ptx["setmaxnreg.dec.sync.aligned.u32"](40)
            if tx == 0:
                T.ptx.mbarrier.arrive.expect_tx.shared.b64(T.address_of(q_full[0]), T.uint32(q_elems * 2))
                for c in T.unroll(consumers):
                    for cb in T.unroll(cblocks):
                        T.ptx[tma_load](
                            smem.access_ptr("w", offset=(c * cblocks + cb) * 64 * 64),
                            T.address_of(Q_map), cb * 64, *tma_at(head % h, batch, h, qb * bm + c * 64),
                            T.address_of(q_full[0]))
                for j in T.serial(n_tiles):
                    if j >= stages:
                        T.cuda.mbarrier_wait(T.address_of(empty[j % stages]), ((j // stages) + 1) % 2)
                    T.ptx.mbarrier.arrive.expect_tx.shared.b64(T.address_of(k_full[j % stages]), T.uint32(tile_bytes))
                    for cb in T.unroll(cblocks):
                        T.ptx[tma_load](
                            smem.access_ptr("w", offset=q_elems + (j % stages) * 2 * tile_elems + cb * bkv * 64),
                            T.address_of(K_map), cb * 64, *tma_at(kv_head, batch, hkv, j * bkv),
                            T.address_of(k_full[j % stages]))
                    T.ptx.mbarrier.arrive.expect_tx.shared.b64(T.address_of(v_full[j % stages]), T.uint32(tile_bytes))
                    for cb in T.unroll(cblocks):
                        T.ptx[tma_load](
                            smem.access_ptr("w", offset=q_elems + (j % stages) * 2 * tile_elems + tile_elems
                                            + cb * bkv * 64),
                            T.address_of(V_map), cb * 64, *tma_at(kv_head, batch, hkv, j * bkv),
                            T.address_of(v_full[j % stages]))
        else:
            T.ptx["setmaxnreg.inc.sync.aligned.u32"](232)
            for i in T.unroll(2):
                row_max[i] = neg_inf
                row_sum[i] = T.float32(0)
            for i in T.unroll(o_acc):
                Oacc[i] = T.float32(0)
                T.cuda.func_call(FENCE_NAME, Oacc[i], source_code=FENCE_SOURCE)
            T.cuda.mbarrier_wait(T.address_of(q_full[0]), 0)
            if overlap:
                # The softmax of tile j runs while the tensor cores compute P·V of tile j - 1. With ping-pong,
                # as in FlashAttention-3, each turn issues QKᵀ(j) with P·V(j - 1), so the softmax also runs
                # under the other warpgroup's products: n_tiles + 1 turns per warpgroup, handed over as below.
                if pingpong and wg == 2:
                    hand_over(1)
                take_turn(wg)
                qk_issue(S, smem, k_full, desc_a, desc_b, 0, wg)
                hand_over(3 - wg)
                T.ptx.wgmma.wait_group.sync.aligned(0)
                softmax(S, row_max, row_sum, tile_max, alpha, 0, qb, wg, tx)
                pack_and_rescale(S, P, Oacc, alpha)
                for j in T.serial(1, n_tiles):
                    take_turn(wg)
                    qk_issue(S, smem, k_full, desc_a, desc_b, j, wg)
                    pv_issue(Oacc, P, smem, v_full, desc_b, j - 1)
                    hand_over(3 - wg)
                    T.ptx.wgmma.wait_group.sync.aligned(1)  # S of tile j; P·V of tile j - 1 may still run
                    softmax(S, row_max, row_sum, tile_max, alpha, j, qb, wg, tx)
                    T.ptx.wgmma.wait_group.sync.aligned(0)
                    pv_done(Oacc, empty, j - 1)
                    pack_and_rescale(S, P, Oacc, alpha)
                take_turn(wg)
                pv_issue(Oacc, P, smem, v_full, desc_b, n_tiles - 1)
                if pingpong and wg == 1:
                    hand_over(2)
                T.ptx.wgmma.wait_group.sync.aligned(0)
                pv_done(Oacc, empty, n_tiles - 1)
            elif pingpong:
                # Turns alternate QKᵀ(j) of warpgroup 1, of 2, P·V(j) of 1, of 2, ...; each hands the turn over
                # once its product is issued. Warpgroup 2 opens the first turn and skips its last handover, so
                # that every sync on a barrier meets exactly one arrival.
                if wg == 2:
                    hand_over(1)
                for j in T.serial(n_tiles):
                    take_turn(wg)
                    qk_issue(S, smem, k_full, desc_a, desc_b, j, wg)
                    hand_over(3 - wg)
                    T.ptx.wgmma.wait_group.sync.aligned(0)
                    softmax(S, row_max, row_sum, tile_max, alpha, j, qb, wg, tx)
                    pack_and_rescale(S, P, Oacc, alpha)
                    take_turn(wg)
                    pv_issue(Oacc, P, smem, v_full, desc_b, j)
                    if wg == 1 or j < n_tiles - 1:
                        hand_over(3 - wg)
                    T.ptx.wgmma.wait_group.sync.aligned(0)
                    pv_done(Oacc, empty, j)
            else:
                for j in T.serial(n_tiles):
                    qk_issue(S, smem, k_full, desc_a, desc_b, j, wg)
                    T.ptx.wgmma.wait_group.sync.aligned(0)
                    softmax(S, row_max, row_sum, tile_max, alpha, j, qb, wg, tx)
                    pack_and_rescale(S, P, Oacc, alpha)
                    pv_issue(Oacc, P, smem, v_full, desc_b, j)
                    T.ptx.wgmma.wait_group.sync.aligned(0)
                    pv_done(Oacc, empty, j)
            # O / l, stored as pairs; rows past the sequence and padding columns are not written.
            for r in T.unroll(2):
                row_sum[r] = T.cuda.func_call(fn["qsum"][0], row_sum[r], source_code=fn["qsum"][1], return_type="float32")
            for i in T.unroll(o_acc // 2):
                query = T.meta_var(qb * bm + (wg - 1) * 64 + ((tx % 128) // 32) * 16 + (tx % 32) // 4 + (i % 2) * 8)
                col = T.meta_var((i // 2) * 8 + (tx % 4) * 2)
                if query < s and col < d:
                    T.cuda.func_call(fn["store"][0], O.access_ptr("w", offset=out_row(head, query) * d + col),
                                     Oacc[2 * i] / row_sum[i % 2], Oacc[2 * i + 1] / row_sum[i % 2],
                                     source_code=fn["store"][1])
    # fmt: on
    return main


class HopperAttentionSpace(HopperTemplate):
    """Prefill ``attention`` on sm_90: the TIRx kernel above; consumers, KV tile and stages are the knobs."""

    name = "hopper_attention"
    version = 4  # 2: the overlap knob; 3: pingpong; 4: KV tiles of 160 and 176, pingpong with overlap
    families = ("attention", "attention_bshd")

    @classmethod
    def suits(cls, func, target, hints) -> bool:
        op = (hints or {}).get("op")
        shape = _attention_shape(func, op == "attention_bshd")
        if target.arch not in HOPPER_ARCHS or op not in cls.families or shape is None:
            return False
        b, h, hkv, s, d, dtype = shape
        return serves(dtype, d) and h % hkv == 0

    def __init__(self, func, target, hints=None):
        super().__init__(func, target, hints)
        self.model_layout = self.hints.get("op") == "attention_bshd"
        self.b, self.h, self.hkv, self.s, self.d, self.dtype = self.taken(
            _attention_shape(func, self.model_layout),
            "Q[b,h,s,d], K/V[b,hkv,s,d], O[b,h,s,d] (Q/O[b,s,h,d], K/V[b,s,hkv,d] for attention_bshd)")
        self.causal = bool(self.hints.get("causal", True))
        self.sms = device_facts(target).sms
        self.knobs = [Knob("consumers", (1, 2)), Knob("block_kv", (64, 128, 160, 176)), Knob("stages", (2, 3)),
                      Knob("overlap", (False, True), ordered=False), Knob("pingpong", (False, True), ordered=False)]

    def check(self, p: Point) -> str | None:
        bm, bkv = 64 * p["consumers"], p["block_kv"]
        dp = padded_head_dim(self.d)
        regs = bkv // 2 + dp // 2 + bkv // 4
        if regs > 200:
            return f"{regs} registers of scores, output and probabilities per thread (at most 200 fit)"
        smem = (bm * dp + 2 * p["stages"] * bkv * dp) * 2 + 1024
        if smem > SMEM_LIMIT:
            return f"{smem} bytes of shared memory (limit {SMEM_LIMIT})"
        if p.get("pingpong", False) and p["consumers"] != 2:
            return "ping-pong alternates two consumers' turns on the tensor cores (two consumers)"
        return None

    def default(self) -> Point:
        # Two consumer warpgroups: the faster default on the H200 (one consumer leaves the tensor cores idle
        # while it computes the softmax).
        for point in ({"consumers": 2, "block_kv": 128, "stages": 2, "overlap": False, "pingpong": False},
                      {"consumers": 2, "block_kv": 64, "stages": 2, "overlap": False, "pingpong": False}):
            if self.check(point) is None:
                return point
        return super().default()

    def kernel(self, point: Point):
        return hopper_attention_kernel(self.b, self.h, self.hkv, self.s, self.d, self.dtype, self.causal, point,
                                       self.model_layout)

    def point_features(self, p: Point) -> list[float]:
        bm = 64 * p["consumers"]
        ctas = math.ceil(self.s / bm) * self.b * self.h
        return [p["consumers"], p["block_kv"], p["stages"], bm, math.log2(ctas), ctas / self.sms,
                math.ceil(self.s / p["block_kv"]), self.s % p["block_kv"] / p["block_kv"], float(self.causal),
                float(p.get("overlap", False)), float(p.get("pingpong", False))]


def serves(dtype: str, d: int) -> bool:
    """Whether this space takes attention of this dtype and head dimension (on sm_90)."""
    return dtype in PTX_TYPE and takes_head_dim(d)


def takes_head_dim(d: int) -> bool:
    """64 to 256, in rows TMA can address (16-byte strides); smaller heads take the flash_attention space."""
    return 64 <= d <= 256 and d % 8 == 0


def padded_head_dim(d: int) -> int:
    """The head dimension in whole 64-element (128-byte swizzle) column blocks."""
    return -(-d // 64) * 64


def _attention_shape(func, model_layout: bool = False) -> tuple[int, int, int, int, int, str] | None:
    """(b, h, hkv, s, d, dtype) of an attention function Q[b,h,s,d], K[b,hkv,s,d], V, O (with
    ``model_layout``, Q[b,s,h,d], K[b,s,hkv,d]); None for others."""
    params = list(func.params)
    if len(params) != 4 or any(len(p.shape) != 4 for p in params):
        return None
    try:
        q, k = ([int(x) for x in p.shape] for p in params[:2])
    except (TypeError, ValueError):  # symbolic dimensions
        return None
    (b, s, h, d), (b2, s2, hkv, d2) = (q, k) if model_layout else ((q[0], q[2], q[1], q[3]), (k[0], k[2], k[1], k[3]))
    if (b2, s2, d2) != (b, s, d) or hkv < 1:
        return None
    return b, h, hkv, s, d, str(params[0].dtype)
