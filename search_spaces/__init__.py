"""Schedule spaces: for each operator family and target, the knobs and how to apply them.

Spaces are chosen by the structure of the TensorIR function, not by operator name, so that a kernel
fused by Relax finds the same space as the workload it resembles:

=========== =============================================================== =======================
family      structure                                                       examples
=========== =============================================================== =======================
matmul      one contraction block; other blocks elementwise                 gemm, dequant_gemm
rows        blocks share leading row loops and reduce within a row          rmsnorm, softmax,
                                                                            attention (CPU, b > 1)
attention   rows whose first stage reads Q and K (``cpu_attention``:       prefill attention
            blocks of query rows, K transposed)                             (CPU, b = 1)
injective   no reduction                                                    rope, casts, adds
moe_matmul  a contraction whose weight is picked per row by an index input  moe_gemm
moe_grouped the same, rows sorted by expert, each expert's row range given  moe_grouped_gemm
=========== =============================================================== =======================

``moe_gemm`` has spaces of its own (``moe_matmul`` on the CPU, ``gpu_moe_matmul`` on CUDA): the generic
matmul spaces tile B as shared by every row of a tile, which a weight gathered per row is not. ``moe_grouped_gemm``
(a prefill's routed rows sorted by expert) has ``moe_matmul`` on the CPU and on sm_90 ``moe_grouped_gemm``, a
grouped GEMM on tensor cores whose row tiles each share one expert's weight tiles.

A space may also decline a function for a target (``Space.suits``): ``hopper_gemm``,
``hopper_fp8_gemm``, ``hopper_dequant_gemm`` and ``hopper_attention``, the TIRx wgmma kernels, serve ``gemm``,
``fp8_gemm``, int4 ``dequant_gemm`` past sixteen rows and prefill ``attention`` on sm_90 only; older GPUs get the
WMMA and ``flash_attention`` spaces. The streaming decode GEMVs ``int4_gemv`` and ``gemv8`` (8-bit weights, int8 or
float8 E4M3, one scale per output channel) serve ``dequant_gemm``'s steps of up to eight rows on sm_90 (``int4_gemv``
up to sixteen on tensor cores, for fp16 in groups of 128 or more), and ``swiglu_gemv`` (gate, up and SiLU·up in one
streaming GEMV) ``swiglu_gemm``'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autosched.errors import SpaceError

from ._knobs import InvalidPoint, Knob, Point, Space, TileKnob, point_from_json, point_key

if TYPE_CHECKING:
    from tvm.tirx import PrimFunc

    from autosched.target import TargetSpec

# Deferred imports: tvm, numpy (imported where used: `autosched --help` stays fast).

__all__ = [
    "InvalidPoint",
    "Knob",
    "Point",
    "Space",
    "TileKnob",
    "create_space",
    "point_from_json",
    "point_key",
    "space_classes",
]


def space_classes() -> dict[str, type[Space]]:
    """Every space by name, in the order they are tried on an unknown function."""
    from .generated.cpu_attention import BlockedAttentionSpace
    from .generated.gpu_matmul import GpuGemvSpace, GpuMatmulSpace
    from .generated.gpu_moe_matmul import GpuMoeMatmulSpace
    from .generated.gpu_rows import GpuInjectiveSpace, GpuRowsSpace
    from .generated.injective import InjectiveSpace
    from .generated.matmul import MatmulSpace
    from .generated.moe_matmul import MoeMatmulSpace
    from .generated.rows import RowsSpace
    from .templates.gemv8 import Gemv8Space
    from .templates.gpu_attention import FlashAttentionSpace
    from .templates.hopper_attention import HopperAttentionSpace
    from .templates.hopper_dequant import HopperDequantGemmSpace
    from .templates.hopper_gemm import HopperFp8GemmSpace, HopperGemmSpace
    from .templates.int4_gemv import Int4GemvSpace
    from .templates.moe_grouped_gemm import MoeGroupedGemmSpace
    from .templates.paged_decode import PagedDecodeSpace
    from .templates.swiglu_gemv import SwigluGemvSpace

    ordered = (MatmulSpace, MoeMatmulSpace, BlockedAttentionSpace, RowsSpace, InjectiveSpace,  # CPU
               SwigluGemvSpace, HopperGemmSpace, HopperFp8GemmSpace, HopperAttentionSpace, Int4GemvSpace, Gemv8Space,
               HopperDequantGemmSpace, PagedDecodeSpace, MoeGroupedGemmSpace,
               # (CUDA, sm_90: each declines other targets)
               FlashAttentionSpace, GpuMoeMatmulSpace, GpuGemvSpace, GpuMatmulSpace, GpuRowsSpace, GpuInjectiveSpace)  # CUDA
    return {cls.name: cls for cls in ordered}


def create_space(func: PrimFunc, target: TargetSpec, family: str | None = None,
                 hints: dict | None = None) -> Space:
    """The space for ``func`` on ``target``: the one serving ``family`` (an operator's declared family),
    else the first whose structural test matches the function. ``hints`` are the workload's attributes
    (e.g. ``causal``), which template spaces need.

    Raises:
        SpaceError: if no space applies.
    """
    from ._analysis import has_dynamic_shape

    if has_dynamic_shape(func):
        raise SpaceError("the function has symbolic shapes; autosched tunes static shapes only")
    candidates = [cls for cls in space_classes().values()
                  if target.kind in cls.targets and (family is None or family in cls.families)
                  and cls.suits(func, target, hints)]
    for cls in candidates:
        if cls.matches(func):
            return cls(func, target, hints)
    if family is not None and candidates:
        # The operator declares its family; its first space applies even where no structural test does.
        return candidates[0](func, target, hints)
    which = f"family '{family}'" if family else "this function's structure"
    raise SpaceError(f"no schedule space for {which} on target {target.kind}")
