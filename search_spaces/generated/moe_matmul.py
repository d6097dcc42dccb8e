"""The mixture-of-experts GEMM (``moe_gemm``) on the CPU: Y[i, j] = Σ_k X[i, k] · W[expert[i], j, k].

Each row reads its own expert's weight through the gathered index, so the contraction is not the
matmul family's (B is indexed by data): no packing of B, no row tiles sharing a B tile. The schedule
tiles the output columns and the reduction, runs the rows and column blocks in parallel and vectorises
an inner column tile. CUDA's space is ``gpu_moe_matmul``.

It serves ``moe_grouped_gemm`` (rows sorted by expert, the experts' row offsets as input) as well: the same
product block, its expert index computed per row from the offsets by a small block before it, which stays
as built. On sm_90 that workload has the tensor-core grouped GEMM (``templates/moe_grouped_gemm.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._analysis import const_extents
from .._knobs import Knob, Point, Space

if TYPE_CHECKING:
    from tvm import s_tir

# Deferred imports: tvm (imported where used: `autosched --help` stays fast).

BLOCK = "moe_matmul"


def _divisors(extent: int, cap: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, min(extent, cap) + 1) if extent % d == 0)


class MoeMatmulSpace(Space):
    """Column and reduction tiles, parallel rows x column blocks, a vectorised inner column tile."""

    name = "moe_matmul"
    version = 1
    targets = ("llvm",)
    families = ("moe_matmul", "moe_grouped")

    @classmethod
    def matches(cls, func) -> bool:
        from tvm import s_tir

        try:
            s_tir.Schedule(func).get_sblock(BLOCK)
        except (RuntimeError, ValueError):
            return False
        return True

    def __init__(self, func, target, hints=None):
        super().__init__(func, target, hints)
        from tvm import s_tir

        sch = s_tir.Schedule(func)
        try:
            main = sch.get_sblock(BLOCK)
        except (RuntimeError, ValueError) as exc:
            raise ValueError("moe_matmul takes moe_gemm functions only") from exc
        self.extent_i, self.extent_j, self.extent_k = const_extents(sch, sch.get_loops(main))
        self.knobs = [
            Knob("tile_j", _divisors(self.extent_j, 256)),
            Knob("vector_j", (1, 4, 8, 16)),
            Knob("tile_k", _divisors(self.extent_k, 512)),
            Knob("unroll", (0, 16, 64, 256)),
        ]

    def check(self, p: Point) -> str | None:
        if p["tile_j"] % p["vector_j"]:
            return f"vector tile {p['vector_j']} does not divide the column tile {p['tile_j']}"
        return None

    def default(self) -> Point:
        def near(knob_name, wanted):
            knob = next(k for k in self.knobs if k.name == knob_name)
            return min(knob.choices, key=lambda c: abs(c - wanted))

        point = {"tile_j": near("tile_j", 64), "tile_k": near("tile_k", 64), "unroll": 16}
        point["vector_j"] = max(v for v in (1, 4, 8, 16) if point["tile_j"] % v == 0)
        return point if self.check(point) is None else super().default()

    def schedule(self, sch: s_tir.Schedule, p: Point) -> None:
        main = sch.get_sblock(BLOCK)
        i, j, k = sch.get_loops(main)
        j0, j1, j2 = sch.split(j, [None, p["tile_j"] // p["vector_j"], p["vector_j"]])
        k0, k1 = sch.split(k, [None, p["tile_k"]])
        sch.reorder(i, j0, k0, j1, k1, j2)
        sch.parallel(sch.fuse(i, j0))
        if p["vector_j"] > 1:
            sch.vectorize(j2)
        if p["unroll"]:
            sch.annotate(main, "pragma_auto_unroll_max_step", p["unroll"])
            sch.annotate(main, "pragma_unroll_explicit", 1)
        sch.decompose_reduction(main, k0)
        try:
            epilogue = sch.get_sblock("epilogue")  # the cast to a half-precision output
        except (RuntimeError, ValueError):
            return
        sch.parallel(sch.get_loops(epilogue)[0])
