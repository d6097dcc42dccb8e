"""A layer whose attention and MLP read the same input side by side, their outputs added to it together:
``x + attn(norm_1(x)) + mlp(norm_2(x))`` (GPT-NeoX and Pythia with ``use_parallel_residual``), or with one norm
for both, ``x + attn(norm(x)) + mlp(norm(x))`` (StableLM with ``use_parallel_residual``)."""

from __future__ import annotations

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor

from .attention import Attention, CacheLayout
from .mlp import MLP, MoE
from .norms import add_norm, make_norm


class ParallelDecoderLayer(nn.Module):
    """Attention and MLP in parallel, each behind a norm of its own (``cfg.parallel_block`` "two_norms") or both
    behind one ("one_norm"). As :class:`.decoder.DecoderLayer`, the sum of their outputs is added to the residual
    stream by the next layer's first norm."""

    def __init__(self, cfg, layout: CacheLayout, sparse: bool = False, hopper: bool = False):
        self.cfg, self.layout = cfg, layout
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg)
        if cfg.parallel_block == "two_norms":
            self.mlp_norm = make_norm(cfg)
        self.mlp = MoE(cfg, hopper) if sparse else MLP(cfg, hopper)

    def forward(self, x: Tensor, pending: Tensor | None, caches: list, layer_id: int, rope=None,
                barrier_ids: Tensor | None = None):
        cache, index, rope = self.layout.attention_inputs(self.cfg, layer_id, caches, rope)
        h, x = add_norm(self.attn_norm, x, pending)
        out = self.attn(h, cache, index, rope, barrier_ids)
        return x, out + self.mlp(self.mlp_norm(x) if self.cfg.parallel_block == "two_norms" else h)
