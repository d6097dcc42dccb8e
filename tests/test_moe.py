"""Mixture-of-experts models: the ``moe_gemm`` workload, the router's semantics, and Mixtral and Qwen3-MoE
generating transformers' exact greedy tokens (slow tier), with a tuned ``moe_gemm`` record applied."""

from __future__ import annotations

import copy
import json

import pytest

from .helpers import assert_gpu_greedy_matches, cli, transformers_greedy

NEW, MAX_SEQ_LEN, MAX_BATCH = 24, 80, 4
PROMPTS = [[17], [5, 7, 9, 11, 13, 2, 8], [(7 * i + 3) % 512 for i in range(40)]]
TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, vocab_size=512,
            max_position_embeddings=4096)


def test_moe_gemm_reference_is_each_rows_expert_product():
    """The float64 reference is, row by row, the row times its own expert's weight (numpy)."""
    import numpy as np
    import torch

    from autosched.workloads import get_operator, make_workload

    wl = make_workload("moe_gemm", "m=6,e=3,n=5,k=4")
    op = get_operator("moe_gemm")
    inputs = op.make_inputs(wl, torch.Generator().manual_seed(0), "cpu")
    x, expert, w = (t.numpy() for t in inputs)
    assert expert.dtype == np.int32 and w.shape == (3, 5, 4)
    want = np.stack([x[i].astype(np.float64) @ w[expert[i]].astype(np.float64).T for i in range(6)])
    np.testing.assert_allclose(op.reference(wl, inputs)[0].numpy(), want, rtol=1e-12)
    assert op.flops(wl) == 2 * 6 * 5 * 4
    assert op.preset("mixtral-8x7b-down-decode").shape == {"m": 2, "e": 8, "n": 4096, "k": 14336}
    assert op.preset("qwen3-30b-a3b-gate-up-prefill").shape == {"m": 4096, "e": 128, "n": 1536, "k": 2048}


def test_moe_gemm_kernel_matches_its_reference_on_the_cpu():
    """The space's default point, compiled for the CPU, computes the reference (a float32 and a float16 case)."""
    from autosched.target import parse_target
    from autosched.task import Task
    from autosched.workloads import make_workload

    from .helpers import check_point

    target = parse_target("llvm")
    for shape, dtype in (("m=10,e=4,n=48,k=40", "float32"), ("m=4,e=3,n=32,k=16", "float16")):
        task = Task.from_workload(make_workload("moe_gemm", shape, dtype))
        space = task.space(target)
        assert space.name == "moe_matmul"
        assert check_point(task, space, space.default(), target) < (1e-5 if dtype == "float32" else 4e-3)


def _router(logits, k, renorm):
    """Our MoE block's routing in numpy: softmax over the experts, the top k, renormalised or not."""
    import numpy as np

    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    chosen = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(probs, chosen, -1)
    return (weights / weights.sum(-1, keepdims=True) if renorm else weights), chosen


def test_router_semantics_are_each_models():
    """Mixtral renormalises the top-k probabilities (a softmax over the chosen logits); Qwen3-MoE does where
    norm_topk_prob says so. transformers' routers agree with ours, and the config reads each choice."""
    import numpy as np
    import torch
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    from autosched.generation.decoder import config_from_hf

    torch.manual_seed(0)
    x = torch.randn(5, 64)
    mixtral = transformers.MixtralConfig(**TINY, intermediate_size=32, num_local_experts=6, num_experts_per_tok=2)
    for config, router_cls in [(mixtral, MixtralTopKRouter)] + [
            (transformers.Qwen3MoeConfig(**TINY, intermediate_size=96, moe_intermediate_size=32, num_experts=6,
                                         num_experts_per_tok=3, norm_topk_prob=norm), Qwen3MoeTopKRouter)
            for norm in (False, True)]:
        ours = config_from_hf(config, "float32")
        router = router_cls(config)
        with torch.no_grad():
            torch.nn.init.normal_(router.weight)
            _, theirs_w, theirs_i = router(x)
            logits = (x @ router.weight.T).double().numpy()
        weights, chosen = _router(logits, ours.top_k, ours.renorm_topk)
        assert (chosen == theirs_i.numpy()).all()
        np.testing.assert_allclose(weights, theirs_w.double().numpy(), rtol=1e-5)
        if ours.renorm_topk:  # = the softmax over the chosen logits alone
            top = np.take_along_axis(logits, chosen, -1)
            np.testing.assert_allclose(weights, np.exp(top) / np.exp(top).sum(-1, keepdims=True), rtol=1e-9)
    assert config_from_hf(mixtral, "float32").renorm_topk


def test_sparse_layers_and_refusals_come_from_the_config():
    import transformers

    from autosched.errors import UsageError
    from autosched.generation.decoder import config_from_hf

    mixtral = config_from_hf(transformers.MixtralConfig(**TINY, intermediate_size=32, num_local_experts=4), "float32")
    assert (mixtral.family, mixtral.experts, mixtral.top_k, mixtral.expert_mlp) == ("mixtral", 4, 2, 32)
    assert mixtral.sparse_layers == [0, 1] and not mixtral.qk_norm
    qwen = config_from_hf(transformers.Qwen3MoeConfig(**{**TINY, "num_hidden_layers": 4}, intermediate_size=96,
                                                      moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                                      decoder_sparse_step=2, mlp_only_layers=[3]), "float32")
    assert qwen.sparse_layers == [1] and qwen.qk_norm and qwen.mlp == 96 and qwen.expert_mlp == 32
    qwen2 = config_from_hf(_config("qwen2_moe")[0], "float32")
    assert (qwen2.sparse_layers, qwen2.shared_expert_mlp, qwen2.expert_mlp, qwen2.qkv_bias, qwen2.renorm_topk) == (
        [0], 64, 48, True, False)
    config = transformers.MixtralConfig(**TINY, intermediate_size=32, num_local_experts=4)
    config.shared_expert_intermediate_size = 16
    with pytest.raises(UsageError, match="shared experts"):
        config_from_hf(config, "float32")


def _config(name: str):
    import transformers

    if name == "mixtral":
        return (transformers.MixtralConfig(**TINY, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2),
                transformers.MixtralForCausalLM)
    if name == "qwen2_moe":  # q/k/v biases; layer 0 sparse with a gated shared expert, layer 1 dense; top-2 of 4
        return (transformers.Qwen2MoeConfig(**TINY, intermediate_size=96, moe_intermediate_size=48,
                                            shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                                            norm_topk_prob=False, mlp_only_layers=[1]), transformers.Qwen2MoeForCausalLM)
    # Qwen3-MoE: layer 0 sparse, layer 1 dense (mlp_only_layers); top-3 of 6, not renormalised
    return (transformers.Qwen3MoeConfig(**TINY, head_dim=32, intermediate_size=96, moe_intermediate_size=48,
                                        num_experts=6, num_experts_per_tok=3, norm_topk_prob=False,
                                        mlp_only_layers=[1]), transformers.Qwen3MoeForCausalLM)


def _saved(name: str, folder):
    """The tiny model with lively weights, saved. The router's scale was checked: with the renormalisation flipped
    (Mixtral's, or Qwen3-MoE's norm_topk_prob) the greedy tokens differ, so the comparison can fail."""
    import torch

    config, cls = _config(name)
    torch.manual_seed(1)
    model = cls(config).eval()
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if "norm" in param_name:
                p.normal_(1.0, 0.1)
            elif param_name.endswith("gate.weight"):  # the router: logits of spread ~1, neither tied nor so far
                p.normal_(0.0, 0.15)                  # apart that the top expert takes all (renormalising shows)
            else:
                p.normal_(0.0, 0.1 if p.dim() > 1 else 0.02)
    model.save_pretrained(folder)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_moe_family_matches_transformers(name, tmp_path):
    from autosched.generation import Generator

    model = _saved(name, tmp_path / "hf")
    cli("build", str(tmp_path / "hf"), "--generate", "-o", str(tmp_path / "art"), "--max-seq-len", str(MAX_SEQ_LEN),
        "--max-batch", str(MAX_BATCH), "--db", str(tmp_path / "t.db"))
    results = Generator(tmp_path / "art").generate(PROMPTS, NEW)
    for prompt, result in zip(PROMPTS, results):
        assert result.error is None
        assert result.tokens == transformers_greedy(model, prompt, NEW), (name, len(prompt))
    assert all(len(set(r.tokens)) > 3 for r in results)
    if name == "qwen2_moe":  # and the shared expert shows: without it, the 40-token prompt continues otherwise
        alone = copy.deepcopy(model)
        alone.model.layers[0].mlp.shared_expert.down_proj.weight.data.zero_()
        assert results[2].tokens != transformers_greedy(alone, PROMPTS[2], NEW)


@pytest.mark.slow
def test_a_tuned_moe_gemm_record_is_applied_by_the_build(tmp_path):
    """``autosched tune moe_gemm`` on the CPU at a shape the model's decode step has, then a build with that
    database: the manifest says that kernel's schedule came from the database, and the tokens are still
    transformers'."""
    from autosched.generation import Generator

    model = _saved("mixtral", tmp_path / "hf")
    build = ("build", str(tmp_path / "hf"), "--generate", "--max-seq-len", str(MAX_SEQ_LEN), "--max-batch", "1")
    cli(*build, "-o", str(tmp_path / "plain"))
    kernels = json.loads((tmp_path / "plain" / "manifest.json").read_text())["workload_kernels"]
    moe = {name: k for name, k in kernels.items() if k["workload"].startswith("moe_gemm[")}
    assert moe and {k["space"] for k in moe.values()} == {"moe_matmul"}
    assert {k["schedule"] for k in moe.values()} == {"default point"}
    key = min(k["workload"] for k in moe.values())  # e.g. moe_gemm[m=2,e=4,n=192,k=64]:float32
    shape = key[len("moe_gemm["):key.index("]")]
    db = tmp_path / "tuned.db"
    cli("tune", "moe_gemm", "--shape", shape, "--trials", "8", "--db", str(db))
    cli(*build, "-o", str(tmp_path / "tuned"), "--db", str(db))
    kernels = json.loads((tmp_path / "tuned" / "manifest.json").read_text())["workload_kernels"]
    assert {k["schedule"] for k in kernels.values() if k["workload"] == key} == {"database"}
    result = Generator(tmp_path / "tuned").generate([PROMPTS[1]], NEW)[0]
    assert result.error is None and result.tokens == transformers_greedy(model, PROMPTS[1], NEW)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_expert_weights_load_fused_or_per_expert(name, tmp_path):
    """The experts' weights as a loaded model holds them (fused ``experts.gate_up_proj``/``down_proj``) and as
    ``save_pretrained`` writes them (one tensor per expert and projection) map onto the same parameters."""
    import torch
    from safetensors.torch import load_file

    from autosched.generation.decoder import config_from_hf, weights_from_hf

    model = _saved(name, tmp_path)
    cfg = config_from_hf(model.config, "float32")
    fused = weights_from_hf(model.state_dict(), cfg)
    per_expert = weights_from_hf(load_file(str(tmp_path / "model.safetensors")), cfg)
    assert sorted(fused) == sorted(per_expert)
    assert "layers.0.mlp.experts_up" in fused and fused["layers.0.mlp.experts_up"].shape == (
        cfg.experts, 2 * cfg.expert_mlp, cfg.hidden)
    for key in fused:
        assert torch.equal(fused[key], per_expert[key]), key
    if name == "qwen3_moe":  # layer 1 is dense (mlp_only_layers)
        assert "layers.1.mlp.up.weight" in fused and "layers.1.mlp.experts_up" not in fused


@pytest.mark.gpu
def test_mixtral_dimensions_in_half_precision_match_transformers_on_the_gpu():
    """Mixtral-8x7B's layer (hidden 4096, 8 experts of 14336, top 2, 32 heads over 8 K/V heads), two of them and a
    vocabulary of 8000, random weights scaled so that activations stay near 1 and the head's logits spread over a
    few units (greedy choices rarely near-ties), fp16 on the GPU, built through the Python API (no folder: the
    experts alone are 5.6 GB): the 8 greedy tokens of each prompt are transformers' (fp16, same GPU), or the first
    difference is a near-tie of transformers' logits (its margin in the message)."""
    from .helpers import gpu_generator, random_mixtral_on_gpu

    model = random_mixtral_on_gpu(4096, 14336, 32, 8)
    generator, report = gpu_generator(model, "mixtral-2-layers", 128, (2,))
    # The static decode step's expert products are moe_gemm kernels, which the CUDA space serves.
    experts = [kernel for kernel in report.workloads.values() if kernel["workload"].startswith("moe_gemm")]
    assert experts and all(kernel["space"] == "gpu_moe_matmul" for kernel in experts), report.workloads
    prompts = [[(37 * i + 11) % 8000 for i in range(7)], [(101 * i + 5) % 8000 for i in range(40)]]
    results = generator.generate(prompts, 8)
    assert_gpu_greedy_matches(model, prompts, results, 8, max_margin=0.1)
