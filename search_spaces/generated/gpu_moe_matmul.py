"""The mixture-of-experts GEMM (``moe_gemm``) on CUDA: Y[i, j] = Σ_k X[i, k] · W[expert[i], j, k].

Each row (a token routed to one of its experts) reads the weight of its own expert, picked by an index
read at run time, so rows do not share a weight tile the way a GEMM's rows do: the product is a GEMV per
row, as in MLC-LLM's ``moe_matmul.gemv`` (a block per routed token). Decode has a few such rows (tokens x
experts per token), prefill many; rows routed to the same expert read the same weight rows, which the L2
serves (grouping the rows by expert first, as a grouped GEMM would, is the caller's choice, not this
workload's). A block computes ``outputs_per_block`` outputs of ``rows_per_block`` rows; its threads split
K (``lanes`` x ``vector`` elements per step, one wide load each) with partial sums in registers, then
reduce across the lanes with warp shuffles. ``stage_x`` reads the block's rows of X into shared memory
once, for all of its outputs, instead of once per output from global memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._analysis import HALF8_REASON, const_extents
from .._knobs import Knob, Point, Space
from .gpu_matmul import reduce_across_lanes
from .moe_matmul import BLOCK

if TYPE_CHECKING:
    from tvm import s_tir

# Deferred imports: tvm, numpy (imported where used: `autosched --help` stays fast).

STATIC_SHARED = 48 * 1024
MAX_THREADS = 1024


class GpuMoeMatmulSpace(Space):
    """A GEMV per routed row over its expert's weight: outputs per block, lanes splitting K, vector loads."""

    name = "gpu_moe_matmul"
    version = 1
    targets = ("cuda",)
    families = ("moe_matmul",)

    @classmethod
    def matches(cls, func) -> bool:
        from .moe_matmul import MoeMatmulSpace

        return MoeMatmulSpace.matches(func)

    @classmethod
    def suits(cls, func, target, hints) -> bool:
        """K a multiple of a warp's 32 lanes (every model's is), else no point divides it: TVM's default then."""
        from tvm import s_tir

        try:
            sch = s_tir.Schedule(func)
            depth = const_extents(sch, sch.get_loops(sch.get_sblock(BLOCK)))[-1]
        except (RuntimeError, ValueError):
            return True  # not ours to judge: __init__ names the functions the space takes
        return depth % 32 == 0

    def __init__(self, func, target, hints=None):
        super().__init__(func, target, hints)
        from tvm import s_tir

        sch = s_tir.Schedule(func)
        try:
            main = sch.get_sblock(BLOCK)
        except (RuntimeError, ValueError) as exc:
            raise ValueError("gpu_moe_matmul takes moe_gemm functions only") from exc
        self.rows, self.cols, self.depth = const_extents(sch, sch.get_loops(main))
        x_dtype = str(sch.get(main).reads[0].source.dtype)
        self.elem = 4 if x_dtype == "float32" else 2
        self.half = self.elem == 2
        self.knobs = [
            Knob("outputs_per_block", (1, 2, 4, 8, 16)),
            Knob("rows_per_block", (1, 2, 4)),
            Knob("lanes", (32, 64, 128, 256)),  # threads splitting K
            Knob("vector", (1, 2, 4, 8)),
            Knob("stage_x", (False, True), ordered=False),
            Knob("unroll", (0, 4, 16, 64)),
        ]

    def check(self, p: Point) -> str | None:
        outs, rows, lanes, vec = p["outputs_per_block"], p["rows_per_block"], p["lanes"], p["vector"]
        if outs * lanes > MAX_THREADS:
            return f"{outs * lanes} threads per block"
        # Tiles divide their loops: the gathered weight leaves nothing to pad (pad_einsum cannot see through
        # the expert index).
        if self.cols % outs:
            return f"{outs} outputs per block do not divide the {self.cols} columns"
        if self.rows % rows:
            return f"{rows} rows per block do not divide the {self.rows} rows"
        if self.depth % (lanes * vec):
            return f"{lanes} lanes x {vec} elements do not divide K = {self.depth}"
        if self.half and vec == 8:
            return HALF8_REASON
        if p["stage_x"] and rows * self.depth * self.elem > STATIC_SHARED:
            return f"{rows} rows of X ({rows * self.depth * self.elem} bytes) exceed 48 KB of shared memory"
        return None

    def default(self) -> Point:
        point = {"outputs_per_block": 4, "rows_per_block": 1, "lanes": 64, "vector": 4, "stage_x": False, "unroll": 16}
        if self.check(point) is None:
            return point
        # Small or odd shapes: the widest lane count and vector that divide K, outputs that divide N.
        for lanes in (64, 32, 128, 256):
            for vec in (4, 2, 1):
                for outs in (4, 2, 8, 1):
                    candidate = {**point, "lanes": lanes, "vector": vec, "outputs_per_block": outs}
                    if self.check(candidate) is None:
                        return candidate
        return super().default()

    def schedule(self, sch: s_tir.Schedule, p: Point) -> None:
        outs, rows, lanes, vec = p["outputs_per_block"], p["rows_per_block"], p["lanes"], p["vector"]
        main = sch.get_sblock(BLOCK)
        try:
            epilogue = sch.get_sblock("epilogue")  # the cast to a half-precision output
        except (RuntimeError, ValueError):
            # fp32: the product writes the output itself; accumulate in registers, copy out after.
            epilogue = sch.cache_write(main, 0, "local")
        i, j, k = sch.get_loops(main)
        i0, i1 = sch.split(i, [None, rows])
        j0, j1 = sch.split(j, [None, outs])
        k0, k1, k2 = sch.split(k, [None, lanes, vec])
        sch.reorder(i0, j0, j1, k1, i1, k0, k2)
        # Step 1. Per-lane partial sums over (k0, k2) in registers, one per row of the block.
        partial = sch.rfactor(k1, factor_axis=0)
        i0, j0, j1, k1, i1, k0, k2 = sch.get_loops(partial)
        block_loop = sch.fuse(i0, j0)
        sch.bind(block_loop, "blockIdx.x")
        sch.bind(j1, "threadIdx.y")
        sch.bind(k1, "threadIdx.x")
        sch.set_scope(partial, 0, "local")
        if p["stage_x"]:
            self._stage_x(sch, partial, block_loop, outs, lanes, vec)
        self._vector_loads(sch, partial, k0, vec, skip_x=p["stage_x"])
        sch.unroll(k2)
        if p["unroll"]:
            sch.annotate(k0, "pragma_auto_unroll_max_step", p["unroll"])
            sch.annotate(k0, "pragma_unroll_explicit", 1)
        # Step 2. The lanes' partial sums reduced by the lanes themselves (warp shuffles).
        reduce_across_lanes(sch, main, j1)
        # Step 3. The output stage writes the block's outputs (the cast where the output is half precision).
        sch.reverse_compute_at(epilogue, j1, preserve_unit_loops=True)

    def _stage_x(self, sch, partial, block_loop, outs: int, lanes: int, vec: int) -> None:
        """The block's rows of X copied to shared memory by all of its threads, once."""
        cache = sch.cache_read(partial, 0, "shared")
        sch.compute_at(cache, block_loop, preserve_unit_loops=True)
        loops = sch.get_loops(cache)[1:]
        fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
        _, ty, tx, v = sch.split(fused, [None, outs, lanes, vec])
        sch.bind(ty, "threadIdx.y")
        sch.bind(tx, "threadIdx.x")
        sch.vectorize(v)

    def _vector_loads(self, sch, partial, k0, vec: int, skip_x: bool) -> None:
        """Each thread's ``vec`` consecutive elements of X and of its row's weight staged through registers,
        so they are read with one wide load rather than ``vec`` narrow ones."""
        if vec == 1:
            return
        # Reads of the rfactor block: X (or its shared copy, already on chip), expert (the index), W.
        names = [region.source.name for region in sch.get(partial).reads]
        for index, name in enumerate(names):
            if name != "W" and (skip_x or name != "X"):
                continue
            cache = sch.cache_read(partial, index, "local")
            sch.compute_at(cache, k0, preserve_unit_loops=True)
            sch.vectorize(sch.get_loops(cache)[-1])
