"""The decoder layer and the model: the functions a generation runtime calls (``batch_prefill``,
``batch_decode``, ``greedy_tokens``, ``sample_tokens``, ``create_paged_kv_cache``), as MLC-LLM's models export
them, and the KV caches they read (one, or a second for the windowed layers of a model whose other layers attend
over all tokens)."""

from __future__ import annotations

import contextlib

from tvm import tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache

from autosched.tvm_adapter import suffixed_functions, tir_paged_kv_cache

from ..attention import WINDOW_SUFFIX
from ..barrier import step_barrier
from ..linear import linear
from ..sampler import greedy_kernel, sample_kernel
from .attention import Attention, CacheLayout
from .mlp import MLP, MoE
from .norms import add_norm, make_norm
from .parallel import ParallelDecoderLayer
from .positions import TableRotary, gather, table_rope
from .projections import Linear


class DecoderLayer(nn.Module):
    """A layer as most families have it: norm, attention, (norm), add; norm, MLP or experts, (norm), add. The
    MLP's output is added to the residual stream by the next layer's first norm, in one kernel."""

    def __init__(self, cfg, layout: CacheLayout, sparse: bool = False, hopper: bool = False):
        self.cfg, self.layout = cfg, layout
        if cfg.pre_norms:
            self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg)
        if cfg.post_norms:
            self.attn_post_norm = make_norm(cfg)
        if cfg.pre_norms:
            self.mlp_norm = make_norm(cfg)
        if cfg.post_norms:
            self.mlp_post_norm = make_norm(cfg)
        self.mlp = MoE(cfg, hopper) if sparse else MLP(cfg, hopper)

    def forward(self, x: Tensor, pending: Tensor | None, caches: list, layer_id: int, rope=None,
                barrier_ids: Tensor | None = None):
        """(the residual stream, this layer's MLP output): the output is added by the next norm, in the same
        kernel (``pending``: the previous layer's, None before the first layer)."""
        cfg = self.cfg
        cache, index, rope = self.layout.attention_inputs(cfg, layer_id, caches, rope)
        h, x = add_norm(self.attn_norm if cfg.pre_norms else None, x, pending)
        out = self.attn(h, cache, index, rope, barrier_ids)
        post = self.attn_post_norm(out) if cfg.post_norms else out
        h, x = add_norm(self.mlp_norm if cfg.pre_norms else None, x, post)
        out = self.mlp(h)
        return x, (self.mlp_post_norm(out) if cfg.post_norms else out)


class Decoder(nn.Module):
    """The model of ``cfg`` for ``target`` (its KV cache's and sampler's kernels are generated for it):
    embeddings, the layers, the final norm and the LM head (or the embedding table, tied)."""

    def __init__(self, cfg, target, hopper: bool = False):
        self.cfg, self.target = cfg, target
        self.layout = CacheLayout.of(cfg)
        self.rotary = TableRotary(cfg) if table_rope(cfg) else None
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden, dtype=cfg.dtype)
        if cfg.learned_positions:
            self.positions = nn.Embedding(cfg.learned_positions, cfg.hidden, dtype=cfg.dtype)
        layer = ParallelDecoderLayer if cfg.parallel_block else DecoderLayer
        self.layers = nn.ModuleList([layer(cfg, self.layout, i in cfg.sparse_layers, hopper) for i in range(cfg.layers)])
        self.norm = make_norm(cfg)
        if not cfg.tied_embeddings:
            self.lm_head = Linear(cfg.hidden, cfg.vocab, bias=False, dtype=cfg.dtype)

    def forward(self, x: Tensor, caches: list, last: Tensor | None = None, barrier_ids: Tensor | None = None):
        """The layers over ``x``; ``barrier_ids`` (a decode step's token ids): the step barrier goes before the
        first access to the cache (barrier.py), after the first layer's QKV projection where nothing reads the
        cache before its attention, so that the GPU runs that projection while the step waits."""
        cfg = self.cfg
        b, s, _ = x.shape
        if barrier_ids is not None and (cfg.learned_positions or self.rotary is not None):  # they read positions
            x, barrier_ids = step_barrier(x, barrier_ids), None
        if cfg.learned_positions:
            at = caches[0].get_query_positions(b * s)
            x = x + op.reshape(gather(self.positions.weight, at, 0, "positions"), (b, s, cfg.hidden))
        rope = self.rotary.cos_sin(caches[0], b, s, last) if self.rotary is not None else None
        pending = None
        for layer_id, layer in enumerate(self.layers):
            x, pending = layer(x, pending, caches, layer_id, rope, barrier_ids if layer_id == 0 else None)
        return add_norm(self.norm, x, pending)[0]

    def logits(self, x: Tensor):
        cfg = self.cfg
        out = linear(x, self.embed.weight) if cfg.tied_embeddings else self.lm_head(x)
        out = out.astype("float32") if out.dtype != "float32" else out
        if cfg.logit_scale != 1.0:
            out = out * cfg.logit_scale
        if cfg.logit_softcap:
            out = op.tanh(out / cfg.logit_softcap) * cfg.logit_softcap
        return out

    def embed_tokens(self, input_ids: Tensor):
        x = gather(self.embed.weight, input_ids, 0, "embed")
        return x * self.cfg.embed_scale if self.cfg.embed_scale != 1.0 else x

    def _prefill(self, input_ids: Tensor, logit_positions: Tensor, caches: list):
        x = op.reshape(self.embed_tokens(input_ids), (1, input_ids.shape[0], self.cfg.hidden))
        x = gather(self.forward(x, caches, logit_positions), logit_positions, 1, "last_tokens")
        return self.logits(x), *caches

    def _decode(self, input_ids: Tensor, caches: list):
        x = op.reshape(self.embed_tokens(input_ids), (input_ids.shape[0], 1, self.cfg.hidden))
        # The step before is waited for inside the call, not before it (barrier.py: the host launches ahead).
        return self.logits(self.forward(x, caches, barrier_ids=input_ids)), *caches

    def batch_prefill(self, input_ids: Tensor, logit_positions: Tensor, cache: PagedKVCache):
        """Prompts packed one after another in ``input_ids``; logits at ``logit_positions`` (each prompt's last)."""
        return self._prefill(input_ids, logit_positions, [cache])

    def batch_decode(self, input_ids: Tensor, cache: PagedKVCache):
        """One token for each sequence of the batch."""
        return self._decode(input_ids, [cache])

    def batch_prefill_windowed(self, input_ids: Tensor, logit_positions: Tensor, cache: PagedKVCache,
                               window_cache: PagedKVCache):
        """batch_prefill of a model with windowed and global layers: a cache for each."""
        return self._prefill(input_ids, logit_positions, [cache, window_cache])

    def batch_decode_windowed(self, input_ids: Tensor, cache: PagedKVCache, window_cache: PagedKVCache):
        return self._decode(input_ids, [cache, window_cache])

    def greedy_tokens(self, logits: Tensor):
        """Each row's greedy choice (the first index of its largest logit, as numpy's argmax): what the runtime
        reads back of a greedy step, a token per sequence rather than the whole logits. ``logits`` as a step
        returns them: [1, sequences, vocab] from a prefill, [sequences, 1, vocab] from a decode."""
        rows, columns, vocab = logits.shape
        flat = op.reshape(logits, (rows * columns, vocab))
        kernel = greedy_kernel(vocab, gpu=self.target.kind.name == "cuda")
        index, _ = op.tensor_ir_op(kernel, "greedy_tokens", [flat],
                                   [Tensor.placeholder((rows * columns,), "int32"),
                                    Tensor.placeholder((rows * columns,), "float32")])
        return index

    def sample_tokens(self, logits: Tensor, params: Tensor):
        """Each row's token chosen on the device as its (temperature, top_k, top_p, uniform) row of ``params``
        asks (see :func:`..sampler.sample_kernel`): what the runtime reads back of a sampled step, a token per
        sequence rather than the whole logits. ``logits`` as :meth:`greedy_tokens` takes them."""
        rows, columns, vocab = logits.shape
        flat = op.reshape(logits, (rows * columns, vocab))
        kernel = sample_kernel(vocab, gpu=self.target.kind.name == "cuda")
        return op.tensor_ir_op(kernel, "sample_tokens", [flat, params], [Tensor.placeholder((rows * columns,), "int32")])

    def create_paged_kv_cache(self, max_batch_size: tirx.Var, max_total_seq_len: tirx.Var,
                              prefill_chunk_size: tirx.Var, page_size: tirx.Var,
                              support_sliding_window: tirx.Var) -> PagedKVCache:
        """The main cache (the only one, windowed or not, unless layers differ)."""
        sizes = (max_batch_size, max_total_seq_len, prefill_chunk_size, page_size, support_sliding_window)
        if self.layout.windowed and not self.layout.two_caches:
            return self._cache(self.cfg.layers, True, sizes)
        return self._cache(len(self.layout.main), False, sizes)

    def create_window_cache(self, max_batch_size: tirx.Var, max_total_seq_len: tirx.Var,
                            prefill_chunk_size: tirx.Var, page_size: tirx.Var,
                            support_sliding_window: tirx.Var) -> PagedKVCache:
        """The windowed layers' cache of a model whose other layers are global."""
        sizes = (max_batch_size, max_total_seq_len, prefill_chunk_size, page_size, support_sliding_window)
        return self._cache(len(self.layout.local), True, sizes)

    def _cache(self, layers: int, window: bool, sizes: tuple) -> PagedKVCache:
        """A TIRPagedKVCache over ``layers`` layers. Its fused RoPE: the default and llama3 frequencies (dynamic's
        are the default ones within max_position_embeddings), linear scaling as scaled positions; none where the
        model rotates from a table. A windowed cache rotates q and k as it appends them, at the windowed layers'
        theta with the default frequencies (the build refuses others)."""
        cfg = self.cfg
        rope_type = cfg.rope_scaling.get("rope_type", "default") if cfg.rotary_dim else None
        cache_rope = window or (rope_type is not None and not table_rope(cfg))
        scaling = cfg.rope_scaling if rope_type == "llama3" and not window else {}
        scale = 1.0 / cfg.rope_scaling["factor"] if rope_type == "linear" and not window else 1
        # the second cache's kernels under symbols of their own: TVM adds them under the first cache's
        with suffixed_functions(WINDOW_SUFFIX) if window and self.layout.two_caches else contextlib.nullcontext():
            return tir_paged_kv_cache(
                layers=layers, heads=cfg.heads, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, dtype=cfg.dtype,
                target=self.target, sizes=sizes, rope_mode="normal" if cache_rope else "none", rope_scale=scale,
                rope_theta=window_rope_theta(cfg) if window else cfg.rope_theta, rope_scaling=scaling,
                rotary_dim=cfg.rotary_dim or cfg.head_dim, window=cfg.sliding_window if window else 0)


def window_rope_theta(cfg) -> float:
    """The rotary theta of the windowed layers (Gemma 3's local layers have their own)."""
    tables = cfg.rope_scaling.get("tables")
    if tables and cfg.sliding_layers:
        return tables[cfg.rope_scaling["layer_tables"][cfg.sliding_layers[0]]]["rope_theta"]
    return cfg.rope_theta
