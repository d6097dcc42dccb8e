"""int4 weight-dequantising GEMM for prefill on sm_90a: the weights dequantised in the pipeline feeding wgmma.

The ``dequant_gemm`` workload with 4-bit weights and more rows than a decode step (17 on; the GEMV
spaces take up to 16): C[m, n] = act(A[m, k] · dequant(Wq[n, k / 2])ᵀ + bias[n]). The kernel is ``hopper_gemm``'s
(a producer warp issuing TMA loads into an mbarrier ring, one or two consumer warpgroups issuing
``wgmma`` from shared memory, grouped rasterisation, optional persistent CTAs) with the B operand made
on chip:

* each ring stage holds the activations' tile (128-byte swizzle, as in ``hopper_gemm``) and the packed
  weights' tile, bn rows of 32 bytes (64 weights), four times smaller than the fp16 tile it stands for;
* the consumers turn a packed tile into an fp16/bf16 tile in one of two shared B buffers, in the
  128-byte-swizzled layout that TMA would have written, while the tensor cores work on the other
  buffer: tile ks + 1 is dequantised after wgmma(ks) is issued and before it is waited for;
* a thread takes 8 weights (4 bytes) at a time: four mask-and-or steps put nibbles under a half's (or
  bfloat16's) exponent, one subtraction gives q - 8 exactly (with zero points, ``zeros=1``: q - z, the row's
  zero point loaded with its scale, ``cuda/hopper_dequant_zeros.cuh``), one multiplication by the row's group
  scale rounds once, as the workload's definition does; byte permutes put them back in k order;
* ``fence.proxy.async`` makes those generic-proxy stores visible to wgmma, and a named barrier over the
  consumer threads orders the two buffers' reuse.

Shapes: k a multiple of 64 and groups of 64, 128 or 256 weights (one scale per row and k step); m and n
any (TMA fills out-of-bounds boxes with zeros, rows past n get a zero scale, the epilogue is predicated).
"""

from __future__ import annotations

import math

from .._knobs import Knob, Point
from ._hopper import BK, CUDA_SCALAR, PTX_TYPE, SMEM_LIMIT, canonical_group_m, cuda_file, epilogue_source, grouped_raster
from ._pipeline import (
    CONSUMERS_SYNC,
    CONSUMERS_SYNC_SOURCE,
    fence_accumulators,
    init_stage_barriers,
    pipeline_buffers,
    tile_walk_scalars,
    zero_accumulators,
)
from .int4_gemv import Int4Template, _shape, dequant_main

# Deferred imports: tvm (imported where used: `autosched --help` stays fast).

PACKED_BK = BK // 2  # bytes of packed int4 weights per row and k step


def _dequant_source(dtype: str, zeros: bool = False) -> tuple[str, str]:
    """(name, source) of the helper that writes 8 dequantised weights of row r, chunk j into the B tile
    (``cuda/hopper_dequant.cuh``; with ``zeros`` it takes the row's zero point after its scale,
    ``cuda/hopper_dequant_zeros.cuh``)."""
    if zeros:
        name = f"autosched_dequant8_zeros_{PTX_TYPE[dtype]}"
        return name, cuda_file("hopper_dequant_zeros.cuh") + f"AUTOSCHED_DEQUANT8_ZEROS({name}, {CUDA_SCALAR[dtype]})\n"
    name = f"autosched_dequant8_{PTX_TYPE[dtype]}"
    return name, cuda_file("hopper_dequant.cuh") + f"AUTOSCHED_DEQUANT8({name}, {CUDA_SCALAR[dtype]})\n"


def hopper_dequant_kernel(m: int, n: int, k: int, group: int, dtype: str, bias: bool, act: str, p: Point,
                          zeros: bool = False):
    """The TIRx kernel of point ``p`` for C[m, n] = act(A[m, k] · dequant(Wq[n, k / 2], zeros)ᵀ + bias[n])."""
    from tvm.script import tirx as T

    consumers, wg_rows, bn, stages = p["consumers"], p["wg_rows"], p["block_n"], p["stages"]
    group_m, persistent = p["group_m"], p["persistent"]
    bm = consumers * wg_rows
    m_frags = wg_rows // 64
    acc_n = bn // 2
    threads, cthreads = 128 * (consumers + 1), 128 * consumers
    elem = 2
    a_stage, w_stage = bm * BK * elem, bn * PACKED_BK
    w_slot = math.ceil(w_stage / 1024) * 1024  # keeps every A tile 1024-byte aligned (swizzle atoms)
    stage_bytes = a_stage + w_slot
    b_tile = bn * BK * elem  # one dequantised B tile; two of them after the ring
    smem_elems = (stages * stage_bytes + 2 * b_tile) // elem
    b_base = stages * stage_bytes // elem
    tiles_m, tiles_n = math.ceil(m / bm), math.ceil(n / bn)
    tiles = tiles_m * tiles_n
    k_iters = k // BK
    grid = min(tiles, p["sms"]) if persistent else tiles
    group_m = min(group_m, tiles_m)
    units = bn * 8 // cthreads  # 8-weight chunks per consumer thread per k step
    mma = f"wgmma.mma_async.sync.aligned.m64n{bn}k16.f32.{PTX_TYPE[dtype]}.{PTX_TYPE[dtype]}"
    store2, store1, epi_source = epilogue_source(dtype, act)
    dequant8, dequant_source = _dequant_source(dtype, zeros)
    acc_len = m_frags * acc_n

    def accs(acc, f):
        return [acc[f * acc_n + i] for i in range(acc_n)]

    def stored(acc, Bias, i, col):
        return acc[i] + T.Cast("float32", Bias[col]) if bias else acc[i]

    tile_m, tile_n = grouped_raster(tiles_m, tiles_n, group_m)

    def zero_point(Z, row, kt):  # the row's zero point in k step kt, where the workload has them
        return [T.Cast("float32", Z[T.min(row, n - 1), kt * BK // group])] if zeros else []

    # fmt: off
    @T.macro
    def dequantize(smem, S, Z, slot, buf, kt, tn, ct):
        # The packed tile of ring slot `slot` into B buffer `buf`: chunk u = (row u / 8, 8 weights u % 8).
        for i in T.unroll(units):
            u = T.meta_var(ct + i * cthreads)
            row = T.meta_var(tn * bn + u // 8)
            scale = T.meta_var(T.if_then_else(row < n, T.Cast("float32", S[T.min(row, n - 1), kt * BK // group]),
                                              T.float32(0)))
            T.cuda.func_call(dequant8, smem.access_ptr("w", offset=b_base + buf * (b_tile // elem)),
                             smem.access_ptr("r", offset=slot * (stage_bytes // elem) + a_stage // elem),
                             u // 8, u % 8, scale, *zero_point(Z, row, kt), source_code=dequant_source)
        T.ptx.fence.proxy.async_.shared__cta()

    @T.macro
    def epilogue(acc, Bias, C, tm, tn, wg, tx):
        for f in T.unroll(m_frags):
            for j in T.unroll(bn // 8):
                for h in T.unroll(2):
                    row = T.meta_var(tm * bm + (wg - 1) * wg_rows + f * 64 + ((tx % 128) // 32) * 16
                                     + (tx % 32) // 4 + h * 8)
                    col = T.meta_var(tn * bn + j * 8 + (tx % 4) * 2)
                    i = T.meta_var(f * acc_n + j * 4 + h * 2)
                    if row < m and col < n:  # n is even (a multiple of 8 below): pairs never straddle it
                        T.cuda.func_call(store2, C.access_ptr("w", offset=row * n + col),
                                         stored(acc, Bias, i, col), stored(acc, Bias, i + 1, col + 1),
                                         source_code=epi_source)

    @T.macro
    def body(A, Wq, S, Z, Bias, C):
        A_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        T.tensormap_encode_tiled(A_map, A.data, k, m, k * elem, BK, bm, 1, 1, descriptor_dtype=dtype, rank=2,
                                 swizzle=3)
        W_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        T.tensormap_encode_tiled(W_map, Wq.data, k // 2, n, k // 2, PACKED_BK, bn, 1, 1, descriptor_dtype="uint8",
                                 rank=2, swizzle=0)
        T.device_entry()
        bx = T.cta_id([grid])
        tx = T.thread_id([threads])
        smem, full, empty, acc = pipeline_buffers(smem_elems, dtype, stages, acc_len)
        desc_a, desc_b, it, tile, tm, tn = tile_walk_scalars()
        wg = T.meta_var(tx // 128)

        if tx == 0:
            init_stage_barriers(full, empty, stages, cthreads)
        T.cuda.cta_sync()

        it = 0
        if wg == 0:
            T.ptx["setmaxnreg.dec.sync.aligned.u32"](40)
            if tx == 0:
                tile = bx
                while tile < tiles:
                    tm = tile_m(tile)
                    tn = tile_n(tile)
                    for kt in T.serial(k_iters):
                        if it >= stages:
                            T.cuda.mbarrier_wait(T.address_of(empty[it % stages]), ((it // stages) + 1) % 2)
                        T.ptx.mbarrier.arrive.expect_tx.shared.b64(T.address_of(full[it % stages]),
                                                                   T.uint32(a_stage + w_stage))
                        T.ptx["cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"](
                            smem.access_ptr("w", offset=(it % stages) * (stage_bytes // elem)),
                            T.address_of(A_map), kt * BK, tm * bm, T.address_of(full[it % stages]))
                        T.ptx["cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"](
                            smem.access_ptr("w", offset=(it % stages) * (stage_bytes // elem) + a_stage // elem),
                            T.address_of(W_map), kt * PACKED_BK, tn * bn, T.address_of(full[it % stages]))
                        it = it + 1
                    tile = tile + grid
        else:
            T.ptx["setmaxnreg.inc.sync.aligned.u32"](232)
            ct = T.meta_var(tx - 128)
            tile = bx
            while tile < tiles:
                tm = tile_m(tile)
                tn = tile_n(tile)
                zero_accumulators(acc, acc_len)
                # The previous tile's last wgmma in both warpgroups is complete (wait_group 0): buffer 0 is free.
                T.cuda.func_call(CONSUMERS_SYNC, cthreads, source_code=CONSUMERS_SYNC_SOURCE)
                T.cuda.mbarrier_wait(T.address_of(full[it % stages]), (it // stages) % 2)
                dequantize(smem, S, Z, it % stages, 0, 0, tn, ct)
                T.cuda.func_call(CONSUMERS_SYNC, cthreads, source_code=CONSUMERS_SYNC_SOURCE)
                for ks in T.serial(k_iters):
                    T.ptx.wgmma.fence.sync.aligned()
                    for kk in T.unroll(BK // 16):
                        for f in T.unroll(m_frags):
                            T.cuda.wgmma.encode_matrix_descriptor(
                                T.address_of(desc_a),
                                smem.access_ptr("r", offset=(it % stages) * (stage_bytes // elem)
                                                + ((wg - 1) * wg_rows + f * 64) * BK + kk * 16), 1, 64, 3)
                            T.cuda.wgmma.encode_matrix_descriptor(
                                T.address_of(desc_b),
                                smem.access_ptr("r", offset=b_base + (ks % 2) * (b_tile // elem) + kk * 16), 1, 64, 3)
                            T.ptx[mma](*accs(acc, f), desc_a, desc_b, T.bool(True), 1, 1, 0, 0)
                    T.ptx.wgmma.commit_group.sync.aligned()
                    T.ptx.wgmma.wait_group.sync.aligned(1)  # wgmma(ks - 1) is complete, wgmma(ks) runs on
                    if ks > 0:
                        T.ptx.mbarrier.arrive.shared.b64(T.address_of(empty[(it + stages - 1) % stages]))
                    if ks + 1 < k_iters:
                        # Both warpgroups are past wgmma(ks - 1): its B buffer takes tile ks + 1.
                        T.cuda.func_call(CONSUMERS_SYNC, cthreads, source_code=CONSUMERS_SYNC_SOURCE)
                        T.cuda.mbarrier_wait(T.address_of(full[(it + 1) % stages]), ((it + 1) // stages) % 2)
                        dequantize(smem, S, Z, (it + 1) % stages, (ks + 1) % 2, ks + 1, tn, ct)
                        T.cuda.func_call(CONSUMERS_SYNC, cthreads, source_code=CONSUMERS_SYNC_SOURCE)
                    it = it + 1
                T.ptx.wgmma.wait_group.sync.aligned(0)
                T.ptx.mbarrier.arrive.shared.b64(T.address_of(empty[(it + stages - 1) % stages]))
                fence_accumulators(acc, acc_len)
                epilogue(acc, Bias, C, tm, tn, wg, tx)
                tile = tile + grid

    # fmt: on
    attrs = {"global_symbol": "main", "tirx.noalias": True, "tirx.launch_bounds_min_blocks_per_sm": 1}
    return dequant_main(body, m, n, k, math.ceil(k / group), dtype, bias, attrs, zeros)  # a short last group too


class HopperDequantGemmSpace(Int4Template):
    """``dequant_gemm`` with int4 weights past a decode step's rows on sm_90: the kernel above."""

    name = "hopper_dequant_gemm"
    version = 1
    MIN_M = 17  # up to 16 rows the GEMV spaces stream the weights (int4_gemv; past 8 rows of bf16 or small groups,
    # gpu_gemv)

    @classmethod
    def suits(cls, func, target, hints) -> bool:
        hints = hints or {}
        if not cls.suits_target(target, hints):
            return False
        shape = _shape(func)
        if shape is None:
            return False
        m, n, k, dtype = shape
        # Whole k steps, one scale per row and step, and pair stores that never straddle a row.
        return (m >= cls.MIN_M and k % BK == 0 and int(hints.get("group", 128)) % BK == 0 and n % 8 == 0
                and dtype in PTX_TYPE)

    def __init__(self, func, target, hints=None):
        super().__init__(func, target, hints)
        self.knobs = [
            Knob("consumers", (1, 2)),
            Knob("wg_rows", (64, 128)),
            Knob("block_n", (64, 128, 192, 256)),
            Knob("stages", (2, 3, 4, 5, 6)),
            Knob("group_m", (1, 4, 8, 16)),
            Knob("persistent", (False, True), ordered=False),
        ]

    def smem_bytes(self, p: Point) -> int:
        bm, bn = p["consumers"] * p["wg_rows"], p["block_n"]
        w_slot = math.ceil(bn * PACKED_BK / 1024) * 1024
        return p["stages"] * (bm * BK * 2 + w_slot) + 2 * bn * BK * 2 + 1024

    def check(self, p: Point) -> str | None:
        bm, bn = p["consumers"] * p["wg_rows"], p["block_n"]
        acc = p["wg_rows"] // 64 * bn // 2
        if acc > 128:
            return f"{acc} accumulator registers per thread (at most 128 fit without spilling)"
        if bn * 8 % (128 * p["consumers"]):
            return f"block_n {bn}'s 8-weight chunks do not divide among {128 * p['consumers']} consumer threads"
        smem = self.smem_bytes(p)
        if smem > SMEM_LIMIT:
            return f"{smem} bytes of shared memory (limit {SMEM_LIMIT})"
        for extent, tile, name in ((self.m, bm, "m"), (self.n, bn, "n")):
            if tile > 64 and math.ceil(extent / tile) * tile > 1.5 * extent:
                return f"block tile {tile} pads {name}={extent} by more than half"
        tiles = math.ceil(self.m / bm) * math.ceil(self.n / bn)
        if p["persistent"] and tiles <= self.sms:
            return f"persistent CTAs need more tiles ({tiles}) than multiprocessors ({self.sms})"
        if p["group_m"] > 1 and math.ceil(self.m / bm) < 2:
            return "grouped rasterisation needs two or more row tiles"
        return None

    def canonical(self, p: Point) -> Point:
        return canonical_group_m(p, math.ceil(self.m / (p["consumers"] * p["wg_rows"])))

    def default(self) -> Point:
        for point in ({"consumers": 2, "wg_rows": 64, "block_n": 256, "stages": 4, "group_m": 8, "persistent": False},
                      {"consumers": 2, "wg_rows": 64, "block_n": 128, "stages": 4, "group_m": 1, "persistent": False},
                      {"consumers": 1, "wg_rows": 64, "block_n": 64, "stages": 4, "group_m": 1, "persistent": False}):
            point = self.canonical(point)
            if self.check(point) is None:
                return point
        return super().default()

    def kernel(self, p: Point):
        return hopper_dequant_kernel(self.m, self.n, self.k, self.group, self.dtype, self.bias, self.act,
                                     {**p, "sms": self.sms}, self.zeros)

    def point_features(self, p: Point) -> list[float]:
        """Knobs, tiles and waves, shared memory, and the dequantisation work per consumer thread."""
        bm, bn = p["consumers"] * p["wg_rows"], p["block_n"]
        tiles = math.ceil(self.m / bm) * math.ceil(self.n / bn)
        waves = tiles / self.sms
        return [p["consumers"], p["wg_rows"], bn, p["stages"], p["group_m"], float(p["persistent"]), bm * bn,
                math.log2(tiles), waves, waves / max(1, math.ceil(waves)), self.smem_bytes(p) / SMEM_LIMIT,
                (bm + bn) / (bm * bn), bn * 8 / (128 * p["consumers"]), self.k / BK / p["stages"]]
