"""The model families and features deployed today generate transformers' exact greedy tokens: rotary scaling
(llama3, linear, yarn, longrope, dynamic), Qwen3's q/k norms, Gemma 2 and 3, sliding windows (Mistral's,
Qwen2's, Qwen3's, Phi-3's; of 8 tokens, shorter than the longest prompt and than --max-seq-len). Each model is a
tiny transformers model made here with weights large enough that greedy decoding wanders over the vocabulary,
saved with ``save_pretrained`` and built from that folder; a batch of prompts of 1, 7 and 40 tokens, 24 new
tokens each. Features whose effect depends on the length (rotary scaling) take an
``original_max_position_embeddings`` of 16, well inside the prompts and the generated tokens."""

from __future__ import annotations

import copy
import re

import pytest

from .helpers import assert_gpu_greedy_matches, cli, record_launches_behind, transformers_greedy

transformers = pytest.importorskip("transformers", reason="pip install -e '.[test]' installs transformers")

NEW, MAX_SEQ_LEN, MAX_BATCH = 24, 80, 4
PROMPTS = [[17], [5, 7, 9, 11, 13, 2, 8], [(7 * i + 3) % 512 for i in range(40)]]
TINY = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256, num_hidden_layers=2,
            vocab_size=512, max_position_embeddings=4096)
ORIGINAL = 16  # original_max_position_embeddings: scaling shows within the prompts
WINDOW = 8  # sliding windows shorter than the prompts

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": ORIGINAL}
LINEAR = {"rope_type": "linear", "factor": 4.0}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
# Phi-3.5's longrope: 12 factors for a rotary dimension of 24 (head_dim 32, partial_rotary_factor 0.75, as Phi-4-mini).
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(12)],
            "long_factor": [1.0 + 0.5 * i for i in range(12)]}


def _config(name: str):
    """(config, class) of each case: a family with the feature under test."""
    if name == "llama3":
        return transformers.LlamaConfig(**TINY, rope_scaling=LLAMA3), transformers.LlamaForCausalLM
    if name == "linear":
        return transformers.LlamaConfig(**TINY, rope_scaling=LINEAR), transformers.LlamaForCausalLM
    if name == "yarn":  # Qwen2.5 with YaRN
        return transformers.Qwen2Config(**TINY, rope_scaling=YARN), transformers.Qwen2ForCausalLM
    if name == "longrope":  # Phi-3.5 / Phi-4-mini
        return (transformers.Phi3Config(**{**TINY, "max_position_embeddings": 4 * ORIGINAL}, pad_token_id=0,
                                        original_max_position_embeddings=ORIGINAL, partial_rotary_factor=0.75,
                                        rope_scaling=LONGROPE), transformers.Phi3ForCausalLM)
    if name == "qwen3":
        return transformers.Qwen3Config(**TINY, head_dim=48), transformers.Qwen3ForCausalLM
    if name == "mistral-window":  # every layer over a window of 8, shorter than the 40-token prompt
        return transformers.MistralConfig(**TINY, sliding_window=WINDOW), transformers.MistralForCausalLM
    if name == "qwen2-window":  # Qwen2's window, from layer max_window_layers on: every layer here
        return (transformers.Qwen2Config(**TINY, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0),
                transformers.Qwen2ForCausalLM)
    if name == "phi3-window":  # Phi-3-mini's window (2047 tokens in the 4k model)
        return transformers.Phi3Config(**TINY, sliding_window=WINDOW, pad_token_id=0), transformers.Phi3ForCausalLM
    if name == "qwen3-window":
        return (transformers.Qwen3Config(**TINY, head_dim=48, use_sliding_window=True, sliding_window=WINDOW,
                                         max_window_layers=0), transformers.Qwen3ForCausalLM)
    if name == "qwen2-mixed-window":  # from max_window_layers on: layer 0 global, layer 1 windowed
        return (transformers.Qwen2Config(**TINY, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
                transformers.Qwen2ForCausalLM)
    if name in ("gemma2-window", "gemma3-window"):  # Gemma's alternating windowed and global layers
        config, cls = _config(name.split("-")[0])
        config.sliding_window = WINDOW
        return config, cls
    if name == "gemma3-local-window":  # Gemma 3's first five layers are windowed: both of two
        return (transformers.Gemma3TextConfig(**TINY, head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW),
                transformers.Gemma3ForCausalLM)
    if name == "gemma2":  # final soft-capping, pre- and post-norms, query_pre_attn_scalar; no attention soft-cap
        return (transformers.Gemma2Config(**TINY, head_dim=32, query_pre_attn_scalar=24, attn_logit_softcapping=None,
                                          final_logit_softcapping=5.0), transformers.Gemma2ForCausalLM)
    if name == "gemma3":  # q/k norms, a rotary table per layer type (local theta 10000; global 1e6, linear x8)
        return (transformers.Gemma3TextConfig(**TINY, head_dim=32, query_pre_attn_scalar=24,
                                              layer_types=["sliding_attention", "full_attention"], rope_parameters={
                                                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                  "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                     "rope_theta": 1000000.0}}),
                transformers.Gemma3ForCausalLM)
    if name == "olmo2":  # q/k norms over the whole projections, norms after attention and MLP instead of before
        return transformers.Olmo2Config(**TINY, rms_norm_eps=1e-6), transformers.Olmo2ForCausalLM
    if name in ("gpt_neox", "gpt_neox-sequential"):  # Pythia: LayerNorms, biases, a quarter of each head rotated,
        # attention and MLP side by side (use_parallel_residual) or one after the other
        tiny = {k: v for k, v in TINY.items() if k != "num_key_value_heads"}
        return (transformers.GPTNeoXConfig(**tiny, use_parallel_residual=name == "gpt_neox"),
                transformers.GPTNeoXForCausalLM)
    if name in ("stablelm", "stablelm-parallel"):  # LayerNorms, a quarter of each head rotated; StableLM 2's q/k/v
        # biases and, in parallel, attention and MLP behind one norm
        return (transformers.StableLmConfig(**TINY, use_qkv_bias=name == "stablelm-parallel",
                                            use_parallel_residual=name == "stablelm-parallel"),
                transformers.StableLmForCausalLM)
    if name == "granite":  # its four multipliers, none 1
        return (transformers.GraniteConfig(**TINY, embedding_multiplier=4.0, residual_multiplier=0.5,
                                           attention_multiplier=0.1, logits_scaling=2.0), transformers.GraniteForCausalLM)
    if name == "olmoe":  # experts on every layer (4, two a token, not renormalised), q/k norms over all heads
        return (transformers.OlmoeConfig(**{**TINY, "intermediate_size": 64}, num_experts=4, num_experts_per_tok=2,
                                         pad_token_id=0, eos_token_id=2), transformers.OlmoeForCausalLM)
    if name == "cohere":  # Command-R: LayerNorms without biases, parallel behind one norm, rotary on interleaved
        # pairs, logit_scale, tied embeddings
        return (transformers.CohereConfig(**TINY, bos_token_id=1, eos_token_id=2, logit_scale=0.25),
                transformers.CohereForCausalLM)
    if name == "smollm3":  # every fourth layer without a rotary embedding (NoPE): the last of 4; a theta at which
        # rotation shows within the prompts (SmolLM3's 2e6 turns them by little)
        return (transformers.SmolLM3Config(**{**TINY, "num_hidden_layers": 4}, pad_token_id=0, bos_token_id=1,
                                           eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
                transformers.SmolLM3ForCausalLM)
    if name.startswith("falcon"):  # 7B's multi-query attention and MLP behind one norm; 40B's grouped queries behind
        # two norms (new_decoder_architecture); the first Falcons' heads of q, k and v together, one after the other
        tiny = {k: v for k, v in TINY.items() if k not in ("num_key_value_heads", "intermediate_size")}
        shape = {"falcon": {}, "falcon-new": {"new_decoder_architecture": True, "num_kv_heads": 2, "bias": True},
                 "falcon-sequential": {"multi_query": False, "parallel_attn": False}}[name]
        return transformers.FalconConfig(**tiny, ffn_hidden_size=256, bos_token_id=1, eos_token_id=2, **shape), \
            transformers.FalconForCausalLM
    if name == "dynamic":  # within max_position_embeddings, transformers' dynamic frequencies are the default ones
        return (transformers.LlamaConfig(**{**TINY, "max_position_embeddings": MAX_SEQ_LEN},
                                         rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
                transformers.LlamaForCausalLM)
    raise ValueError(name)


# The LayerNorm families' weights (and StableLM's biases), SmolLM3's four layers': sizes at which each prompt's
# greedy tokens move.
LIVELY = {"gpt_neox": (0.25,), "stablelm-parallel": (0.3, 0.5),
          "smollm3": (0.12,), "falcon": (0.2, 0.3), "falcon-new": (0.2, 0.3), "falcon-sequential": (0.2, 0.3)}
NORM_WEIGHTS = ("norm.weight", "ln_attn.weight", "ln_mlp.weight", "ln_f.weight")  # Falcon's names them ln_*


def _saved(name: str, folder):
    """The case's model with lively random weights (as tests/test_generation.py makes them), saved to ``folder``."""
    import torch

    config, cls = _config(name)
    torch.manual_seed(1)
    model = cls(config).eval()
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if p.dim() > 1:  # Gemma's post-norms: layers outweigh its scaled (and tied) embeddings only if they are small;
                # LayerNorm families flatten small weights into a token repeated: larger ones, of a size that moves
                p.normal_(0.0, 0.02 if name.startswith("gemma") and "embed" in param_name else LIVELY.get(name, (0.08,))[0])
            elif len(LIVELY.get(name, ())) > 1 and not param_name.endswith(NORM_WEIGHTS):  # biases, the norms' too
                p.normal_(0.0, LIVELY[name][1])
            elif "norm" in param_name or param_name.endswith(NORM_WEIGHTS):  # Gemma's norms scale by 1 + w
                p.normal_(0.0 if name.startswith("gemma") else 1.0, 0.1)
            else:
                p.normal_(0.0, 0.02)
    model.save_pretrained(folder)
    return model


def _reference(model, prompt, new=NEW):
    return transformers_greedy(model, prompt, new)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama3", "linear", "yarn", "longrope", "dynamic", "qwen3", "gemma2", "gemma3", "olmo2",
                                  "mistral-window", "qwen2-window", "qwen3-window", "phi3-window", "qwen2-mixed-window",
                                  "gemma2-window", "gemma3-window", "gemma3-local-window", "gpt_neox",
                                  "stablelm-parallel", "granite", "olmoe", "cohere", "smollm3", "falcon", "falcon-new",
                                  "falcon-sequential"])
def test_a_family_or_feature_matches_transformers(name, tmp_path):
    from autosched.generation import Generator

    model = _saved(name, tmp_path / "hf")
    # One static decode function (the batch of 3 padded to 4): the families differ in their layers, not in
    # how batches are padded, which tests/test_generation.py covers.
    cli("build", str(tmp_path / "hf"), "--generate", "-o", str(tmp_path / "art"), "--max-seq-len", str(MAX_SEQ_LEN),
        "--max-batch", str(MAX_BATCH), "--decode-batches", str(MAX_BATCH), "--db", str(tmp_path / "t.db"))
    gen = Generator(tmp_path / "art")
    results = gen.generate(PROMPTS, NEW)
    for prompt, result in zip(PROMPTS, results):
        assert result.error is None
        assert result.tokens == _reference(model, prompt), (name, len(prompt))
    assert all(len(set(r.tokens)) > 3 for r in results)  # greedy decoding moves: a comparison that can fail
    if name in ROPE_CASES:  # and the scaling shows: without it, the 40-token prompt continues otherwise
        assert results[2].tokens != _reference(_unscaled(model), PROMPTS[2]), name
    if name.endswith("window"):  # and the window shows: without it, the 40-token prompt continues otherwise
        assert results[2].tokens != _reference(_unwindowed(model), PROMPTS[2]), name
    if name == "gpt_neox":  # and the parallel block shows: one after the other, the prompt continues otherwise
        sequential = copy.deepcopy(model)
        for layer in sequential.gpt_neox.layers:
            layer.use_parallel_residual = False
        assert results[2].tokens != _reference(sequential, PROMPTS[2]), name
    if name == "granite":  # and its multipliers show: with them all 1 (the same weights), the prompt continues otherwise
        plain = transformers.GraniteForCausalLM(transformers.GraniteConfig(**TINY)).eval()
        plain.load_state_dict(model.state_dict())
        assert results[2].tokens != _reference(plain, PROMPTS[2]), name
    if name == "smollm3":  # and the NoPE layer shows: rotated like the others, the prompt continues otherwise
        rotated = copy.deepcopy(model)
        rotated.model.layers[3].self_attn.use_rope = 1
        assert results[2].tokens != _reference(rotated, PROMPTS[2]), name
    if name == "olmo2":  # and its norms show: with per-head q/k norms and Llama's pre-norms, otherwise
        assert results[2].tokens != _reference(_as_llama_norms(model), PROMPTS[2]), name
    if name in ("longrope", "mistral-window"):  # a sequence re-read, or its tokens dropped: no forks of a prefix
        forked = gen.generate([[1]], 2, prefix=[1, 2, 3])[0]
        assert "forks of a prefix are not supported" in forked.error and gen.live == []


ROPE_CASES = ("llama3", "linear", "yarn", "longrope")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mistral-window", "gemma2-window"])
def test_a_prompt_of_several_windows_prefills_in_chunks_of_a_window(name, tmp_path):
    """A prompt of 2.5 windows (20 tokens over a window of 8) beside a short one, in an artifact with a static
    chunk longer than the window: the long prompt goes in calls of a window (8, 8, 4: three, not 8 + 12 calls of
    a token), the short one beside its first, and both give transformers' greedy tokens, for a model windowed on
    every layer (one cache) and one whose windowed layers have a cache of their own (Gemma 2)."""
    from autosched.generation import Generator

    model = _saved(name, tmp_path / "hf")
    cli("build", str(tmp_path / "hf"), "--generate", "-o", str(tmp_path / "art"), "--max-seq-len", str(MAX_SEQ_LEN),
        "--max-batch", str(MAX_BATCH), "--decode-batches", "2", "--prefill-chunks", "16", "--db", str(tmp_path / "t.db"))
    gen = Generator(tmp_path / "art")
    prompts = [[(11 * i + 5) % 512 for i in range(20)], [3, 1, 4]]
    results = gen.generate(prompts, NEW)
    for prompt, result in zip(prompts, results):
        assert result.error is None
        assert result.tokens == _reference(model, prompt), (name, len(prompt))
    assert gen.stats["prefill_calls"] == 3 and gen.stats["prefill_tokens"] == 23
    assert results[0].tokens != _reference(_unwindowed(model), prompts[0])  # the window binds


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["mistral-window", "gemma2-window"])
def test_windowed_prefill_in_chunks_matches_transformers_on_the_gpu(name, tmp_path):
    """fp16 on the GPU, TVM's CUDA kernels for the sliding layers (the prefill over cached pages masked to the
    window): prompts of 1, 7 and 40 tokens over a window of 8 (the 40-token one in five calls), the first 16
    greedy tokens are transformers' (fp16, same GPU), or the first difference is a near-tie of its logits.
    With decode steps launched ahead (run_ahead: the step barrier before a windowed cache, and Gemma 2's two
    caches, are read) the same tokens."""
    import torch

    from autosched.generation import Generator

    model = _saved(name, tmp_path / "hf")
    cli("build", str(tmp_path / "hf"), "--generate", "--target", "cuda", "--dtype", "float16", "-o",
        str(tmp_path / "art"), "--max-seq-len", str(MAX_SEQ_LEN), "--max-batch", str(MAX_BATCH),
        "--db", str(tmp_path / "t.db"))
    model = model.to("cuda", torch.float16)
    gen = Generator(tmp_path / "art", run_ahead=False)
    results = gen.generate(PROMPTS, 16)
    assert gen.stats["prefill_calls"] == 5  # the 40-token prompt in windows of 8, the others beside its first
    assert_gpu_greedy_matches(model, PROMPTS, results, 16, max_margin=0.05)
    gen.run_ahead = True
    behind = record_launches_behind(gen)
    assert [r.tokens for r in gen.generate(PROMPTS, 16)] == [r.tokens for r in results]
    assert any(behind)


def _as_llama_norms(model):
    """OLMo 2's weights in Llama's layout: each norm before its attention or MLP, where OLMo 2 puts it after,
    and no q/k norms (per head, Qwen3's, takes a weight per head dimension, not per projection)."""
    import torch

    config = transformers.LlamaConfig(**TINY, rms_norm_eps=1e-6)
    plain = transformers.LlamaForCausalLM(config).eval()
    state = {name.replace("post_attention_layernorm", "input_layernorm")
             .replace("post_feedforward_layernorm", "post_attention_layernorm"): w
             for name, w in model.state_dict().items() if "q_norm" not in name and "k_norm" not in name}
    with torch.no_grad():
        plain.load_state_dict(state)
    return plain


def _unwindowed(model):
    """The same weights with a window longer than any sequence here."""
    config = model.config.__class__(**{**model.config.to_dict(), "sliding_window": 4096})
    plain = model.__class__(config).eval()
    plain.load_state_dict(model.state_dict())
    return plain


def _unscaled(model):
    """The same weights with the default rotary embedding."""
    config = model.config.__class__(**{**model.config.to_dict(), "rope_scaling": None, "rope_parameters": None})
    plain = model.__class__(config).eval()
    plain.load_state_dict(model.state_dict())
    return plain


def _cache_rope_cos(scaling: dict, scale: float, rotary_dim: int, theta: float, positions: int):
    """cos of every (position, dimension) as the KV cache's fused RoPE computes it (``switch_rope_freq_func``
    on ``position * scale``, as ``llama_rope_with_position_map`` calls it), compiled for the CPU."""
    import numpy as np
    import tvm
    from tvm import te, tirx
    from tvm.relax.frontend.nn.llm.position_embedding import switch_rope_freq_func

    def cos(s, d):
        value, _, bindings = switch_rope_freq_func(scaling)(s * tirx.const(scale, "float32"), d, rotary_dim, theta, "float32")
        for var, bound in bindings.items():
            value = tirx.Let(var, bound, value)
        return value

    out = te.compute((positions, rotary_dim), cos, name="cos")
    run = tvm.compile(te.create_prim_func([out]), target=tvm.target.Target({"kind": "llvm"}))
    result = tvm.runtime.empty((positions, rotary_dim), "float32", tvm.cpu())
    run(result)
    return result.numpy().astype(np.float64)


@pytest.mark.parametrize("name", ["llama3", "linear"])
def test_the_caches_rotary_frequencies_are_transformers(name):
    """llama3 and linear scaling run in the KV cache's fused RoPE: its cos for each position equals the cos of
    transformers' frequencies (``ROPE_INIT_FUNCTIONS``, as the model's rotary embedding computes it)."""
    import numpy as np
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from autosched.generation.decoder import config_from_hf

    config, _ = _config(name)
    ours = config_from_hf(config, "float32")
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[name](config, "cpu")
    assert attention_factor == 1.0
    positions = torch.arange(64, dtype=torch.float32)[:, None]
    theirs = torch.cat([positions * inv_freq[None, :]] * 2, dim=1).cos().double().numpy()
    scaling = ours.rope_scaling if name == "llama3" else {}
    scale = 1.0 / ours.rope_scaling["factor"] if name == "linear" else 1.0
    got = _cache_rope_cos(scaling, scale, ours.rotary_dim, ours.rope_theta, 64)
    assert np.abs(got - theirs).max() < 2e-5
    # and the scaling shows: unscaled frequencies differ
    assert np.abs(_cache_rope_cos({}, 1.0, ours.rotary_dim, ours.rope_theta, 64) - theirs).max() > 0.1


def test_rotary_scaling_and_new_families_read_from_the_config():
    """yarn and longrope carry transformers' own frequency tables and attention factor; Qwen3 its q/k norms;
    what the build cannot reproduce is refused in one line naming it."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from autosched.errors import UsageError
    from autosched.generation.decoder import config_from_hf

    for name in ("yarn", "longrope"):
        config, _ = _config(name)
        scaling = config_from_hf(config, "float32").rope_scaling
        inv_freq, factor = ROPE_INIT_FUNCTIONS[name](config, "cpu")
        assert scaling["inv_freq"] == inv_freq.tolist() and scaling["attention_factor"] == factor > 1.0
    longrope = config_from_hf(_config("longrope")[0], "float32")
    assert longrope.rotary_dim == 24 and longrope.rope_scaling["original_max_position_embeddings"] == ORIGINAL
    assert len(longrope.rope_scaling["long_inv_freq"]) == 12 != longrope.rope_scaling["inv_freq"]
    qwen3 = config_from_hf(_config("qwen3")[0], "float32")
    assert qwen3.family == "qwen3" and qwen3.qk_norm and qwen3.head_dim == 48 and not qwen3.qkv_bias
    gemma2 = config_from_hf(_config("gemma2")[0], "float32")
    assert gemma2.post_norms and gemma2.logit_softcap == 5.0 and gemma2.attn_scale == 24 ** -0.5
    gemma3 = config_from_hf(_config("gemma3")[0], "float32").rope_scaling
    local, global_ = gemma3["tables"]  # sorted by layer type: full_attention first
    assert gemma3["layer_tables"] == [1, 0] and global_["inv_freq"][1] != local["inv_freq"][1]
    neox = config_from_hf(_config("gpt_neox")[0], "float32")
    assert (neox.parallel_block, neox.rotary_dim, neox.norm, neox.qkv_bias, neox.tied_embeddings) == (
        "two_norms", 8, "layer", True, False)
    assert not config_from_hf(_config("gpt_neox-sequential")[0], "float32").parallel_block
    stablelm = config_from_hf(_config("stablelm-parallel")[0], "float32")
    assert (stablelm.parallel_block, stablelm.rotary_dim, stablelm.norm, stablelm.qkv_bias) == ("one_norm", 8, "layer", True)
    no_bias = {k: v for k, v in TINY.items() if k != "num_key_value_heads"}
    cohere = config_from_hf(_config("cohere")[0], "float32")
    assert (cohere.parallel_block, cohere.norm, cohere.logit_scale, cohere.tied_embeddings) == ("one_norm", "layer", 0.25, True)
    smol = config_from_hf(_config("smollm3")[0], "float32")
    table = smol.rope_scaling["inv_freq"]
    assert smol.nope_layers == [3] and len(table) == 16 and table[1] == pytest.approx(1e4 ** (-2 / 32), rel=1e-6)
    falcons = [config_from_hf(_config(n)[0], "float32") for n in ("falcon", "falcon-new", "falcon-sequential")]
    assert [(c.kv_heads, c.parallel_block, c.qkv_bias) for c in falcons] == [(1, "one_norm", False), (2, "two_norms", True),
                                                                              (4, "", False)]
    granite = config_from_hf(_config("granite")[0], "float32")
    assert (granite.embed_scale, granite.residual_scale, granite.attn_scale, granite.logit_scale) == (4.0, 0.5, 0.1, 0.5)
    olmoe = config_from_hf(_config("olmoe")[0], "float32")
    assert (olmoe.experts, olmoe.top_k, olmoe.expert_mlp, olmoe.renorm_topk, olmoe.sparse_layers, olmoe.qk_norm_whole) == (
        4, 2, 64, False, [0, 1], True)
    refused = {
        "rotary scaling 'longrope' is supported for phi3 models; this model is 'llama'":
            transformers.LlamaConfig(**TINY, rope_scaling={**LONGROPE, "original_max_position_embeddings": 16}),
        "attention_bias=True is not supported": transformers.LlamaConfig(**TINY, attention_bias=True),
        "mlp_bias=True is not supported": transformers.LlamaConfig(**TINY, mlp_bias=True),
        "attention soft-capping (attn_logit_softcapping=50.0) is not supported": transformers.Gemma2Config(**TINY),
        "GPT-NeoX with attention_bias=False is not supported": transformers.GPTNeoXConfig(**no_bias, attention_bias=False),
        "qk_layernorm=True is not supported": transformers.StableLmConfig(**TINY, qk_layernorm=True),
        "clip_qkv=8.0 is not supported": transformers.OlmoeConfig(**TINY, clip_qkv=8.0),
        "use_qk_norm=True is not supported": transformers.CohereConfig(**TINY, use_qk_norm=True),
        "Falcon with alibi=True is not supported": transformers.FalconConfig(**no_bias, ffn_hidden_size=256, alibi=True),
        "no_rope_layers) with rotary scaling 'linear'": transformers.SmolLM3Config(
            **{**TINY, "num_hidden_layers": 4}, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
    }
    from autosched.generation.build import lower_generation
    from autosched.target import parse_target

    with pytest.raises(UsageError, match="--prefill-chunks is not supported for a longrope model"):
        lower_generation(longrope, parse_target("llvm"), (), (8,))
    for says, config in refused.items():
        with pytest.raises(UsageError, match=re.escape(says)):
            config_from_hf(config, "float32")


def test_what_a_window_or_dynamic_scaling_cannot_do_is_refused_at_build(tmp_path):
    """A window whose layers rotate otherwise than TVM's windowed cache can (scaled, partial) is refused in one
    line when it binds (and builds as the model without a window when --max-seq-len is within it); dynamic
    scaling past max_position_embeddings too."""
    from autosched.generation.build import _check_limits
    from autosched.generation.decoder import config_from_hf

    mixed = config_from_hf(_config("qwen2-mixed-window")[0], "float32")
    assert mixed.sliding_window == WINDOW and mixed.sliding_layers == [1]
    _check_limits(mixed, MAX_SEQ_LEN, 1)
    gemma3 = config_from_hf(_config("gemma3-window")[0], "float32")
    assert gemma3.sliding_layers == [0]
    _check_limits(gemma3, MAX_SEQ_LEN, 1)  # its windowed layers' table is the default one
    scaled = transformers.Gemma3TextConfig(**TINY, head_dim=32, sliding_window=WINDOW, rope_parameters={
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})
    yarn = config_from_hf(transformers.Qwen2Config(**TINY, use_sliding_window=True, sliding_window=WINDOW,
                                                   max_window_layers=0, rope_scaling=YARN), "float32")
    phi4 = config_from_hf(transformers.Phi3Config(**TINY, sliding_window=WINDOW, partial_rotary_factor=0.75,
                                                  pad_token_id=0), "float32")
    for cfg, says in ((yarn, "a sliding window of 8 tokens with rotary scaling 'yarn' is not supported"),
                      (config_from_hf(scaled, "float32"),
                       "a sliding window of 8 tokens with rotary scaling 'linear' on its windowed layers is not supported"),
                      (phi4, "a sliding window of 8 tokens with a partial rotary embedding is not supported")):
        _check_limits(cfg, WINDOW, 1)
        with pytest.raises(Exception, match=re.escape(says + " for generation yet: use --max-seq-len 8 or less")):
            _check_limits(cfg, MAX_SEQ_LEN, 1)
    dynamic = config_from_hf(_config("dynamic")[0], "float32")
    _check_limits(dynamic, MAX_SEQ_LEN, 1)
    with pytest.raises(Exception, match=re.escape("rotary scaling 'dynamic' is supported up to --max-seq-len 80")):
        _check_limits(dynamic, MAX_SEQ_LEN + 1, 1)
    plain = config_from_hf(_config("mistral-window")[0], "float32")
    assert plain.sliding_window == WINDOW and plain.sliding_layers == [0, 1]
    _check_limits(plain, MAX_SEQ_LEN, 1)


def test_a_hugging_face_cache_folder_names_its_snapshot(tmp_path):
    """models--org--name as huggingface_hub downloads it: the snapshot refs/main names, else the only one; several
    and no ref, or none, are refused in one line."""
    from autosched.errors import UsageError
    from autosched.generation.build import model_folder

    cache = tmp_path / "models--org--tiny"
    for rev in ("aaa111", "bbb222"):
        (cache / "snapshots" / rev).mkdir(parents=True)
    with pytest.raises(UsageError, match="2 snapshots and no refs/main: give one"):
        model_folder(str(cache))
    (cache / "refs").mkdir()
    (cache / "refs" / "main").write_text("bbb222\n")
    assert model_folder(str(cache)) == cache / "snapshots" / "bbb222"
    assert model_folder(str(tmp_path / "plain")) == tmp_path / "plain"
    empty = tmp_path / "models--org--empty"
    (empty / "snapshots").mkdir(parents=True)
    with pytest.raises(UsageError, match="without snapshots"):
        model_folder(str(empty))


def test_a_model_in_the_hugging_face_cache_loads_from_its_snapshot(tmp_path):
    """A build of models--org--name reads the snapshot's checkpoint (the build itself: the families' tests)."""
    from autosched.generation.build import load_generation_model

    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "0123abc"
    model = _saved("granite", snapshot)
    loaded = load_generation_model(str(tmp_path / "hub" / "models--org--tiny"))
    assert loaded.config.family == "granite" and loaded.config.dtype == "float32" and loaded.eos_token_ids == [2]
    name = "model.layers.0.self_attn.o_proj.weight"
    assert loaded.state[name].equal(model.state_dict()[name])


@pytest.mark.slow
def test_a_sharded_bf16_checkpoint_builds_tensor_by_tensor_with_transformers_tokens(tmp_path):
    """save_pretrained's shards (model-0000x-of-0000y.safetensors and their index) of a bfloat16 model, built as
    float32: read a tensor at a time (the build never loads the model whole), the tokens of transformers' model
    loaded from the same folder; a folder's other safetensors are not read."""
    import torch

    from autosched.generation import Generator
    from autosched.generation.build import load_generation_model
    from autosched.generation.checkpoint import CheckpointTensors

    folder = tmp_path / "hf"
    model = _saved("llama3", tmp_path / "float")
    model.to(torch.bfloat16).save_pretrained(folder, max_shard_size="200KB")
    shards = sorted(p.name for p in folder.glob("model-*.safetensors"))
    assert len(shards) > 2 and (folder / "model.safetensors.index.json").is_file()
    (folder / "consolidated.safetensors").write_bytes(b"not a checkpoint of this format")
    loaded = load_generation_model(str(folder), "float32")
    assert loaded.hf is None and isinstance(loaded.state, CheckpointTensors)
    assert loaded.state["model.embed_tokens.weight"].dtype == torch.float32
    cli("build", str(folder), "--generate", "--dtype", "float32", "-o", str(tmp_path / "art"), "--max-seq-len",
        str(MAX_SEQ_LEN), "--max-batch", str(MAX_BATCH), "--decode-batches", str(MAX_BATCH), "--db", str(tmp_path / "t.db"))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    results = Generator(tmp_path / "art").generate(PROMPTS, NEW)
    assert [r.tokens for r in results] == [_reference(theirs, p) for p in PROMPTS]
