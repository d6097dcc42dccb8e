"""The injective family: elementwise and data-movement kernels (RoPE, casts, residual adds, transposes).

All producers are inlined into the output block; its loops are fused, the innermost chunk vectorised
and the rest run in parallel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._analysis import blocks_of, const_extents, is_injective
from .._knobs import Knob, Point, Space
from .rows import inline_spatial

if TYPE_CHECKING:
    from tvm import s_tir


class InjectiveSpace(Space):
    name = "injective"
    version = 2  # 2: reshapes are inlined (they were stages: a whole copy, a kernel of their own on the GPU)
    targets = ("llvm",)
    families = ("injective",)

    @classmethod
    def matches(cls, func) -> bool:
        return is_injective(func)

    def __init__(self, func, target, hints=None):
        super().__init__(func, target, hints)
        self.knobs = [
            Knob("vector", (1, 4, 8, 16, 32, 64)),
            Knob("chunk", (1, 2, 4, 8, 16, 64)),
            Knob("unroll", (0, 16, 64)),
        ]

    def default(self) -> Point:
        return {"vector": 16, "chunk": 4, "unroll": 0}

    def schedule(self, sch: s_tir.Schedule, p: Point) -> None:
        inline_spatial(sch, keep_row_stages=False)
        for block in blocks_of(sch):
            loops = sch.get_loops(block)
            fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
            total = const_extents(sch, [fused])[0]
            vec = p["vector"] if p["vector"] <= total else 1
            outer, chunk, lane = sch.split(fused, [None, p["chunk"], vec])
            sch.parallel(outer)
            if vec > 1:
                sch.vectorize(lane)
            if p["unroll"]:
                sch.annotate(block, "pragma_auto_unroll_max_step", p["unroll"])
                sch.annotate(block, "pragma_unroll_explicit", 1)
