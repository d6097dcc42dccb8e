"""GPTQ checkpoints (4-bit, ``desc_act`` false) read without their library, repacked for ``q4f16`` or ``q4f16_zp``.

A GPTQ folder (``config.json`` with ``quantization_config.quant_method`` "gptq") stores each quantised linear
layer as ``qweight`` int32 [K / 8, N] (eight 4-bit codes along K per word, the lowest bits first), ``qzeros``
int32 [K / group, N / 8] (eight zero points along N per word, stored one less than they are in the original
"gptq" format), ``scales`` [K / group, N] and ``g_idx`` [K] (the group of each input feature). A weight is
``scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n])``: ``dequant_gemm``'s int4 layout with zero points once
transposed (codes [N, K / 2], low nibble first; scales and uint8 zero points [N, K / group]), so a build runs the
checkpoint's own weights, not a re-quantisation of them. With symmetric quantisation every zero point is 8 and
the checkpoint builds as ``q4f16`` (the kernels' fixed zero point); with ``sym: false`` as ``q4f16_zp``. The
"gptq" format's zero points are read as its library reads them, the 4-bit field plus one: 1 to 16 (a zero point
of 0 was stored as -1, whose field reads 15, so it comes back as 16, as in the library's own kernels).
Activation order (a ``g_idx`` other than k // group) and other bit widths are refused in one line.
"""

from __future__ import annotations

from pathlib import Path

from autosched.errors import UsageError

from .prequantized import check_bits_and_group, load_prequantized, quant_config, to_q4f16, unpack_int4

# Deferred imports: torch (imported where used: `autosched --help` stays fast).


def gptq_config(folder: str | Path) -> dict | None:
    """The ``quantization_config`` of a GPTQ folder, or None for a folder that is not one."""
    return quant_config(folder, "gptq")


def repack(qweight, qzeros, scales, g_idx, group: int, zero_offset: int):
    """(codes uint8 [N, K / 2], scales [N, K / group], zero points uint8 [N, K / group]) in ``dequant_gemm``'s
    layout from one GPTQ layer's tensors; a one-line UsageError for what that layout cannot hold."""
    import torch

    codes = unpack_int4(qweight, 0)  # [K, N]
    k = codes.shape[0]
    if g_idx is not None and not torch.equal(g_idx.to(torch.int64), torch.arange(k) // group):
        raise UsageError(
            "this GPTQ checkpoint reorders its groups (desc_act / activation order): only desc_act=false "
            "checkpoints are supported"
        )
    zeros = unpack_int4(qzeros, 1) + zero_offset
    return to_q4f16(codes, zeros, scales)


def load_gptq(folder: str | Path, dtype: str | None):
    """(transformers model holding the checkpoint's float tensors, the quantised projections as the decoder's
    parameters ``layers.<i>.<p>.qweight`` / ``.scales`` / ``.zeros``, the group size) of a GPTQ folder."""
    quant = gptq_config(folder)
    group = check_bits_and_group(quant, "GPTQ")
    if quant.get("desc_act"):
        raise UsageError("this GPTQ checkpoint has desc_act=true: only desc_act=false checkpoints are supported")
    fmt = str(quant.get("checkpoint_format", quant.get("format", "gptq"))).lower()
    zero_offset = 1 if fmt == "gptq" else 0  # "gptq" (v1) stores each zero point one less

    def layer(state, prefix):
        return repack(
            state[prefix + "qweight"], state[prefix + "qzeros"], state[prefix + "scales"], state.get(prefix + "g_idx"),
            group, zero_offset,
        )

    hf, quantized = load_prequantized(folder, dtype, "GPTQ", layer)
    return hf, quantized, group
