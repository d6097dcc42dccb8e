"""FP8 checkpoints (compressed-tensors, per-channel or per-tensor E4M3 weights) read without their library, as ``fp8``.

A compressed-tensors folder (``config.json`` with ``quantization_config.quant_method`` "compressed-tensors" and
``format`` "float-quantized", as llm-compressor writes its FP8 and FP8-dynamic models) stores each quantised
linear layer as ``weight`` float8_e4m3fn [N, K] and ``weight_scale`` [N, 1] (``strategy`` "channel") or [1]
("tensor"): a weight is ``weight_scale · weight``, which is ``fp8``'s layout (``dequant_gemm``'s ``fmt=e4m3``:
the codes' uint8 bits [N, K], one scale per output channel, a tensor's scale repeated), so a build runs the
checkpoint's own codes and scales. Its activation scheme (``input_activations``, an ``input_scale``) and an FP8
KV cache scheme are not applied: activations and the KV cache stay in the model's dtype in this weight-only form.

Refused in one line: other compressed-tensors formats and weight schemes (integers, groups, blocks), float8
E5M2 weights, scales not exact in the build's dtype, and transformers' block-wise FP8 format (``quant_method``
"fp8", one ``weight_scale_inv`` per block of ``weight_block_size``), whose scales differ along K within a row:
one scale per output channel cannot hold them.
"""

from __future__ import annotations

from pathlib import Path

from autosched.errors import UsageError

from .prequantized import load_prequantized, quant_config

# Deferred imports: torch (imported where used: `autosched --help` stays fast).

COMPRESSED_TENSORS = "compressed-tensors"
STRATEGIES = ("channel", "tensor")  # one scale per output channel, or one for the whole tensor


def fp8_config(folder: str | Path) -> dict | None:
    """The ``quantization_config`` of a compressed-tensors folder or a transformers block-wise FP8 one (to refuse
    it by name), or None for a folder that is neither."""
    return quant_config(folder, COMPRESSED_TENSORS) or quant_config(folder, "fp8")


def check_fp8_config(quant: dict) -> None:
    """A one-line UsageError for a ``quantization_config`` whose weights are not per-channel or per-tensor E4M3."""
    method = str(quant.get("quant_method", "")).lower()
    if method == "fp8":
        raise UsageError(
            f"block-wise FP8 checkpoints (quant_method \"fp8\", weight_block_size {quant.get('weight_block_size')}) are "
            "not supported: their scales differ along K within a row, which fp8's one scale per output channel "
            "cannot hold; per-channel or per-tensor FP8 checkpoints in compressed-tensors' format are read"
        )
    fmt = str(quant.get("format", "")).lower()
    if fmt != "float-quantized":
        raise UsageError(
            f"compressed-tensors format {fmt!r} is not supported: only \"float-quantized\" (FP8 weights) checkpoints "
            "are read"
        )
    for name, group in (quant.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        kind, bits = str(weights.get("type", "")).lower(), weights.get("num_bits")
        strategy = str(weights.get("strategy", "")).lower()
        if kind != "float" or bits != 8 or strategy not in STRATEGIES or not weights.get("symmetric", True) \
                or weights.get("dynamic"):
            raise UsageError(
                f"the compressed-tensors group {name!r} quantises weights as type={kind}, num_bits={bits}, "
                f"strategy={strategy}: only 8-bit float weights with one scale per channel or tensor "
                "(strategy channel or tensor) are read"
            )


def repack(weight, scale, dtype):
    """(codes uint8 [N, K], scales [N, 1]) in ``dequant_gemm``'s ``fmt=e4m3`` layout from one layer's float8 E4M3
    ``weight`` [N, K] and its ``weight_scale`` ([N, 1] or one for the tensor); a one-line UsageError for what that
    layout cannot hold exactly in ``dtype`` (a torch dtype)."""
    import torch

    if weight.dtype != torch.float8_e4m3fn:
        raise UsageError(
            f"an FP8 checkpoint's weight is {str(weight.dtype).replace('torch.', '')}: only float8_e4m3fn weights are read"
        )
    n = weight.shape[0]
    if scale.numel() not in (1, n):
        raise UsageError(
            f"an FP8 checkpoint's weight_scale has {scale.numel()} values for {n} output channels: only one per "
            "channel or one per tensor is read"
        )
    scales = scale.reshape(-1, 1).expand(n, 1).contiguous()
    if not torch.equal(scales.to(dtype).to(scales.dtype), scales):
        name = str(scales.dtype).replace("torch.", "")
        raise UsageError(
            f"the FP8 checkpoint's weight_scale ({name}) is not exact in {str(dtype).replace('torch.', '')}: build "
            f"with --dtype {name} or leave out --dtype"
        )
    return weight.view(torch.uint8), scales.to(dtype)


def load_fp8(folder: str | Path, dtype: str | None):
    """(transformers model holding the checkpoint's float tensors, the quantised projections as the decoder's
    parameters ``layers.<i>.<p>.qweight`` / ``.scales``) of a compressed-tensors FP8 folder."""
    import torch

    check_fp8_config(fp8_config(folder))

    def layer(state, prefix):
        scale = state[prefix + "weight_scale"]
        return repack(state[prefix + "weight"], scale, getattr(torch, dtype) if dtype else scale.dtype)

    return load_prequantized(
        folder, dtype, "FP8", layer, required=("weight", "weight_scale"), scales="weight_scale",
        parameters=("qweight", "scales"), kind="in float8 E4M3 with a weight_scale",
    )
