"""A Llama-style decoder in plain PyTorch with random weights (nothing is downloaded).

RMSNorm, rotary position embedding, grouped-query attention and a SwiGLU MLP, as in Llama 2/3. The
factories at the bottom are what ``autosched tune-model`` / ``build`` accept by name:

- ``tiny-llama``: 2 layers, hidden 128, small enough to tune on a CPU in CI;
- ``small-llama``: 2 layers, hidden 512 (grouped-query, 8 heads, 4 KV heads), for CPU benchmarks;
- ``llama-7b-layers``: 2 layers with Llama-2-7B dimensions (hidden 4096, 32 heads, MLP 11008), for a GPU;
- ``llama3-8b-layers``: 2 layers with Llama-3-8B dimensions (8 KV heads, MLP 14336).

Each factory returns ``(model, example_inputs)``; the input is a batch of token embeddings
``[batch, tokens, hidden]`` so that the exported graph is the decoder itself (no embedding gather).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class LlamaConfig:
    hidden: int
    heads: int
    kv_heads: int
    mlp: int
    layers: int
    rope_theta: float = 10000.0
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def rope_tables(tokens: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.arange(tokens, dtype=torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.q = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=False)
        self.k = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        c = self.cfg
        q = self.q(x).view(b, t, c.heads, c.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, c.kv_heads, c.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, c.kv_heads, c.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        group = c.heads // c.kv_heads
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, t, c.heads * c.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.hidden, cfg.mlp, bias=False)
        self.up = nn.Linear(cfg.hidden, cfg.mlp, bias=False)
        self.down = nn.Linear(cfg.mlp, cfg.hidden, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.hidden, eps=cfg.eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.hidden, eps=cfg.eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class LlamaDecoder(nn.Module):
    """Decoder layers and the final norm over token embeddings of a fixed length."""

    def __init__(self, cfg: LlamaConfig, tokens: int):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden, eps=cfg.eps)
        cos, sin = rope_tables(tokens, cfg.head_dim, cfg.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        return self.norm(x)


def _build(cfg: LlamaConfig, batch: int, tokens: int, dtype: torch.dtype, seed: int = 0):
    torch.manual_seed(seed)
    model = LlamaDecoder(cfg, tokens).eval()
    for p in model.parameters():
        # Small weights keep activations O(1) through the layers in half precision too.
        nn.init.normal_(p, std=0.02) if p.dim() > 1 else nn.init.ones_(p)
    model = model.to(dtype)
    return model, (torch.randn(batch, tokens, cfg.hidden).to(dtype),)


TINY = LlamaConfig(hidden=128, heads=4, kv_heads=2, mlp=256, layers=2)
SMALL = LlamaConfig(hidden=512, heads=8, kv_heads=4, mlp=1376, layers=2)
LLAMA2_7B = LlamaConfig(hidden=4096, heads=32, kv_heads=32, mlp=11008, layers=2)
LLAMA3_8B = LlamaConfig(hidden=4096, heads=32, kv_heads=8, mlp=14336, layers=2, rope_theta=500000.0)


def tiny_llama(batch: int = 1, tokens: int = 32, dtype: torch.dtype = torch.float32):
    return _build(TINY, batch, tokens, dtype)


def small_llama(batch: int = 1, tokens: int = 128, dtype: torch.dtype = torch.float32):
    return _build(SMALL, batch, tokens, dtype)


def llama_7b_layers(batch: int = 1, tokens: int = 512, dtype: torch.dtype = torch.float16):
    return _build(LLAMA2_7B, batch, tokens, dtype)


def llama3_8b_layers(batch: int = 1, tokens: int = 512, dtype: torch.dtype = torch.float16):
    return _build(LLAMA3_8B, batch, tokens, dtype)


MODELS = {"tiny-llama": tiny_llama, "small-llama": small_llama, "llama-7b-layers": llama_7b_layers,
          "llama3-8b-layers": llama3_8b_layers}
