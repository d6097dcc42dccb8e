"""Hugging Face transformers' own model classes, built from configs with random weights.

Nothing is downloaded: each factory makes the family's config, builds the ``*ForCausalLM`` class from
it and returns it with token ids as the input, so that the whole model is imported, embedding gather
and LM head included. ``hf-<family>`` has a tiny model's dimensions (for tests on a CPU);
``hf-<family>-<size>-layers`` has two decoder layers of a real model of that family, with its full
vocabulary (for benchmarks on a GPU): Llama-2-7B, Qwen2-1.5B, Mistral-7B, Gemma-2B, Phi-3-mini and
GPT-2 XL; and ``hf-llama3-8b-layers`` and ``hf-qwen3-8b-layers``, two layers of Llama-3-8B (also Llama-3.1-8B's
kernels: its rope scaling changes no shape) and of Qwen3-8B, to tune what generating with those models runs.
What differs between the families, and what each one exercises in the pipeline:

- ``hf-llama``: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU;
- ``hf-qwen2``: as Llama, with a bias on the q/k/v projections (Linear + bias in half precision);
- ``hf-mistral``: as Llama, with sliding-window attention configured (wider than the prompt);
- ``hf-gemma``: GeGLU (tanh GELU), embeddings scaled by sqrt(hidden), (1 + w) RMSNorm, tied LM head;
- ``hf-phi3``: fused qkv and gate/up projections split in the graph;
- ``hf-gpt2``: LayerNorm, GELU, learned positions, Conv1D projections with biases.

Requires ``transformers`` (a test dependency: ``pip install -e '.[test]'``).
"""

from __future__ import annotations

import torch
from torch import nn

from autosched.errors import UsageError

# Deferred imports: transformers (imported where used: `autosched --help` stays fast).

# The dimensions every family shares at the tiny size: small enough to import and build on a CPU in seconds.
HIDDEN, HEADS, KV_HEADS, MLP, LAYERS, VOCAB = 128, 4, 2, 256, 2, 512
TINY = dict(hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, mlp=MLP, vocab=VOCAB)

# Two layers of a real model per family, at its published dimensions: (size name, dimensions).
REAL = {
    "llama": ("7b", dict(hidden=4096, heads=32, kv_heads=32, mlp=11008, vocab=32000)),  # Llama-2-7B
    "qwen2": ("1.5b", dict(hidden=1536, heads=12, kv_heads=2, mlp=8960, vocab=151936)),  # Qwen2-1.5B
    "mistral": ("7b", dict(hidden=4096, heads=32, kv_heads=8, mlp=14336, vocab=32000)),  # Mistral-7B-v0.1
    "gemma": ("2b", dict(hidden=2048, heads=8, kv_heads=1, mlp=16384, vocab=256000, head_dim=256)),  # Gemma-2B
    "phi3": ("mini", dict(hidden=3072, heads=32, kv_heads=32, mlp=8192, vocab=32064)),  # Phi-3-mini
    "gpt2": ("xl", dict(hidden=1600, heads=25, kv_heads=25, mlp=6400, vocab=50257)),  # GPT-2 XL
}
# More real sizes, named hf-<name>-layers: (family, dimensions).
MORE_REAL = {
    "llama3-8b": ("llama", dict(hidden=4096, heads=32, kv_heads=8, mlp=14336, vocab=128256, rope_theta=500000.0)),
    "qwen3-8b": ("qwen3", dict(hidden=4096, heads=32, kv_heads=8, mlp=12288, vocab=151936, head_dim=128,
                               rope_theta=1000000.0)),
}


class _Logits(nn.Module):
    """``model(input_ids).logits``: the causal LM as one tensor in, one out, with no KV cache."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.config = model.config  # read by the loader for the vocabulary size (token-id inputs)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def _config(family: str, dims: dict):
    try:
        import transformers
    except ImportError:
        raise UsageError("the hf-* example models need transformers: pip install transformers") from None
    hidden, heads, vocab = dims["hidden"], dims["heads"], dims["vocab"]
    llama_like = dict(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=dims["kv_heads"],
                      intermediate_size=dims["mlp"], num_hidden_layers=LAYERS, vocab_size=vocab,
                      max_position_embeddings=4096)
    if "rope_theta" in dims:
        llama_like["rope_parameters"] = {"rope_type": "default", "rope_theta": dims["rope_theta"]}
    if family == "llama":
        return transformers.LlamaConfig(**llama_like), transformers.LlamaForCausalLM
    if family == "qwen2":
        return transformers.Qwen2Config(**llama_like), transformers.Qwen2ForCausalLM
    if family == "qwen3":  # per-head RMSNorm of q and k
        return (transformers.Qwen3Config(**llama_like, head_dim=dims["head_dim"], tie_word_embeddings=False),
                transformers.Qwen3ForCausalLM)
    if family == "mistral":
        return transformers.MistralConfig(**llama_like, sliding_window=4096), transformers.MistralForCausalLM
    if family == "gemma":
        return (transformers.GemmaConfig(**llama_like, head_dim=dims.get("head_dim", hidden // heads),
                                         hidden_activation="gelu_pytorch_tanh"),
                transformers.GemmaForCausalLM)
    if family == "phi3":
        return transformers.Phi3Config(**llama_like, pad_token_id=0), transformers.Phi3ForCausalLM
    if family == "gpt2":
        return (transformers.GPT2Config(n_embd=hidden, n_head=heads, n_inner=dims["mlp"], n_layer=LAYERS,
                                        vocab_size=vocab, n_positions=4096), transformers.GPT2LMHeadModel)
    raise ValueError(family)


def _build(family: str, dims: dict, batch: int, tokens: int, dtype: torch.dtype, seed: int = 0):
    config, cls = _config(family, dims)
    config._attn_implementation = "sdpa"  # one scaled-dot-product call per layer: our attention kernel's pattern
    torch.manual_seed(seed)
    model = cls(config).eval().to(dtype)
    vocab = dims["vocab"]
    ids = torch.randint(0, vocab, (batch, tokens), dtype=torch.int64, generator=torch.Generator().manual_seed(seed))
    return _Logits(model).eval(), (ids,), {"input_ranges": [[0, vocab]]}


def _factory(family: str, dims: dict, size: str | None = None):
    # The real sizes are for a GPU: half precision and a 512-token prompt, as llama-7b-layers.
    default_dtype, default_tokens = (torch.float32, 16) if size is None else (torch.float16, 512)

    def factory(batch: int = 1, tokens: int = default_tokens, dtype: torch.dtype = default_dtype):
        return _build(family, dims, batch, tokens, dtype)

    factory.__name__ = f"hf_{family}" + (f"_{size}_layers" if size else "")
    factory.__doc__ = (f"transformers' {family} causal LM ({LAYERS} layers, hidden {dims['hidden']}, "
                       f"vocabulary {dims['vocab']}{f'; as {family} {size}' if size else ''}).")
    return factory


FAMILIES = ("llama", "qwen2", "mistral", "gemma", "phi3", "gpt2")
MODELS = {f"hf-{family}": _factory(family, TINY) for family in FAMILIES}
MODELS.update({f"hf-{family}-{REAL[family][0]}-layers": _factory(family, REAL[family][1], REAL[family][0])
               for family in FAMILIES})
MODELS.update({f"hf-{name}-layers": _factory(family, dims, name) for name, (family, dims) in MORE_REAL.items()})
