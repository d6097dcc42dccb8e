"""Prefill attention on the CPU in blocks of query rows.

The rows space computes attention one query row at a time, and its QKᵀ reads K along the key axis,
a stride of the head dimension per key: the vector loop gathers. Here each task is a block of query
rows of one head: K is first copied transposed (``[d, keys]``, once per block), so that QKᵀ for the
block is a GEMM whose vector loop runs along the keys, each K row reused by every query row of the block;
the softmax stages and PV (vectorised along the head dimension, V as stored) then run over the whole
block, several times faster than one row at a time.
"""

from __future__ import annotations

from tvm import s_tir

from .._analysis import blocks_of, const_extents, loop_kinds
from .._knobs import Knob, Point
from .rows import RowsSpace


class BlockedAttentionSpace(RowsSpace):
    name = "cpu_attention"
    version = 2  # 2: tile_rows (register tiles in QKᵀ and PV)
    targets = ("llvm",)
    families = ("attention",)

    @classmethod
    def suits(cls, func, target, hints=None) -> bool:
        # Batch 1 only: with more sequences, placing the stages under a block of the fused (batch, head,
        # query) loop fails TVM's compute_at ("does not have compact dataflow"); the rows space takes them.
        return len(func.params[0].shape) == 4 and int(func.params[0].shape[0]) == 1

    @classmethod
    def matches(cls, func) -> bool:
        return _qk_block(s_tir.Schedule(func)) is not None

    def __init__(self, func, target, hints=None):
        super().__init__(func, target, hints)
        # Blocks within one head: a block across two heads, or past the last row, would give the stages
        # placed under it extents that depend on the block (not supported). The divisors of the query
        # length up to 64.
        queries = int(func.params[0].shape[-2])
        blocks = tuple(r for r in range(4, 65) if queries % r == 0) or (1,)
        self.knobs = [
            Knob("rows_per_task", blocks[-6:]),
            Knob("vector", (8, 16, 32)),
            Knob("rfactor", (True, False), ordered=False),
            Knob("unroll", (0, 16, 64)),
            Knob("transpose_k", (True, False), ordered=False),
            # rows of a register tile in the two GEMM stages: each K (or V) vector loaded once feeds
            # this many rows' accumulators, which stay in registers over the reduction (1: none)
            Knob("tile_rows", (1, 2, 4, 8)),
        ]

    def default(self) -> Point:
        blocks = self.knobs[0].choices
        rows = min(blocks, key=lambda r: abs(r - 32))
        return {"rows_per_task": rows, "vector": 16, "rfactor": True, "unroll": 16, "transpose_k": True,
                "tile_rows": next(t for t in (8, 4, 2, 1) if rows % t == 0)}

    def check(self, point: Point) -> str | None:
        if point["rows_per_task"] % point["tile_rows"]:
            return f"tile_rows={point['tile_rows']} does not divide rows_per_task={point['rows_per_task']}"
        return super().check(point)

    def schedule(self, sch: s_tir.Schedule, p: Point) -> None:
        super().schedule(sch, p)
        if p["tile_rows"] > 1:
            for block in (_qk_block(sch), blocks_of(sch)[-1]):  # QKᵀ and PV
                _register_tile(sch, block, p["tile_rows"])

    def _stages_at(self, p: Point, task, row):
        return task  # every stage over the whole block of rows

    def _before_vectorizing(self, sch: s_tir.Schedule, p: Point, task) -> None:
        if not p["transpose_k"]:
            return
        qk = _qk_block(sch)
        index = next(i for i, region in enumerate(sch.get(qk).reads) if region.source.name == "K")
        copy = sch.cache_read(qk, index, "global")
        sch.transform_layout(qk, ("read", index), lambda n, h, s, d: (n, h, d, s))
        sch.compute_at(copy, task, preserve_unit_loops=True)


def _register_tile(sch: s_tir.Schedule, block, rows: int) -> None:
    """Reorder a GEMM-shaped stage, whose loops below the task are (reduction, row, outer, vector), to
    (row / rows, outer, reduction, rows unrolled, vector): ``rows`` x vector accumulators that stay in
    registers over the reduction, the reduction's init hoisted out of it. Left as it is otherwise."""
    loops = sch.get_loops(block)[1:]  # below the parallel task loop
    kinds, extents = loop_kinds(sch, block)[1:], const_extents(sch, loops)
    shaped = [(lp, k) for lp, k, e in zip(loops, kinds, extents) if e > 1]
    if [k for _, k in shaped] != ["R", "S", "S", "S"]:
        return
    (reduction, _), (row, _), (outer, _), (vector, _) = shaped
    row_out, row_in = sch.split(row, [None, rows])
    sch.reorder(row_out, outer, reduction, row_in, vector)
    sch.unroll(row_in)
    sch.decompose_reduction(block, reduction)


def _qk_block(sch: s_tir.Schedule):
    """The block of QKᵀ: the one reading Q and K or its copy (None if the function has no such block)."""
    for block in blocks_of(sch):
        names = {region.source.name for region in sch.get(block).reads}
        if "Q" in names and ("K" in names or "K_global" in names):  # K_global: K's transposed copy
            return block
    return None
