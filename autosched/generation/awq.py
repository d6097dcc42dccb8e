"""AWQ checkpoints (AutoAWQ's GEMM layout, 4-bit) read without their library, repacked for ``q4f16_zp`` (or ``q4f16``).

An AWQ folder (``config.json`` with ``quantization_config.quant_method`` "awq", ``version`` "gemm") stores each
quantised linear layer as ``qweight`` int32 [K, N / 8] (eight 4-bit codes along N, the output features, per
word, interleaved: the code of output ``8 w + AWQ_ORDER[j]`` at bits ``4 j``), ``qzeros`` int32 [K / group, N / 8]
packed the same way and ``scales`` [K / group, N]. A weight is ``scales[k // group, n] * (q[k, n] - zero[k // group,
n])``. AWQ's zero points are per group and output channel and usually not 8 (asymmetric): codes, scales and zero
points are repacked as they are into ``dequant_gemm``'s layout with zero points (``zeros=1``), and the checkpoint
builds as ``q4f16_zp``; one whose zero points are all 8 builds as ``q4f16`` (the kernels' fixed zero point).
"""

from __future__ import annotations

from pathlib import Path

from autosched.errors import UsageError

from .prequantized import check_bits_and_group, load_prequantized, quant_config, to_q4f16, unpack_int4

# AutoAWQ's packing order (awq/utils/packing_utils.py): bits 4 j of a word hold output 8 w + AWQ_ORDER[j].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def awq_config(folder: str | Path) -> dict | None:
    """The ``quantization_config`` of an AWQ folder, or None for a folder that is not one."""
    return quant_config(folder, "awq")


def unpack_awq(qweight, qzeros):
    """(codes [K, N], zero points [K / group, N]) of one AWQ GEMM layer's ``qweight`` and ``qzeros``."""
    return unpack_int4(qweight, 1, AWQ_ORDER), unpack_int4(qzeros, 1, AWQ_ORDER)


def repack(qweight, qzeros, scales):
    """(codes uint8 [N, K / 2], scales [N, K / group], zero points uint8 [N, K / group]) in ``dequant_gemm``'s
    layout from one AWQ GEMM layer's tensors."""
    codes, zeros = unpack_awq(qweight, qzeros)
    return to_q4f16(codes, zeros, scales)


def check_awq_config(quant: dict) -> int:
    """The group size of an AWQ ``quantization_config``; a one-line UsageError for what is not read."""
    version = str(quant.get("version", "gemm")).lower()
    if version != "gemm":
        raise UsageError(
            f"AWQ checkpoint version {version!r} is not supported: only AutoAWQ's GEMM layout (version \"gemm\") is read"
        )
    if not quant.get("zero_point", True):
        raise UsageError("AWQ checkpoint with zero_point false is not supported: only checkpoints with zero points are read")
    return check_bits_and_group(quant, "AWQ")


def load_awq(folder: str | Path, dtype: str | None):
    """(transformers model holding the checkpoint's float tensors, the quantised projections as the decoder's
    parameters ``layers.<i>.<p>.qweight`` / ``.scales`` / ``.zeros``, the group size) of an AWQ folder."""
    group = check_awq_config(awq_config(folder))
    hf, quantized = load_prequantized(
        folder, dtype, "AWQ", lambda state, prefix: repack(*(state[prefix + t] for t in ("qweight", "qzeros", "scales")))
    )
    return hf, quantized, group
