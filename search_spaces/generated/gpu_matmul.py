"""The contraction family on CUDA: tensor-core (WMMA) tiling for fp16/bf16, SIMT tiling otherwise,
and a GEMV space for the small-M matrix products of decoding.

All start from the same normalisation as the CPU space: C[S, I, J] += A[S, I, K] · B[S, J, K], padded
so the tiles divide. Epilogues (bias, activation, cast) run in the stage that writes the output.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from autosched.tvm_adapter import block_realize

from .._analysis import (
    HALF8_REASON,
    const_extents,
    find_matmul_block,
    fold_consumer_chain,
    inline_producers,
    is_contraction,
    loop_kinds,
    normalize_matmul,
)
from .._knobs import Knob, Point, Space

if TYPE_CHECKING:
    from tvm import s_tir

# Deferred imports: tvm, numpy (imported where used: `autosched --help` stays fast).

WARP = 32
STATIC_SHARED = 48 * 1024


def _matmul_info(func):
    """(extents S, I, J, K, input dtype, accumulator dtype) of the normalised contraction."""
    from tvm import s_tir

    sch = s_tir.Schedule(func)
    main = find_matmul_block(sch)
    if main is None:
        raise ValueError("not a contraction")
    parts = normalize_matmul(sch, main)
    extents = const_extents(sch, sch.get_loops(parts.main))
    block = sch.get(parts.main)
    in_dtype = str(sch.get(parts.a_copy).writes[0].source.dtype)
    out_dtype = str(block.writes[0].source.dtype)
    return extents, in_dtype, out_dtype


def _k_contiguous(func) -> tuple[bool, bool]:
    """Whether A and B are contiguous along the reduction axis (their last index is K). A vector load
    along K of an operand stored K-outer (B of torch.bmm) would gather, which TVM's CUDA code generator
    cannot pack into one wide load."""
    from tvm import s_tir, tirx

    sch = s_tir.Schedule(func)
    block = sch.get(find_matmul_block(sch))
    reduce_vars = {iv.var.name for iv in block.iter_vars if int(iv.iter_type) == tirx.IterVar.CommReduce}
    out = []
    for region in list(block.reads)[:2]:
        last = {v.name for v in tirx.analysis.undefined_vars(region.region[-1].min)}
        out.append(bool(last & reduce_vars))
    return out[0], out[1]


def _pad_to(sch, main, extents, tiles) -> None:
    if any(e % t for e, t in zip(extents[1:], tiles)):
        sch.pad_einsum(main, [1, *tiles])


class GpuMatmulSpace(Space):
    """Block tiles in shared memory, warp or thread tiles in registers, and for fp16/bf16 inputs
    tensor cores through WMMA, with an optional software pipeline over the K loop."""

    name = "gpu_matmul"
    version = 1
    targets = ("cuda",)
    families = ("matmul",)

    @classmethod
    def matches(cls, func) -> bool:
        return is_contraction(func)

    def __init__(self, func, target, hints=None):
        super().__init__(func, target, hints)
        (self.s, self.i, self.j, self.k), self.in_dtype, self.acc_dtype = _matmul_info(func)
        self.tc_ok = self.in_dtype in ("float16", "bfloat16") and self.acc_dtype in ("float32", "float16") \
            and min(self.i, self.j, self.k) >= 16
        self.elem = 2 if self.in_dtype in ("float16", "bfloat16") else 4
        self.k_contiguous = _k_contiguous(func)
        # Integer weights mean a dequantising prologue that is computed inside the shared-memory fetch.
        self.prologue = any(str(p.dtype) in ("int8", "uint8", "int32") for p in func.params)
        self.knobs = [
            Knob("tensor_core", (True, False) if self.tc_ok else (False,), ordered=False),
            # Tensor-core tiles: warps along I and J, 16x16 fragments per warp, 16-wide K steps per stage.
            Knob("warps_i", (1, 2, 4)),
            Knob("warps_j", (1, 2, 4)),
            Knob("frags_i", (1, 2, 4)),
            Knob("frags_j", (1, 2, 4, 8)),
            Knob("k_steps", (1, 2, 4)),
            Knob("pipeline", (True, False), ordered=False),
            # SIMT tiles: threads along I and J, elements per thread.
            Knob("threads_i", (4, 8, 16, 32)),
            Knob("threads_j", (4, 8, 16, 32)),
            Knob("micro_i", (1, 2, 4, 8)),
            Knob("micro_j", (1, 2, 4, 8)),
            Knob("micro_k", (4, 8, 16, 32)),
            Knob("vector", (1, 2, 4, 8)),
            Knob("unroll", (0, 16, 64, 256)),
        ]

    TC_KNOBS = ("warps_i", "warps_j", "frags_i", "frags_j", "k_steps", "pipeline")
    SIMT_KNOBS = ("threads_i", "threads_j", "micro_i", "micro_j", "micro_k", "unroll")
    FIXED = {"warps_i": 1, "warps_j": 1, "frags_i": 1, "frags_j": 1, "k_steps": 1, "pipeline": False,
             "threads_i": 4, "threads_j": 4, "micro_i": 1, "micro_j": 1, "micro_k": 4, "unroll": 0}

    def canonical(self, p: Point) -> Point:
        ignored = self.SIMT_KNOBS if p["tensor_core"] else self.TC_KNOBS
        return {**p, **{k: self.FIXED[k] for k in ignored}}

    def build_config(self, p: Point) -> dict:
        # TVM 0.27's StorageRewrite lets the fp32 output staging tile reuse the fp16 input tiles'
        # shared memory and then rejects its own typed pointers into it ("tvm_access_ptr element type
        # must match"); tensor-core kernels are compiled without that rewrite.
        return {"tirx.disable_storage_rewrite": True} if p["tensor_core"] else {}

    # ---- constraints ---------------------------------------------------------------------------
    def _tiles(self, p: Point) -> tuple[int, int, int]:
        if p["tensor_core"]:
            return 16 * p["warps_i"] * p["frags_i"], 16 * p["warps_j"] * p["frags_j"], 16 * p["k_steps"]
        return p["threads_i"] * p["micro_i"], p["threads_j"] * p["micro_j"], p["micro_k"]

    def check(self, p: Point) -> str | None:
        bm, bn, bk = self._tiles(p)
        for name, extent, tile in (("i", self.i, bm), ("j", self.j, bn), ("k", self.k, bk)):
            padded = math.ceil(extent / tile) * tile
            if padded > 1.25 * extent and tile > 16:
                return f"tile {tile} pads loop {name} of {extent} by more than 25%"
        if p["tensor_core"]:
            threads = WARP * p["warps_i"] * p["warps_j"]
            if threads > 1024:
                return f"{threads} threads per block"
            # Inputs (double-buffered when pipelined) plus the fp32 output tile staged in shared memory.
            stages = 2 if p["pipeline"] else 1
            smem = stages * (bm + bn) * (bk + 8) * self.elem + bm * (bn + 4) * 4
            limit = self.target.max_shared_memory or STATIC_SHARED
            if smem > limit:
                return f"{smem} bytes of shared memory (limit {limit})"
            if (bm * bk) % (threads * p["vector"]) or (bn * bk) % (threads * p["vector"]):
                return "the shared-memory fetch does not divide among the threads"
            if p["frags_i"] * p["frags_j"] > 16:
                return "more than 16 accumulator fragments per warp"
            if self.prologue and self.elem == 2 and p["vector"] == 8:
                return HALF8_REASON + " (the fetch dequantises)"
            return None
        threads = p["threads_i"] * p["threads_j"]
        if not 32 <= threads <= 1024:
            return f"{threads} threads per block"
        if p["micro_i"] * p["micro_j"] > 64:
            return "more than 64 accumulators per thread"
        if (bm + bn) * bk * self.elem > STATIC_SHARED:
            return "shared-memory tiles exceed 48 KB"
        if p["micro_j"] % p["vector"]:
            return "vector width does not divide the per-thread J tile"
        if self.elem == 2 and p["vector"] == 8:
            return HALF8_REASON
        return None

    def default(self) -> Point:
        base = {"tensor_core": self.tc_ok, "warps_i": 2, "warps_j": 2, "frags_i": 2, "frags_j": 4, "k_steps": 2,
                "pipeline": True, "threads_i": 16, "threads_j": 8, "micro_i": 4, "micro_j": 4, "micro_k": 16,
                "vector": 2, "unroll": 64}
        base = self.canonical(base)
        return base if self.check(base) is None else super().default()

    # ---- schedules -----------------------------------------------------------------------------
    def schedule(self, sch: s_tir.Schedule, p: Point) -> None:
        main = find_matmul_block(sch)
        parts = normalize_matmul(sch, main)
        bm, bn, bk = self._tiles(p)
        _pad_to(sch, main, [self.s, self.i, self.j, self.k], [bm, bn, bk])
        out = fold_consumer_chain(sch, main)
        if p["tensor_core"]:
            self._tensor_core(sch, main, out, p)
        else:
            self._simt(sch, main, out, p, bm, bn)
        del parts

    def _cooperative_fetch(self, sch, block, index, at, threads_y, threads_x, vec, scope, align):
        cache = sch.cache_read(block, index, scope)
        sch.compute_at(cache, at, preserve_unit_loops=True)
        inline_producers(sch, cache)
        loops = sch.get_loops(cache)[-2:]
        fused = sch.fuse(*loops)
        _, ty, tx, v = sch.split(fused, [None, threads_y, threads_x, vec])
        sch.bind(ty, "threadIdx.y")
        sch.bind(tx, "threadIdx.x")
        sch.vectorize(v)
        if align:
            sch.storage_align(cache, 0, axis=-2, factor=32, offset=align)
        return cache

    def _simt(self, sch, main, out, p, bm, bn) -> None:
        ty_n, tx_n = p["threads_i"], p["threads_j"]
        s, i, j, k = sch.get_loops(main)
        by, ty, yi = sch.split(i, [None, ty_n, p["micro_i"]])
        bx, tx, xi = sch.split(j, [None, tx_n, p["micro_j"]])
        ko, ki = sch.split(k, [None, p["micro_k"]])
        sch.reorder(s, by, bx, ty, tx, ko, ki, yi, xi)
        sch.bind(sch.fuse(s, by), "blockIdx.y")
        sch.bind(bx, "blockIdx.x")
        sch.bind(ty, "threadIdx.y")
        sch.bind(tx, "threadIdx.x")
        if p["unroll"]:
            sch.annotate(tx, "pragma_auto_unroll_max_step", p["unroll"])
            sch.annotate(tx, "pragma_unroll_explicit", 1)
        # The accumulator tile of each thread lives in registers; the output stage writes it back.
        sch.set_scope(main, 0, "local")
        sch.reverse_compute_at(out, tx, preserve_unit_loops=True)
        for index in (0, 1):
            vec = p["vector"] if self.k_contiguous[index] else 1
            self._cooperative_fetch(sch, main, index, ko, ty_n, tx_n, vec, "shared", vec)
        sch.decompose_reduction(main, ko)

    def _tensor_core(self, sch, main, out, p) -> None:
        from ._cuda_intrin import wmma_intrins

        s, i, j, k = sch.get_loops(main)
        i, i_frag = sch.split(i, [None, 16])
        j, j_frag = sch.split(j, [None, 16])
        k, k_frag = sch.split(k, [None, 16])
        sch.reorder(i, j, k, i_frag, j_frag, k_frag)
        inner = main
        outer = sch.blockize(i_frag)
        i0, i1, i2 = sch.split(i, [None, p["warps_i"], p["frags_i"]])
        j0, j1, j2 = sch.split(j, [None, p["warps_j"], p["frags_j"]])
        k0, k1 = sch.split(k, [None, p["k_steps"]])
        sch.reorder(s, i0, j0, i1, j1, k0, k1, i2, j2)
        sch.bind(s, "blockIdx.z")
        sch.bind(i0, "blockIdx.y")
        sch.bind(j0, "blockIdx.x")
        warp = sch.fuse(i1, j1)
        sch.bind(warp, "threadIdx.y")
        warps = p["warps_i"] * p["warps_j"]

        fetches = [self._cooperative_fetch(sch, outer, index, k0, warps, WARP,
                                           p["vector"] if self.k_contiguous[index] else 1, "shared.dyn", 8)
                   for index in (0, 1)]
        a_frag = sch.cache_read(outer, 0, "wmma.matrix_a")
        b_frag = sch.cache_read(outer, 1, "wmma.matrix_b")
        sch.compute_at(a_frag, k1)
        sch.compute_at(b_frag, k1)
        # Accumulators: WMMA fragments, stored through shared memory to the output stage.
        sch.set_scope(outer, 0, "shared.dyn")
        acc = sch.cache_write(outer, 0, "wmma.accumulator")
        sch.storage_align(acc, 0, axis=-2, factor=32, offset=4)  # rows of the staged output tile
        sch.reverse_compute_at(acc, warp)
        sch.reverse_compute_at(out, warp, preserve_unit_loops=True)
        fused = sch.fuse(*sch.get_loops(out)[-2:])
        _, tx, vec = sch.split(fused, [None, WARP, 4])
        sch.bind(tx, "threadIdx.x")
        sch.vectorize(vec)

        ii, jj = sch.get_loops(acc)[-2:]
        ii0, ii1 = sch.split(ii, [None, 16])
        jj0, jj1 = sch.split(jj, [None, 16])
        sch.reorder(ii0, jj0, ii1, jj1)
        init = sch.decompose_reduction(outer, k0)
        for frag in (a_frag, b_frag):
            ii, jj = sch.get_loops(frag)[-2:]
            ii0, ii1 = sch.split(ii, [None, 16])
            jj0, jj1 = sch.split(jj, [None, 16])
            sch.reorder(ii0, jj0, ii1, jj1)
        intrins = wmma_intrins(self.in_dtype, self.acc_dtype if self.acc_dtype != "float16" else "float16",
                               b_transposed=True)
        sch.tensorize(sch.get_loops(a_frag)[-2], intrins["load_a"])
        sch.tensorize(sch.get_loops(b_frag)[-2], intrins["load_b"])
        sch.tensorize(sch.get_loops(sch.get_child_blocks(init)[0])[-2], intrins["init"])
        sch.tensorize(sch.get_loops(acc)[-2], intrins["store"])
        sch.tensorize(sch.get_loops(inner)[-3], intrins["compute"])
        if p["pipeline"]:
            # Two-stage software pipeline: fetch the next K block into shared memory while the tensor
            # cores work on this one (TVM turns the global->shared copies into cp.async).
            sch.annotate(k0, "software_pipeline_stage", [0, 0, 1])
            sch.annotate(k0, "software_pipeline_order", [0, 1, 2])
            sch.annotate(k0, "software_pipeline_async_stages", [0])
            for fetch in fetches:
                sch.annotate(fetch, "double_buffer_scope", 0)


class GpuGemvSpace(Space):
    """Matrix-vector products (decode: M of 1 to 16): each block computes a few outputs, its threads
    split K with per-thread partial sums in registers and finish with a cross-thread reduction."""

    name = "gpu_gemv"
    version = 1
    targets = ("cuda",)
    families = ("matmul",)
    MAX_M = 16

    @classmethod
    def matches(cls, func) -> bool:
        from tvm import s_tir

        if find_matmul_block(s_tir.Schedule(func)) is None:
            return False
        (_, i, _, _), _, _ = _matmul_info(func)
        return i <= cls.MAX_M

    def __init__(self, func, target, hints=None):
        super().__init__(func, target, hints)
        (self.s, self.i, self.j, self.k), self.in_dtype, _ = _matmul_info(func)
        self.knobs = [
            Knob("outputs_per_block", (1, 2, 4, 8, 16)),
            Knob("lanes", (32, 64, 128, 256)),  # threads splitting K
            Knob("vector", (1, 2, 4, 8)),
            Knob("unroll", (0, 4, 16, 64)),
        ]

    def check(self, p: Point) -> str | None:
        threads = p["outputs_per_block"] * p["lanes"]
        if threads > 1024:
            return f"{threads} threads per block"
        if p["lanes"] * p["vector"] > 2 * self.k and p["lanes"] > 32:
            return "more lanes than K needs"
        if p["outputs_per_block"] > 2 * self.j:
            return "more outputs per block than outputs"
        return None

    def default(self) -> Point:
        return {"outputs_per_block": 4, "lanes": 64, "vector": 8 if self.in_dtype != "float32" else 4, "unroll": 16}

    def schedule(self, sch: s_tir.Schedule, p: Point) -> None:
        main = find_matmul_block(sch)
        normalize_matmul(sch, main)
        vec, lanes, outs = p["vector"], p["lanes"], p["outputs_per_block"]
        _pad_to(sch, main, [self.s, self.i, self.j, self.k], [1, outs, lanes * vec])
        out = fold_consumer_chain(sch, main)
        for stage in sch.get_producers(main):
            inline_producers(sch, stage)
            sch.compute_inline(stage)
        s, i, j, k = sch.get_loops(main)
        j0, j1 = sch.split(j, [None, outs])
        k0, k1, k2 = sch.split(k, [None, lanes, vec])
        sch.reorder(s, j0, j1, k1, k0, i, k2)
        # Step 1. Per-lane partial sums over (k0, k2) in registers.
        partial = sch.rfactor(k1, factor_axis=0)
        s, j0, j1, k1, k0, i, k2 = sch.get_loops(partial)  # rfactor replaced the loop nest
        sch.bind(sch.fuse(s, j0), "blockIdx.x")
        sch.bind(j1, "threadIdx.y")
        sch.bind(k1, "threadIdx.x")
        sch.set_scope(partial, 0, "local")
        self._vector_loads(sch, partial, k0, k2, vec)
        if p["unroll"]:
            sch.annotate(k0, "pragma_auto_unroll_max_step", p["unroll"])
            sch.annotate(k0, "pragma_unroll_explicit", 1)
        # Step 2. The lanes' partial sums are reduced by the lanes themselves (warp shuffles).
        reduce_across_lanes(sch, main, j1)
        # Step 3. The epilogue writes each block's outputs.
        sch.reverse_compute_at(out, j1, preserve_unit_loops=True)

    def _vector_loads(self, sch, partial, k0, k2, vec: int) -> None:
        """Stage each thread's ``vec`` consecutive elements of every global operand through registers, so
        they are read with one wide load (16 bytes for 8 halves) rather than ``vec`` narrow ones."""
        from tvm import tirx

        k2_name = sch.get(k2).loop_var.name
        realize = _realize(sch, partial)
        realize_vars = {iv.var.name: val for iv, val in zip(realize.block.iter_vars, realize.iter_values)}
        params = {p.name for p in self.func.params}
        for index, region in enumerate(list(sch.get(partial).reads)):
            buf = region.source
            if buf.name not in params or vec == 1:
                continue
            last = {v.name for v in tirx.analysis.undefined_vars(region.region[-1].min)}
            uses_k2 = any(k2_name in {x.name for x in tirx.analysis.undefined_vars(realize_vars[v])}
                          for v in last if v in realize_vars)
            if not uses_k2:
                continue
            try:
                cache = sch.cache_read(partial, index, "local")  # reads keep their order
                sch.compute_at(cache, k0, preserve_unit_loops=True)
                sch.vectorize(sch.get_loops(cache)[-1])
            except (RuntimeError, ValueError):
                continue
        sch.unroll(k2)


def reduce_across_lanes(sch, main, j1) -> None:
    """A GEMV's reduction ``main`` of the lanes' partial sums, by the lanes themselves (warp shuffles): under
    ``j1`` (the block's output loop), in registers, with no unit loops around it and the lane loop innermost,
    as cross-thread reduction requires."""
    sch.reverse_compute_at(main, j1, preserve_unit_loops=False)
    sch.set_scope(main, 0, "local")
    inner = list(zip(sch.get_loops(main), loop_kinds(sch, main)))[2:]  # below the block and j1 loops
    lane_loop = [lp for lp, kind in inner if kind == "R"][-1]
    others = [lp for lp, kind in inner if kind != "R"]
    if others:
        sch.reorder(*others, lane_loop)
    sch.bind(lane_loop, "threadIdx.x")


def _realize(sch, block):
    return block_realize(sch, block)
