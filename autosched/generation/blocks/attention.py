"""Self-attention over the paged KV cache: the fused q/k/v projection, q/k norms, the rotary embedding of a
frequency table where the model has one, then ``attention_with_fused_qkv`` (the cache appends K and V, rotates
them where its RoPE is on, and runs the attention kernels it was created with: :mod:`..attention`), and the
output projection."""

from __future__ import annotations

from dataclasses import dataclass, field

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache

from ..barrier import step_barrier
from .norms import make_norm
from .positions import rotate
from .projections import projection


class Attention(nn.Module):
    """``cfg``'s attention: ``qkv`` (q, k and v concatenated), ``q_norm``/``k_norm`` where the family norms them
    (per head, or over all heads at once), ``o``."""

    def __init__(self, cfg):
        self.cfg = cfg
        heads, kv_heads, head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.qkv = projection(cfg, cfg.hidden, (heads + 2 * kv_heads) * head_dim, bias=cfg.qkv_bias)
        if cfg.qk_norm_whole:
            self.q_norm, self.k_norm = make_norm(cfg, heads * head_dim), make_norm(cfg, kv_heads * head_dim)
        elif cfg.qk_norm:
            self.q_norm, self.k_norm = make_norm(cfg, head_dim), make_norm(cfg, head_dim)
        self.o = projection(cfg, heads * head_dim, cfg.hidden, bias=cfg.dense_bias)

    def forward(self, x: Tensor, cache: PagedKVCache, layer_id: int, rope=None, barrier_ids: Tensor | None = None):
        """``x`` attended over ``cache``'s layer ``layer_id``; ``rope``: (cos, sin) where the model rotates q and k
        itself; ``barrier_ids``: a decode step's token ids, the step barrier before the cache is first read."""
        cfg = self.cfg
        heads, kv_heads, head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        b, s, _ = x.shape
        qkv = self.qkv(x)
        if cfg.qk_norm_whole:  # each of q and k normed over all of its heads at once
            q, k, v = op.split(qkv, [heads * head_dim, (heads + kv_heads) * head_dim], axis=2)
            qkv = op.concat([self.q_norm(q), self.k_norm(k), v], dim=2)
        qkv = op.reshape(qkv, (b, s, heads + 2 * kv_heads, head_dim))
        if cfg.qk_norm and not cfg.qk_norm_whole:
            q, k, v = op.split(qkv, [heads, heads + kv_heads], axis=2)
            qkv = op.concat([self.q_norm(q), self.k_norm(k), v], dim=2)
        if rope is not None:
            qkv = rotate(cfg, qkv, *rope)
        if barrier_ids is not None:  # a decode step's first access to the cache: see barrier.py
            qkv = step_barrier(qkv, barrier_ids)
        attn = cache.attention_with_fused_qkv(layer_id, qkv, heads, sm_scale=cfg.attn_scale or head_dim ** -0.5)
        return self.o(op.reshape(attn, (b, s, heads * head_dim)))


@dataclass(frozen=True)
class CacheLayout:
    """Which cache each layer attends through. Windowed layers attend through a KV cache of their own whose
    layers are TVM's sliding layers (decode reads the last window of keys; a prefill call's cached keys are
    masked to the window per query, so a call of up to a window of tokens is exact anywhere), rotated by that
    cache at the window's theta; the others through the main cache. A model windowed on every layer has the one
    cache, windowed."""

    windowed: tuple[int, ...]  # the windowed layers
    local: dict[int, int] = field(default_factory=dict)  # a windowed layer -> its index in the window cache
    main: dict[int, int] = field(default_factory=dict)  # another layer -> its index in the main cache

    @classmethod
    def of(cls, cfg) -> CacheLayout:
        windowed = tuple(sorted(cfg.sliding_layers)) if cfg.sliding_window else ()
        two = 0 < len(windowed) < cfg.layers
        local = {layer: i for i, layer in enumerate(windowed)} if two else {}
        main = {layer: i for i, layer in enumerate(layer for layer in range(cfg.layers) if layer not in local)}
        return cls(windowed, local, main)

    @property
    def two_caches(self) -> bool:
        return bool(self.local)

    def attention_inputs(self, cfg, layer_id: int, caches: list, rope):
        """(the cache layer ``layer_id`` attends through, its index there, the rotation it applies itself): none
        where a windowed cache rotates q and k itself or the layer has no rotary embedding (NoPE); where layers have
        tables of their own (``rope`` a list), this layer's."""
        cache, index = (caches[1], self.local[layer_id]) if layer_id in self.local else (caches[0], self.main[layer_id])
        if layer_id in self.windowed or layer_id in cfg.nope_layers:  # rotated by its cache, or not at all
            rope = None
        if isinstance(rope, list):
            rope = rope[cfg.rope_scaling["layer_tables"][layer_id]]
        return cache, index, rope
