"""Hugging Face transformers' own model classes, built from small configs with random weights.

Nothing is downloaded: each factory makes the family's config (the dimensions of a tiny model with
that family's structure), builds the ``*ForCausalLM`` class from it and returns it with token ids as
the input, so that the whole model is imported, embedding gather and LM head included. What differs
between the families, and what each one exercises in the pipeline:

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

# The dimensions every family shares here: small enough to import and build on a CPU in seconds.
HIDDEN, HEADS, KV_HEADS, MLP, LAYERS, VOCAB = 128, 4, 2, 256, 2, 512


class _Logits(nn.Module):
    """``model(input_ids).logits``: the causal LM as one tensor in, one out, with no KV cache."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.config = model.config  # read by the loader for the vocabulary size (token-id inputs)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def _config(family: str):
    try:
        import transformers
    except ImportError:
        raise UsageError("the hf-* example models need transformers: pip install transformers") from None
    llama_like = dict(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                      intermediate_size=MLP, num_hidden_layers=LAYERS, vocab_size=VOCAB, max_position_embeddings=4096)
    if family == "llama":
        return transformers.LlamaConfig(**llama_like), transformers.LlamaForCausalLM
    if family == "qwen2":
        return transformers.Qwen2Config(**llama_like), transformers.Qwen2ForCausalLM
    if family == "mistral":
        return transformers.MistralConfig(**llama_like, sliding_window=4096), transformers.MistralForCausalLM
    if family == "gemma":
        return (transformers.GemmaConfig(**llama_like, head_dim=HIDDEN // HEADS, hidden_activation="gelu_pytorch_tanh"),
                transformers.GemmaForCausalLM)
    if family == "phi3":
        return transformers.Phi3Config(**llama_like, pad_token_id=0), transformers.Phi3ForCausalLM
    if family == "gpt2":
        return (transformers.GPT2Config(n_embd=HIDDEN, n_head=HEADS, n_inner=MLP, n_layer=LAYERS, vocab_size=VOCAB,
                                        n_positions=4096), transformers.GPT2LMHeadModel)
    raise ValueError(family)


def _build(family: str, batch: int, tokens: int, dtype: torch.dtype, seed: int = 0):
    config, cls = _config(family)
    config._attn_implementation = "sdpa"  # one scaled-dot-product call per layer: our attention kernel's pattern
    torch.manual_seed(seed)
    model = cls(config).eval().to(dtype)
    ids = torch.randint(0, VOCAB, (batch, tokens), dtype=torch.int64, generator=torch.Generator().manual_seed(seed))
    return _Logits(model).eval(), (ids,), {"input_ranges": [[0, VOCAB]]}


def _factory(family: str):
    def factory(batch: int = 1, tokens: int = 16, dtype: torch.dtype = torch.float32):
        return _build(family, batch, tokens, dtype)

    factory.__name__ = f"hf_{family}"
    factory.__doc__ = f"transformers' {family} causal LM ({LAYERS} layers, hidden {HIDDEN}, vocabulary {VOCAB})."
    return factory


FAMILIES = ("llama", "qwen2", "mistral", "gemma", "phi3", "gpt2")
MODELS = {f"hf-{family}": _factory(family) for family in FAMILIES}
