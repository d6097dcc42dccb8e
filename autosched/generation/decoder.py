"""A decoder-only language model over TVM's paged KV cache, written once for every family we import.

The families (Llama 2/3.x, Qwen2/2.5, Qwen3, Mistral, Gemma 1/2/3, Phi-3/3.5/4-mini, OLMo 2, GPT-2, GPT-NeoX /
Pythia, StableLM, Granite, Command-R, SmolLM3, Falcon, and the mixtures of experts Mixtral, Qwen3-MoE, OLMoE and
Qwen2-MoE) differ in a handful of choices: the norm (and whether attention and MLP outputs are normed too), the MLP
(dense, or a router over experts), biases, q/k norms, how positions enter (rotary in the cache, rotary from a
frequency table in the model, or a learned table), the attention window, how the embeddings, residual outputs and
logits are scaled, a soft-cap on the logits, whether the LM head is the embedding table, and whether attention and
MLP run one after the other or side by side. :class:`DecoderConfig` names those choices; :func:`config_from_hf`
reads them from a transformers config (refusing, in one line, what it cannot reproduce), and
:func:`weights_from_hf` maps the model's state dict onto this module's parameters (q/k/v and gate/up concatenated,
experts stacked, GPT-2's Conv1D weights transposed, Gemma's ``1 + w`` norms folded).

The model itself is made of the blocks in :mod:`.blocks` (:class:`.blocks.decoder.Decoder`); :func:`export`
traces it into the functions a generation runtime drives (as MLC-LLM's models do): ``batch_prefill`` (a batch of
prompts' token ids packed along one axis, logits at the last token of each), ``batch_decode`` (one token for
each of a batch of sequences), their static forms (``decode_b<N>``, ``prefill_t<T>``, ``verify_b<N>_k<K>``) and
``create_paged_kv_cache``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from autosched.errors import UsageError

from .linear import w8a8_prefill
from .quantize import scheme as quant_scheme
from .speculative import static_verify_name

# Deferred imports: tvm, torch, transformers, numpy, .blocks (its modules import tvm at their top) (imported where
# used: `autosched --help` stays fast).

# What a family (transformers' model_type) decides beyond what its config's fields say: a new family like
# these is a row here, and its weight names in weights_from_hf where they are not Llama's.
#   qkv_bias: biases on q/k/v only; qk_norm: an RMSNorm on each head of q and k ("whole": over the whole q and
#   k projections); post_norms: attention's and MLP's outputs normed too ("only": instead of their inputs);
#   gemma: (1 + w) norms, embeddings scaled by sqrt(hidden), query_pre_attn_scalar;
#   window: which layers attend over config.sliding_window ("all", or those layer_types names sliding);
#   rope_per_layer_type: a rotary table per layer type (rope_parameters by layer type).
TRAITS: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"window": "all"},
    "qwen2": {"qkv_bias": True, "window": "layer_types"},
    "qwen3": {"qk_norm": True, "window": "layer_types"},
    "gemma": {"gemma": True},
    "gemma2": {"gemma": True, "post_norms": True, "window": "layer_types"},
    "gemma3_text": {"gemma": True, "post_norms": True, "qk_norm": True, "window": "layer_types",
                    "rope_per_layer_type": True},
    "phi3": {"window": "all"},  # q/k/v and gate/up fused in its weights; longrope
    # moe: a mixture-of-experts MLP (on every layer for Mixtral; for Qwen3-MoE on the layers config's
    # decoder_sparse_step and mlp_only_layers leave sparse, a dense MLP on the others)
    "mixtral": {"window": "all", "moe": True},
    "qwen3_moe": {"qk_norm": True, "window": "all", "moe": True},
    "olmo2": {"qk_norm": "whole", "post_norms": "only"},
    # LayerNorms (with biases); use_qkv_bias; use_parallel_residual: attention and MLP behind the one norm; partial rotary
    "stablelm": {"norm": "layer"},
    # embedding_multiplier, attention_multiplier (the softmax scale), residual_multiplier (folded into the output
    # projections), logits_scaling (logits divided by it)
    "granite": {},
    "olmoe": {"qk_norm": "whole", "moe": True},  # OLMo 2's q/k norms with pre-norms, experts on every layer
    "qwen2_moe": {"qkv_bias": True, "window": "layer_types", "moe": True},  # and a gated shared expert
    # Command-R: LayerNorms without biases, attention and MLP behind one norm, logit_scale, rotary embedding on
    # interleaved pairs (q and k rows reordered at load into the halves every other family rotates)
    "cohere": {"norm": "layer", "parallel": "one_norm", "interleaved_rope": True},
    "smollm3": {"window": "layer_types"},  # Llama's layers, some without rotary embedding (no_rope_layers): NoPE
}
FAMILIES = (*TRAITS, "gpt2", "gpt_neox", "falcon")
GEMMA = tuple(family for family, traits in TRAITS.items() if traits.get("gemma"))


@dataclass(frozen=True)
class DecoderConfig:
    family: str
    vocab: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    mlp: int
    norm: str = "rms"  # "rms" or "layer"
    norm_eps: float = 1e-5
    gated_mlp: bool = True  # act(gate) * up, else act(fc)
    activation: str = "silu"  # "silu", "gelu_tanh" or "gelu"
    qkv_bias: bool = False
    qk_norm: bool = False  # an RMSNorm over each head of q and of k before the rotary embedding (Qwen3, Gemma 3)
    qk_norm_whole: bool = False  # the q and k norms over the whole projection, all heads at once (OLMo 2)
    post_norms: bool = False  # a norm on the attention's and on the MLP's output too (Gemma 2 and 3)
    pre_norms: bool = True  # a norm on the attention's and on the MLP's input (all but OLMo 2)
    attn_scale: float = 0.0  # the attention's softmax scale; 0: head_dim ** -0.5
    logit_softcap: float = 0.0  # logits as cap * tanh(logits / cap) (Gemma 2); 0: none
    dense_bias: bool = False  # biases on the output projection, the MLP and the norms (GPT-2)
    rope_theta: float = 10000.0
    rotary_dim: int = 0  # 0: no rotary embedding
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    learned_positions: int = 0  # rows of a learned position table (GPT-2), else 0
    embed_scale: float = 1.0
    tied_embeddings: bool = False
    sliding_window: int = 0  # attention window (a token sees itself and the window - 1 before it); 0: none
    sliding_layers: list[int] = field(default_factory=list)  # the layers that attend over the window (else all)
    # Mixture of experts: experts (0: none), experts per token, each expert's intermediate size, whether the
    # chosen experts' probabilities are renormalised to sum to one, and the layers whose MLP is the experts'.
    experts: int = 0
    top_k: int = 0
    expert_mlp: int = 0
    renorm_topk: bool = True
    sparse_layers: list[int] = field(default_factory=list)
    shared_expert_mlp: int = 0  # a sparse layer's shared expert: its intermediate size (0: none), gated (Qwen2-MoE)
    nope_layers: list[int] = field(default_factory=list)  # layers without a rotary embedding (SmolLM3); the others
    # rotate from a frequency table in the model (rope_scaling's inv_freq), the cache then rotating none
    dtype: str = "float32"
    # attention and MLP side by side on one input (blocks/parallel.py), each behind a norm of its own ("two_norms":
    # GPT-NeoX) or both behind one ("one_norm": StableLM); "": one after the other
    parallel_block: str = ""
    logit_scale: float = 1.0  # logits multiplied by this (Granite: 1 / logits_scaling)
    residual_scale: float = 1.0  # attention's and MLP's outputs scaled before the residual add (Granite), folded into
    # the output projections' weights by weights_from_hf
    quantize: str = ""  # the projections' weight quantisation (a scheme of .quantize: "q4f16", "q8f16", "fp8"); "": none

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> DecoderConfig:
        return cls(**data)


# Rotary scaling, by transformers' ``rope_type``. The KV cache's fused RoPE computes the frequencies of
# "default", "linear" (positions scaled by 1 / factor: the cache's ``rope_scale``) and "llama3" (TVM's
# ``rope_freq_llama3`` is transformers' formula: the smooth factor clamped to [0, 1] picks the same low, medium
# and high bands). "yarn" and "longrope" are rotated by the model itself, before the cache, from the frequency
# table transformers' own init function gives (TVM's ``rope_freq_yarn`` neither truncates the correction range
# nor indexes the ramp by frequency for the second half of a head, and applies no attention factor), with
# cos and sin scaled by the attention factor as transformers scales them.
CACHE_ROPE = ("default", "linear", "llama3")
TABLE_ROPE = ("yarn", "longrope")


def _rope(config) -> tuple[float, dict]:
    """(theta, scaling) of a transformers config, old (``rope_theta``/``rope_scaling``) or new (``rope_parameters``)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    old = dict(getattr(config, "rope_scaling", None) or {})
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    kind = params.get("rope_type") or old.get("rope_type") or old.get("type") or "default"
    params = {**old, **params}
    if kind == "default":
        return theta, {}
    if kind == "linear":
        return theta, {"rope_type": "linear", "factor": float(params["factor"])}
    if kind == "llama3":
        return theta, {"rope_type": "llama3", **{key: float(params[key]) for key in (
            "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}}
    if kind in TABLE_ROPE:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
        scaling = {"rope_type": kind, "inv_freq": [float(f) for f in inv_freq], "attention_factor": float(attention_factor)}
        if kind == "longrope":
            # transformers rotates with the long factors once a sequence is longer than the original context
            # (from the forward whose last position passes it: a whole prompt's, then each decode step's).
            original = int(params.get("original_max_position_embeddings") or config.original_max_position_embeddings)
            long, _ = ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len=original + 1)
            scaling.update(long_inv_freq=[float(f) for f in long], original_max_position_embeddings=original)
        return theta, scaling
    if kind == "dynamic":
        # transformers' frequencies are the default ones up to max_position_embeddings; past it, they follow the
        # longest sequence it has seen so far, which a KV cache's keys cannot (the build refuses a longer
        # --max-seq-len).
        return theta, {"rope_type": "dynamic", "max_position_embeddings": int(config.max_position_embeddings)}
    raise UsageError(f"rotary scaling '{kind}' is not supported for generation yet: use a model without rope_scaling")


def _layered_rope(config) -> tuple[float, dict]:
    """Gemma 3's rotary embedding: one table per layer type (local layers at theta 10000, global ones at
    1e6, scaled), rotated by the model (the cache's fused RoPE has one theta)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    tables, index = [], {}
    for kind in sorted(set(config.layer_types)):
        params = config.rope_parameters[kind]
        rope_type = params.get("rope_type", "default")
        if rope_type not in ("default", "linear", "llama3", "yarn"):
            raise UsageError(f"rotary scaling '{rope_type}' is not supported for generation yet ({kind} layers)")
        init = Gemma3RotaryEmbedding.compute_default_rope_parameters if rope_type == "default" else ROPE_INIT_FUNCTIONS[rope_type]
        inv_freq, factor = init(config, None, layer_type=kind)
        index[kind] = len(tables)
        tables.append({"inv_freq": [float(f) for f in inv_freq], "attention_factor": float(factor),
                       "rope_type": rope_type, "rope_theta": float(params["rope_theta"])})
    return 10000.0, {"rope_type": "per_layer", "inv_freq": tables[0]["inv_freq"], "tables": tables,
                     "layer_tables": [index[kind] for kind in config.layer_types]}


def config_from_hf(config, dtype: str) -> DecoderConfig:
    """The :class:`DecoderConfig` of a transformers ``PretrainedConfig``; a UsageError for another family."""
    family = getattr(config, "model_type", None)
    if family not in FAMILIES:
        raise UsageError(f"generation supports the families {', '.join(FAMILIES)}; this model is '{family}'")
    if family == "gpt2":
        if getattr(config, "scale_attn_by_inverse_layer_idx", False) or getattr(config, "reorder_and_upcast_attn", False):
            raise UsageError("GPT-2 with scale_attn_by_inverse_layer_idx or reorder_and_upcast_attn is not supported")
        hidden, heads = config.n_embd, config.n_head
        act = _activation(config.activation_function, "GPT-2 ", GELUS)
        return DecoderConfig(family, config.vocab_size, hidden, heads, heads, hidden // heads, config.n_layer,
                             config.n_inner or 4 * hidden, norm="layer", norm_eps=config.layer_norm_epsilon,
                             gated_mlp=False, activation=act, qkv_bias=True, dense_bias=True,
                             learned_positions=config.n_positions, tied_embeddings=True, dtype=dtype)
    if family == "gpt_neox":
        return _gpt_neox_config(config, dtype)
    if family == "falcon":
        return _falcon_config(config, dtype)
    traits = TRAITS[family]
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    partial = float((getattr(config, "rope_parameters", None) or {}).get(
        "partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)))
    window, sliding_layers = _window(config, traits.get("window"))
    theta, scaling = _layered_rope(config) if traits.get("rope_per_layer_type") else _rope(config)
    if scaling.get("rope_type") == "longrope" and family != "phi3":
        # transformers' Phi-3 re-reads a sequence as it passes the original context (as our Generator does);
        # another family would keep its short-factor keys, which a build does not reproduce.
        raise UsageError(f"rotary scaling 'longrope' is supported for phi3 models; this model is '{family}'")
    # Gemma's MLP reads hidden_activation (hidden_act is a leftover of its config)
    hidden_act = getattr(config, "hidden_activation", None) or config.hidden_act
    act = _activation(hidden_act, "", ACTIVATIONS)
    if getattr(config, "attn_logit_softcapping", None):
        raise UsageError(f"attention soft-capping (attn_logit_softcapping={config.attn_logit_softcapping}) is not "
                         "supported for generation: TVM's paged attention kernels have none")
    scalar = getattr(config, "query_pre_attn_scalar", None) if traits.get("gemma") else None
    for flag in ("attention_bias", "mlp_bias", "qk_layernorm", "clip_qkv", "use_qk_norm"):
        if getattr(config, flag, False):
            raise UsageError(f"{flag}={getattr(config, flag)} is not supported for generation yet")
    moe = _moe(config, family) if traits.get("moe") else {}
    nope = [i for i, rotated in enumerate(getattr(config, "no_rope_layers", None) or []) if not rotated]
    if nope:
        scaling = _nope_table(theta, scaling, int(head_dim * partial))
    # the softmax's scale: Gemma's query_pre_attn_scalar, Granite's attention_multiplier (0: head_dim ** -0.5)
    attn_scale = float(scalar) ** -0.5 if scalar else float(getattr(config, "attention_multiplier", 0.0))
    embed_scale = math.sqrt(hidden) if traits.get("gemma") else float(getattr(config, "embedding_multiplier", 1.0))
    return DecoderConfig(family, config.vocab_size, hidden, heads, config.num_key_value_heads or heads, head_dim,
                         config.num_hidden_layers, config.intermediate_size, norm=traits.get("norm", "rms"),
                         norm_eps=getattr(config, "rms_norm_eps", None) or config.layer_norm_eps, activation=act,
                         qkv_bias=bool(traits.get("qkv_bias") or getattr(config, "use_qkv_bias", False)),
                         parallel_block=traits.get("parallel") or ("one_norm" if getattr(config, "use_parallel_residual",
                                                                                         False) else ""),
                         qk_norm=bool(traits.get("qk_norm")),
                         qk_norm_whole=traits.get("qk_norm") == "whole", post_norms=bool(traits.get("post_norms")),
                         pre_norms=traits.get("post_norms") != "only", attn_scale=attn_scale,
                         logit_softcap=float(getattr(config, "final_logit_softcapping", None) or 0.0), rope_theta=theta,
                         rotary_dim=int(head_dim * partial), rope_scaling=scaling,
                         embed_scale=embed_scale,
                         logit_scale=float(getattr(config, "logit_scale", None) or 1.0)
                         / float(getattr(config, "logits_scaling", 1.0)),
                         residual_scale=float(getattr(config, "residual_multiplier", 1.0)),
                         tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
                         sliding_window=window, sliding_layers=sliding_layers, nope_layers=nope, dtype=dtype, **moe)


# transformers' activation names -> the decoder's (blocks/mlp.py); the LayerNorm families' MLPs are GELUs only
ACTIVATIONS = {"silu": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
GELUS = {name: ours for name, ours in ACTIVATIONS.items() if name != "silu"}


def _activation(name: str, who: str, known: dict) -> str:
    """The decoder's activation for transformers' ``name``; a one-line UsageError for one ``known`` lacks."""
    if name not in known:
        raise UsageError(f"{who}activation '{name}' is not supported for generation")
    return known[name]


def _falcon_config(config, dtype: str) -> DecoderConfig:
    """Falcon: LayerNorms with biases, multi-query or grouped attention, attention and MLP side by side behind one
    norm (7B: ``parallel_attn``) or two (``new_decoder_architecture``: 40B, 180B), a GELU MLP, biases on the
    projections where ``bias``."""
    if getattr(config, "alibi", False):
        raise UsageError("Falcon with alibi=True is not supported for generation (it has no rotary embedding)")
    new = bool(getattr(config, "new_decoder_architecture", False))
    hidden, heads = config.hidden_size, config.num_attention_heads
    kv_heads = config.num_kv_heads if new else (1 if config.multi_query else heads)
    if new:
        parallel = "one_norm" if getattr(config, "num_ln_in_parallel_attn", None) == 1 else "two_norms"
    else:
        parallel = "one_norm" if config.parallel_attn else ""
    act = _activation(config.activation, "Falcon ", GELUS)
    theta, scaling = _rope(config)
    return DecoderConfig("falcon", config.vocab_size, hidden, heads, kv_heads, hidden // heads, config.num_hidden_layers,
                         config.ffn_hidden_size or 4 * hidden, norm="layer", norm_eps=config.layer_norm_epsilon,
                         gated_mlp=False, activation=act, qkv_bias=bool(config.bias), dense_bias=bool(config.bias),
                         rope_theta=theta, rotary_dim=hidden // heads, rope_scaling=scaling,
                         tied_embeddings=bool(getattr(config, "tie_word_embeddings", True)), parallel_block=parallel,
                         dtype=dtype)


def _nope_table(theta: float, scaling: dict, rotary_dim: int) -> dict:
    """The frequency table of a model whose layers are not all rotated: the cache rotates every layer or none, so
    the model rotates the others itself (transformers' default frequencies)."""
    if scaling:
        raise UsageError(f"layers without a rotary embedding (no_rope_layers) with rotary scaling "
                         f"'{scaling.get('rope_type')}' are not supported for generation")
    import torch

    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    return {"rope_type": "default", "inv_freq": inv_freq.tolist(), "attention_factor": 1.0}


def _gpt_neox_config(config, dtype: str) -> DecoderConfig:
    """GPT-NeoX and Pythia: LayerNorms, biases everywhere, a partial rotary embedding, attention and MLP in parallel
    (``use_parallel_residual``, else one after the other), an untied head."""
    if not getattr(config, "attention_bias", True):
        raise UsageError("GPT-NeoX with attention_bias=False is not supported for generation (its MLP keeps its "
                         "biases, which this decoder ties to the attention's)")
    act = _activation(config.hidden_act, "GPT-NeoX ", GELUS)
    hidden, heads = config.hidden_size, config.num_attention_heads
    theta, scaling = _rope(config)
    partial = float((getattr(config, "rope_parameters", None) or {}).get(
        "partial_rotary_factor", getattr(config, "rotary_pct", 1.0)))
    return DecoderConfig("gpt_neox", config.vocab_size, hidden, heads, heads, hidden // heads, config.num_hidden_layers,
                         config.intermediate_size, norm="layer", norm_eps=config.layer_norm_eps, gated_mlp=False,
                         activation=act, qkv_bias=True, dense_bias=True, rope_theta=theta,
                         rotary_dim=int(hidden // heads * partial), rope_scaling=scaling,
                         tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
                         parallel_block="two_norms" if getattr(config, "use_parallel_residual", True) else "", dtype=dtype)


def _moe(config, family: str) -> dict[str, Any]:
    """The mixture-of-experts fields of :class:`DecoderConfig` for a Mixtral, Qwen3-MoE, OLMoE or Qwen2-MoE config;
    a one-line UsageError for what the decoder does not reproduce (another family's shared experts, more experts
    per token than experts)."""
    shared = int(getattr(config, "shared_expert_intermediate_size", 0) or 0) if family == "qwen2_moe" else 0
    for name, value in config.to_dict().items():
        if "shared_expert" in name and value and family != "qwen2_moe":
            raise UsageError(f"shared experts ({name}={value}) are not supported for generation yet")
    layers = config.num_hidden_layers
    if family == "mixtral":
        experts, inter, renorm = config.num_local_experts, config.intermediate_size, True
        sparse = list(range(layers))
    elif family == "olmoe":
        experts, inter, renorm = config.num_experts, config.intermediate_size, bool(config.norm_topk_prob)
        sparse = list(range(layers))
    else:  # qwen3_moe, qwen2_moe
        experts, inter, renorm = config.num_experts, config.moe_intermediate_size, bool(config.norm_topk_prob)
        step, dense = config.decoder_sparse_step, set(config.mlp_only_layers or [])
        sparse = [i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0]
    top_k = config.num_experts_per_tok
    if sparse and not 0 < top_k <= experts:
        raise UsageError(f"num_experts_per_tok={top_k} must be between 1 and the {experts} experts")
    return {"experts": experts if sparse else 0, "top_k": top_k if sparse else 0, "expert_mlp": inter if sparse else 0,
            "renorm_topk": renorm, "sparse_layers": sparse, "shared_expert_mlp": shared if sparse else 0}


def _window(config, layers: str | None) -> tuple[int, list[int]]:
    """(window, the layers attending over it) of a transformers config: ``sliding_window`` on every layer
    (``layers`` "all": Mistral, Phi-3) or on those ``layer_types`` names ``sliding_attention`` (Qwen2's and
    Qwen3's from ``max_window_layers`` on, with ``use_sliding_window``; Gemma 2's and 3's alternating)."""
    window = getattr(config, "sliding_window", None)
    if not window or layers is None:
        return 0, []
    types = getattr(config, "layer_types", None)
    if layers == "all" or types is None:
        layers = list(range(config.num_hidden_layers))
    else:
        layers = [i for i, kind in enumerate(types) if kind == "sliding_attention"]
    return (int(window), layers) if layers else (0, [])


def weights_from_hf(state: dict, cfg: DecoderConfig) -> dict:
    """This module's parameters, by name, as torch tensors, from a transformers state dict (``model.``/
    ``transformer.`` prefixes as the ``*ForCausalLM`` classes have them)."""
    import torch

    def get(name):
        for prefix in ("", "model.", "transformer.", "gpt_neox."):
            if prefix + name in state:
                return state[prefix + name]
        raise UsageError(f"the model has no weight '{name}': is it a {cfg.family} model as transformers writes it?")

    def norm_bias(name, weight):  # a LayerNorm's bias, zeros where the model's norms have none (Command-R)
        for prefix in ("", "model."):
            if prefix + name + ".bias" in state:
                return state[prefix + name + ".bias"]
        return torch.zeros_like(weight)

    out = {}
    if cfg.family == "gpt2":
        out["embed.weight"] = get("wte.weight")
        out["positions.weight"] = get("wpe.weight")
        for i in range(cfg.layers):
            p, q = f"h.{i}.", f"layers.{i}."
            for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
                out[q + ours + ".weight"], out[q + ours + ".bias"] = get(p + theirs + ".weight"), get(p + theirs + ".bias")
            # Conv1D keeps weights as [in, out]; Linear takes [out, in].
            for ours, theirs in (("attn.qkv", "attn.c_attn"), ("attn.o", "attn.c_proj"), ("mlp.up", "mlp.c_fc"),
                                 ("mlp.down", "mlp.c_proj")):
                out[q + ours + ".weight"] = get(p + theirs + ".weight").t()
                out[q + ours + ".bias"] = get(p + theirs + ".bias")
        out["norm.weight"], out["norm.bias"] = get("ln_f.weight"), get("ln_f.bias")
    elif cfg.family == "gpt_neox":
        out.update(_gpt_neox_weights(get, state, cfg))
    elif cfg.family == "falcon":
        out.update(_falcon_weights(get, state, cfg))
    else:
        # Gemma's norms scale by (1 + w): folded here so that every family runs a plain RMSNorm.
        norm = (lambda w: w.float().add(1.0).to(w.dtype)) if cfg.family in GEMMA else (lambda w: w)
        out["embed.weight"] = get("embed_tokens.weight")
        for i in range(cfg.layers):
            p, q = f"layers.{i}.", f"layers.{i}."
            if not cfg.pre_norms:  # OLMo 2: a norm after each of attention and MLP only
                out[q + "attn_post_norm.weight"] = get(p + "post_attention_layernorm.weight")
                out[q + "mlp_post_norm.weight"] = get(p + "post_feedforward_layernorm.weight")
            elif cfg.post_norms:  # Gemma 2 and 3: a norm before and after each of attention and MLP
                out[q + "attn_norm.weight"] = norm(get(p + "input_layernorm.weight"))
                out[q + "attn_post_norm.weight"] = norm(get(p + "post_attention_layernorm.weight"))
                out[q + "mlp_norm.weight"] = norm(get(p + "pre_feedforward_layernorm.weight"))
                out[q + "mlp_post_norm.weight"] = norm(get(p + "post_feedforward_layernorm.weight"))
            else:
                out[q + "attn_norm.weight"] = norm(get(p + "input_layernorm.weight"))
                if cfg.parallel_block != "one_norm":  # StableLM's parallel layer: attention and MLP behind one norm
                    out[q + "mlp_norm.weight"] = norm(get(p + "post_attention_layernorm.weight"))
            if cfg.norm == "layer":  # LayerNorms' biases (StableLM; Command-R's have none)
                for ours, theirs in (("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm")):
                    if q + ours + ".weight" in out:
                        out[q + ours + ".bias"] = norm_bias(p + theirs, out[q + ours + ".weight"])
            if cfg.family == "phi3":
                out[q + "attn.qkv.weight"] = get(p + "self_attn.qkv_proj.weight")
                out[q + "mlp.up.weight"] = get(p + "mlp.gate_up_proj.weight")
            else:
                q_, k_, v_ = (get(p + f"self_attn.{x}_proj.weight") for x in "qkv")
                if TRAITS[cfg.family].get("interleaved_rope"):
                    q_, k_ = _halves_from_pairs(q_, cfg.head_dim), _halves_from_pairs(k_, cfg.head_dim)
                out[q + "attn.qkv.weight"] = torch.cat([q_, k_, v_])
                if cfg.qkv_bias:
                    out[q + "attn.qkv.bias"] = torch.cat([get(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
            if cfg.family != "phi3" and i not in cfg.sparse_layers:
                out[q + "mlp.up.weight"] = torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
            if cfg.qk_norm:
                out[q + "attn.q_norm.weight"] = norm(get(p + "self_attn.q_norm.weight"))
                out[q + "attn.k_norm.weight"] = norm(get(p + "self_attn.k_norm.weight"))
            out[q + "attn.o.weight"] = get(p + "self_attn.o_proj.weight")
            if i in cfg.sparse_layers:
                out.update(_expert_weights(get, state, cfg, p, q))
            else:
                out[q + "mlp.down.weight"] = get(p + "mlp.down_proj.weight")
        out["norm.weight"] = norm(get("norm.weight"))
        if cfg.norm == "layer":
            out["norm.bias"] = norm_bias("norm", out["norm.weight"])
    if not cfg.tied_embeddings and "lm_head.weight" not in out:
        out["lm_head.weight"] = state.get("lm_head.weight", out["embed.weight"])
    if cfg.residual_scale != 1.0:  # out * s + residual: s folded into what makes out
        scaled = (".attn.o.weight", ".attn.o.bias", ".mlp.down.weight", ".mlp.down.bias", ".mlp.experts_down")
        out = {k: (v.float() * cfg.residual_scale).to(v.dtype) if k.endswith(scaled) else v for k, v in out.items()}
    return out


def _halves_from_pairs(weight, head_dim: int):
    """A q or k projection whose rotary embedding turns interleaved pairs (dimensions 2i, 2i + 1 of each head) with
    its rows reordered so that the pairs become the halves (i, i + head_dim / 2) that the cache's rotary embedding
    turns: q and k reordered alike, their products, and so attention, are unchanged."""
    rows, cols = weight.shape
    return weight.reshape(rows // head_dim, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _falcon_weights(get, state: dict, cfg: DecoderConfig) -> dict:
    """Falcon's weights. Its ``query_key_value`` rows come in kv groups, each group's queries then its k and v
    (``new_decoder_architecture``; multi-query: one group, so q of every head, k, v; neither: a group a head),
    regrouped as ours: q of every head, then k, then v."""
    import torch

    out = {"embed.weight": get("word_embeddings.weight")}
    per_group = cfg.heads // cfg.kv_heads

    def regrouped(t):  # [kv, per_group + 2, head_dim, ...] -> q of every head, k of every group, v of every group
        g = t.reshape(cfg.kv_heads, per_group + 2, cfg.head_dim, *t.shape[1:])
        q, k, v = g[:, :per_group], g[:, per_group], g[:, per_group + 1]
        return torch.cat([q.reshape(-1, *t.shape[1:]), k.reshape(-1, *t.shape[1:]), v.reshape(-1, *t.shape[1:])])

    norms = {"one_norm": (("attn_norm", "input_layernorm"),),
             "two_norms": (("attn_norm", "ln_attn"), ("mlp_norm", "ln_mlp")),
             "": (("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm"))}[cfg.parallel_block]
    for i in range(cfg.layers):
        p, q = f"h.{i}.", f"layers.{i}."
        for ours, theirs in norms:
            out[q + ours + ".weight"], out[q + ours + ".bias"] = get(p + theirs + ".weight"), get(p + theirs + ".bias")
        for ours, theirs in (("attn.o", "self_attention.dense"), ("mlp.up", "mlp.dense_h_to_4h"),
                             ("mlp.down", "mlp.dense_4h_to_h")):
            out[q + ours + ".weight"] = get(p + theirs + ".weight")
            if cfg.dense_bias:
                out[q + ours + ".bias"] = get(p + theirs + ".bias")
        qkv = get(p + "self_attention.query_key_value.weight")
        out[q + "attn.qkv.weight"] = regrouped(qkv)
        if cfg.qkv_bias:
            out[q + "attn.qkv.bias"] = regrouped(get(p + "self_attention.query_key_value.bias"))
    out["norm.weight"], out["norm.bias"] = get("ln_f.weight"), get("ln_f.bias")
    if not cfg.tied_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    return out


def _gpt_neox_weights(get, state: dict, cfg: DecoderConfig) -> dict:
    """GPT-NeoX's weights: its ``query_key_value`` holds each head's q, k and v together ([heads, 3, head_dim]
    rows), regrouped as q of every head, then k, then v."""
    # the head: lm_head in transformers 5, embed_out in the checkpoints of older ones
    head = "lm_head.weight" if any(k.endswith("lm_head.weight") for k in state) else "embed_out.weight"
    out = {"embed.weight": get("embed_in.weight"), "lm_head.weight": get(head)}

    def by_part(t):
        return t.reshape(cfg.heads, 3, cfg.head_dim, *t.shape[1:]).transpose(0, 1).reshape(t.shape)

    for i in range(cfg.layers):
        p, q = f"layers.{i}.", f"layers.{i}."
        for ours, theirs in (("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm"),
                             ("attn.o", "attention.dense"), ("mlp.up", "mlp.dense_h_to_4h"), ("mlp.down", "mlp.dense_4h_to_h")):
            out[q + ours + ".weight"], out[q + ours + ".bias"] = get(p + theirs + ".weight"), get(p + theirs + ".bias")
        out[q + "attn.qkv.weight"] = by_part(get(p + "attention.query_key_value.weight"))
        out[q + "attn.qkv.bias"] = by_part(get(p + "attention.query_key_value.bias"))
    out["norm.weight"], out["norm.bias"] = get("final_layer_norm.weight"), get("final_layer_norm.bias")
    return out


def _expert_weights(get, state: dict, cfg: DecoderConfig, p: str, q: str) -> dict:
    """A sparse layer's router and experts: the experts' gate and up projections stacked [experts, 2 x inter,
    hidden] (gate rows first) and their down projections [experts, hidden, inter], from transformers' fused
    tensors (``mlp.experts.gate_up_proj``, ``down_proj``, as a loaded model has them) or per expert (as
    ``save_pretrained`` writes them: Mixtral's ``block_sparse_moe.experts.{i}.w1/w3/w2``, Qwen3-MoE's
    ``mlp.experts.{i}.gate_proj/up_proj/down_proj``)."""
    import torch

    def has(name):
        return any(prefix + name in state for prefix in ("", "model."))

    block = "block_sparse_moe." if has(p + "block_sparse_moe.gate.weight") else "mlp."
    out = {q + "mlp.router.weight": get(p + block + "gate.weight")}
    if cfg.shared_expert_mlp:  # Qwen2-MoE: gate and up concatenated, as a dense MLP's
        shared = p + block + "shared_expert."
        out[q + "mlp.shared.up.weight"] = torch.cat([get(shared + "gate_proj.weight"), get(shared + "up_proj.weight")])
        out[q + "mlp.shared.down.weight"] = get(shared + "down_proj.weight")
        out[q + "mlp.shared_gate.weight"] = get(p + block + "shared_expert_gate.weight")
    if has(p + block + "experts.gate_up_proj"):
        out[q + "mlp.experts_up"] = get(p + block + "experts.gate_up_proj")
        out[q + "mlp.experts_down"] = get(p + block + "experts.down_proj")
        return out
    names = ("w1", "w3", "w2") if block == "block_sparse_moe." else ("gate_proj", "up_proj", "down_proj")
    experts = [[get(f"{p}{block}experts.{e}.{name}.weight") for name in names] for e in range(cfg.experts)]
    out[q + "mlp.experts_up"] = torch.stack([torch.cat([gate, up]) for gate, up, _ in experts])
    out[q + "mlp.experts_down"] = torch.stack([down for _, _, down in experts])
    return out


def build_module(cfg: DecoderConfig, target, decode_batches: tuple[int, ...] = (), prefill_chunks: tuple[int, ...] = (),
                 speculate: tuple[int, ...] = ()):
    """The ``tvm.relax.frontend.nn`` module of ``cfg`` for ``target`` (:class:`.blocks.decoder.Decoder`) and its
    export spec. ``decode_batches``: batch sizes that also get a decode function of their own, ``decode_b<N>``,
    whose shapes are all static (its kernels can be tuned, and on CUDA the step is captured as CUDA graphs);
    other sizes run ``batch_decode``. ``prefill_chunks``: token counts that get a prefill function of their own,
    ``prefill_t<T>`` (prompts are prefilled in chunks of exactly that many tokens, the rest by
    ``batch_prefill``). ``speculate``: numbers of proposed tokens k whose verification gets a function of its own
    at each decode batch n, ``verify_b<n>_k<k>``: a prefill of n sequences' k + 1 tokens with the logits of every
    one (a speculative step of another shape verifies through ``batch_prefill``)."""
    from tvm.relax.frontend import nn
    from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache

    from autosched.search_spaces.templates.hopper_gemm import HOPPER_ARCHS

    from .blocks.decoder import Decoder

    hopper = target.kind.name == "cuda" and str(target.attrs.get("arch", "")) in HOPPER_ARCHS
    module = Decoder(cfg, target, hopper)
    packed = {"param_mode": "packed", "effect_mode": "none"}
    cache_spec = nn.spec.Object(object_type=PagedKVCache)
    spec = {
        "batch_prefill": {"input_ids": nn.spec.Tensor(["seq_len"], "int32"),
                          "logit_positions": nn.spec.Tensor(["batch_size"], "int32"), "cache": cache_spec, "$": packed},
        "batch_decode": {"input_ids": nn.spec.Tensor(["batch_size"], "int32"), "cache": cache_spec, "$": packed},
        "greedy_tokens": {"logits": nn.spec.Tensor(["rows", "columns", cfg.vocab], "float32"),
                          "$": {"param_mode": "none", "effect_mode": "none"}},
        "sample_tokens": {"logits": nn.spec.Tensor(["rows", "columns", cfg.vocab], "float32"),
                          "params": nn.spec.Tensor(["sampled", 4], "float32"),
                          "$": {"param_mode": "none", "effect_mode": "none"}},
        "create_paged_kv_cache": {name: int for name in ("max_batch_size", "max_total_seq_len", "prefill_chunk_size",
                                                         "page_size", "support_sliding_window")}
        | {"$": {"param_mode": "none", "effect_mode": "none"}},
    }
    caches = {"cache": cache_spec}
    if module.layout.two_caches:  # every step function takes both caches
        caches["window_cache"] = cache_spec
        module.batch_prefill, module.batch_decode = module.batch_prefill_windowed, module.batch_decode_windowed
        spec["create_window_cache"] = dict(spec["create_paged_kv_cache"])
        for name in ("batch_prefill", "batch_decode"):
            spec[name] = {**spec[name], **caches, "$": packed}
    for n in decode_batches:
        setattr(module, f"decode_b{n}", module.batch_decode)
        spec[f"decode_b{n}"] = {"input_ids": nn.spec.Tensor([n], "int32"), **caches, "$": packed}
    for k in speculate:
        for n in decode_batches:
            tokens = n * (k + 1)
            setattr(module, static_verify_name(n, k), module.batch_prefill)
            spec[static_verify_name(n, k)] = {"input_ids": nn.spec.Tensor([tokens], "int32"),
                                           "logit_positions": nn.spec.Tensor([tokens], "int32"), **caches, "$": packed}
    chunk = module.batch_prefill
    if hopper and cfg.quantize and quant_scheme(cfg.quantize).fmt == "e4m3":
        chunk = _w8a8(chunk)  # an fp8 build's prefill chunks on FP8 tensor cores: W8A8 (.linear.fp8_linear)
    for t in prefill_chunks:
        setattr(module, f"prefill_t{t}", chunk)
        spec[f"prefill_t{t}"] = {"input_ids": nn.spec.Tensor([t], "int32"),
                                 "logit_positions": nn.spec.Tensor(["batch_size"], "int32"), **caches, "$": packed}
    return module, spec


def _w8a8(method):
    """``method`` traced with its fp8 projections as W8A8 (:func:`.linear.w8a8_prefill`); its signature kept
    (the exporter reads the parameter names)."""
    @functools.wraps(method)
    def traced(*args, **kwargs):
        with w8a8_prefill():
            return method(*args, **kwargs)

    return traced


def window_rope_unsupported(cfg: DecoderConfig) -> str | None:
    """Why the windowed layers' rotary embedding cannot run in TVM's windowed cache (its kernels rotate the whole
    head with the default frequencies at one theta), or None."""
    if cfg.rotary_dim != cfg.head_dim:
        return "with a partial rotary embedding"
    tables = cfg.rope_scaling.get("tables")
    if tables:
        used = {cfg.rope_scaling["layer_tables"][layer] for layer in cfg.sliding_layers}
        kinds = {tables[i]["rope_type"] for i in used}
        if len(used) > 1 or kinds != {"default"}:
            return f"with rotary scaling '{'/'.join(sorted(kinds))}' on its windowed layers"
        return None
    if cfg.rope_scaling:
        return f"with rotary scaling '{cfg.rope_scaling.get('rope_type')}'"
    return None


def export(cfg: DecoderConfig, tvm_target, decode_batches: tuple[int, ...] = (), prefill_chunks: tuple[int, ...] = (),
           speculate: tuple[int, ...] = ()):
    """(IRModule, parameter names in the order the functions take them) of ``cfg`` for ``tvm_target``."""
    module, spec = build_module(cfg, tvm_target, decode_batches, prefill_chunks, speculate)
    mod, params = module.export_tvm(spec=spec)
    return mod, [name for name, _ in params]
