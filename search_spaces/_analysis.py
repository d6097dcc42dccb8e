"""Structural analysis of TensorIR functions shared by the spaces: which blocks reduce, which loops
are spatial, and the normalisation of any contraction to C[S, I, J] += A[S, I, K] · B[S, J, K].

The normalisation and the inlining helpers are TVM's own (dlight), so that a Relax-produced kernel and
one of our workloads are seen the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from autosched.tvm_adapter import block_realize, is_one

if TYPE_CHECKING:
    from tvm import s_tir
    from tvm.s_tir.schedule import SBlockRV
    from tvm.tirx import PrimFunc

# Deferred imports: tvm (imported where used: `autosched --help` stays fast).


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

    realize = block_realize(sch, block)
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


def matmul_index_maps(block):
    """dlight's index maps to C[S, I, J] += A[S, I, K] · B[S, J, K], also for GEMV and other contractions
    with a unit I, J or K axis, which dlight's own detection refuses (it wants all three non-unit)."""
    from tvm.s_tir.dlight.gpu import matmul as dm

    if len(block.reads) != 2 or len(block.writes) != 1:
        return None

    def axes(region):
        out = set()
        for r in region:
            if not is_one(r.extent):
                return None
            out |= set(v.name for v in _free_vars(r.min))
        return out

    a_axes, b_axes, c_axes = axes(block.reads[0].region), axes(block.reads[1].region), axes(block.writes[0].region)
    if a_axes is None or b_axes is None or c_axes is None:
        return None
    traits = []
    for iv in block.iter_vars:
        name, extent = iv.var.name, iv.dom.extent
        if is_one(extent):
            kind = dm.IterKind.kIter_T
        elif int(iv.iter_type) == 0:  # data parallel
            kind = {(True, True, True): dm.IterKind.kIter_S, (True, False, True): dm.IterKind.kIter_I,
                    (False, True, True): dm.IterKind.kIter_J}.get((name in a_axes, name in b_axes, name in c_axes))
        else:
            kind = dm.IterKind.kIter_K if name in a_axes and name in b_axes and name not in c_axes else None
        if kind is None:
            return None
        traits.append((iv, dm.IterTrait(kind, extent)))
    if not any(t.kind == dm.IterKind.kIter_K for _, t in traits):
        return None

    def fused(selected, order):
        return dm.make_iter_fusion_index_map([t for _, t in selected], order)

    S, I, J, K = dm.IterKind.kIter_S, dm.IterKind.kIter_I, dm.IterKind.kIter_J, dm.IterKind.kIter_K
    on = lambda names: [(iv, t) for iv, t in traits if iv.var.name in names]  # noqa: E731
    return (fused(traits, [S, I, J, K]), fused(on(a_axes), [S, I, K]), fused(on(b_axes), [S, J, K]),
            fused(on(c_axes), [S, I, J]))


def reads_b_along_k(sch: s_tir.Schedule, main: SBlockRV) -> bool:
    """Whether a contraction's second operand B has the reduction as its innermost axis (B[n, k], as
    torch.nn.Linear stores weights) rather than an output column (B[k, n]). Read before normalising."""
    block = sch.get(main)
    reduction = {iv.var.name for iv in block.iter_vars if int(iv.iter_type) == 2}
    return bool({v.name for v in _free_vars(block.reads[1].region[-1].min)} & reduction)


def _free_vars(expr):
    from tvm import tirx

    return tirx.analysis.undefined_vars(expr)


def find_matmul_block(sch: s_tir.Schedule) -> SBlockRV | None:
    """The one contraction block of a function whose other blocks are all spatial, else None."""
    blocks = blocks_of(sch)
    reductions = [b for b in blocks if is_reduction(sch, b)]
    if len(reductions) != 1:
        return None
    main = reductions[0]
    if matmul_index_maps(sch.get(main)) is None:
        return None
    return main


def normalize_matmul(sch: s_tir.Schedule, main: SBlockRV) -> MatmulParts:
    """Rewrite the contraction ``main`` to iterate (S, I, J, K) over re-indexed operands (dlight's Step 0)."""
    a_copy = sch.reindex(main, ("read", 0))
    b_copy = sch.reindex(main, ("read", 1))
    c_copy = sch.reindex(main, ("write", 0))
    matmul_map, a_map, b_map, c_map = matmul_index_maps(sch.get(main))
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


# ---- structural tests that pick a space for a function of unknown origin -------------------------
def is_contraction(func: PrimFunc) -> bool:
    """One matrix-product block, every other block elementwise."""
    from tvm import s_tir

    return find_matmul_block(s_tir.Schedule(func)) is not None


def is_injective(func: PrimFunc) -> bool:
    """No reduction at all."""
    from tvm import s_tir

    sch = s_tir.Schedule(func)
    return not any(is_reduction(sch, b) for b in blocks_of(sch))


# ---- limits of TVM 0.27's CUDA code generator ------------------------------------------------------
# It emits invalid code for arithmetic on 8-wide half vectors (a uint4 built with make_uint4 of 8
# arguments; nvcc: "too many arguments in function call"), seen on the H200.
HALF8_REASON = "8-wide half-precision vector arithmetic miscompiles in TVM 0.27's CUDA code generator"


def has_half(func: PrimFunc) -> bool:
    """Any fp16 or bf16 parameter."""
    return any(str(p.dtype) in ("float16", "bfloat16") for p in func.params)


def operand_shapes(func: PrimFunc, counts: tuple[int, ...]):
    """((a, b, c), their shapes) for a template: ``func``'s first, second and last parameters (the operand,
    the weights and the output of a GEMM-like kernel) and their static 2-D shapes, if ``func`` takes one of
    ``counts`` parameters and those shapes are static and 2-D; else None."""
    params = list(func.params)
    if len(params) not in counts:
        return None
    picked = (params[0], params[1], params[-1])
    try:
        shapes = [tuple(int(x) for x in buf.shape) for buf in picked]
    except (AttributeError, TypeError, ValueError):
        return None
    return (picked, shapes) if all(len(shape) == 2 for shape in shapes) else None
