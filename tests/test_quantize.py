"""Quantised generation builds (``build --generate --quantize q4f16|q4f16_zp|q8f16|fp8``) and ``autosched eval``.

The weights are quantised at build time as ``dequant_gemm`` reads them; the artifact's logits are those of a
float64 model holding the same dequantised weights (exact up to fp32 accumulation order), on the dynamic
prefill, a static prefill chunk and a static decode step. A tiny Llama trained here on a synthetic Markov
chain measures what the schemes cost: its perplexity (``autosched eval``) and greedy tokens against its fp32
build."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from .helpers import cli

transformers = pytest.importorskip("transformers", reason="pip install -e '.[test]' installs transformers")

MAX_SEQ_LEN = 64


def _run(capsys, *args) -> tuple[int, list[str]]:
    """``autosched ARGS`` in this process: (exit code, autosched's lines on stderr: not transformers' progress bars)."""
    code, _, lines = _run_out(capsys, *args)
    return code, lines


def _run_out(capsys, *args) -> tuple[int, str, list[str]]:
    """(exit code, stdout, autosched's lines on stderr) of ``autosched ARGS`` run in this process."""
    from autosched.cli import main

    capsys.readouterr()
    code = main(list(args))
    said = capsys.readouterr()
    return code, said.out, [line for line in said.err.splitlines() if line.strip() and "it/s]" not in line]


# ---- fast: the quantisation itself and what is refused ----------------------------------------------------


@pytest.mark.parametrize("name, bits, dtype", [("q4f16", 4, "float32"), ("q8f16", 8, "float16")])
def test_quantized_weights_are_what_dequant_gemm_reads_rounded_to_the_nearest_level(name, bits, dtype):
    """Codes and scales in dequant_gemm's layout (its own reference dequantises them): every weight within half
    a level of its float value, each group's largest magnitude on the top level exactly."""
    import torch

    from autosched.generation.quantize import quantize_weight
    from autosched.workloads import get_operator, make_workload

    from .helpers import dequantize_weight

    n, k = 6, 256
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 0.05
    weight[2, :128] = 0.0  # an all-zero group quantises to zeros
    codes, scales = quantize_weight(weight, name, dtype)
    group = 128 if bits == 4 else k
    assert codes.dtype == (torch.uint8 if bits == 4 else torch.int8)
    assert tuple(codes.shape) == (n, k // 2 if bits == 4 else k) and tuple(scales.shape) == (n, k // group)
    assert scales.dtype == getattr(torch, dtype)
    wl = make_workload("dequant_gemm", {"m": 1, "n": n, "k": k}, dtype, {"bits": bits, "group": group})
    ours = get_operator("dequant_gemm").dequantize(wl, codes, scales)
    assert torch.equal(ours.to(getattr(torch, dtype)).double(), dequantize_weight(codes, scales, name, k, dtype))
    step = scales.double().repeat_interleave(group, dim=1)
    assert bool(((ours - weight).abs() <= step / 2 + 1e-12).all())
    assert bool((ours[2, :128] == 0).all())
    top = 7 if bits == 4 else 127
    levels = (ours / step).round()
    assert float(levels.abs().max()) == top and float(levels.min()) >= -top  # symmetric: 4-bit code 0 (-8) unused
    peak = weight.abs().reshape(n, k // group, group).argmax(-1)
    assert bool((levels.reshape(n, k // group, group).gather(-1, peak[..., None]).abs()[[0, 1, 3, 4, 5]] == top).all())


def test_q4f16_zp_weights_are_what_dequant_gemm_with_zero_points_reads():
    """q4f16_zp's codes, scales and zero points in dequant_gemm's zeros=1 layout (its own reference dequantises
    them): every weight within half a level of its float value, a group's range (0 included) spanning the 16
    levels, zero points where a group's minimum puts them (0 for a group of positive weights)."""
    import torch

    from autosched.generation.quantize import quantize_weight
    from autosched.workloads import get_operator, make_workload

    from .helpers import dequantize_weight

    n, k = 6, 256
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 0.05
    weight[2, :128] = 0.0  # an all-zero group quantises to zeros
    weight[3, 128:] = weight[3, 128:].abs() + 0.01  # positive weights: zero point 0
    codes, scales, zeros = quantize_weight(weight, "q4f16_zp", "float16")
    assert (codes.dtype, scales.dtype, zeros.dtype) == (torch.uint8, torch.float16, torch.uint8)
    assert tuple(codes.shape) == (n, k // 2) and tuple(scales.shape) == tuple(zeros.shape) == (n, k // 128)
    wl = make_workload("dequant_gemm", {"m": 1, "n": n, "k": k}, "float16", {"bits": 4, "group": 128, "zeros": 1})
    ours = get_operator("dequant_gemm").dequantize(wl, codes, scales, zeros)
    assert torch.equal(ours.half().double(), dequantize_weight(codes, scales, "q4f16_zp", k, "float16", zeros))
    step = scales.double().repeat_interleave(128, dim=1)
    assert bool(((ours - weight).abs() <= step / 2 + 1e-12).all())
    assert bool((ours[2, :128] == 0).all()) and int(zeros[3, 1]) == 0 and int(zeros.max()) <= 15
    assert int(zeros[[0, 1, 4, 5]].min()) > 0  # normal weights: the zero point inside the range
    nibbles = torch.stack([codes & 15, codes >> 4], dim=-1).reshape(n, k // 128, 128)
    assert bool((nibbles.amax(-1) - nibbles.amin(-1) >= 14)[[0, 1, 3, 4, 5]].all())  # the levels are used


def test_fp8_weights_are_the_nearest_e4m3_values_of_w_over_a_channels_scale():
    """fp8: uint8 bits of E4M3FN codes [n, k] and one scale per output channel (largest magnitude / 448 in the
    model's dtype); each code is ml_dtypes' round-to-nearest-even E4M3 of w / s, each row's largest magnitude
    on 448, and dequant_gemm's fmt=e4m3 reference dequantises them as dequantize_weight does."""
    import ml_dtypes
    import torch

    from autosched.generation.quantize import quantize_weight
    from autosched.workloads import get_operator, make_workload

    from .helpers import dequantize_weight

    n, k = 6, 96
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 0.05
    weight[1, :8] = torch.tensor([1e-6, -1e-6, 3e-5, 0, 0, 0, 0, 0], dtype=torch.float64)  # subnormal codes
    weight[2] = 0.0  # an all-zero row quantises to zeros against a scale of one
    for dtype in ("float16", "float32"):
        codes, scales = quantize_weight(weight, "fp8", dtype)
        assert (codes.dtype, tuple(codes.shape), tuple(scales.shape)) == (torch.uint8, (n, k), (n, 1))
        assert scales.dtype == getattr(torch, dtype) and float(scales[2, 0]) == 1.0
        expected = (weight / scales.double()).numpy().astype(ml_dtypes.float8_e4m3fn)
        assert np.array_equal(codes.numpy(), expected.view(np.uint8))
        wl = make_workload("dequant_gemm", {"m": 1, "n": n, "k": k}, dtype, {"bits": 8, "group": k, "fmt": "e4m3"})
        ours = get_operator("dequant_gemm").dequantize(wl, codes, scales)
        assert torch.equal(ours.to(getattr(torch, dtype)).double(), dequantize_weight(codes, scales, "fp8", k, dtype))
        levels = codes.view(torch.float8_e4m3fn).double()
        assert bool((levels.abs().amax(1)[[0, 1, 3, 4, 5]] == 448).all()) and bool((ours[2] == 0).all())
        assert int(((codes & 0x7F) < 8).sum()) > 3  # some subnormal codes (and zeros) are used
        assert bool(((ours - weight).abs() <= 448 / 16 * scales.double() + 1e-12).all())


def test_group_sizes_follow_k_and_a_k_the_scheme_cannot_group_is_refused():
    from autosched.errors import UsageError
    from autosched.generation.decoder import DecoderConfig
    from autosched.generation.quantize import check_quantizable, group_size

    assert [group_size("q4f16", k) for k in (4096, 11008, 192, 96)] == [128, 128, 64, 32]
    assert group_size("q8f16", 11008) == 11008  # one scale per output channel
    with pytest.raises(UsageError, match="K=48, not a multiple of 32"):
        group_size("q4f16", 48)
    moe = DecoderConfig("mixtral", 512, 128, 4, 2, 32, 2, 256, experts=4, top_k=2, expert_mlp=256, sparse_layers=[0, 1])
    with pytest.raises(UsageError, match="mixture-of-experts models"):
        check_quantizable(moe, "q4f16")
    with pytest.raises(UsageError, match="'fp4' is not a scheme: use q4f16, q4f16_zp, q8f16 or fp8"):
        group_size("fp4", 128)
    assert group_size("fp8", 11008) == 11008
    # dequant_gemm's group: its usual sizes or any other positive one (k: a scale per output channel)
    from autosched.workloads import make_workload

    assert make_workload("dequant_gemm", {"k": 11008}, "float16", {"bits": 8, "group": "11008"}).attrs_dict["group"] == 11008
    for bad in ("0", "-128", "row", True):
        with pytest.raises(UsageError, match="or another positive whole number"):
            make_workload("dequant_gemm", {"k": 256}, "float16", {"bits": 8, "group": bad})


def test_bad_quantize_input_is_one_line_and_exit_2(capsys, tmp_path):
    """An unknown scheme (refused before the model loads), --quantize without --generate, and a model whose
    K q4f16 cannot group (hidden 48): one line each, exit code 2, nothing written."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = str(tmp_path / "art")
    for args, says in (
        (["build", "hf-llama", "--generate", "--quantize", "q3", "-o", out], "'q3' is not a scheme"),
        (["tune-model", "hf-llama", "--generate", "--quantize", "int4"], "'int4' is not a scheme"),
        (["build", "hf-llama", "--quantize", "q4f16", "-o", out], "add --generate"),
        (["build", "hf-llama", "--quantize", "fp8", "-o", out], "--quantize fp8 applies to text generation builds"),
    ):
        code, lines = _run(capsys, *args)
        assert code == 2 and len(lines) == 1 and says in lines[0], (args, lines)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path / "odd")
    code, lines = _run(capsys, "build", str(tmp_path / "odd"), "--generate", "--quantize", "q4f16", "-o", out)
    assert code == 2 and len(lines) == 1 and "K=48, not a multiple of 32: use --quantize q8f16" in lines[0], lines
    assert not (tmp_path / "art").exists()


# ---- slow: built artifacts ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from .test_generation import _saved_model

    root = tmp_path_factory.mktemp("quant")
    return _saved_model("llama", root / "hf"), root


def _quantized(tiny_llama, scheme: str):
    """The tiny Llama built with ``--quantize scheme`` (once per module)."""
    _, root = tiny_llama
    artifact = root / f"art-{scheme}"
    if not artifact.exists():
        _build(root / "hf", artifact, "--decode-batches", "1", "--prefill-chunks", "8", "--quantize", scheme)
    return artifact


def _build(folder, out, *extra):
    cli("build", str(folder), "--generate", "-o", str(out), "--max-seq-len", str(MAX_SEQ_LEN), "--max-batch", "2",
        "--db", str(out) + ".db", *extra)
    return out


def _reference_model(hf, artifact):
    """A float64 copy of ``hf`` holding the artifact's dequantised projections (dequant_gemm's own reference
    dequantises them), q/k/v and gate/up split back."""
    import copy

    import torch

    from autosched.artifact import load_generation_artifact
    from autosched.generation.quantize import scheme
    from autosched.workloads import get_operator, make_workload

    _, params, manifest, _ = load_generation_artifact(artifact)
    named = {name: torch.from_numpy(p.numpy()) for name, p in zip(manifest["param_names"], params)}
    cfg = manifest["decoder"]
    bits, fmt = manifest["quantization"]["bits"], scheme(manifest["quantization"]["scheme"]).fmt
    ref = copy.deepcopy(hf).double()
    state = ref.state_dict()

    def weight(prefix):
        codes, scales, zeros = named[prefix + ".qweight"], named[prefix + ".scales"], named.get(prefix + ".zeros")
        n, k = codes.shape[0], codes.shape[1] * (2 if bits == 4 else 1)
        group = k // scales.shape[1]
        attrs = {"bits": bits, "group": group, "zeros": int(zeros is not None), "fmt": fmt}
        wl = make_workload("dequant_gemm", {"m": 1, "n": n, "k": k}, cfg["dtype"], attrs)
        return get_operator("dequant_gemm").dequantize(wl, codes, scales, zeros)

    q, kv = cfg["heads"] * cfg["head_dim"], cfg["kv_heads"] * cfg["head_dim"]
    for i in range(cfg["layers"]):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        qkv = weight(ours + "attn.qkv")
        for name, part in zip("qkv", torch.split(qkv, [q, kv, kv])):
            state[f"{theirs}self_attn.{name}_proj.weight"] = part
        state[theirs + "self_attn.o_proj.weight"] = weight(ours + "attn.o")
        gate, up = torch.split(weight(ours + "mlp.up"), cfg["mlp"])
        state[theirs + "mlp.gate_proj.weight"], state[theirs + "mlp.up_proj.weight"] = gate, up
        state[theirs + "mlp.down_proj.weight"] = weight(ours + "mlp.down")
    ref.load_state_dict(state)
    return ref


def assert_functions_match(artifact, ids, expected, chunk: int = 8, relative: float = 2e-5, chunk_expected=None):
    """The artifact's dynamic prefill (every position), its ``prefill_t<chunk>`` chunk over the first ``chunk``
    ids and its ``decode_b1`` step give ``expected`` (float64 logits of ``ids``; the chunk ``chunk_expected``
    where given: W8A8's) within ``relative`` of its largest; returns that tolerance."""
    from autosched.generation.evaluate import all_logits
    from autosched.generation.model import LoadedModel

    tolerance = relative * np.abs(expected).max()
    model = LoadedModel.load(artifact)
    np.testing.assert_allclose(all_logits(model, ids), expected, rtol=0, atol=tolerance)
    model.add(0)
    logits = model.forward(f"prefill_t{chunk}", [0], [chunk], ids[:chunk], prefill=True,
                           logit_positions=np.arange(chunk))
    chunk_expected = expected if chunk_expected is None else chunk_expected
    np.testing.assert_allclose(logits.numpy().reshape(chunk, -1), chunk_expected[:chunk], rtol=0, atol=tolerance)
    model.forward("batch_prefill", [0], [len(ids) - chunk - 1], ids[chunk:-1], prefill=True)
    step = model.forward("decode_b1", [0], [1], ids[-1:], prefill=False)
    np.testing.assert_allclose(step.numpy().reshape(-1), expected[-1], rtol=0, atol=tolerance)
    return tolerance


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["q4f16", "q8f16", "q4f16_zp", "fp8"])
def test_quantized_logits_equal_a_float64_model_of_the_same_dequantised_weights(tiny_llama, scheme):
    """Every position of the dynamic prefill (TVM's schedule of the dequantising TE), a static prefill chunk
    and a static decode step (dequant_gemm kernels) give the float64 reference's logits up to fp32
    accumulation order, and differ from the float model's by far more than that tolerance."""
    import copy

    import torch


    hf, root = tiny_llama
    artifact = _quantized(tiny_llama, scheme)
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["quantization"]["scheme"] == scheme and manifest["decoder"]["quantize"] == scheme
    kernels = [w["workload"] for w in manifest["workload_kernels"].values()]
    assert sum(k.startswith("dequant_gemm[m=1,") for k in kernels) == 4  # qkv, o, up, down of decode_b1
    assert sum(k.startswith("dequant_gemm[m=8,") for k in kernels) == 4  # and of the chunk of 8
    assert {k.split("]")[0].split(",", 1)[1] for k in kernels if k.startswith("gemm[")} == {"n=512,k=128"}  # the LM head

    ids = [5, 7, 9, 11, 13, 2, 8, 100, 200, 3, 3, 3, 4, 42, 43, 44, 45, 46, 17, 301]
    with torch.no_grad():
        ref = _reference_model(hf, artifact)(torch.tensor([ids])).logits[0].numpy()
        floats = copy.deepcopy(hf).double()(torch.tensor([ids])).logits[0].numpy()
    tolerance = assert_functions_match(artifact, ids, ref)
    assert np.abs(ref - floats).max() > 20 * tolerance  # the weights were quantised


@pytest.mark.slow
def test_eval_reads_text_or_token_ids_and_its_perplexity_is_the_float64_models(tiny_llama, tmp_path, capsys):
    """``autosched eval``: a text through a local tokenizer and the same ids from a file give one perplexity, that
    of the float64 model of the same weights over the same windows of 16 tokens; bad input is one line, exit 2."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    hf, _ = tiny_llama
    artifact = _quantized(tiny_llama, "q4f16")
    words = Tokenizer(models.WordLevel({"[UNK]": 0, **{f"w{i}": i for i in range(1, 512)}}, unk_token="[UNK]"))
    words.pre_tokenizer, words.decoder = pre_tokenizers.Whitespace(), decoders.WordPiece()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]").save_pretrained(tmp_path / "tok")
    ids = [int(i) for i in np.random.default_rng(0).integers(1, 512, 100)]
    (tmp_path / "text.txt").write_text(" ".join(f"w{i}" for i in ids), encoding="utf-8")
    (tmp_path / "ids.txt").write_text(",".join(map(str, ids[:50])) + "\n" + " ".join(map(str, ids[50:])))
    base = ["eval", str(artifact), "--max-seq-len", "16", "--format", "json"]
    code, out, _ = _run_out(capsys, *base, "--text", str(tmp_path / "text.txt"), "--tokenizer", str(tmp_path / "tok"))
    assert code == 0
    from_text = json.loads(out)
    code, out, _ = _run_out(capsys, *base, "--token-ids", str(tmp_path / "ids.txt"))
    assert code == 0 and json.loads(out) == from_text
    assert (from_text["windows"], from_text["scored_tokens"], from_text["weights"]) == (7, 6 * 15 + 3, "q4f16")
    reference = _reference_model(hf, artifact)
    nll = []
    with torch.no_grad():
        for start in range(0, 100, 16):
            window = ids[start : start + 16]
            logits = reference(torch.tensor([window])).logits[0, :-1]
            nll += (-torch.log_softmax(logits, -1)[torch.arange(len(window) - 1), window[1:]]).tolist()
    assert from_text["perplexity"] == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-5)

    (tmp_path / "latin1.txt").write_bytes("w5 caf\u00e9".encode("latin-1"))
    (tmp_path / "big.txt").write_text("1 2 999")
    (tmp_path / "word.txt").write_text("1 2 x3")
    for args, says in (
        (["--text", str(tmp_path / "text.txt"), "--token-ids", str(tmp_path / "ids.txt")], "give one of them"),
        (["--token-ids", str(tmp_path / "none.txt")], "is not a file"),
        (["--text", str(tmp_path / "latin1.txt"), "--tokenizer", str(tmp_path / "tok")], "is not UTF-8"),
        (["--text", str(tmp_path / "text.txt")], "--text needs a tokenizer"),
        (["--token-ids", str(tmp_path / "big.txt")], "token id 999 is outside the artifact's vocabulary (0 to 511)"),
        (["--token-ids", str(tmp_path / "word.txt")], "'x3' is not a token id"),
        (["--token-ids", str(tmp_path / "ids.txt"), "--max-seq-len", "65"], "holds 2 to 64 tokens"),
    ):
        code, _, lines = _run_out(capsys, "eval", str(artifact), *args)
        assert code == 2 and len(lines) == 1 and says in lines[0], (args, lines)


LIKELY = 0.8  # the probability of a token's likely successor; each of four others: 0.05


def _markov_chain(vocab: int, seed: int = 0):
    """Each token's likely successor and four others."""
    rng = np.random.default_rng(seed)
    likely = rng.permutation(vocab)
    others = np.stack([rng.choice(np.setdiff1d(np.arange(vocab), [likely[t]]), 4, replace=False) for t in range(vocab)])
    return likely, others


def _sample(chain, rows: int, length: int, seed: int) -> np.ndarray:
    likely, others = chain
    rng = np.random.default_rng(seed)
    out = np.empty((rows, length), dtype=np.int64)
    out[:, 0] = rng.integers(0, len(likely), rows)
    for i in range(1, length):
        prev = out[:, i - 1]
        out[:, i] = np.where(rng.random(rows) < LIKELY, likely[prev], others[prev, rng.integers(0, 4, rows)])
    return out


def _trained_llama(folder):
    """A tiny Llama (hidden 128: q4f16 groups of 128, 2 layers) trained on a Markov chain over 64 tokens (entropy
    0.78 nats a token), saved to ``folder``; returns the chain."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = 64
    chain = _markov_chain(vocab)
    # Sequences as long as a prompt and its 64 new tokens: the positions generation reaches are trained ones.
    data = torch.from_numpy(_sample(chain, 1024, 72, seed=1))
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=None,  # every token is the chain's: none ends a sequence
        eos_token_id=None,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = torch.Generator().manual_seed(2)
    for _ in range(60):
        batch = data[torch.randint(0, len(data), (8,), generator=batches)]
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval().save_pretrained(folder)
    return chain


@pytest.mark.slow
def test_a_trained_model_keeps_its_perplexity_and_greedy_tokens_when_quantized(tmp_path):
    """A tiny Llama (hidden 128: q4f16 groups of 128) trained on a Markov chain (entropy 0.78 nats a token) and
    built fp32, q8f16, fp8 and q4f16: ``autosched eval`` perplexity within 5% (q8f16, fp8) and 15% (q4f16) of the
    fp32 build's on held-out text, and greedy tokens the fp32 build's for at least 90% of 8 x 64 new tokens."""
    from autosched.generation import Generator

    chain = _trained_llama(tmp_path / "hf")
    held_out = _sample(chain, 1, 8 * MAX_SEQ_LEN, seed=3)[0]
    (tmp_path / "ids.txt").write_text(" ".join(map(str, held_out)))

    perplexity, tokens = {}, {}
    prompts = [list(map(int, row)) for row in _sample(chain, 8, 6, seed=4)]
    for scheme in ("fp32", "q8f16", "fp8", "q4f16"):
        extra = ("--quantize", scheme) if scheme != "fp32" else ()
        artifact = tmp_path / scheme
        cli(
            "build",
            str(tmp_path / "hf"),
            "--generate",
            "-o",
            str(artifact),
            "--max-seq-len",
            "96",
            "--max-batch",
            "2",
            "--decode-batches",
            "1,2",
            "--db",
            str(tmp_path / "t.db"),
            *extra,
        )
        said = json.loads(
            cli(
                "eval",
                str(artifact),
                "--token-ids",
                str(tmp_path / "ids.txt"),
                "--max-seq-len",
                str(MAX_SEQ_LEN),
                "--format",
                "json",
            ).stdout
        )
        assert said["scored_tokens"] == 8 * (MAX_SEQ_LEN - 1) and said["windows"] == 8
        perplexity[scheme] = said["perplexity"]
        tokens[scheme] = [r.tokens for r in Generator(artifact).generate(prompts, 64)]
    entropy = -(LIKELY * math.log(LIKELY) + (1 - LIKELY) * math.log((1 - LIKELY) / 4))  # nats a token
    assert perplexity["fp32"] < 1.5 * math.exp(entropy), perplexity  # trained (uniform guessing: 64)
    assert perplexity["q8f16"] < 1.05 * perplexity["fp32"], perplexity
    assert perplexity["fp8"] < 1.05 * perplexity["fp32"], perplexity
    assert perplexity["q4f16"] < 1.15 * perplexity["fp32"], perplexity
    for scheme in ("q8f16", "fp8", "q4f16"):
        same = sum(a == b for ours, theirs in zip(tokens[scheme], tokens["fp32"]) for a, b in zip(ours, theirs))
        assert same >= 0.9 * 8 * 64, (scheme, same, perplexity)
    assert all(len(t) == 64 for t in tokens["fp32"])


# A transformers Llama's projections: what --quantize quantises (q/k/v, o, gate/up, down).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _quantize_rows(x):
    """``x`` (float64) as W8A8's activations: per token, scale = amax / 448 rounded to float32 (fp8_quant_rows'),
    each value rounded to E4M3 against it (a zero row stays zero)."""
    import torch

    from autosched.generation.quantize import round_to_e4m3

    scale = (x.abs().amax(-1, keepdim=True) / 448).float().double()
    return round_to_e4m3(x / torch.where(scale > 0, scale, torch.ones_like(scale))) * scale


class _w8a8_projections:
    """While inside, ``model``'s projections read their input quantised per token (:func:`_quantize_rows`): a float64
    simulation of fp8_quant_rows -> fp8_gemm (q, k and v read the same rows, so quantising each one's input is
    quantising the fused q/k/v's once; gate and up likewise)."""

    def __init__(self, model):
        self.modules = [m for name, m in model.named_modules() if name.split(".")[-1] in PROJECTIONS]

    def __enter__(self):
        self.hooks = [m.register_forward_pre_hook(lambda _, args: (_quantize_rows(args[0]), *args[1:]))
                      for m in self.modules]

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()


@pytest.mark.slow
def test_w8a8_logits_of_a_trained_model_stay_close_to_weight_only_fp8s(tmp_path):
    """A float64 simulation, on the tiny Llama trained on a Markov chain, of what an fp8 build's prefill chunks on
    sm_90 compute (W8A8: every projection's input quantised per token to E4M3) against weight-only fp8 (the same
    E4M3 weights, float activations), over 8 held-out sequences of 64 tokens: logits within 5% (relative L2),
    perplexity within 1%, the same greedy token at 99% of positions or more.

    The bound: E4M3 keeps 3 mantissa bits, so rounding moves a value by at most 2^-4 of it and by about 2^-4/√3
    (3.6%) RMS where values spread over the binade; a projection's output is a sum over K of such independent
    errors, about as large relative to the output, and the norms keep the logits' share of it there (measured:
    1.7%, weight-only's own distance from the float model 0.9%). A wrong scale, sign or code is off by O(1)."""
    import copy

    import torch
    from transformers import LlamaForCausalLM

    from autosched.generation.quantize import quantize_weight

    from .helpers import dequantize_weight

    chain = _trained_llama(tmp_path / "hf")
    model = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval().double()
    weight_only = copy.deepcopy(model)
    for name, module in weight_only.named_modules():
        if name.split(".")[-1] in PROJECTIONS:  # as an fp16 build quantises them (float16 scales)
            codes, scales = quantize_weight(module.weight.data, "fp8", "float16")
            module.weight.data = dequantize_weight(codes, scales, "fp8", module.weight.shape[1], "float16")
    ids = torch.from_numpy(_sample(chain, 8, MAX_SEQ_LEN, seed=3))
    with torch.no_grad():
        floats, ours = model(ids).logits, weight_only(ids).logits
        with _w8a8_projections(weight_only):
            w8a8 = weight_only(ids).logits

    def perplexity(logits):
        return float(torch.exp(-torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).mean()))

    distance = float((w8a8 - ours).norm() / ours.norm())
    assert 1e-3 < distance < 0.05, distance  # the activations were quantised, and closely
    assert float((ours - floats).norm() / floats.norm()) < distance  # their rounding costs more than the weights'
    assert abs(perplexity(w8a8) / perplexity(ours) - 1) < 0.01, (perplexity(w8a8), perplexity(ours))
    assert float((w8a8.argmax(-1) == ours.argmax(-1)).double().mean()) >= 0.99


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["q4f16", "q4f16_zp"])
def test_a_q4f16_build_for_sm_90_compiles_its_projections_as_int4_kernels(tiny_llama, tmp_path, scheme):
    """Built here without a GPU for sm_90a in float16: decode steps' projections on int4_gemv (a batch of 16 too,
    on its tensor-core kernel), a prefill chunk's on hopper_dequant_gemm, the library written (the CUDA compiled
    when loaded on the GPU); with zero points (q4f16_zp, zeros=1) too."""
    _, root = tiny_llama
    out = tmp_path / "sm90"
    cli(
        "build",
        str(root / "hf"),
        "--generate",
        "--target",
        "cuda:sm_90a",
        "--dtype",
        "float16",
        "-o",
        str(out),
        "--max-seq-len",
        "256",
        "--max-batch",
        "16",
        "--decode-batches",
        "1,4,16",
        "--prefill-chunks",
        "128",
        "--quantize",
        scheme,
        "--db",
        str(out) + ".db",
    )
    manifest = json.loads((out / "manifest.json").read_text())
    spaces = {
        (w["workload"].split(",")[0], w["space"])
        for w in manifest["workload_kernels"].values()
        if w["workload"].startswith("dequant_gemm")
    }
    assert spaces == {
        ("dequant_gemm[m=1", "int4_gemv"),
        ("dequant_gemm[m=4", "int4_gemv"),
        ("dequant_gemm[m=16", "int4_gemv"),
        ("dequant_gemm[m=128", "hopper_dequant_gemm"),
    }
    assert all(
        ";bits=4;group=128;" in w["workload"] and w["workload"].endswith(";zeros=1") == (scheme == "q4f16_zp")
        for w in manifest["workload_kernels"].values()
        if w["workload"].startswith("dequant_gemm")
    )
    assert (out / manifest["library"]).exists()


@pytest.mark.parametrize("scheme", ["q4f16", "q4f16_zp"])
def test_a_q4f16_decode_step_at_batch_16_for_sm_90_is_int4_gemv_on_tensor_cores(scheme):
    """What ``tune-model --generate --quantize q4f16 --decode-batches 16`` tunes for sm_90, lowered here without a
    GPU: the decode step's four projections are dequant_gemm tasks of 16 rows whose space is int4_gemv, its default
    point on the tensor-core kernel (its CUDA-core points take at most 8 rows); at batch 1, int4_gemv's CUDA cores."""
    from autosched.generation.build import generation_tasks, load_generation_model, lower_generation
    from autosched.pipeline import split_tunable
    from autosched.target import parse_target

    target = parse_target("cuda:sm_90", require_device=False)
    model = load_generation_model("hf-llama", "float16", scheme)
    lowered, _ = lower_generation(model.config, target, (1, 16), ())
    tasks, _ = split_tunable(generation_tasks(lowered), target)
    projections = [t for t in tasks if t.workload is not None and t.workload.op == "dequant_gemm"]
    rows = sorted(t.workload.shape_dict["m"] for t in projections)
    assert rows == [1] * 4 + [16] * 4, rows
    for task in projections:
        space = task.space(target)
        assert space.name == "int4_gemv", task.workload
        assert space.default()["mma"] == (task.workload.shape_dict["m"] == 16), task.workload
        assert task.workload.attrs_dict.get("zeros", 0) == (scheme == "q4f16_zp")


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["fp8", "q8f16"])
def test_an_8bit_build_for_sm_90_compiles_its_decode_projections_as_gemv8_kernels(tiny_llama, tmp_path, scheme):
    """Built here without a GPU for sm_90a in float16 with --quantize fp8 (E4M3 codes, fmt=e4m3) or q8f16 (int8
    codes), a scale per output channel: decode steps' projections on gemv8 (weight-only), a prefill chunk's on
    gpu_matmul (q8f16: decoding the codes as the TE does) or, for fp8, W8A8 (its activations quantised per token
    by fp8_quant_rows, the GEMM on hopper_fp8_gemm), the library written."""
    _, root = tiny_llama
    out = tmp_path / "sm90"
    cli("build", str(root / "hf"), "--generate", "--target", "cuda:sm_90a", "--dtype", "float16", "-o", str(out),
        "--max-seq-len", "256", "--max-batch", "4", "--decode-batches", "1,4", "--prefill-chunks", "128",
        "--quantize", scheme, "--db", str(out) + ".db")
    manifest = json.loads((out / "manifest.json").read_text())
    kernels = [w for w in manifest["workload_kernels"].values() if w["workload"].startswith("dequant_gemm")]
    chunk = {("fp8_gemm[m=128", "hopper_fp8_gemm"), ("fp8_quant_rows[m=128", "gpu_rows")} if scheme == "fp8" \
        else {("dequant_gemm[m=128", "gpu_matmul")}
    assert {(w["workload"].split(",")[0], w["space"]) for w in manifest["workload_kernels"].values()
            if w["workload"].startswith(("dequant_gemm", "fp8_"))} == {
        ("dequant_gemm[m=1", "gemv8"),
        ("dequant_gemm[m=4", "gemv8"),
        *chunk,
    }
    assert manifest["quantization"]["activations"].startswith("float8 E4M3 per token" if scheme == "fp8" else "float16")
    assert all(";bits=8;" in w["workload"] and w["workload"].endswith(";fmt=e4m3") == (scheme == "fp8")
               for w in kernels)
    assert (out / manifest["library"]).exists()


@pytest.mark.slow
def test_an_fp8_build_for_sm_90_runs_its_prefill_chunks_w8a8_on_fp8_wgmma_and_its_cuda_compiles():
    """--quantize fp8 on cuda:sm_90 (a tiny Llama, float16, hidden 256, MLP 128): each projection of a prefill
    chunk of 128 tokens is fp8_quant_rows (gpu_rows) then fp8_gemm (hopper_fp8_gemm), tasks that tune-model lists;
    a chunk of one token (which hopper_fp8_gemm does not take) and the decode steps stay weight-only
    (dequant_gemm on gemv8). The compiled module's CUDA, the quantisation kernels and the wgmma e4m3 GEMMs,
    compiles with nvcc for sm_90a. On the CPU the same model keeps every projection weight-only."""
    from autosched.generation.build import generation_tasks, lower_generation, schedule_generation
    from autosched.generation.quantize import manifest_entry
    from autosched.pipeline import split_tunable
    from autosched.pipeline.build import build_pipeline, compile_separate
    from autosched.target import compile_module, parse_target

    from .nvcc import nvcc_compile
    from .test_kv_cache_decode import _tiny

    cfg = _tiny(quantize="fp8")
    sm90 = parse_target("cuda:sm_90", require_device=False)
    lowered, _ = lower_generation(cfg, sm90, (1, 4), (1, 128))
    tasks, _ = split_tunable(generation_tasks(lowered), sm90)
    spaces = {t.key.split(";")[0]: t.space(sm90).name for t in tasks if t.key.startswith(("fp8", "dequant"))}
    assert spaces == {
        "fp8_quant_rows[m=128,k=256]:float16": "gpu_rows",  # the input of q/k/v, gate/up and o
        "fp8_quant_rows[m=128,k=128]:float16": "gpu_rows",  # down's
        "fp8_gemm[m=128,n=512,k=256]:float16": "hopper_fp8_gemm",  # q/k/v
        "fp8_gemm[m=128,n=256,k=256]:float16": "hopper_fp8_gemm",  # o, gate/up
        "fp8_gemm[m=128,n=256,k=128]:float16": "hopper_fp8_gemm",  # down
        **{f"dequant_gemm[m={m},n={n},k={k}]:float16": "gemv8" for m in (1, 4)
           for n, k in ((512, 256), (256, 256), (256, 128))},
    }
    weights = {t.key.split(";")[0]: t.weight for t in tasks}
    assert weights["fp8_quant_rows[m=128,k=256]:float16"] == 3 and weights["fp8_gemm[m=128,n=256,k=256]:float16"] == 2
    scheduled, report, applied = schedule_generation(lowered, None, sm90)
    w8a8 = any(w["workload"].startswith("fp8_gemm[") for w in report.workloads.values())
    assert manifest_entry(cfg, w8a8=w8a8)["activations"].startswith("float8 E4M3 per token (fp8_quant_rows")
    executable = compile_separate(compile_module(scheduled, sm90, {}, relax_pipeline=build_pipeline(sm90)), applied, sm90)
    sources = [m.inspect_source() for lib in executable.mod.imports for m in [lib, *lib.imports] if m.kind == "cuda"]
    fp8 = [src for src in sources if "autosched_fp8_quant_rows" in src or "e4m3.e4m3" in src]
    assert any("autosched_fp8_quant_rows" in src for src in fp8) and sum("e4m3.e4m3" in src for src in fp8) == 3
    for src in fp8:
        report = nvcc_compile(src, "sm_90a")
        assert report.ok, report.log[-3000:]

    cpu, _ = lower_generation(cfg, parse_target("llvm"), (1,), (128,))
    assert not any(t.key.startswith("fp8") for t in generation_tasks(cpu))
    assert manifest_entry(cfg)["activations"] == "float16 (weight-only)"


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["q4f16", "q4f16_zp", "q8f16", "fp8"])
def test_half_precision_quantized_logits_on_the_gpu_match_the_float64_model(tiny_llama, scheme, tmp_path):
    """fp16 on the GPU: the dynamic prefill, a static chunk of 32 tokens (q4f16 and q4f16_zp: hopper_dequant_gemm on
    sm_90; fp8: W8A8 on sm_90, fp8_quant_rows and fp8_gemm on FP8 wgmma) and a static decode step (q4f16 and
    q4f16_zp: int4_gemv; q8f16 and fp8: gemv8) give the float64 model's logits of the same dequantised weights (for
    fp8's W8A8 chunk, with each projection's input quantised per token as fp8_quant_rows does), to half
    precision's tolerance.

    fp8 runs on the Llama trained on a Markov chain, over a sample of the chain: on random weights, rounding the
    activations to fp16 before E4M3 already moves the float64 W8A8 logits by more than that tolerance (codes
    flip at E4M3 ties and the untrained layers amplify it), while on the trained model it stays within it and
    the W8A8 chunk stays distinguishable from a weight-only one."""
    import torch

    if scheme == "fp8":
        from transformers import LlamaForCausalLM

        folder = tmp_path / "trained"
        ids = _sample(_trained_llama(folder), 1, 40, seed=3)[0].tolist()
        hf = LlamaForCausalLM.from_pretrained(folder).eval()
    else:
        hf, root = tiny_llama
        folder, ids = root / "hf", list(range(3, 3 + 7 * 40, 7))
    out = tmp_path / "gpu"
    cli("build", str(folder), "--generate", "--target", "cuda", "--dtype", "float16", "-o", str(out),
        "--max-seq-len", str(MAX_SEQ_LEN), "--max-batch", "2", "--decode-batches", "1", "--prefill-chunks", "32",
        "--quantize", scheme, "--db", str(out) + ".db")
    manifest = json.loads((out / "manifest.json").read_text())
    w8a8 = any(w["workload"].startswith("fp8_gemm[") for w in manifest["workload_kernels"].values())
    assert w8a8 == (scheme == "fp8"), manifest["workload_kernels"]  # the H200 is sm_90
    with torch.no_grad():
        model = _reference_model(hf, out)
        ref = model(torch.tensor([ids])).logits[0].numpy()
        with _w8a8_projections(model):
            chunk = model(torch.tensor([ids])).logits[0].numpy() if w8a8 else None
    tolerance = assert_functions_match(out, ids, ref, chunk=32, relative=2e-2, chunk_expected=chunk)
    if w8a8:  # the chunk's activations were quantised: weight-only logits are beyond the tolerance
        assert np.abs(chunk[:32] - ref[:32]).max() > tolerance


@pytest.mark.gpu
def test_tune_model_fp8_on_the_gpu_tunes_the_w8a8_prefill_kernels(tiny_llama, tmp_path):
    """``tune-model --generate --quantize fp8 --prefill-chunks 32`` on the H200 (sm_90, float16): the chunk's
    per-token quantisation (fp8_quant_rows on gpu_rows) and its FP8 GEMMs (fp8_gemm on hopper_fp8_gemm) are tasks
    beside the decode step's gemv8 ones, each measured without a wrong result."""
    _, root = tiny_llama
    rows = json.loads(cli("tune-model", str(root / "hf"), "--generate", "--target", "cuda", "--dtype", "float16",
                          "--decode-batches", "1", "--max-batch", "2", "--prefill-chunks", "32", "--quantize", "fp8",
                          "--trials", "48", "--db", str(tmp_path / "tune.db"), "--format", "json").stdout)
    # 48 trials: the first round measures every one of the build's 29 tasks once (16 left the lightest unmeasured,
    # the quantisation among them)
    spaces = {r["kernel"].rstrip("0123456789"): r["space"].split("@")[0] for r in rows}  # ids are name@version
    assert spaces["autosched_fp8_quant_rows"] == "gpu_rows" and spaces["autosched_fp8_gemm"] == "hopper_fp8_gemm"
    assert spaces["autosched_dequant_gemm"] == "gemv8"
    assert sum(r["kernel"].startswith("autosched_fp8_gemm") for r in rows) == 4  # q/k/v, o, gate/up, down
    assert all(r["latency_us"] is not None for r in rows if r["kernel"].startswith("autosched_fp8")), rows


def _pack_along(fields, axis: int):
    """Eight 4-bit ``fields`` per int32 along ``axis`` (the lowest bits first), as GPTQ packs them."""
    import torch

    moved = fields.to(torch.int64).movedim(axis, -1)
    words = sum(moved[..., b::8] << (4 * b) for b in range(8))
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)  # the same 32 bits as a signed int32
    return words.to(torch.int32).movedim(-1, axis).contiguous()


def _pack_awq(fields):
    """Eight 4-bit ``fields`` per int32 along the last axis in AutoAWQ's order (awq/utils/packing_utils.py): bits
    4 j of word w hold field 8 w + order[j]."""
    import torch

    order = [0, 2, 4, 6, 1, 3, 5, 7]
    fields = fields.to(torch.int64)
    words = torch.zeros(fields.shape[0], fields.shape[1] // 8, dtype=torch.int64)
    for col in range(words.shape[1]):
        for j in range(8):
            words[:, col] |= fields[:, col * 8 + order[j]] << (4 * j)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)
    return words.to(torch.int32)


def _write_prequantized(hf, folder, float_folder, zero_point: int = 8, desc_act: bool = False, fmt: str = "gptq",
                        asymmetric: bool = False):
    """``hf``'s projections quantised as q4f16 quantises them (float16 scales), written as a GPTQ checkpoint
    (format "gptq": zero points stored one less) or, with ``fmt="awq"``, an AutoAWQ GEMM one in ``folder``;
    ``float_folder`` gets the float model whose projections are those dequantised weights. ``asymmetric``: each
    group and output channel a random zero point instead (AWQ 0 to 15; GPTQ 1 to 16, whose stored fields are 0 to
    15) and codes ``round(w / s) + z`` clipped to 0..15 against the range's scale, dequantised here as
    ``s·(q − z)``."""
    import copy

    import torch
    from safetensors.torch import save_file

    from autosched.generation.quantize import quantize_weight

    from .helpers import dequantize_weight

    model = copy.deepcopy(hf).float()
    state, tensors = model.state_dict(), {}
    gen = torch.Generator().manual_seed(3)
    for key in list(state):
        if not any(f".{p}.weight" in key for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")):
            continue
        n, k = state[key].shape
        if asymmetric:
            _, scales, _ = quantize_weight(state[key], "q4f16_zp", "float16")
            zeros = torch.randint(1 if fmt == "gptq" else 0, 17 if fmt == "gptq" else 16, (n, k // 128), generator=gen)
            step, zero = scales.double().repeat_interleave(128, 1), zeros.double().repeat_interleave(128, 1)
            nibbles = torch.clamp(torch.round(state[key].double() / step) + zero, 0, 15).to(torch.int64)
            state[key] = ((nibbles.double() - zero) * step).float()  # exact in float32
            zero_points = zeros.t()  # [K / group, N]
        else:
            codes, scales = quantize_weight(state[key], "q4f16", "float16")
            state[key] = dequantize_weight(codes, scales, "q4f16", k, "float32").float()
            nibbles = torch.stack([codes & 15, codes >> 4], dim=-1).reshape(n, k)  # [N, K]
            zero_points = torch.full((k // 128, n), zero_point)
        prefix = key[: -len("weight")]
        tensors[prefix + "scales"] = scales.t().contiguous()
        if fmt == "awq":
            tensors[prefix + "qweight"] = _pack_awq(nibbles.t())
            tensors[prefix + "qzeros"] = _pack_awq(zero_points)
            continue
        tensors[prefix + "qweight"] = _pack_along(nibbles.t(), 0)
        tensors[prefix + "qzeros"] = _pack_along(zero_points - 1, 1)
        tensors[prefix + "g_idx"] = (torch.arange(k) // 128).to(torch.int32)
    model.load_state_dict(state)
    model.save_pretrained(float_folder)
    quantized = {key[: -len("weight")] for key in state if key[: -len("weight")] + "qweight" in tensors}
    floats = {key: value.contiguous() for key, value in state.items() if key[: -len("weight")] not in quantized}
    folder.mkdir()
    save_file({**floats, **tensors}, str(folder / "model.safetensors"))
    config = json.loads((float_folder / "config.json").read_text())
    if fmt == "awq":
        config["quantization_config"] = {
            "quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"
        }
    else:
        config["quantization_config"] = {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": 128,
            "desc_act": desc_act,
            "sym": not asymmetric,
            "checkpoint_format": "gptq",
        }
    (folder / "config.json").write_text(json.dumps(config))


def test_awq_codes_unpack_from_autoawqs_interleaved_order():
    """AutoAWQ's GEMM packing (eight codes along the output features per int32, order 0 2 4 6 1 3 5 7) unpacks to
    the codes packed, and the layer repacks to dequant_gemm's layout with its scales kept."""
    import torch

    from autosched.generation.awq import repack, unpack_awq

    # Outputs 0..7 holding their own index pack as the nibbles 0 2 4 6 1 3 5 7, lowest bits first.
    assert _pack_awq(torch.arange(8)[None]).item() == 0x75316420
    gen = torch.Generator().manual_seed(0)
    k, n = 256, 32
    codes = torch.randint(0, 16, (k, n), generator=gen)
    zeros = torch.randint(0, 16, (k // 128, n), generator=gen)
    got_codes, got_zeros = unpack_awq(_pack_awq(codes), _pack_awq(zeros))
    assert torch.equal(got_codes, codes) and torch.equal(got_zeros, zeros)
    scales = torch.rand(k // 128, n, generator=gen).half()
    packed, got_scales, got_zeros = repack(_pack_awq(codes), _pack_awq(zeros), scales)
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (n, k // 2)
    assert torch.equal(packed & 15, codes.t()[:, 0::2].to(torch.uint8))
    assert torch.equal(packed >> 4, codes.t()[:, 1::2].to(torch.uint8))
    assert torch.equal(got_scales, scales.t())
    assert got_zeros.dtype == torch.uint8 and torch.equal(got_zeros, zeros.t().to(torch.uint8))  # asymmetric: kept


def test_gptq_zero_points_read_as_its_library_reads_them():
    """GPTQ's "gptq" format stores each zero point one less (its 4-bit field plus one is read back: 1 to 16, a
    stored -1 coming back as 16), "gptq_v2" as it is; codes and scales repack as AWQ's do."""
    import torch

    from autosched.generation.gptq import repack

    gen = torch.Generator().manual_seed(0)
    k, n = 256, 16
    codes = torch.randint(0, 16, (k, n), generator=gen)
    fields = torch.randint(0, 16, (k // 128, n), generator=gen)
    fields[0, :2] = torch.tensor([0, 15])
    scales = torch.rand(k // 128, n, generator=gen).half()
    g_idx = (torch.arange(k) // 128).to(torch.int32)
    for offset, (low, high) in ((1, (1, 16)), (0, (0, 15))):  # "gptq", "gptq_v2"
        packed, got_scales, zeros = repack(_pack_along(codes, 0), _pack_along(fields, 1), scales, g_idx, 128, offset)
        assert torch.equal(zeros, (fields + offset).t().to(torch.uint8)) and torch.equal(got_scales, scales.t())
        assert (int(zeros.min()), int(zeros.max())) == (low, high)
        assert torch.equal(packed & 15, codes.t()[:, 0::2].to(torch.uint8))


def test_awq_checkpoints_kernels_cannot_run_are_refused_in_one_line(tmp_path):
    """A version other than gemm, other bit widths, no groups and zero_point false are each refused with a
    UsageError that names the problem; an asymmetric checkpoint is refused only as q4f16 (it builds as q4f16_zp)."""
    import torch

    from autosched.errors import UsageError
    from autosched.generation.awq import load_awq
    from autosched.generation.build import load_generation_model
    from autosched.generation.prequantized import choose_scheme

    zeros = torch.full((2, 8), 8, dtype=torch.uint8)
    given = {"layers.0.attn.o.qweight": None, "layers.0.attn.o.zeros": zeros}
    assert choose_scheme(given, None, "AWQ")[0] == "q4f16" and "layers.0.attn.o.zeros" not in choose_scheme(given, None, "AWQ")[1]
    assert choose_scheme(given, "q4f16_zp", "AWQ") == ("q4f16_zp", given)
    zeros[1, 3] = 7
    assert choose_scheme(given, None, "AWQ") == ("q4f16_zp", given)
    with pytest.raises(UsageError, match=r"zero points other than 8 \(asymmetric\).*leave out --quantize q4f16 "):
        choose_scheme(given, "q4f16", "AWQ")
    cases = {
        "version 'gemv' is not supported": {"version": "gemv"},
        "bits=8 and group_size=128": {"bits": 8},
        "bits=4 and group_size=-1": {"group_size": -1},
        "zero_point false": {"zero_point": False},
    }
    for says, fields in cases.items():
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        quant = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm", **fields}
        (folder / "config.json").write_text(json.dumps({"quantization_config": quant}))
        with pytest.raises(UsageError, match=re.escape(says)) as raised:
            load_awq(folder, None)
        assert "\n" not in str(raised.value)
    with pytest.raises(UsageError, match=r"quantised with AWQ, which builds as q4f16 \(q4f16_zp with zero points "
                       r"other than 8\): leave out --quantize q8f16"):
        load_generation_model(str(folder), quantize="q8f16")


@pytest.mark.slow
@pytest.mark.parametrize(
    "fmt, refused",
    [("gptq", (({"desc_act": True}, "desc_act=true"),)), ("awq", ())],
    ids=["gptq", "awq"],
)
def test_a_prequantized_checkpoint_builds_as_q4f16_of_the_same_weights(tiny_llama, tmp_path, capsys, fmt, refused):
    """A GPTQ folder (4-bit, desc_act false, symmetric) or an AutoAWQ GEMM one (every zero point 8) read from its
    safetensors without the format's library and repacked gives the parameters and logits of ``--quantize q4f16``
    of the float weights it holds (its zero points, all 8, dropped: the int4 kernels' own); activation order is
    refused in one line with exit code 2."""
    from autosched.artifact import load_generation_artifact
    from autosched.generation.evaluate import all_logits
    from autosched.generation.model import LoadedModel

    hf, _ = tiny_llama
    _write_prequantized(hf, tmp_path / fmt, tmp_path / "float", fmt=fmt)
    ours = _build(tmp_path / "float", tmp_path / "ours", "--decode-batches", "1", "--quantize", "q4f16")
    theirs = _build(tmp_path / fmt, tmp_path / "theirs", "--decode-batches", "1", "--dtype", "float32")
    manifest = json.loads((theirs / "manifest.json").read_text())
    assert manifest["quantization"]["scheme"] == "q4f16" and manifest["quantization"]["source"] == fmt
    (_, a, m, _), (_, b, n, _) = load_generation_artifact(ours), load_generation_artifact(theirs)
    assert m["param_names"] == n["param_names"]
    for name, x, y in zip(m["param_names"], a, b):
        assert x.dtype == y.dtype and np.array_equal(x.numpy(), y.numpy()), name
    ids = [5, 7, 9, 11, 13, 2, 8, 100, 200, 3]
    np.testing.assert_array_equal(all_logits(LoadedModel.load(theirs), ids), all_logits(LoadedModel.load(ours), ids))

    for kind, says in refused:
        folder = tmp_path / f"bad-{next(iter(kind))}"
        _write_prequantized(hf, folder, tmp_path / f"float-{next(iter(kind))}", fmt=fmt, **kind)
        code, lines = _run(capsys, "build", str(folder), "--generate", "-o", str(tmp_path / "no"))
        assert code == 2 and len(lines) == 1 and says in lines[0], lines


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_an_asymmetric_checkpoint_builds_as_q4f16_zp_and_computes_its_own_weights(tiny_llama, tmp_path, capsys, fmt):
    """A GPTQ (sym false) or AutoAWQ GEMM folder with a random zero point per group and output channel builds as
    q4f16_zp: its codes, scales and zero points kept as dequant_gemm's zeros=1 parameters, the logits of the
    dynamic prefill, a static prefill chunk and a static decode step those of a float64 model of ``s·(q − z)``
    (dequantised by the writer, not by us), its greedy tokens that model's; --quantize q4f16 is refused."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from autosched.artifact import load_generation_artifact
    from autosched.generation import Generator

    from .helpers import transformers_greedy

    hf, _ = tiny_llama
    _write_prequantized(hf, tmp_path / fmt, tmp_path / "float", fmt=fmt, asymmetric=True)
    built = _build(tmp_path / fmt, tmp_path / "built", "--decode-batches", "1", "--prefill-chunks", "8", "--dtype",
                   "float32")
    manifest = json.loads((built / "manifest.json").read_text())
    quant = manifest["quantization"]
    assert (quant["scheme"], quant["source"], quant["zero_points"]) == ("q4f16_zp", fmt, True)
    assert manifest["decoder"]["quantize"] == "q4f16_zp"
    kernels = [w["workload"] for w in manifest["workload_kernels"].values() if w["workload"].startswith("dequant_gemm")]
    assert len(kernels) == 8 and all(k.endswith(";zeros=1") for k in kernels)  # 4 projections x decode_b1, prefill_t8
    _, params, _, _ = load_generation_artifact(built)
    named = dict(zip(manifest["param_names"], params))
    zeros = named["layers.0.attn.o.zeros"].numpy()
    assert zeros.dtype == np.uint8 and zeros.shape == (128, 1)
    every = np.concatenate([p.numpy().ravel() for name, p in named.items() if name.endswith(".zeros")])
    assert (every.min(), every.max()) == ((1, 16) if fmt == "gptq" else (0, 15)) and len(np.unique(every)) == 16

    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "float").double().eval()
    ids = [5, 7, 9, 11, 13, 2, 8, 100, 200, 3, 3, 3, 4, 42, 43, 44, 45, 46, 17, 301]
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0].numpy()
        floats = copy.deepcopy(hf).double()(torch.tensor([ids])).logits[0].numpy()
    tolerance = assert_functions_match(built, ids, expected)
    assert np.abs(expected - floats).max() > 20 * tolerance  # the weights were quantised
    prompt = [5, 7, 9, 11, 13, 2, 8]
    result = Generator(built).generate([prompt], 12)[0]
    assert result.error is None and result.tokens == transformers_greedy(ref, prompt, 12)

    code, lines = _run(capsys, "build", str(tmp_path / fmt), "--generate", "--quantize", "q4f16", "-o", str(tmp_path / "no"))
    assert code == 2 and len(lines) == 1 and "zero points other than 8 (asymmetric)" in lines[0], lines


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["q4f16", "fp8"])
def test_tune_model_quantize_tunes_the_dequant_gemm_kernels_and_build_applies_them(tiny_llama, tmp_path, scheme):
    """``tune-model --generate --quantize q4f16`` (or fp8): the decode step's projections are dequant_gemm tasks,
    tuned and stored; the build with that database runs their records and computes what the untuned build
    computes."""
    from autosched.generation.evaluate import all_logits
    from autosched.generation.model import LoadedModel

    _, root = tiny_llama
    db = str(tmp_path / "tune.db")
    rows = json.loads(
        cli(
            "tune-model",
            str(root / "hf"),
            "--generate",
            "--decode-batches",
            "1",
            "--max-batch",
            "2",
            "--quantize",
            scheme,
            "--trials",
            "16",
            "--db",
            db,
            "--format",
            "json",
        ).stdout
    )
    assert sum(r["kernel"].startswith("autosched_dequant_gemm") for r in rows) == 4
    artifact = _build(
        root / "hf", tmp_path / "tuned", "--decode-batches", "1", "--prefill-chunks", "8", "--quantize", scheme, "--db", db
    )
    kernels = json.loads((artifact / "manifest.json").read_text())["workload_kernels"].values()
    tuned = {w["workload"].split(";")[0] for w in kernels if w["schedule"] == "database"}
    fp8 = {w["workload"].endswith(";fmt=e4m3") for w in kernels if w["workload"].startswith("dequant_gemm")}
    assert fp8 == {scheme == "fp8"}
    assert {k for k in tuned if k.startswith("dequant_gemm[m=1,")} == {
        "dequant_gemm[m=1,n=256,k=128]:float32",
        "dequant_gemm[m=1,n=128,k=128]:float32",
        "dequant_gemm[m=1,n=512,k=128]:float32",
        "dequant_gemm[m=1,n=128,k=256]:float32",
    }
    ids = [5, 7, 9, 11, 13, 2, 8, 100]
    untuned = all_logits(LoadedModel.load(_quantized(tiny_llama, scheme)), ids)
    model = LoadedModel.load(artifact)
    model.add(0)
    model.forward("batch_prefill", [0], [7], ids[:7], prefill=True)
    step = model.forward("decode_b1", [0], [1], ids[7:], prefill=False).numpy().reshape(-1)
    np.testing.assert_allclose(step, untuned[-1], rtol=0, atol=2e-5 * np.abs(untuned).max())


# ---- FP8 checkpoints (compressed-tensors) ---------------------------------------------------------------------


def _fp8_quantization_config(strategy: str = "channel", **weights) -> dict:
    """A compressed-tensors ``quantization_config`` as llm-compressor writes an FP8-dynamic model's."""
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False,
                            "group_size": None, **weights},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                      "dynamic": True},
            }
        },
    }


def _write_fp8_checkpoint(hf, folder, strategy: str = "channel"):
    """``hf``'s projections quantised as ``--quantize fp8`` quantises them (float32 scales), written as a
    compressed-tensors FP8 checkpoint in ``folder`` (weights float8_e4m3fn, ``weight_scale`` [N, 1]);
    ``strategy="tensor"``: one scale per projection (the largest), its codes quantised against it."""
    import torch
    from safetensors.torch import save_file

    from autosched.generation.quantize import e4m3_bits, quantize_weight, round_to_e4m3

    tensors = {}
    for key, value in hf.state_dict().items():
        if not any(f".{p}.weight" in key for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")):
            tensors[key] = value.contiguous()
            continue
        codes, scales = quantize_weight(value, "fp8", "float32")
        if strategy == "tensor":
            scales = scales.max().reshape(1)
            codes = e4m3_bits(round_to_e4m3(value.double() / scales.double()))
        prefix = key[: -len("weight")]
        tensors[prefix + "weight"] = codes.view(torch.float8_e4m3fn)
        tensors[prefix + "weight_scale"] = scales
        tensors[prefix + "input_scale"] = torch.ones(1)  # an activation scale, not applied in the weight-only form
    hf.save_pretrained(folder)
    for old in folder.glob("*.safetensors"):
        old.unlink()
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = _fp8_quantization_config(strategy)
    (folder / "config.json").write_text(json.dumps(config))


def test_fp8_layers_repack_per_channel_or_per_tensor_scales_and_refuse_what_fp8_cannot_hold():
    """A layer's float8 weight becomes its uint8 bits and its weight_scale one per output channel (a tensor's
    scale repeated); float8 E5M2 weights, scales per group and scales not exact in the build's dtype are
    refused with a UsageError that names the problem."""
    import torch

    from autosched.errors import UsageError
    from autosched.generation.fp8 import repack

    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 256, (4, 32), generator=gen, dtype=torch.uint8)
    bits[(bits & 0x7F) == 0x7F] = 0
    weight = bits.view(torch.float8_e4m3fn)
    channel = torch.rand(4, 1, generator=gen).to(torch.bfloat16)
    codes, scales = repack(weight, channel, torch.float32)
    assert torch.equal(codes, bits) and scales.dtype == torch.float32 and torch.equal(scales, channel.float())
    codes, scales = repack(weight, torch.tensor([0.5]), torch.float16)
    assert tuple(scales.shape) == (4, 1) and bool((scales == 0.5).all()) and scales.dtype == torch.float16
    for call, says in (
        (lambda: repack(weight.view(torch.uint8).view(torch.float8_e5m2), channel, torch.float32), "is float8_e5m2"),
        (lambda: repack(weight, torch.rand(4, 2, generator=gen), torch.float32), "has 8 values for 4 output channels"),
        (lambda: repack(weight, torch.tensor([[0.1]]), torch.float16), "weight_scale (float32) is not exact in float16"),
    ):
        with pytest.raises(UsageError, match=re.escape(says)) as raised:
            call()
        assert "\n" not in str(raised.value)


def test_fp8_checkpoints_fp8_cannot_read_are_refused_in_one_line(capsys, tmp_path):
    """Block-wise FP8 (transformers' quant_method "fp8"), other compressed-tensors formats and weight schemes, and
    another --quantize for an FP8 checkpoint: one line each, exit code 2, before any weight is read."""
    import copy

    block = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    group = _fp8_quantization_config("group", group_size=128)
    packed = {**_fp8_quantization_config(), "format": "pack-quantized"}
    integers = copy.deepcopy(_fp8_quantization_config())
    integers["config_groups"]["group_0"]["weights"]["type"] = "int"
    cases = (
        (block, (), "block-wise FP8 checkpoints (quant_method \"fp8\", weight_block_size [128, 128]) are not supported"),
        (group, (), "quantises weights as type=float, num_bits=8, strategy=group: only 8-bit float weights"),
        (packed, (), "compressed-tensors format 'pack-quantized' is not supported"),
        (integers, (), "type=int, num_bits=8, strategy=channel"),
        (_fp8_quantization_config(), ("--quantize", "q8f16"), "is an FP8 checkpoint, which builds as fp8: leave out "
                                                              "--quantize q8f16"),
    )
    for index, (quant, extra, says) in enumerate(cases):
        folder = tmp_path / str(index)
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": quant}))
        for command in ("build", "tune-model"):
            args = [command, str(folder), "--generate", *extra] + (["-o", str(tmp_path / "no")] if command == "build" else [])
            code, lines = _run(capsys, *args)
            assert code == 2 and len(lines) == 1 and says in lines[0], (args, lines)
    assert not (tmp_path / "no").exists()


@pytest.mark.slow
def test_an_fp8_checkpoint_builds_as_fp8_of_the_same_weights(tiny_llama, tmp_path, capsys):
    """A compressed-tensors FP8 folder (per-channel float32 scales, read without its library) gives the
    parameters and logits of ``--quantize fp8`` of the float weights it was quantised from; a per-tensor one
    computes a float64 model of its own dequantised weights; --dtype float16 with its float32 scales is refused
    in one line."""
    import torch

    from autosched.artifact import load_generation_artifact
    from autosched.generation.evaluate import all_logits
    from autosched.generation.model import LoadedModel

    hf, _ = tiny_llama
    ours = _quantized(tiny_llama, "fp8")
    _write_fp8_checkpoint(hf, tmp_path / "fp8")
    theirs = _build(tmp_path / "fp8", tmp_path / "theirs", "--decode-batches", "1", "--prefill-chunks", "8")
    manifest = json.loads((theirs / "manifest.json").read_text())
    assert (manifest["quantization"]["scheme"], manifest["quantization"]["source"]) == ("fp8", "compressed-tensors")
    assert manifest["decoder"]["dtype"] == "float32"
    (_, a, m, _), (_, b, n, _) = load_generation_artifact(ours), load_generation_artifact(theirs)
    assert m["param_names"] == n["param_names"]
    for name, x, y in zip(m["param_names"], a, b):
        assert x.dtype == y.dtype and np.array_equal(x.numpy(), y.numpy()), name
    ids = [5, 7, 9, 11, 13, 2, 8, 100, 200, 3]
    np.testing.assert_array_equal(all_logits(LoadedModel.load(theirs), ids), all_logits(LoadedModel.load(ours), ids))

    _write_fp8_checkpoint(hf, tmp_path / "tensor", strategy="tensor")
    built = _build(tmp_path / "tensor", tmp_path / "built", "--decode-batches", "1", "--prefill-chunks", "8")
    ids = [5, 7, 9, 11, 13, 2, 8, 100, 200, 3, 3, 3, 4, 42, 43, 44, 45, 46, 17, 301]
    with torch.no_grad():
        expected = _reference_model(hf, built)(torch.tensor([ids])).logits[0].numpy()
    assert_functions_match(built, ids, expected)
    from safetensors.torch import load_file

    written = load_file(str(tmp_path / "tensor" / "model.safetensors"))
    _, params, manifest, _ = load_generation_artifact(built)
    named = dict(zip(manifest["param_names"], params))
    o_proj = "model.layers.0.self_attn.o_proj."
    assert np.array_equal(named["layers.0.attn.o.qweight"].numpy(), written[o_proj + "weight"].view(torch.uint8).numpy())
    scales = named["layers.0.attn.o.scales"].numpy()
    assert scales.shape == (128, 1) and (scales == written[o_proj + "weight_scale"].item()).all()  # repeated per channel

    code, lines = _run(capsys, "build", str(tmp_path / "fp8"), "--generate", "--dtype", "float16", "-o", str(tmp_path / "no"))
    assert code == 2 and len(lines) == 1 and "weight_scale (float32) is not exact in float16" in lines[0], lines
