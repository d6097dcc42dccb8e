"""Structural analysis of TensorIR functions shared by the spaces: which blocks reduce, which loops
are spatial, and the normalisation of any contraction to C[S, I, J] += A[S, I, K] · B[S, J, K].

The normalisation and the inlining helpers are TVM's own (dlight), so that a Relax-produced kernel and
one of our workloads are seen the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tvm import s_tir
    from tvm.s_tir.schedule import SBlockRV
    from tvm.tirx import PrimFunc


def blocks_of(sch: s_tir.Schedule) -> list[SBlockRV]:
    return list(sch.get_child_blocks(sch.get_sblock("root", func_name="main")))


def iter_kinds(sch: s_tir.Schedule, block: SBlockRV) -> str:
    """One letter per block iterator: S (spatial), R (reduction), O (other)."""
    from tvm.tirx import IterVar

    kinds = {IterVar.DataPar: "S", IterVar.CommReduce: "R"}
    return "".join(kinds.get(int(iv.iter_type), "O") for iv in sch.get(block).iter_vars)


def loop_kinds(sch: s_tir.Schedule, block: SBlockRV) -> list[str]:
    """For each loop around ``block``: "R" if a reduction iterator is bound to it, "S" if only spatial
    ones are, "U" if none (a unit or outer loop of another block)."""
    from tvm import tirx
    from tvm.s_tir.dlight.analysis.common_analysis import get_sblockrealize

    realize = get_sblockrealize(sch, block)
    uses: dict[str, set[str]] = {}
    for iv, value in zip(realize.block.iter_vars, realize.iter_values):
        kind = "R" if int(iv.iter_type) == tirx.IterVar.CommReduce else "S"
        for var in tirx.analysis.undefined_vars(value):
            uses.setdefault(var.name, set()).add(kind)
    kinds = []
    for loop in sch.get_loops(block):
        used = uses.get(sch.get(loop).loop_var.name, set())
        kinds.append("R" if "R" in used else "S" if used else "U")
    return kinds


def is_reduction(sch: s_tir.Schedule, block: SBlockRV) -> bool:
    return "R" in iter_kinds(sch, block)


def const_extents(sch: s_tir.Schedule, loops) -> list[int]:
    from tvm import tirx

    out = []
    for loop in loops:
        extent = sch.get(loop).extent
        if not isinstance(extent, tirx.IntImm):
            raise ValueError("dynamic loop extents are not supported; give every shape as a number")
        out.append(int(extent))
    return out


def has_dynamic_shape(func: PrimFunc) -> bool:
    from tvm import tirx

    return any(not isinstance(dim, tirx.IntImm) for param in func.params for dim in (getattr(param, "shape", None) or ()))


@dataclass
class MatmulParts:
    """Blocks of a normalised contraction. ``main`` iterates (S, I, J, K)."""

    main: SBlockRV
    a_copy: SBlockRV  # A re-indexed to [S, I, K]
    b_copy: SBlockRV  # B re-indexed to [S, J, K]
    c_copy: SBlockRV  # the copy from the [S, I, J] accumulator back to the original output layout


def find_matmul_block(sch: s_tir.Schedule) -> SBlockRV | None:
    """The one contraction block of a function whose other blocks are all spatial, else None."""
    from tvm.s_tir.dlight.gpu.matmul import get_index_map

    blocks = blocks_of(sch)
    reductions = [b for b in blocks if is_reduction(sch, b)]
    if len(reductions) != 1:
        return None
    main = reductions[0]
    if len(sch.get(main).reads) < 2 or get_index_map(sch.get(main)) is None:
        return None
    return main


def normalize_matmul(sch: s_tir.Schedule, main: SBlockRV) -> MatmulParts:
    """Rewrite the contraction ``main`` to iterate (S, I, J, K) over re-indexed operands (dlight's Step 0)."""
    from tvm.s_tir.dlight.gpu.matmul import get_index_map

    a_copy = sch.reindex(main, ("read", 0))
    b_copy = sch.reindex(main, ("read", 1))
    c_copy = sch.reindex(main, ("write", 0))
    matmul_map, a_map, b_map, c_map = get_index_map(sch.get(main))
    sch.transform_layout(a_copy, ("write", 0), a_map)
    sch.transform_layout(b_copy, ("write", 0), b_map)
    sch.transform_layout(c_copy, ("read", 0), c_map)
    sch.transform_block_layout(main, matmul_map)
    return MatmulParts(main, a_copy, b_copy, c_copy)


def inline_producers(sch: s_tir.Schedule, block: SBlockRV) -> None:
    """Inline every spatial producer chain of ``block`` into it (e.g. a dequantisation, a cast)."""
    from tvm.s_tir.dlight.gpu.matmul import auto_inline_producers

    auto_inline_producers(sch, block)


def fold_consumer_chain(sch: s_tir.Schedule, block: SBlockRV) -> SBlockRV | None:
    """Inline the elementwise copies after ``block`` forward into the last consumer and return it.

    The last consumer (epilogue, un-padding or re-index copy) then becomes the write-back stage. We
    inline forward (compute_inline) rather than backward into a cache-write block: TVM 0.27's
    reverse_compute_inline drops the bounds of an un-padding copy and writes past the output.
    """
    consumers = sch.get_consumers(block)
    if not consumers:
        return None
    stage = consumers[0]
    while True:
        following = sch.get_consumers(stage)
        if len(following) != 1:
            return stage
        sch.compute_inline(stage)
        stage = following[0]


def spatial_producers(sch: s_tir.Schedule, block: SBlockRV) -> list[SBlockRV]:
    return [p for p in sch.get_producers(block) if not is_reduction(sch, p)]
