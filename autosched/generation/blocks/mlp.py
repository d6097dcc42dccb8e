"""The decoder's MLP: dense (gated or not), or a mixture of experts behind a router."""

from __future__ import annotations

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op

from ..linear import grouped_moe, grouped_moe_serves, moe_linear, swiglu
from .projections import Linear, projection


def activation(cfg, x: Tensor) -> Tensor:
    """``cfg``'s activation: SiLU, or GELU (exact, or its tanh form)."""
    if cfg.activation == "silu":
        return op.silu(x)
    return op.gelu(x, approximate="tanh" if cfg.activation == "gelu_tanh" else None)


class MLP(nn.Module):
    """``up`` (gate and up concatenated, gate rows first, where the MLP is gated), the activation, ``down``, of
    ``size`` intermediate features (default ``cfg.mlp``). ``hopper``: on sm_90, gate, up and SiLU·up as one
    kernel where it serves (:func:`..linear.swiglu`)."""

    def __init__(self, cfg, hopper: bool = False, size: int | None = None):
        self.cfg, self.hopper = cfg, hopper
        size = size or cfg.mlp
        self.up = projection(cfg, cfg.hidden, size * (2 if cfg.gated_mlp else 1), bias=cfg.dense_bias)
        self.down = projection(cfg, size, cfg.hidden, bias=cfg.dense_bias)

    def forward(self, x: Tensor) -> Tensor:
        cfg = self.cfg
        if cfg.gated_mlp and cfg.activation == "silu" and self.up.bias is None and not cfg.quantize:
            fused = swiglu(x, self.up.weight, self.hopper)
            if fused is not None:
                return self.down(fused)
        up = self.up(x)
        if cfg.gated_mlp:
            gate, up = op.split(up, 2, axis=-1)
            return self.down(activation(cfg, gate) * up)
        return self.down(activation(cfg, up))


class MoE(nn.Module):
    """A mixture of experts: the ``router``, the experts' gate and up projections stacked (``experts_up``,
    [experts, 2 x expert_mlp, hidden], gate rows first) and their down projections (``experts_down``); and where
    ``cfg.shared_expert_mlp`` asks, a ``shared`` expert every token goes through, its output scaled by
    sigmoid(``shared_gate``) (Qwen2-MoE)."""

    def __init__(self, cfg, hopper: bool = False):
        self.cfg, self.hopper = cfg, hopper
        self.router = Linear(cfg.hidden, cfg.experts, bias=False, dtype=cfg.dtype)
        self.experts_up = nn.Parameter((cfg.experts, 2 * cfg.expert_mlp, cfg.hidden), cfg.dtype)
        self.experts_down = nn.Parameter((cfg.experts, cfg.hidden, cfg.expert_mlp), cfg.dtype)
        if cfg.shared_expert_mlp:
            self.shared = MLP(cfg, hopper, cfg.shared_expert_mlp)
            self.shared_gate = Linear(cfg.hidden, 1, bias=False, dtype=cfg.dtype)

    def forward(self, x: Tensor) -> Tensor:
        """Router logits, softmax over the experts (in float32), the top k, their probabilities renormalised to
        sum to one where the model does (Mixtral always; Qwen3-MoE with norm_topk_prob). Each token is replicated
        k times, each row multiplied by its own expert's gate/up and down weights (``moe_gemm``; in a prefill
        chunk on sm_90, with the rows sorted by expert, grouped GEMMs: :func:`..linear.grouped_moe`), SwiGLU
        between, and the k rows summed with their weights."""
        cfg = self.cfg
        b, s, hidden = x.shape
        tokens, k = b * s, cfg.top_k
        flat = op.reshape(x, (tokens, hidden))
        logits = self.router(flat)
        probs = op.softmax(logits.astype("float32") if logits.dtype != "float32" else logits, axis=-1)
        weights, chosen = op.topk(probs, k=k, axis=-1, ret_type="both", largest=True, dtype="int32")
        if cfg.renorm_topk:
            weights = weights / op.sum(weights, axis=-1, keepdims=True)
        rows = tokens * k
        expert = op.reshape(chosen, (rows,))
        act = lambda t: activation(cfg, t)  # noqa: E731
        if grouped_moe_serves(rows, s, self.experts_up, self.experts_down, self.hopper):
            out = grouped_moe(flat, expert, k, self.experts_up, self.experts_down, act)
        else:
            replicated = op.reshape(op.broadcast_to(op.reshape(flat, (tokens, 1, hidden)), (tokens, k, hidden)),
                                    (rows, hidden))
            gate, up = op.split(moe_linear(replicated, expert, self.experts_up), 2, axis=-1)
            out = moe_linear(act(gate) * up, expert, self.experts_down)
        out = op.reshape(out, (tokens, k, hidden)) * op.reshape(weights.astype(cfg.dtype), (tokens, k, 1))
        out = op.reshape(op.sum(out, axis=1), (b, s, hidden))
        if cfg.shared_expert_mlp:
            out = out + self.shared(x) * op.sigmoid(self.shared_gate(x))
        return out
