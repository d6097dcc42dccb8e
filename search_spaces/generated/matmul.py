"""The contraction family: GEMM, batched GEMM, dequantising GEMM and any fused kernel whose one
reduction block is a matrix product (bias, activation and casts become the write-back stage).

Every variant is first normalised to C[S, I, J] += A[S, I, K] · B[S, J, K] and padded so that the chosen
tiles divide the loops; awkward sizes therefore cost a little padding, never a wrong or scalar kernel.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .._analysis import (
    const_extents,
    find_matmul_block,
    fold_consumer_chain,
    inline_producers,
    is_contraction,
    normalize_matmul,
    reads_b_along_k,
)
from .._knobs import Knob, Point, Space, TileKnob, padded

if TYPE_CHECKING:
    from tvm import s_tir

# Deferred imports: tvm (imported where used: `autosched --help` stays fast).

# Bound on the padding a tile choice may add to a loop, as a fraction of the loop.
MAX_PAD_WASTE = 0.25


class MatmulSpace(Space):
    """Ansor-style multi-level tiling for the CPU (SSRSRS: parallel outer tiles, register tiles,
    vectorised innermost J), with optional packing of B into a J-blocked layout so that the vector
    loads are contiguous whatever the original layout."""

    name = "matmul"
    version = 1
    targets = ("llvm",)
    families = ("matmul",)

    @classmethod
    def matches(cls, func) -> bool:
        return is_contraction(func)

    def __init__(self, func, target, hints=None):
        super().__init__(func, target, hints)
        from tvm import s_tir

        sch = s_tir.Schedule(func)
        main = find_matmul_block(sch)
        if main is None:
            raise ValueError("not a contraction")
        self.b_along_k = reads_b_along_k(sch, main)
        parts = normalize_matmul(sch, main)
        self.extent_s, self.extent_i, self.extent_j, self.extent_k = const_extents(sch, sch.get_loops(parts.main))
        out_dtype = sch.get(parts.main).writes[0].source.dtype
        # Vector lanes of the accumulator on this CPU: 512-bit registers where AVX-512 is available.
        self.lanes = (64 if _has_avx512(target.arch) else 32) // (4 if out_dtype == "float32" else 2)
        i, j, k = self.extent_i, self.extent_j, self.extent_k
        self.knobs = [
            TileKnob.make("tile_i", i, 4, max_inner=min(256, _round_up_pow2(i))),
            TileKnob.make("tile_j", j, 4, max_inner=min(512, _round_up_pow2(j)),
                          last_choices=tuple(v for v in (1, 4, 8, 16, 32, 64) if v <= max(_round_up_pow2(j), 1))),
            # Inner K block up to 512: the cache block of the reduction (BLIS's kc).
            TileKnob.make("tile_k", k, 2, max_inner=min(512, _round_up_pow2(k)), cap=512),
            Knob("pack_b", (True, False), ordered=False),
            Knob("parallel_levels", (1, 2)),
            Knob("write_back_level", (1, 2)),
            Knob("unroll", (0, 16, 64, 256, 1024)),
        ]

    def check(self, p: Point) -> str | None:
        ti, tj, tk = math.prod(p["tile_i"]), math.prod(p["tile_j"]), p["tile_k"][0]
        for name, extent, tile in (("i", self.extent_i, ti), ("j", self.extent_j, tj), ("k", self.extent_k, tk)):
            if tile > extent and padded(extent, tile) - extent > max(MAX_PAD_WASTE * extent, 0):
                return f"tile of {tile} pads loop {name} of {extent} by more than {MAX_PAD_WASTE:.0%}"
            if padded(extent, tile) > (1 + MAX_PAD_WASTE) * extent:
                return f"tile of {tile} pads loop {name} of {extent} by more than {MAX_PAD_WASTE:.0%}"
        # Register tile: accumulators of i3 x j3 must fit the vector register file (32 on AVX-512).
        regs = p["tile_i"][-1] * math.ceil(p["tile_j"][-1] / self.lanes)
        if regs > 32:
            return f"register tile {p['tile_i'][-1]}x{p['tile_j'][-1]} needs {regs} vector registers"
        return None

    def default(self) -> Point:
        def pick(knob_name, wanted):
            knob = next(k for k in self.knobs if k.name == knob_name)
            best = min(knob.choices, key=lambda c: sum(abs(math.log2(a) - math.log2(b)) for a, b in zip(c, wanted)))
            return best

        point = {"tile_i": pick("tile_i", (2, 2, 4)), "tile_j": pick("tile_j", (1, 2, self.lanes)),
                 "tile_k": pick("tile_k", (8,)), "pack_b": True, "parallel_levels": 1, "write_back_level": 1,
                 "unroll": 16}
        # A GEMV (a decode step's few rows) reads each weight once: packing B would copy all of it first,
        # every call. Unpacked, the vector loop runs along B's contiguous axis: wide column tiles where that
        # is the output column (B[k, n]); where it is k (B[n, k]), one row only and narrow column tiles.
        if not self.b_along_k and self.extent_i <= 8:
            point.update(tile_i=pick("tile_i", (1, 1, 1)), tile_j=pick("tile_j", (1, 16, 32)), pack_b=False,
                         write_back_level=2)
        elif self.b_along_k and self.extent_i == 1:
            point.update(tile_i=pick("tile_i", (1, 1, 1)), tile_j=pick("tile_j", (8, 2, 4)), pack_b=False,
                         unroll=256)
        return point if self.check(point) is None else super().default()

    def schedule(self, sch: s_tir.Schedule, p: Point) -> None:
        main = find_matmul_block(sch)
        normalize_matmul(sch, main)
        ti, tj, tk = p["tile_i"], p["tile_j"], p["tile_k"]
        tile_i, tile_j, tile_k = math.prod(ti), math.prod(tj), tk[0]
        pads = [1, tile_i, tile_j, tile_k]
        if any(e % t for e, t in zip((self.extent_i, self.extent_j, self.extent_k), pads[1:])):
            sch.pad_einsum(main, pads)

        # Step 1. Operands: A is read as a broadcast scalar, so it is inlined. B is either inlined or
        # packed into [S, J / j3, K, j3] so that each vector load of the inner J tile is contiguous.
        a_stage, b_stage = operand_stages(sch, main)
        inline_producers(sch, a_stage)
        sch.compute_inline(a_stage)
        if p["pack_b"]:
            # A fresh copy block iterates exactly over [S, J, K], whatever B's original layout was.
            packed = sch.cache_read(main, 1, "global")
            inline_producers(sch, packed)
            vec = tj[-1]
            sch.transform_layout(packed, ("write", 0), lambda s, j, k: (s, j // vec, k, j % vec))
            bs, bj, bk = sch.get_loops(packed)
            bj0, bj1 = sch.split(bj, [None, vec])
            sch.reorder(bs, bj0, bk, bj1)
            sch.parallel(sch.fuse(bs, bj0))
            sch.vectorize(bj1)
        else:
            inline_producers(sch, b_stage)
            sch.compute_inline(b_stage)

        # Step 2. Tile (S, I, J, K) as S I0 J0 | I1 J1 | K0 | I2 J2 | K1 | I3 J3.
        s, i, j, k = sch.get_loops(main)
        i0, i1, i2, i3 = sch.split(i, [None, *ti])
        j0, j1, j2, j3 = sch.split(j, [None, *tj])
        k0, k1 = sch.split(k, [None, tk[0]])
        sch.reorder(s, i0, j0, i1, j1, k0, i2, j2, k1, i3, j3)

        # Step 3. The write-back stage computes the epilogue (bias, activation, cast) per tile.
        write_back = fold_consumer_chain(sch, main)
        sch.reverse_compute_at(write_back, j1 if p["write_back_level"] == 1 else j2, preserve_unit_loops=True)

        outer = [s, i0, j0] + ([i1, j1] if p["parallel_levels"] == 2 else [])
        sch.parallel(sch.fuse(*outer))
        sch.vectorize(j3)
        if p["unroll"]:
            sch.annotate(main, "pragma_auto_unroll_max_step", p["unroll"])
            sch.annotate(main, "pragma_unroll_explicit", 1)
        sch.decompose_reduction(main, k0)
        wb_inner = sch.get_loops(write_back)[-1]
        sch.vectorize(wb_inner)


def operand_stages(sch: s_tir.Schedule, main) -> tuple:
    """The blocks that write the A and B operands of the normalised ``main`` (re-index or pad copies)."""
    reads = [r.source.name for r in sch.get(main).reads]
    by_buffer = {sch.get(p).writes[0].source.name: p for p in sch.get_producers(main)}
    return by_buffer[reads[0]], by_buffer[reads[1]]


def _has_avx512(mcpu: str) -> bool:
    return mcpu in {"skylake-avx512", "cascadelake", "cooperlake", "icelake-server", "icelake-client",
                    "tigerlake", "sapphirerapids", "emeraldrapids", "graniterapids", "znver4", "znver5",
                    "rocketlake", "cannonlake", "alderlake-avx512"}


def _round_up_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
