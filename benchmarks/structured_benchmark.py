"""Structured output on a GPU (issue 68's measurement): ms per decode step of a batch whose every sequence is held
to a JSON schema against the same batch unconstrained, in the same run, and time to first token with a schema
not yet compiled.

The model as ``generate_benchmark.py`` makes it (Llama-2-7B's configuration by default, random weights, fp16, made
on the GPU; nothing is downloaded) built with a static decode function at ``--batch`` (CUDA graphs). Its tokenizer:
a byte-level BPE of the model's vocabulary size trained here on the Python sources of the installed packages, so
that XGrammar's masks cover a vocabulary of the real size. Each sequence of the constrained batch is held to a
schema of its own (an array of ``--items`` objects: an integer, a bounded string, an array of an enum), whose
output is longer than the steps timed, so that every row decodes throughout. Greedy; decode steps launched ahead
(the generator's default on a GPU) and, with ``--step-at-a-time``, also one at a time; the grammar's masks on the
device (the default) and on the host (``device_masks = False``).

    python benchmarks/structured_benchmark.py --model llama2-7b --batch 16 --out structured.json
    python benchmarks/structured_benchmark.py --target llvm --layers 1 --batch 4 --new 8   # a smoke test, CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def train_tokenizer(vocab: int, folder: Path, megabytes: float = 24.0):
    """A byte-level BPE of ``vocab`` tokens (``<unk>``, ``<s>``, ``</s>`` first) trained on the installed packages'
    Python sources, saved to ``folder`` as transformers saves one; (its tokenizer, seconds to train)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    began = time.perf_counter()
    texts, size = [], 0
    for path in sorted(Path(transformers.__file__).resolve().parents[1].rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        texts.append(text)
        size += len(text)
        if size > megabytes * 1e6:
            break
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(str(folder))
    return fast, time.perf_counter() - began


def long_schema(i: int, items: int) -> dict:
    """Row ``i``'s schema: an object holding an array of exactly ``items`` objects."""
    item = {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "name": {"type": "string", "maxLength": 6 + i % 7},
        "tags": {"type": "array", "items": {"enum": ["alpha", "beta", "gamma", f"tag{i}"]}, "minItems": 1,
                 "maxItems": 2}}, "required": ["id", "name", "tags"]}
    return {"type": "object", "properties": {"rows": {"type": "array", "items": item, "minItems": items,
                                                      "maxItems": items}}, "required": ["rows"]}


def first_token_ms(gen, prompt, sampling) -> float:
    """ms from adding one sequence to its first token (its grammar compiled in ``add`` where not yet)."""
    began = time.perf_counter()
    seq = gen.add(prompt, 2, sampling, stop_tokens=[])
    while not gen.completion(seq).tokens:
        gen.step()
    elapsed = time.perf_counter() - began
    while seq in gen.live:
        gen.step()
    gen.remove(seq)
    return 1e3 * elapsed


def decode_ms(gen, prompts, samplings, new: int, repeats: int = 3) -> tuple[float, list[list[int]]]:
    """Median over ``repeats`` of the wall ms per decode step of the batch, ``new`` steps after two warm ones,
    every row decoding throughout; and the tokens of the last repeat."""
    times = []
    for _ in range(repeats):
        seqs = [gen.add(p, new + 8, s, stop_tokens=[]) for p, s in zip(prompts, samplings)]
        for _ in range(3):  # the prefill, then two steps: launching ahead is under way
            gen.step()
        began = time.perf_counter()
        for _ in range(new):
            gen.step()
        times.append((time.perf_counter() - began) / new * 1e3)
        assert all(s in gen.live for s in seqs), "a row finished inside the steps timed: give more --items"
        while any(s in gen.live for s in seqs):
            gen.step()
        tokens = [gen.remove(s).tokens for s in seqs]
    return statistics.median(times), tokens


def main() -> int:
    import generate_benchmark as gb

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(gb.CONFIGS), default="llama2-7b")
    parser.add_argument("--layers", type=int, help="the first N layers (default: all)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64, help="decode steps timed")
    parser.add_argument("--items", type=int, default=48, help="objects in each row's array (long enough for --new)")
    parser.add_argument("--step-at-a-time", action="store_true", help="also each step launched after the one before")
    parser.add_argument("--target", choices=("cuda", "llvm"), default="cuda")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    gb.DEVICE = "cuda" if args.target == "cuda" else "cpu"

    import numpy as np

    from autosched.generation import GrammarSpec, Sampling

    out = {"model": args.model, "layers": args.layers, "batch": args.batch, "prompt": args.prompt, "new": args.new}
    model = gb.make_model(args.model, args.layers)
    vocab = model.config.vocab_size
    make_generator, built, _, _ = gb.build_ours(model, [1, args.batch], args.prompt + args.new + 64)
    del model
    out["build_s"] = built
    folder = Path(os.environ.get("TMPDIR", "/tmp")) / "structured-benchmark-tokenizer"
    tokenizer, out["tokenizer_train_s"] = train_tokenizer(vocab, folder)
    out["tokenizer_vocab"] = len(tokenizer)
    print(f"built in {built:.1f} s; a {len(tokenizer)}-token tokenizer in {out['tokenizer_train_s']:.1f} s", flush=True)

    gen = make_generator()
    gen.use_grammars(tokenizer)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, len(tokenizer), size=args.prompt).tolist() for _ in range(args.batch)]
    # time to first token, batch 1: unconstrained, the first grammar of the process (the tokenizer's tables and
    # the mask kernel made too), a schema not yet compiled, the same schema again
    first_token_ms(gen, prompts[0], Sampling())  # warm: kernels loaded, graphs captured
    out["ttft_ms_unconstrained"] = first_token_ms(gen, prompts[0], Sampling())
    spec = lambda i: GrammarSpec.json_schema(long_schema(i, args.items))  # noqa: E731
    out["ttft_ms_first_grammar"] = first_token_ms(gen, prompts[0], Sampling(grammar=spec(1000)))
    out["ttft_ms_new_schema"] = first_token_ms(gen, prompts[0], Sampling(grammar=spec(1001)))
    out["ttft_ms_compiled_schema"] = first_token_ms(gen, prompts[0], Sampling(grammar=spec(1001)))
    began = time.perf_counter()
    gen.grammars.compile(spec(1002))
    out["compile_ms"] = 1e3 * (time.perf_counter() - began)
    print({k: round(v, 2) for k, v in out.items() if k.startswith(("ttft", "compile"))}, flush=True)

    plain = [Sampling()] * args.batch
    constrained = [Sampling(grammar=spec(i)) for i in range(args.batch)]
    for s in constrained:
        gen.grammars.compile(s.grammar)
    decode_ms(gen, prompts, constrained, 4, repeats=1)  # warm: every UTF-8 state's table, the masks' buffers
    modes = [("ahead", None)] + ([("one_at_a_time", False)] if args.step_at_a_time else [])
    for name, run_ahead in modes:
        if run_ahead is not None:
            gen.run_ahead = run_ahead
        out[f"{name}_ms_unconstrained"], _ = decode_ms(gen, prompts, plain, args.new)
        out[f"{name}_ms_constrained"], tokens = decode_ms(gen, prompts, constrained, args.new)
        out[f"{name}_slowdown"] = out[f"{name}_ms_constrained"] / out[f"{name}_ms_unconstrained"] - 1
        gen.device_masks, masks = False, gen.sampler.masks
        gen.sampler.masks = None
        out[f"{name}_ms_constrained_host_masks"], host_tokens = decode_ms(gen, prompts, constrained, args.new)
        gen.device_masks, gen.sampler.masks = True, masks
        out[f"{name}_same_tokens_device_and_host_masks"] = host_tokens == tokens
        print({k: v for k, v in out.items() if k.startswith(name)}, flush=True)
    text = tokenizer.decode(tokens[0], skip_special_tokens=True)
    out["row_0_starts"] = text[:120]
    print(json.dumps(out), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
