"""torch's int4 weight-only recipe, for the quantized rows of ``generate_benchmark.py``: every decoder linear layer
(not the LM head, as our ``--quantize q4f16`` leaves it) with int4 weights in groups of 128 along K, an asymmetric
scale and zero per group, run by PyTorch's own int4 GEMM (``aten._weight_int4pack_mm``: the "tinygemm" kernel
that torchao's int4 weight-only quantization dispatches to on CUDA; its CPU twin ``_weight_int4pack_mm_for_cpu``
lets this file be checked without a GPU). The CUDA kernel takes bfloat16 activations only, so the quantized
model runs in bfloat16 (the same bytes as fp16)."""

from __future__ import annotations

import copy

import torch

GROUP = 128
INNER_K_TILES = 8  # the packing's K tiles per 8x8 core tile (2, 4 or 8; 8 for K a multiple of 1024)


def quantize_groups(weight, group: int = GROUP):
    """(codes int32 [n, k] in 0..15, scales_and_zeros [k / group, n, 2]) of ``weight`` [n, k]: per group, a scale
    (max - min) / 15 and a zero min + 8·scale, so that w ≈ (q − 8)·scale + zero (the kernel's dequantisation)."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // group, group)
    low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale = ((high - low) / 15).clamp(min=1e-6)
    codes = ((w - low) / scale).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    zero = low + 8 * scale
    scales_and_zeros = torch.cat([scale, zero], -1).transpose(0, 1).contiguous()  # [k / group, n, 2]
    return codes, scales_and_zeros


def dequantize(codes, scales_and_zeros, group: int = GROUP):
    """The weight [n, k] (float32) that ``codes`` and ``scales_and_zeros`` stand for."""
    n, k = codes.shape
    scale = scales_and_zeros[..., 0].transpose(0, 1).repeat_interleave(group, 1)
    zero = scales_and_zeros[..., 1].transpose(0, 1).repeat_interleave(group, 1)
    return (codes.float() - 8) * scale + zero


class Int4Linear(torch.nn.Module):
    """An ``nn.Linear`` whose weight is packed for ``_weight_int4pack_mm`` (its CPU twin on the CPU)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        weight = linear.weight.detach()
        self.out_features, self.in_features = weight.shape
        codes, scales_and_zeros = quantize_groups(weight)
        if weight.is_cuda:
            packed = torch.ops.aten._convert_weight_to_int4pack((codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8),
                                                                INNER_K_TILES)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, INNER_K_TILES)
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(weight.dtype))
        self.bias = linear.bias

    def forward(self, x):
        flat = x.reshape(-1, self.in_features)
        mm = torch.ops.aten._weight_int4pack_mm if flat.is_cuda else torch.ops.aten._weight_int4pack_mm_for_cpu
        out = mm(flat, self.packed, GROUP, self.scales_and_zeros).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias


def int4_weight_only(model):
    """A bfloat16 copy of ``model`` (a transformers causal LM) whose decoder linear layers run on int4 weights;
    the embedding and the LM head stay bfloat16."""
    quantized = copy.deepcopy(model).to(torch.bfloat16)
    for name, module in list(quantized.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(child, torch.nn.Linear) and "lm_head" not in full and child.in_features % GROUP == 0:
                setattr(module, child_name, Int4Linear(child))
    return quantized
