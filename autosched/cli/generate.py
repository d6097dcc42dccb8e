"""``autosched tune-model MODEL --generate``, ``build MODEL --generate`` and ``generate DIR``."""

from __future__ import annotations

import json
import os
import sys

from ..errors import UsageError
from ..output import console
from .common import (
    DEFAULT_DB,
    DEFAULT_MAX_BATCH,
    TUNE_MODEL_TRIALS,
    open_build_db,
    parse_ids,
    searched_cell,
    tune_kernels,
    tuning_budget,
)


def add_build_arguments(p) -> None:
    """The options ``build`` takes for a generation artifact."""
    p.add_argument("--generate", action="store_true",
                   help="build for text generation: batched prefill and decode over a paged KV cache "
                        "(MODEL: an hf-* example, a save_pretrained folder, or module:factory of a transformers LM)")
    p.add_argument("--max-seq-len", type=int, default=2048,
                   help="with --generate: the longest sequence, prompt and new tokens (default 2048)")
    p.add_argument("--decode-batches",
                   help="with --generate: batch sizes whose decode step gets a static function of its own (tunable "
                        "kernels; CUDA graphs on a GPU), e.g. 1,16 as tuned by tune-model --generate (default: 1, 2, 4, "
                        "... up to --max-batch; a batch in between is padded up)")
    p.add_argument("--prefill-chunks",
                   help="with --generate: token counts that get a static prefill function, the prompts waiting at once "
                        "being packed and prefilled in chunks of those sizes, e.g. 512,8192 as tuned by tune-model "
                        "--generate (default: none)")
    p.add_argument("--speculate",
                   help="with --generate: numbers of proposed tokens k whose speculative verification gets a static "
                        "function at each decode batch (tuned kernels; CUDA graphs on a GPU), e.g. 4 for "
                        "`generate --speculate 4` (default: none; other k verify through the dynamic prefill)")
    p.add_argument("--tokenizer", help="with --generate: a local folder of the model's Hugging Face tokenizer, copied "
                   "into the artifact for `autosched serve` (default: the model folder's, where it has one)")
    _add_quantize(p)


def _add_quantize(p) -> None:
    p.add_argument("--quantize", help="with --generate: quantise the decoder layers' weights, q4f16 (int4, groups of "
                   "128 along K), q4f16_zp (q4f16 with a zero point per group), q8f16 (int8, a scale per output "
                   "channel) or fp8 (float8 E4M3, a scale per output channel); scales in the model's dtype; the "
                   "embeddings and LM head stay unquantised (default: none; an AWQ or GPTQ folder builds as q4f16, "
                   "or q4f16_zp where its zero points are not all 8; an FP8 compressed-tensors folder as fp8)")


def add_tune_arguments(p) -> None:
    """The options ``tune-model`` takes to tune for generation."""
    p.add_argument("--generate", action="store_true",
                   help="tune the kernels of the decode step, at each batch size of --decode-batches")
    p.add_argument("--decode-batches", help="with --generate: batch sizes to tune the decode step at, e.g. 1,16 "
                   "(default: those the build makes, 1, 2, 4, ... up to --max-batch)")
    p.add_argument("--prefill-chunks", help="with --generate: prefill chunk lengths to tune, e.g. 128,512 "
                   "(default: none)")
    p.add_argument("--speculate", help="with --generate: numbers of proposed tokens k whose static verify functions "
                   "(at each decode batch) to tune, e.g. 4 (default: none)")
    p.add_argument("--decode-steps", type=int,
                   help="with --generate: decode steps per prefill, how the trials weigh a decode step's kernels "
                   "against a prefill chunk's (default 128: replies of 128 tokens)")
    _add_quantize(p)


def _generation_dtype(dtype: str | None) -> str | None:
    """--dtype of a generation build: float32, float16 or bfloat16 (fp32, fp16, bf16), checked before the model loads."""
    if dtype is None:
        return None
    from ..workloads import normalize_dtype

    return normalize_dtype(dtype)


def cmd_build_generate(args) -> int:
    from ..generation.build import build_generator, check_build_options, load_generation_model, model_folder
    from ..target import parse_target

    target = parse_target(args.target, require_device=False)
    if args.tokens or args.batch:
        raise UsageError("--tokens and --batch do not apply to --generate: prompts and batches vary at run time "
                         "(give --max-seq-len and --max-batch)")
    # Every option is checked before the model is loaded and exported (seconds to minutes).
    dtype = _generation_dtype(args.dtype)
    batches = None
    if args.decode_batches is not None:
        batches = tuple(sorted(set(parse_ids(args.decode_batches, "--decode-batches", "batch sizes"))))
    chunks = None
    if args.prefill_chunks is not None:
        chunks = tuple(sorted(set(parse_ids(args.prefill_chunks, "--prefill-chunks", "lengths"))))
    speculate = ()
    if args.speculate is not None:
        speculate = tuple(sorted(set(parse_ids(args.speculate, "--speculate", "numbers of proposed tokens"))))
    check_build_options(args.max_seq_len, args.max_batch, batches, chunks, speculate)
    tokenizer = args.tokenizer
    if tokenizer is not None:
        from ..serve.tokenizer import load_tokenizer

        load_tokenizer(tokenizer)  # a folder without a readable tokenizer is refused before the build
    elif os.path.isdir(args.model):
        tokenizer = model_folder(args.model)  # the model's own, where its folder has one
    model = load_generation_model(args.model, dtype, args.quantize)
    db = open_build_db(args.db)  # as any build: a database one may only read is read as it is
    log = console(stderr=True)
    try:
        out, report = build_generator(model, target, db, args.output, args.max_seq_len, args.max_batch,
                                      db_path=str(db.path) if db else None, decode_batches=batches,
                                      prefill_chunks=chunks, speculate=speculate, tokenizer=tokenizer)
    finally:
        if db is not None:
            db.close()
    print(str(out))
    log.log(f"{report.summary()}; generate with `autosched generate {out}` or autosched.Generator")
    return 0


def cmd_tune_generate(args) -> int:
    """``tune-model MODEL --generate``: the kernels of the decode step at each batch size of
    ``--decode-batches`` (default: those the build makes) and of the
    ``--prefill-chunks``, under one trial budget."""
    import math

    from ..generation.build import (
        DEFAULT_DECODE_STEPS,
        check_decode_steps,
        default_decode_batches,
        generation_tasks,
        is_static_function,
        load_generation_model,
        lower_generation,
    )
    from ..output import emit
    from ..pipeline import split_tunable
    from ..pipeline.tasks import kernel_calls
    from ..target import parse_target

    trials = tuning_budget(args, TUNE_MODEL_TRIALS)
    steps = DEFAULT_DECODE_STEPS if args.decode_steps is None else args.decode_steps
    check_decode_steps(steps)
    target = parse_target(args.target, require_device=args.runner == "local")
    model = load_generation_model(args.model, _generation_dtype(args.dtype), args.quantize)
    if args.decode_batches is not None:
        batches = tuple(sorted(set(parse_ids(args.decode_batches, "--decode-batches", "batch sizes"))))
    else:  # those the build makes by default, so that a plain build applies the records
        batches = default_decode_batches(args.max_batch)
    chunks = tuple(sorted(set(parse_ids(args.prefill_chunks, "--prefill-chunks", "lengths")))) if args.prefill_chunks else ()
    speculate = tuple(sorted(set(parse_ids(args.speculate, "--speculate", "numbers of proposed tokens")))) \
        if args.speculate else ()
    lowered, _ = lower_generation(model.config, target, batches, chunks, speculate)
    tasks, untunable = split_tunable(generation_tasks(lowered, steps), target)
    log = console(stderr=True)
    log.log(f"{args.model}: decode steps at batch {', '.join(map(str, batches))}"
            + (f", prefill chunks of {', '.join(map(str, chunks))} tokens" if chunks else "")
            + f": {len(tasks) + len(untunable)} distinct kernels, {len(tasks)} tunable (attention keeps TVM's kernels)")
    results = tune_kernels(args, tasks, target, trials, log)
    best = {t.key: r.best_latency for t, r in zip(tasks, results)}
    rows = [{"kernel": t.name, "weight": t.weight, "space": r.space, "trials": r.trials,
             "searched": searched_cell(r),
             "latency_us": round(r.best_latency * 1e6, 3) if math.isfinite(r.best_latency) else None,
             "failures": sum(r.failures.values())} for t, r in zip(tasks, results)]
    emit(rows, args.format, [("kernel", "kernel"), ("weight", f"calls (a prefill, {steps} decode steps)"), ("space", "space"),
                             ("trials", "trials"),
                             ("searched", "searched"), ("latency_us", "best (us)"), ("failures", "failed")],
         title=f"{args.model}: kernels of the static functions")
    # Each static function's kernels alone, as tuned: what one decode step (or prefill chunk) costs in them.
    key_of = {kernel: t.key for t in tasks for kernel in (t.name, *t.meta.get("aliases", []))}
    for name in sorted(gv.name_hint for gv in lowered.functions if is_static_function(gv.name_hint)):
        calls = kernel_calls(lowered, lambda fn, name=name: fn == name)
        total = sum(n * best[key_of[kernel]] for kernel, n in calls.items() if kernel in key_of)
        what = f"{_function_label(name)}: {total * 1e3:.4g} ms in its tunable kernels" if math.isfinite(total) \
            else f"{_function_label(name)}: not every kernel has a measurement"
        log.log(f"{args.model}: {what}")
    options_used = [f"--decode-batches {','.join(map(str, batches))}"]
    options_used += [f"--prefill-chunks {','.join(map(str, chunks))}"] if chunks else []
    options_used += [f"--speculate {','.join(map(str, speculate))}"] if speculate else []
    options_used += [f"--max-batch {args.max_batch}"] if args.max_batch != DEFAULT_MAX_BATCH else []
    options_used += [f"--db {args.db}"] if args.db != DEFAULT_DB else []
    options_used += [f"--target {args.target}"] if args.target != "llvm" else []
    options_used += [f"--dtype {args.dtype}"] if args.dtype else []
    options_used += [f"--quantize {args.quantize}"] if args.quantize else []
    log.log(f"build it with `autosched build {args.model} --generate {' '.join(options_used)} -o DIR`")
    return 0


def _function_label(name: str) -> str:
    """``decode_b8`` -> 'a decode step at batch 8', ``prefill_t128`` -> 'a prefill chunk of 128 tokens'."""
    if name.startswith("decode_b"):
        return f"a decode step at batch {name[len('decode_b'):]}"
    if name.startswith("verify_b"):
        rows, proposals = name[len("verify_b"):].split("_k")
        return f"a speculative step of {proposals} proposals at batch {rows}"
    return f"a prefill chunk of {name[len('prefill_t'):]} tokens"


def add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate tokens from an artifact of `autosched build MODEL --generate`")
    p.add_argument("artifact", help="the folder `autosched build --generate` wrote")
    p.add_argument("--prompt-ids", action="append", default=[],
                   help="a prompt as comma-separated token ids (repeat for a batch of prompts)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt as text (needs --tokenizer; repeatable)")
    p.add_argument("--tokenizer", help="a local folder holding a Hugging Face tokenizer (nothing is downloaded)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per prompt (default 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; else sample")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default 0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample among the most likely tokens up to this mass")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (prompt i uses seed + i)")
    p.add_argument("--stop-ids", help="comma-separated token ids that end a sequence (default: the model's EOS)")
    structure = p.add_mutually_exclusive_group()
    structure.add_argument("--json-schema", metavar="FILE",
                           help="hold every output to the JSON schema in FILE (XGrammar; needs the tokenizer: the "
                                "artifact's own or --tokenizer)")
    structure.add_argument("--grammar", metavar="FILE", help="hold every output to the EBNF grammar in FILE (XGrammar's "
                           "EBNF, root rule `root`)")
    structure.add_argument("--regex", metavar="R", help="hold every output to the regular expression R")
    add_speculation_arguments(p)
    p.add_argument("--no-run-ahead", action="store_true",
                   help="decode a step at a time (default on a GPU: each greedy step is launched before the "
                        "tokens of the step before it are read, the same tokens)")
    p.add_argument("--stream", action="store_true",
                   help="print each token as it is made, after its prompt's index (with --tokenizer, the text; with "
                        "--format json, a JSON line per token, then one with the completions and the timing)")
    p.add_argument("--format", choices=("text", "json"), default="text", help="output (default text)")
    p.set_defaults(fn=cmd_generate)


def add_speculation_arguments(p) -> None:
    """``--speculate K`` with ``--draft DIR`` or ``--prompt-lookup`` (generate and serve)."""
    p.add_argument("--speculate", type=int, metavar="K",
                   help="decode speculatively: a draft proposes K tokens a step and the model verifies them in one "
                        "call, keeping its own greedy tokens (or its sampling distribution); needs --draft or "
                        "--prompt-lookup")
    p.add_argument("--draft", metavar="DRAFT_DIR",
                   help="with --speculate: a smaller model's `build --generate` artifact with the same vocabulary")
    p.add_argument("--prompt-lookup", action="store_true",
                   help="with --speculate: propose what followed the latest earlier occurrence of the last tokens "
                        "(no second model)")
    p.add_argument("--always-speculate", action="store_true",
                   help="with --speculate: speculate at every step (default: decode plainly while the draft's "
                        "recent proposals are mostly rejected, trying it again every 16 steps)")


# Why a sequence ended, as the text output says it (Completion.finish_reason).
FINISHED_BECAUSE = {"length": "--max-new-tokens reached", "stop": "a stop token (--stop-ids, default the model's EOS)",
                    "max_seq_len": "the artifact's --max-seq-len reached"}


def _tokenizer(path: str | None):
    from ..serve.tokenizer import load_tokenizer

    return None if path is None else load_tokenizer(path)


def speculation_draft(args):
    """What ``--speculate``, ``--draft`` and ``--prompt-lookup`` ask for: a draft for Generator, or None."""
    from ..generation.generator import read_generation_manifest

    if args.draft and args.prompt_lookup:
        raise UsageError("--draft and --prompt-lookup are two kinds of draft: give one of them")
    if args.speculate is None:
        if args.always_speculate:
            raise UsageError("--always-speculate needs --speculate K and a draft (--draft DRAFT_DIR or --prompt-lookup)")
        if args.draft or args.prompt_lookup:
            raise UsageError(f"{'--draft' if args.draft else '--prompt-lookup'} needs --speculate K: the number of "
                             "tokens the draft proposes a step (e.g. --speculate 4)")
        return None
    if args.speculate < 1:
        raise UsageError(f"--speculate must be at least 1 proposed token (got {args.speculate})")
    if args.prompt_lookup:
        return "prompt-lookup"
    if not args.draft:
        raise UsageError("--speculate needs a draft: --draft DRAFT_DIR (a smaller model's generation artifact) or "
                         "--prompt-lookup")
    read_generation_manifest(args.draft)  # a bad folder is reported before TVM loads
    return args.draft


def _grammar(args, manifest: dict, tokenizer):
    """(The GrammarSpec of --json-schema, --grammar or --regex, the Grammars that compiled it), or (None,
    None); a one-line UsageError with XGrammar's reason for one it cannot compile."""
    from ..generation.grammar import Grammars, GrammarSpec

    if args.json_schema is None and args.grammar is None and args.regex is None:
        return None, None
    option = "--json-schema" if args.json_schema is not None else "--grammar" if args.grammar is not None else "--regex"
    path = None
    if args.regex is not None:
        spec = GrammarSpec.regex(args.regex)
    else:
        path = args.json_schema if args.json_schema is not None else args.grammar
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise UsageError(f"{option} {path}: {exc.strerror or exc}") from None
        try:
            spec = GrammarSpec.json_schema(text) if args.json_schema is not None else GrammarSpec.ebnf(text)
        except UsageError as exc:
            raise UsageError(f"{option} {path}: {exc}") from None
    if tokenizer is None:
        from pathlib import Path

        from ..serve.tokenizer import artifact_tokenizer

        tokenizer = artifact_tokenizer(args.artifact)
        if tokenizer is None:
            raise UsageError(f"{option} needs the model's tokenizer: the artifact has none, give --tokenizer LOCAL_DIR "
                             f"(looked in {Path(args.artifact) / 'tokenizer'})")
    grammars = Grammars(tokenizer, manifest["decoder"]["vocab"], manifest.get("eos_token_ids", ()))
    try:
        grammars.compile(spec)
    except UsageError as exc:
        raise UsageError(f"{_label(option, args.regex if args.regex is not None else path)}: {exc}") from None
    return spec, grammars


def _check_prompts(prompts: list, labels: list[str], manifest: dict) -> None:
    """Each prompt fits the artifact (its ids in the vocabulary, room for a new token): one line naming the
    prompt, before the model is loaded."""
    vocab, longest = manifest["decoder"]["vocab"], manifest["max_seq_len"]
    for prompt, label in zip(prompts, labels):
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise UsageError(f"{label}: token id {bad[0]} is outside the vocabulary (0 to {vocab - 1})")
        if not prompt:
            raise UsageError(f"{label}: the prompt is empty: give at least one token")
        if len(prompt) > longest:
            raise UsageError(f"{label}: the prompt has {len(prompt)} tokens, more than the artifact's --max-seq-len "
                             f"{longest}: shorten it or rebuild with a larger --max-seq-len")
        if len(prompt) == longest:
            raise UsageError(f"{label}: the prompt has {longest} tokens, the artifact's --max-seq-len: no room is left "
                             "for a new token; shorten it or rebuild with a larger --max-seq-len")


def _label(option: str, value: str) -> str:
    return f"{option} {value if len(value) <= 40 else value[:37] + '...'}"


def cmd_generate(args) -> int:
    from ..generation.generator import read_generation_manifest

    manifest = read_generation_manifest(args.artifact)  # a bad folder is reported before TVM loads
    tokenizer = _tokenizer(args.tokenizer)
    if args.prompt and tokenizer is None:
        raise UsageError("--prompt needs --tokenizer LOCAL_DIR (or give token ids with --prompt-ids)")
    prompts = [parse_ids(p, "--prompt-ids") for p in args.prompt_ids]
    prompts += [tokenizer(text)["input_ids"] for text in args.prompt]
    if not prompts:
        raise UsageError("give a prompt: --prompt-ids 1,2,3 (or --prompt TEXT with --tokenizer)")
    _check_prompts(prompts, [_label("--prompt-ids", p) for p in args.prompt_ids]
                   + [_label("--prompt", repr(t)) for t in args.prompt], manifest)
    stop = parse_ids(args.stop_ids, "--stop-ids") if args.stop_ids else None
    vocab = manifest["decoder"]["vocab"]
    if stop and any(t >= vocab for t in stop):
        raise UsageError(f"--stop-ids {args.stop_ids}: token id {next(t for t in stop if t >= vocab)} is outside the "
                         f"vocabulary (0 to {vocab - 1}), so it would never stop a sequence")

    from ..generation.generator import Generator, Sampling

    Sampling(args.temperature, args.top_k, args.top_p, args.seed)  # checks the options before loading
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be at least 1 (got {args.max_new_tokens})")
    draft = speculation_draft(args)
    grammar, grammars = _grammar(args, manifest, tokenizer)  # compiled before the model loads: exit 2 if it cannot be
    gen = Generator(args.artifact, draft=draft, speculate=args.speculate or 1, adaptive=not args.always_speculate,
                    run_ahead=False if args.no_run_ahead else None)
    if grammars is not None:
        gen.use_grammars(grammars)
    _warn_if_speculation_cannot_pay(gen)
    options = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop_tokens=stop,
                   grammar=grammar)
    if args.stream:
        results = _stream(gen, prompts, args.max_new_tokens, options, tokenizer, args.format == "json")
    else:
        results = gen.generate(prompts, args.max_new_tokens, **options)
    timing = gen.timing()
    if gen.speculation is not None:  # what speculation did, also where no step speculated
        timing = {**timing, **gen.speculation}
    rows = []
    for prompt, r in zip(prompts, results):
        row = {"prompt_ids": prompt, "tokens": r.tokens, "finish_reason": r.finish_reason}
        if r.error:
            row["error"] = r.error
        if tokenizer is not None:
            row["text"] = tokenizer.decode(r.tokens)
        rows.append(row)
    for i, row in enumerate(rows):  # a request that failed while others went on: on stderr, as every error
        if "error" in row:
            print(f"autosched: error: prompt {i}: {row['error']}", file=sys.stderr)
    if args.format == "json":
        document = {"completions": rows, "timing": timing}
        print(json.dumps(document) if args.stream else json.dumps(document, indent=2))
    else:
        for i, row in enumerate(rows):
            if "error" in row:
                continue
            if not args.stream:
                print(f"[{i}] " + " ".join(map(str, row["tokens"])))
                if "text" in row:
                    print(f"[{i}] {row['text']}")
            print(f"[{i}] ended: {FINISHED_BECAUSE.get(row['finish_reason'], row['finish_reason'])}", file=sys.stderr)
        speculation = ""
        if "proposed_tokens" in timing:
            speculation = (f"; speculating: {timing['accepted_tokens']} of {timing['proposed_tokens']} proposed tokens "
                           f"accepted, {timing['tokens_per_step']:.2f} tokens per sequence per step, "
                           f"{timing['plain_steps']} of {timing['decode_steps']} steps plain (the draft did not pay)")
        print(f"prefill {timing['prefill_ms']:.2f} ms ({timing['prefill_tokens']} tokens), {timing['ms_per_step']:.3f} ms "
              f"per decode step over {timing['decode_steps']} steps, {timing['tokens_per_s']:.1f} tokens/s{speculation}",
              file=sys.stderr)
    return 2 if any("error" in r for r in rows) else 0


def _stream(gen, prompts: list, max_new_tokens: int, options: dict, tokenizer, json_lines: bool) -> list:
    """Print each token as ``Generator.stream`` makes it: after ``[i]``, its prompt's index, on the line of that
    prompt's tokens while they come one after another (one prompt: one line), on a new line where another
    prompt's token comes between; with a tokenizer, the text the token adds; with ``json_lines``, a JSON line
    per token. Returns the completions."""
    made: list[list[int]] = [[] for _ in prompts]
    shown = [""] * len(prompts)  # each prompt's text printed so far
    line = None  # the prompt whose tokens the current line holds
    for index, token in gen.stream(prompts, max_new_tokens, **options):
        made[index].append(token)
        piece = None
        if tokenizer is not None:  # the text decoded so far, less what was printed: a token may end a character
            text = tokenizer.decode(made[index])
            piece, shown[index] = text[len(shown[index]):], text
        if json_lines:
            print(json.dumps({"index": index, "token": token, **({"text": piece} if piece is not None else {})}),
                  flush=True)
            continue
        if index != line:
            sys.stdout.write(("\n" if line is not None else "") + f"[{index}]" + (" " if piece is not None else ""))
            line = index
        sys.stdout.write(piece if piece is not None else f" {token}")
        sys.stdout.flush()
    if line is not None and not json_lines:
        sys.stdout.write("\n")
    return list(gen.completions)


def _warn_if_speculation_cannot_pay(gen) -> None:
    """Say so where the draft makes speculation cost more than it can make even with every proposal kept (a
    draft as large as the model): the generator then decodes plainly, speculating only to probe the draft."""
    from ..generation.speculative import PROBE_EVERY, VERIFY_COST

    speculator = gen._speculator
    if speculator is None or not speculator.never_pays():
        return
    k, cost = speculator.k, speculator.adaptation.cost
    console(stderr=True).log(
        f"[yellow]warning:[/] speculating with this draft cannot pay: its {k} steps and the verify step cost {cost:.3g} "
        f"plain decode steps, more than the {k + 1} tokens a step makes with every proposal kept (the draft reads "
        f"{(cost - VERIFY_COST) / k:.0%} of the model's weight bytes); decoding plainly, trying the draft every "
        f"{PROBE_EVERY} steps: give a smaller draft, or --always-speculate to speculate at every step")
