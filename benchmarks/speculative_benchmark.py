"""Speculative decoding on a GPU: what verifying K proposed tokens costs against a plain decode step, and
what a draft model's steps give end to end.

A Llama-2-7B or Llama-3-8B configuration (random weights, fp16, made on the GPU: nothing is downloaded) is
built in memory with static verify functions for ``--speculate`` K at each batch, and a draft of the same
configuration cut to ``--draft-layers`` layers (its first layers, embeddings and head: the same vocabulary).
For each batch size:

- ``decode_ms``, ``verify_ms``: one static decode step against one static verify call of K + 1 tokens per
  sequence (the rejected tokens popped after each), on sequences of ``--prompt`` cached tokens: the cost
  of verifying, which speculative decoding trades against the tokens it accepts;
- ``plain_ms_per_step`` (decoding as the generator does by default: on a GPU each step launched before the
  tokens of the one before are read; a speculating generator's plain steps go one at a time) and, speculating
  with each draft, ms per step, tokens per sequence per step, the
  acceptance rate and the speedup in tokens per second: ``replay`` (the plain run's own greedy tokens,
  proposed at no cost: every proposal kept, the ceiling of the mechanism), ``never`` (those tokens shifted
  by one: every proposal rejected: the generator soon decodes plainly, probing the draft now and then;
  ``never_always`` speculates at every step all the same, what verifying costs when a draft never agrees),
  ``draft`` (the cut model; ``draft_always`` speculating at every step, and ``draft_round_ms``, what its
  proposals of a step cost: its time a step less ``never_always``'s) and ``self`` (the target as its own
  draft: every proposal kept, with a draft as costly as the model, which does not pay: the generator decodes
  plainly).
  Random weights make a real draft's acceptance meaningless; the costs are what this measures. Greedy tokens
  are checked against the plain run's for every prompt.

``--db``: the records of ``tune-model --generate --speculate K`` (the verify functions' kernels among them).

    python benchmarks/speculative_benchmark.py --model llama2-7b --batches 1,8 --speculate 4 --db tune.db --out spec.json
    python benchmarks/speculative_benchmark.py --target llvm --layers 2 --draft-layers 1 --prompt 16 --new 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import generate_benchmark as gb  # noqa: E402 - after the path: make_model and the device choice


def build(model, batches: tuple[int, ...], speculate: tuple[int, ...], max_seq_len: int, db_path: str | None = None):
    """A LoadedModel of ``model`` compiled in memory (static decode and verify functions at ``batches``; the
    records of the tuning database ``db_path`` applied where given)."""
    import torch
    import tvm
    from tvm import relax

    from autosched.generation.build import GenerationModel, compile_generation, generation_manifest
    from autosched.generation.decoder import config_from_hf, weights_from_hf
    from autosched.generation.model import LoadedModel
    from autosched.target import parse_target

    target = parse_target("cuda" if gb.DEVICE == "cuda" else "llvm")
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    gm = GenerationModel("benchmark", model, config_from_hf(model.config, dtype), [])
    db = None
    if db_path:
        from autosched.database.store import Database

        db = Database(db_path)
    executable, names, report = compile_generation(gm, target, db, batches, speculate=speculate)
    if db is not None:
        db.close()
    weights = weights_from_hf(model.state_dict(), gm.config)
    params = [tvm.runtime.from_dlpack(weights[n].clone(memory_format=torch.contiguous_format)) for n in names]
    manifest = generation_manifest(gm, names, target, report, max_seq_len, max(batches), decode_batches=batches,
                                   speculate=speculate)
    device = tvm.cuda(0) if gb.DEVICE == "cuda" else tvm.cpu(0)
    return lambda: LoadedModel(relax.VirtualMachine(executable, device), params, manifest, device)


def truncated(model, layers: int):
    """``model``'s first ``layers`` layers with its embeddings, norm and head."""
    import copy

    draft = copy.deepcopy(model)
    draft.model.layers = draft.model.layers[:layers]
    draft.config.num_hidden_layers = layers
    return draft


def replay_drafts(runs: dict[tuple, list[int]], vocab: int):
    """(replay, never): drafts that propose a plain greedy run's own tokens at no cost (every proposal kept:
    the ceiling of tokens per step) and those tokens shifted by one (every proposal rejected: what verifying
    costs when the draft never agrees). ``runs``: each prompt's tokens from the plain run."""
    from autosched.generation.speculative import PromptLookupDraft, Proposal

    class Replay(PromptLookupDraft):
        def __init__(self, shift: int):
            super().__init__()
            self.shift = shift

        def propose(self, requests):
            out = []
            for seq, k in requests:
                made = len(seq.completion.tokens)
                tokens = runs[tuple(seq.prompt_context)][made:made + k]
                out.append(Proposal([(t + self.shift) % vocab for t in tokens]))
            return out

    return Replay(0), Replay(1)


def call_ms(model, batch: int, k: int, prompt: int, repeats: int = 20) -> tuple[float, float]:
    """(ms of a static decode step, ms of a static verify call of k + 1 tokens a sequence) at ``batch``
    sequences of ``prompt`` cached tokens; each call's tokens are popped again."""
    import numpy as np

    from autosched.generation.speculative import static_verify_name

    seqs = list(range(batch))
    for s in seqs:  # one prefill call a sequence: the cache takes at most max_seq_len tokens a call
        model.add(s)
        model.forward("batch_prefill", [s], [prompt], np.ones(prompt, "int32"), prefill=True)

    def timed(function: str, tokens: int, prefill: bool) -> float:
        times = []
        for _ in range(repeats + 3):
            began = time.perf_counter()
            model.forward(function, seqs, [tokens] * batch, np.ones(batch * tokens, "int32"), prefill,
                          every_position=prefill).numpy()
            times.append(time.perf_counter() - began)
            for s in seqs:
                model.popn(s, tokens)
        return 1e3 * statistics.median(times[3:])

    decode = timed(f"decode_b{batch}", 1, False)
    verify = timed(static_verify_name(batch, k), k + 1, True)
    for s in seqs:
        model.remove(s)
    return decode, verify


def run(make_target, draft, prompts, new: int, k: int, adaptive: bool = True) -> tuple[dict, list]:
    """(timing, tokens) of greedy generation, speculating with ``draft`` (None: plain); ``adaptive=False``:
    every step speculates, whether it pays or not."""
    from autosched.generation.generator import Generator

    gen = Generator.from_model(make_target())  # plain: as a user's decodes (on a GPU, steps launched ahead)
    if draft is not None:
        gen.speculate(draft, k, adaptive)
    gen.generate(prompts, 4)  # warm up: kernels loaded, CUDA graphs captured
    gen.reset_timing()
    results = gen.generate(prompts, new, stop_tokens=[])
    return gen.timing(), [r.tokens for r in results]


def main() -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(gb.CONFIGS), default="llama2-7b")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--draft-layers", type=int, default=2)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--speculate", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--db", help="a tuning database whose records both builds apply (tune-model --generate "
                                     "--speculate K, for the verify functions)")
    parser.add_argument("--target", choices=("cuda", "llvm"), default="cuda",
                        help="llvm: a smoke test of this script on the CPU (with a few --layers)")
    args = parser.parse_args()
    gb.DEVICE = "cuda" if args.target == "cuda" else "cpu"
    batches = tuple(int(b) for b in args.batches.split(","))
    k, max_seq_len = args.speculate, args.prompt + args.new + args.speculate + 8
    model = gb.make_model(args.model, args.layers)
    began = time.perf_counter()
    make_target = build(model, batches, (k,), max_seq_len, args.db)
    make_draft = build(truncated(model, args.draft_layers), batches, (), max_seq_len, args.db)
    print(f"{args.model}, {args.layers} layers (draft {args.draft_layers}), built in {time.perf_counter() - began:.1f} s",
          flush=True)
    rows = []
    generator = torch.Generator().manual_seed(0)
    for batch in batches:
        decode_ms, verify_ms = call_ms(make_target(), batch, k, args.prompt)
        row = {"model": args.model, "layers": args.layers, "draft_layers": args.draft_layers, "batch": batch,
               "speculate": k, "prompt": args.prompt, "new": args.new, "decode_ms": decode_ms, "verify_ms": verify_ms,
               "verify_vs_decode": verify_ms / decode_ms}
        rows.append(row)
        prompts = torch.randint(0, model.config.vocab_size, (batch, args.prompt), generator=generator).tolist()
        plain, tokens = run(make_target, None, prompts, args.new, k)
        row["plain_ms_per_step"] = plain["ms_per_step"]
        replay, never = replay_drafts({tuple(p): t for p, t in zip(prompts, tokens)}, model.config.vocab_size)
        drafts = (("replay", replay, True), ("never", never, True), ("never_always", never, False),
                  ("draft", make_draft(), True), ("draft_always", make_draft(), False), ("self", make_target(), True))
        for name, draft, adaptive in drafts:
            timing, theirs = run(make_target, draft, prompts, args.new, k, adaptive)
            row[f"{name}_ms_per_step"] = timing["ms_per_step"]
            # A run whose steps were all plain (adaptive, the draft not paying) made a token a step.
            row[f"{name}_tokens_per_step"] = timing.get("tokens_per_step", 1.0)
            row[f"{name}_acceptance"] = timing.get("acceptance_rate", 0.0)
            row[f"{name}_speedup"] = plain["ms_per_step"] * row[f"{name}_tokens_per_step"] / timing["ms_per_step"]
            row[f"{name}_same_tokens"] = theirs == tokens
        # Speculating at every step, the cut draft and the never-agreeing one verify alike (each proposal
        # rejected, with random weights): the difference is what the draft's proposals cost a step.
        row["draft_round_ms"] = row["draft_always_ms_per_step"] - row["never_always_ms_per_step"]
        print(json.dumps(row), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps({"rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
