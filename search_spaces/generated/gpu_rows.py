"""Row-wise and elementwise kernels on CUDA.

``gpu_rows``: one thread block per row (RMSNorm, softmax, and paged decode attention, whose row is one
head of one sequence). Every stage of the row runs in the block, intermediates in shared memory. In
each stage the warp's 32 lanes take the loop that indexes the innermost dimension of the stage's
largest input, so global loads are coalesced; the warps take the rest; reductions spread over threads
end in warp shuffles (and shared memory across warps).

``gpu_injective``: everything fused into one loop over the output, blocks x threads x vector.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autosched.tvm_adapter import block_realize

from .._analysis import HALF8_REASON, blocks_of, const_extents, has_half, is_injective, is_reduction, loop_kinds
from .._knobs import Knob, Point, Space
from .rows import inline_spatial, row_depth

if TYPE_CHECKING:
    from tvm import s_tir

# Deferred imports: tvm (imported where used: `autosched --help` stays fast).

LANES = 32
STATIC_SHARED = 48 * 1024


def _param_names(func) -> set[str]:
    return {p.name for p in func.params}


def _coalescing_loop(sch, block, loops, params: set[str]):
    """The loop (among ``loops``) that indexes the last dimension of the block's largest global read."""
    from tvm import tirx

    realize = block_realize(sch, block)
    binding = {iv.var.name: {v.name for v in tirx.analysis.undefined_vars(val)}
               for iv, val in zip(realize.block.iter_vars, realize.iter_values)}
    loop_vars = {sch.get(lp).loop_var.name: lp for lp in loops}
    best, best_size = None, -1
    for region in sch.get(block).reads:
        buf = region.source
        if buf.name not in params or not buf.shape:
            continue
        size = 1
        for dim in buf.shape:
            size *= int(dim)
        last_vars = {v.name for v in tirx.analysis.undefined_vars(region.region[-1].min)}
        for iter_name in last_vars:
            for loop_name in binding.get(iter_name, ()):
                if loop_name in loop_vars and size > best_size:
                    best, best_size = loop_vars[loop_name], size
    return best


class GpuRowsSpace(Space):
    name = "gpu_rows"
    version = 1
    targets = ("cuda",)
    families = ("rows", "paged_attention")

    @classmethod
    def matches(cls, func) -> bool:
        from tvm import s_tir

        sch = s_tir.Schedule(func)
        return row_depth(sch) >= 1 and not is_reduction(sch, blocks_of(sch)[-1])

    def __init__(self, func, target, hints=None):
        super().__init__(func, target, hints)
        from tvm import s_tir

        sch = s_tir.Schedule(func)
        self.depth = row_depth(sch)
        self.params = _param_names(func)
        self.half = has_half(func)
        self.knobs = [
            Knob("warps", (1, 2, 4, 8, 16, 32)),
            Knob("vector", (1, 2, 4, 8)),
            Knob("unroll", (0, 16, 64, 256)),
            # Read an input that several stages of the row use (X of a norm or softmax) from global memory
            # once, into shared memory, instead of once per stage.
            Knob("stage_input", (False, True), ordered=False),
        ]

    def check(self, p: Point) -> str | None:
        return HALF8_REASON if self.half and p["vector"] == 8 else None

    def default(self) -> Point:
        return {"warps": 8, "vector": 4, "unroll": 16, "stage_input": False}

    def schedule(self, sch: s_tir.Schedule, p: Point) -> None:
        inline_spatial(sch)
        blocks = blocks_of(sch)
        out = blocks[-1]
        loops = sch.get_loops(out)
        row = sch.fuse(*loops[: self.depth]) if self.depth > 1 else loops[0]
        sch.bind(row, "blockIdx.x")
        for block in reversed(blocks[:-1]):
            sch.compute_at(block, row, preserve_unit_loops=True)
            sch.set_scope(block, 0, "shared")
        staged = {sch.get(b).name_hint for b in self._stage_inputs(sch, row, p)} if p["stage_input"] else set()
        for block in blocks_of(sch):
            if sch.get(block).name_hint in staged:  # already bound to the threads
                continue
            self._threads(sch, block, p)
            if p["unroll"]:
                sch.annotate(block, "pragma_auto_unroll_max_step", p["unroll"])
                sch.annotate(block, "pragma_unroll_explicit", 1)

    def _stage_inputs(self, sch, row, p: Point) -> list:
        """Copy each function input that two or more stages read into shared memory, once per row."""
        readers: dict[str, list] = {}
        for block in blocks_of(sch):
            for index, region in enumerate(sch.get(block).reads):
                if region.source.name in self.params:
                    readers.setdefault(region.source.name, []).append((block, index))
        staged = []
        for uses in readers.values():
            if len(uses) < 2:
                continue
            block, index = uses[0]
            cache = sch.cache_read(block, index, "shared", consumer_blocks=[b for b, _ in uses])
            sch.compute_at(cache, row, preserve_unit_loops=True)
            loops = sch.get_loops(cache)[1:]
            fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
            _, ty, tx, v = sch.split(fused, [None, p["warps"], LANES, p["vector"]])
            sch.bind(ty, "threadIdx.y")
            sch.bind(tx, "threadIdx.x")
            sch.vectorize(v)
            staged.append(cache)
        return staged

    def _threads(self, sch, block, p: Point) -> None:
        warps, vec = p["warps"], p["vector"]
        inner = sch.get_loops(block)[1:]
        kinds = loop_kinds(sch, block)[1:]
        extents = const_extents(sch, inner)
        live = [(lp, k) for lp, k, e in zip(inner, kinds, extents) if e > 1]
        if not live:
            return
        lane = _coalescing_loop(sch, block, [lp for lp, _ in live], self.params) or live[-1][0]
        lane_kind = dict((sch.get(lp).loop_var.name, k) for lp, k in live)[sch.get(lane).loop_var.name]
        others = [(lp, k) for lp, k in live if not sch.get(lp).loop_var.same_as(sch.get(lane).loop_var)]
        same = [lp for lp, k in others if k == lane_kind]
        rest = [lp for lp, k in others if k != lane_kind]
        if not rest:
            # One kind of loop only (a row reduction, or an elementwise stage): all threads share it.
            fused = sch.fuse(*same, lane) if same else lane
            if lane_kind == "S" and vec > 1:
                _, ty, tx, v = sch.split(fused, [None, warps, LANES, vec])
                sch.vectorize(v)
            else:
                _, ty, tx = sch.split(fused, [None, warps, LANES])
            sch.bind(ty, "threadIdx.y")
            sch.bind(tx, "threadIdx.x")
            return
        # Spatial and reduction loops (a score row or P·V): lanes on the coalescing loop, warps on the other.
        if same:
            lane = sch.fuse(*same, lane)
        other = sch.fuse(*rest) if len(rest) > 1 else rest[0]
        l0, tx = sch.split(lane, [None, LANES])
        o0, ty = sch.split(other, [None, warps])
        # A cross-thread reduction needs its reduction loops innermost.
        if lane_kind == "R":
            sch.reorder(o0, ty, l0, tx)
        else:
            sch.reorder(l0, tx, o0, ty)
        sch.bind(ty, "threadIdx.y")
        sch.bind(tx, "threadIdx.x")


class GpuInjectiveSpace(Space):
    name = "gpu_injective"
    version = 2  # 2: reshapes are inlined (they were stages: a whole copy, a kernel of their own on the GPU)
    targets = ("cuda",)
    families = ("injective",)

    @classmethod
    def matches(cls, func) -> bool:
        return is_injective(func)

    def __init__(self, func, target, hints=None):
        super().__init__(func, target, hints)
        self.half = has_half(func)
        self.knobs = [
            Knob("threads", (64, 128, 256, 512, 1024)),
            Knob("vector", (1, 2, 4, 8)),
            Knob("per_thread", (1, 2, 4, 8)),
            Knob("unroll", (0, 16, 64)),
        ]

    def check(self, p: Point) -> str | None:
        return HALF8_REASON if self.half and p["vector"] == 8 else None

    def default(self) -> Point:
        return {"threads": 256, "vector": 4, "per_thread": 1, "unroll": 0}

    def schedule(self, sch: s_tir.Schedule, p: Point) -> None:
        inline_spatial(sch, keep_row_stages=False)
        for block in blocks_of(sch):
            loops = sch.get_loops(block)
            fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
            total = const_extents(sch, [fused])[0]
            vec = p["vector"] if total % p["vector"] == 0 else 1
            bx, _, tx, v = sch.split(fused, [None, p["per_thread"], p["threads"], vec])
            sch.bind(bx, "blockIdx.x")
            sch.bind(tx, "threadIdx.x")
            sch.vectorize(v)
            if p["unroll"]:
                sch.annotate(block, "pragma_auto_unroll_max_step", p["unroll"])
                sch.annotate(block, "pragma_unroll_explicit", 1)
