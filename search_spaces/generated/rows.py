"""The fused-rows family: kernels whose blocks all share leading "row" loops and reduce within a row.

RMSNorm and softmax (one row = one vector), attention (one row = one query of one head) and paged
decode attention (one row = one head of one sequence) have this shape, and so do the norm and softmax
chains that Relax fuses. On the CPU every stage of a group of rows is computed together while the rows
are hot in cache: the groups run in parallel, row reductions are vectorised through rfactor and
elementwise stages are vectorised directly. A row no vector divides ends in one guarded step, which
loop partitioning turns into a shorter vector, so any width keeps the strategy its point names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from autosched.tvm_adapter import LOOP_PARTITION, block_realize, set_block_predicate

from .._analysis import blocks_of, const_extents, is_reduction, iter_kinds, loop_kinds
from .._knobs import Knob, Point, Space

if TYPE_CHECKING:
    from tvm import s_tir

# Deferred imports: tvm (imported where used: `autosched --help` stays fast).


def row_depth(sch: s_tir.Schedule) -> int:
    """Number of leading row loops: the fewest spatial iterators among the reduction blocks (0: none)."""
    kinds = [iter_kinds(sch, b) for b in blocks_of(sch) if is_reduction(sch, b)]
    return min((k.count("S") for k in kinds), default=0)


@dataclass(frozen=True)
class RowTail:
    """The guard a reduction over a row no vector divides needs after ``rfactor``: the block ``name`` may
    only run where ``outer * vec + lane < extent``, with ``outer`` and ``lane`` the positions of those
    iterators among the block's own."""

    name: str
    outer: int
    lane: int
    vec: int
    extent: int


def guard_row_tail(sch: s_tir.Schedule, tail: RowTail) -> None:
    """Put the guard of ``tail`` back on its block, once the loops are final.

    ``rfactor`` over a guarded (non-dividing) split keeps the guard, but TVM 0.27's ``compute_at`` of the
    block it creates drops it, and the partial sums then read past the end of the row. This states the
    guard again in terms of the block's current iterator bindings.
    """
    from tvm import tirx

    block = sch.get_sblock(tail.name)
    realize = block_realize(sch, block)
    values, old = realize.iter_values, realize.predicate
    guard = values[tail.outer] * tail.vec + values[tail.lane] < tail.extent
    if not set_block_predicate(sch, block, guard if isinstance(old, tirx.IntImm) and old.value else old & guard):
        raise RuntimeError(f"block {tail.name} is not the only statement of its innermost loop")


def mark_tails_likely(sch: s_tir.Schedule) -> None:
    """Wrap each block's guard in ``likely``: ``s_tir.LoopPartition`` (see :meth:`RowsSpace.build_config`)
    then splits a row's last, partial vector step off, and the rest of the row runs as whole vectors
    instead of a loop LLVM scalarises because of the guard inside it."""
    from tvm import tirx

    for block in blocks_of(sch):
        predicate = block_realize(sch, block).predicate
        if not isinstance(predicate, tirx.IntImm):
            set_block_predicate(sch, block, tirx.likely(predicate))


def inline_spatial(sch: s_tir.Schedule, keep_row_stages: bool = True) -> None:
    """Inline every spatial block that is neither an output nor needed as a separate stage.

    With ``keep_row_stages``, a block over fewer loops than the output (a per-row value such as RMSNorm's
    1/rms) stays a stage: inlined, it would be recomputed for every element of the row. Injective
    kernels have no such values and inline everything: a reshape kept as a stage was a whole copy of its
    input, a kernel of its own on the GPU (RoPE after a Linear at 16 x 512 tokens, on the H200).
    """
    out_dims = len(sch.get(blocks_of(sch)[-1]).iter_vars)
    changed = True
    while changed:
        changed = False
        for block in blocks_of(sch)[:-1]:
            if is_reduction(sch, block) or (keep_row_stages and len(sch.get(block).iter_vars) < out_dims):
                continue
            try:
                sch.compute_inline(block)
                changed = True
            except RuntimeError:
                continue


class RowsSpace(Space):
    name = "rows"
    version = 2  # 2: rows no vector divides keep the rfactor and vector they name (were scalar before)
    targets = ("llvm",)
    families = ("rows", "attention", "paged_attention")

    @classmethod
    def matches(cls, func) -> bool:
        from tvm import s_tir

        sch = s_tir.Schedule(func)
        blocks = blocks_of(sch)
        return row_depth(sch) >= 1 and not is_reduction(sch, blocks[-1])

    def __init__(self, func, target, hints=None):
        super().__init__(func, target, hints)
        from tvm import s_tir

        sch = s_tir.Schedule(func)
        self.depth = row_depth(sch)
        out = blocks_of(sch)[-1]
        extents = const_extents(sch, sch.get_loops(out))
        self.rows = 1
        for e in extents[: self.depth]:
            self.rows *= e
        self.inner = extents[-1]
        threads = max(1, target.num_cores)
        rows_choices = tuple(r for r in (1, 2, 4, 8, 16, 32, 64) if r <= max(1, self.rows // threads) or r == 1)
        self.knobs = [
            Knob("rows_per_task", rows_choices),
            Knob("vector", (1, 4, 8, 16, 32)),
            Knob("rfactor", (True, False), ordered=False),
            Knob("unroll", (0, 16, 64)),
        ]

    def default(self) -> Point:
        return {"rows_per_task": 1, "vector": 16, "rfactor": True, "unroll": 16}

    def build_config(self, point: Point) -> dict:
        # A row no vector divides ends in a guarded vector step; partitioning splits that step off so the
        # rest of the row runs as whole vectors (otherwise LLVM gets the guarded loop and scalarises it).
        return dict(LOOP_PARTITION)

    def schedule(self, sch: s_tir.Schedule, p: Point) -> None:
        inline_spatial(sch)
        vec = p["vector"]
        tails = []
        if p["rfactor"] and vec > 1:
            for block in blocks_of(sch):
                tail = self._rfactor(sch, block, vec)
                if tail is not None:
                    tails.append(tail)
        blocks = blocks_of(sch)
        out = blocks[-1]
        loops = sch.get_loops(out)
        row = sch.fuse(*loops[: self.depth]) if self.depth > 1 else loops[0]
        r0, r1 = sch.split(row, [None, p["rows_per_task"]])
        sch.parallel(r0)
        at = self._stages_at(p, r0, r1)
        for block in reversed(blocks[:-1]):
            sch.compute_at(block, at, preserve_unit_loops=True)
        self._before_vectorizing(sch, p, r0)
        for block in blocks_of(sch):
            if vec > 1:
                self._vectorize_stage(sch, block, vec, skip=2 if at.same_as(r1) or block.same_as(out) else 1)
            if p["unroll"]:
                sch.annotate(block, "pragma_auto_unroll_max_step", p["unroll"])
                sch.annotate(block, "pragma_unroll_explicit", 1)
        for tail in tails:
            guard_row_tail(sch, tail)
        mark_tails_likely(sch)

    def _stages_at(self, p: Point, task, row):
        """The loop under which every stage but the last is computed: each row on its own."""
        return row

    def _before_vectorizing(self, sch: s_tir.Schedule, p: Point, task) -> None:
        """A hook for subclasses, after the stages are placed (e.g. layout caches at the task loop)."""

    def _rfactor(self, sch, block, vec: int) -> RowTail | None:
        """Split a pure row reduction (row loops, then one reduction loop) into ``vec`` partial sums
        that a vector register holds, followed by a short final reduction. Returns the guard the partial
        sums need where ``vec`` does not divide the row."""
        kinds = iter_kinds(sch, block)
        if kinds != "S" * self.depth + "R":
            return None
        loops = sch.get_loops(block)
        extent = const_extents(sch, loops[-1:])[0]
        if vec < 4 or extent < 2 * vec:
            return None
        _, lane = sch.split(loops[-1], [None, vec])
        rf = sch.rfactor(lane, factor_axis=self.depth)
        if extent % vec == 0:
            return None
        values = list(block_realize(sch, rf).iter_values)
        at = [[i for i, v in enumerate(values) if v.same_as(sch.get(loop).loop_var)] for loop in sch.get_loops(rf)[-2:]]
        if len(at[0]) != 1 or len(at[1]) != 1:
            raise RuntimeError("rfactor did not bind its block's iterators to the split loops")
        return RowTail(sch.get(rf).name_hint, at[0][0], at[1][0], vec, extent)

    def _vectorize_stage(self, sch, block, vec: int, skip: int = 2) -> None:
        """Vectorise the innermost spatial loop of a stage below the row loop, reductions moved outside
        (``skip``: the loops above the stage, the parallel row loop and, where placed per row, the row)."""
        loops = sch.get_loops(block)[skip:]
        kinds = loop_kinds(sch, block)[skip:]
        extents = const_extents(sch, loops)
        spatial = [lp for lp, k, e in zip(loops, kinds, extents) if k == "S" and e > 1]
        reduce = [lp for lp, k, e in zip(loops, kinds, extents) if k == "R" and e > 1]
        if not spatial:
            return
        sch.reorder(*reduce, *spatial)
        last = spatial[-1]
        if const_extents(sch, [last])[0] >= vec:
            _, lane = sch.split(last, [None, vec])
            sch.vectorize(lane)
