"""The decoder's norms, and the residual stream's add fused with the norm that reads it."""

from __future__ import annotations

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor

from ..linear import add_rms_norm, rms_norm


class RMSNorm(nn.RMSNorm):
    """TVM's RMSNorm module (its parameter names), computed by our ``rmsnorm`` at static shapes."""

    def forward(self, x: Tensor) -> Tensor:
        out = rms_norm(x, self.weight, self.epsilon)
        return out if out is not None else super().forward(x)


def make_norm(cfg, size: int | None = None) -> nn.Module:
    """``cfg``'s norm (RMSNorm, or LayerNorm) over ``size`` features (default: the hidden size)."""
    size = cfg.hidden if size is None else size
    if cfg.norm == "layer":
        return nn.LayerNorm(size, eps=cfg.norm_eps, dtype=cfg.dtype)
    return RMSNorm(size, -1, cfg.norm_eps, bias=False, dtype=cfg.dtype)


def add_norm(norm, x: Tensor, residual: Tensor | None) -> tuple[Tensor, Tensor]:
    """(``norm(x + residual)``, ``x + residual``): the residual stream's add and the norm that reads it, one
    ``add_rmsnorm`` kernel at static shapes. ``residual`` None: nothing to add; ``norm`` None: no norm (a model
    whose norms come after attention and MLP, not before)."""
    if norm is None:
        x = x + residual if residual is not None else x
        return x, x
    if residual is None:
        return norm(x), x
    if isinstance(norm, RMSNorm):
        fused = add_rms_norm(x, residual, norm.weight, norm.epsilon)
        if fused is not None:
            return fused
    x = x + residual
    return norm(x), x
