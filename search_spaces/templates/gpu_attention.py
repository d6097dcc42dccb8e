"""Fused FlashAttention-style prefill on CUDA: a template space.

One thread block takes ``tile_x`` query rows of one KV head (rows of the query heads that share it, for
grouped-query attention) and streams K/V in tiles of ``tile_z`` keys through shared memory, keeping the
online-softmax state (running max and sum) and the output accumulator on chip; no score matrix is
materialised. With causal masking only the key tiles at or before the last query of the block are
visited. The tile computations (S = QKᵀ, the online-softmax update, O += PV) are TVM's own TIR macros
from its LLM KV-cache kernels (``tvm.relax.frontend.nn.llm._kernel_common``), scheduled with SIMT thread
tiles; the tile sizes, warps and load widths are the knobs.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from autosched.tvm_adapter import llm_prefill_kernels

from .._analysis import HALF8_REASON
from .._knobs import Knob, Point, Space

if TYPE_CHECKING:
    from tvm import s_tir

# Deferred imports: tvm (imported where used: `autosched --help` stays fast).

STATIC_SHARED = 48 * 1024
BDX = 32


def _shape(func):
    q, k = func.params[0], func.params[1]
    b, h, s, d = (int(x) for x in q.shape)
    return b, h, int(k.shape[1]), s, d, str(q.dtype)


class FlashAttentionSpace(Space):
    name = "flash_attention"
    version = 1
    targets = ("cuda",)
    families = ("attention",)
    template = True

    def __init__(self, func, target, hints=None):
        super().__init__(func, target, hints)
        self.b, self.h, self.hkv, self.s, self.d, self.dtype = _shape(func)
        self.group = self.h // self.hkv
        self.causal = bool(self.hints.get("causal", True))
        self.elem = 2 if self.dtype in ("float16", "bfloat16") else 4
        self.knobs = [
            Knob("tile_x", (16, 32, 64, 128)),
            Knob("tile_z", (16, 32, 64)),
            Knob("warps", (2, 4, 8)),
            Knob("load_vec", (2, 4, 8)),
        ]

    def check(self, p: Point) -> str | None:
        _is_prefill_kernel_config_legal = llm_prefill_kernels()._is_prefill_kernel_config_legal

        tx, tz, warps, vec = p["tile_x"], p["tile_z"], p["warps"], p["load_vec"]
        smem = (tx + 2 * tz) * self.d * self.elem + tx * tz * 4 + 3 * tx * 4
        if smem > STATIC_SHARED:
            return f"{smem} bytes of shared memory"
        if (tx * self.d) // (BDX * warps) > 128:
            return "output accumulator above 128 registers per thread"
        if not _is_prefill_kernel_config_legal(tx, self.d, tz, self.d, vec, BDX, warps, False):
            return "tiles do not divide among the threads"
        if self.elem == 2 and vec == 8:
            return HALF8_REASON
        return None

    def default(self) -> Point:
        point = {"tile_x": 32, "tile_z": 32, "warps": 4, "load_vec": 4}
        return point if self.check(point) is None else super().default()

    def initial(self, p: Point):
        return _flash_prefill(self.b, self.h, self.hkv, self.s, self.d, self.dtype, self.causal,
                              p["tile_x"], p["tile_z"], p["warps"])

    def schedule(self, sch: s_tir.Schedule, p: Point) -> None:
        _schedule_flash(sch, p["load_vec"], BDX, p["warps"], p["tile_x"], self.d, p["tile_z"])


def _flash_prefill(b, h, hkv, s, d, dtype, causal, tile_x, tile_z, num_warps):
    """The kernel, for Q[b,h,s,d], K/V[b,hkv,s,d] -> O[b,h,s,d] (our attention workload's signature)."""
    kernels = llm_prefill_kernels()
    _alloc_mha_qkvo_buffers, _alloc_softmax_state_buffers, _make_prefill_macros = (
        kernels._alloc_mha_qkvo_buffers, kernels._alloc_softmax_state_buffers, kernels._make_prefill_macros)
    from tvm.script import tirx as T

    group = h // hkv
    init_states, compute_s_gemm, softmax_update, compute_o_gemm, *_ = _make_prefill_macros(
        tile_x, d, tile_z, d, BDX, num_warps, group)
    tiles = (s * group + tile_x - 1) // tile_x
    sm_scale = 1.0 / math.sqrt(d)
    causal_flag = 1 if causal else 0

    @T.prim_func(s_tir=True)
    def main(Q: T.Buffer((b, h, s, d), dtype), K: T.Buffer((b, hkv, s, d), dtype),
             V: T.Buffer((b, hkv, s, d), dtype), O: T.Buffer((b, h, s, d), dtype)):
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        for lbx in T.thread_binding(b * tiles, thread="blockIdx.x"):
            for lby in T.thread_binding(hkv, thread="blockIdx.y"):
                for lty in T.thread_binding(num_warps, thread="threadIdx.y"):
                    for ltx in T.thread_binding(BDX, thread="threadIdx.x"):
                        with T.sblock("attn"):
                            vbx, by, ty, tx = T.axis.remap("SSSS", [lbx, lby, lty, ltx])
                            T.reads()
                            T.writes()
                            Q_smem, K_smem, V_smem, O_local = _alloc_mha_qkvo_buffers(tile_x, tile_z, d, d, dtype)
                            S_smem, S_local, m_smem, m_prev_smem, d_smem, m_new, m_prev, d_new = (
                                _alloc_softmax_state_buffers(tile_x, tile_z, BDX, num_warps))
                            b_idx: T.let[T.int32] = vbx // tiles
                            LH_start: T.let[T.int32] = vbx % tiles * tile_x
                            T.tvm_storage_sync("shared")
                            init_states(m_smem, d_smem, O_local, ty, tx)
                            for li, lj in T.grid(tile_x, d):
                                with T.sblock("Q_load"):
                                    i, j = T.axis.remap("SS", [li, lj])
                                    T.reads()
                                    T.writes()
                                    cur_L: T.let[T.int32] = (LH_start + i) // group
                                    cur_H: T.let[T.int32] = by * group + (LH_start + i) % group
                                    if cur_L < s:
                                        Q_smem[i, j] = Q[b_idx, cur_H, cur_L, j]
                                    else:
                                        Q_smem[i, j] = T.cast(0.0, dtype)
                            T.tvm_storage_sync("shared")
                            # Causal: no key after the block's last query row can contribute.
                            last_row: T.let[T.int32] = T.min((LH_start + tile_x - 1) // group, s - 1)
                            kv_end: T.let[T.int32] = T.if_then_else(causal_flag == 1, last_row + 1, s)
                            for iterator in T.serial(T.ceildiv(kv_end, tile_z)):
                                L_kv_start: T.let[T.int32] = iterator * tile_z
                                for lz, ly in T.grid(tile_z, d):
                                    with T.sblock("K_load"):
                                        i, j = T.axis.remap("SS", [lz, ly])
                                        T.reads()
                                        T.writes()
                                        if L_kv_start + i < s:
                                            K_smem[i, j] = K[b_idx, by, L_kv_start + i, j]
                                        else:
                                            K_smem[i, j] = T.cast(0.0, dtype)
                                T.tvm_storage_sync("shared")
                                for lz, ly in T.grid(tile_z, d):
                                    with T.sblock("V_load"):
                                        i, j = T.axis.remap("SS", [lz, ly])
                                        T.reads()
                                        T.writes()
                                        if L_kv_start + i < s:
                                            V_smem[i, j] = V[b_idx, by, L_kv_start + i, j]
                                        else:
                                            V_smem[i, j] = T.cast(0.0, dtype)
                                T.tvm_storage_sync("shared")
                                compute_s_gemm(Q_smem, K_smem, S_local, S_smem, sm_scale)
                                softmax_update(S_smem, m_smem, d_smem, m_prev_smem, m_new, m_prev, d_new, ty, tx,
                                               LH_start, L_kv_start, causal_flag, s, s, 0)
                                compute_o_gemm(S_smem, V_smem, O_local, m_prev_smem, m_smem)
                            for li, lj in T.grid(tile_x, d):
                                with T.sblock("O_store"):
                                    i, j = T.axis.remap("SS", [li, lj])
                                    cur_L: T.let[T.int32] = (LH_start + i) // group
                                    cur_H: T.let[T.int32] = by * group + (LH_start + i) % group
                                    if cur_L < s:
                                        O[b_idx, cur_H, cur_L, j] = T.cast(O_local[i, j] / d_smem[i], dtype)

    return main


def _schedule_flash(sch, load_vec, bdx, num_warps, tile_x, tile_y, tile_z) -> None:
    """Thread tiles of the template's blocks (after TVM's ``_schedule_prefill_kernel``, without the LSE
    output our workload does not have)."""
    kernels = llm_prefill_kernels()
    _get_prefill_load_config, _get_prefill_tile_size, _get_prefill_vector_size = (
        kernels._get_prefill_load_config, kernels._get_prefill_tile_size, kernels._get_prefill_vector_size)

    def extents(*loops):
        return [int(sch.get(lp).extent) for lp in loops]

    def load(block):
        lx, ly = sch.get_loops(block)[-2:]
        vec, tx_, ty_ = _get_prefill_load_config(*extents(lx, ly), bdx * num_warps, load_vec)
        yo, yv = sch.split(ly, [None, vec])
        xo, xi = sch.split(lx, [tx_, None])
        yo, yi = sch.split(yo, [ty_, None])
        sch.reorder(xi, yi, xo, yo)
        ty, tx = sch.split(sch.fuse(xi, yi), [num_warps, bdx])
        sch.bind(ty, "threadIdx.y")
        sch.bind(tx, "threadIdx.x")
        sch.vectorize(yv)

    def elementwise(block, tile):
        lx, ly = sch.get_loops(block)[-2:]
        xo, xi = sch.split(lx, [None, tile[0]])
        yo, yi = sch.split(ly, [None, tile[1]])
        sch.reorder(xo, yo, xi, yi)
        yio, yiv = sch.split(yi, [None, _get_prefill_vector_size(tile[1], load_vec)])
        sch.unroll(yio)
        sch.vectorize(yiv)
        ty, tx = sch.split(sch.fuse(xo, yo), [None, bdx])
        sch.bind(ty, "threadIdx.y")
        sch.bind(tx, "threadIdx.x")

    def gemm(block, tile, k_major):
        lx, ly, lz = sch.get_loops(block)[-3:]
        xo, xi = sch.split(lx, [None, tile[0]])
        yo, yi = sch.split(ly, [None, tile[1]])
        sch.reorder(xo, yo, xi, yi)
        ty, tx = sch.split(sch.fuse(xo, yo), [None, bdx])
        sch.bind(ty, "threadIdx.y")
        sch.bind(tx, "threadIdx.x")
        ko, ki = sch.split(lz, [None, 16])
        sch.reorder(*((ko, xi, yi, ki) if k_major else (ko, ki, xi, yi)))
        yio, yiv = sch.split(yi, [None, _get_prefill_vector_size(tile[1], load_vec)])
        sch.unroll(yio)
        sch.vectorize(yiv)
        sch.unroll(xi)
        sch.decompose_reduction(block, ty)

    tile_s = _get_prefill_tile_size(tile_x, tile_z, bdx * num_warps)
    tile_o = _get_prefill_tile_size(tile_x, tile_y, bdx * num_warps)
    gemm(sch.get_sblock("S_gemm"), tile_s, k_major=True)
    gemm(sch.get_sblock("O_gemm"), tile_o, k_major=False)
    elementwise(sch.get_sblock("S_store"), tile_s)
    elementwise(sch.get_sblock("O_init"), tile_o)
    elementwise(sch.get_sblock("O_store"), tile_o)
    for name in ("Q_load", "K_load", "V_load"):
        load(sch.get_sblock(name))
