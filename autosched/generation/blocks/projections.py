"""The decoder's linear layers: float weights (:class:`Linear`) or quantised ones (:class:`QuantLinear`), each
product our tuned kernel at static shapes (:mod:`..linear`)."""

from __future__ import annotations

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor

from ..linear import linear, quant_linear
from ..quantize import group_size
from ..quantize import scheme as quant_scheme


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters) whose product is our ``gemm`` at static shapes (:mod:`..linear`)."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


class QuantLinear(nn.Module):
    """A linear layer of weights quantised by scheme ``quantize``: codes, scales (and a scheme's zero points) as
    ``dequant_gemm`` reads them (:mod:`..quantize`), its product our ``dequant_gemm`` at static shapes
    (:func:`..linear.quant_linear`)."""

    def __init__(self, in_features: int, out_features: int, quantize: str, bias: bool, dtype: str):
        s = quant_scheme(quantize)
        self.bits, self.group, self.k, self.fmt = s.bits, group_size(quantize, in_features), in_features, s.fmt
        packed = in_features // 2 if self.bits == 4 else in_features
        integers = self.bits == 8 and self.fmt == "int"  # int8 codes; int4 pairs and E4M3 bits are uint8
        self.qweight = nn.Parameter((out_features, packed), "int8" if integers else "uint8")
        self.scales = nn.Parameter((out_features, in_features // self.group), dtype)
        self.zeros = nn.Parameter((out_features, in_features // self.group), "uint8") if s.zeros else None
        self.bias = nn.Parameter((out_features,), dtype) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return quant_linear(x, self.qweight, self.scales, self.bias, self.bits, self.group, self.k, self.zeros,
                            self.fmt)


def projection(cfg, in_features: int, out_features: int, bias: bool) -> nn.Module:
    """A decoder layer's projection: quantised where ``cfg.quantize`` asks (the router, the embeddings and the LM
    head stay in the model's dtype: they are :class:`Linear` always)."""
    if cfg.quantize:
        return QuantLinear(in_features, out_features, cfg.quantize, bias, cfg.dtype)
    return Linear(in_features, out_features, bias=bias, dtype=cfg.dtype)
