"""Test helpers: run the CLI as a user would, fill a database with records, and build and check one point
of a space in-process (no worker pools)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import torch

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


class InstantMeasurer:
    """A measurer for tests of the task scheduler: every point of a task 'runs' in ``seconds(spec)``, nothing
    is built, and ``measured`` lists (spec, points) in the order they were asked for."""

    def __init__(self, seconds=lambda spec: 1e-6):
        self.seconds = seconds
        self.measured = []

    def measure(self, spec, points, cutoff=None, modules=None):
        from autosched.records import MeasureResult

        self.measured.append((spec, list(points)))
        return [MeasureResult((self.seconds(spec),)) for _ in points]

    def measure_batch(self, requests):
        return [self.measure(r.spec, r.points, r.cutoff, r.modules) for r in requests]

    def close(self):
        pass


def autosched(*args, check=True, timeout=600, unset=()):
    """Run ``python -m autosched ARGS``; with ``check``, fail unless it exits 0; ``unset``: environment
    variables the command runs without."""
    env = {k: v for k, v in ENV.items() if k not in unset}
    proc = subprocess.run([sys.executable, "-m", "autosched", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"autosched {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}")
    return proc


def cli(*args, check=True) -> subprocess.CompletedProcess:
    """``autosched ARGS`` run in this process (``autosched.cli.main``), for tests of what the command line
    says and returns rather than of its process: no new interpreter importing TVM and torch (~2.5 s).
    With ``check``, fail unless it returns 0."""
    import contextlib
    import io

    from autosched.cli import main

    out, err = io.StringIO(), io.StringIO()
    handler = signal.getsignal(signal.SIGTERM)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exc:  # argparse's usage errors
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        signal.signal(signal.SIGTERM, handler)  # main() installs its own
    if check and code != 0:
        raise AssertionError(f"autosched {' '.join(args)} returned {code}:\n{err.getvalue()}")
    return subprocess.CompletedProcess(["autosched", *args], code, out.getvalue(), err.getvalue())


def start(*args):
    """Start ``python -m autosched ARGS`` without waiting for it. Ctrl-C (SIGINT) reaches it even where
    the tests themselves run with SIGINT ignored, as every command started in the background by a
    non-interactive shell does (Python then never installs its KeyboardInterrupt handler)."""
    return subprocess.Popen([sys.executable, "-m", "autosched", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def fill(db, task, target, latencies, space="matmul@1", failure=("build", "boom")) -> list[int]:
    """One finished run of records for ``task``: point ``{"x": i}`` took ``latencies[i]`` seconds, or failed
    with ``failure`` (kind, message) where that is None. Returns the record ids."""
    from autosched.records import MeasureResult

    wid, tid = db.ensure_workload(task), db.ensure_target(target)
    run = db.start_run("test", 0)
    points = [{"x": i} for i in range(len(latencies))]
    results = [MeasureResult((lat,)) if lat else MeasureResult.failed(*failure) for lat in latencies]
    ids = db.add_records(wid, tid, run, space, points, results)
    db.finish_run(run, "finished")
    return ids


def check_point(task, space, point, target, seed: int = 0) -> float:
    """Apply ``point``, compile for ``target``, run on fresh random inputs and return the relative error
    against the task's reference (float64 torch, or the unscheduled function)."""
    import tvm

    from autosched.workloads import torch_dtype

    mod = space.apply(point)
    executable = tvm.compile(mod, target=target.tvm_target())
    checker = task.spec.checker(task.func)
    inputs, refs = checker.inputs_and_reference(torch.Generator().manual_seed(seed), target.torch_device)
    outs = [torch.empty(s, dtype=torch_dtype(d), device=target.torch_device) for s, d in checker.output_specs()]
    for out in outs:  # poisoned, as the runner's check poisons them: unwritten elements show up
        out.fill_(float("nan") if out.is_floating_point() else -1)
    executable(*[tvm.runtime.from_dlpack(t) for t in checker.arrange(inputs, outs)])
    return max(checker.errors(inputs, outs, refs))


def transformers_greedy(model, prompt, new: int) -> list[int]:
    """transformers' greedy ``generate()`` of ``new`` tokens after ``prompt`` (one sequence, no padding)."""
    import torch

    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
    return out[0, len(prompt):].tolist()


def random_mixtral_on_gpu(hidden: int, intermediate: int, heads: int, kv_heads: int):
    """A transformers Mixtral of 2 layers, 8 experts (top 2) and a vocabulary of 8000, in fp16 on the GPU, its
    random weights scaled as :func:`random_on_gpu` scales them."""
    import transformers

    return random_on_gpu(transformers.MixtralConfig(
        hidden_size=hidden, intermediate_size=intermediate, num_local_experts=8, num_experts_per_tok=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, num_hidden_layers=2, vocab_size=8000,
        max_position_embeddings=4096))


def random_on_gpu(config):
    """A transformers causal LM of ``config`` in fp16 on the GPU, its random weights scaled so that activations
    stay near 1 and the head's logits (and a router's) spread over a few units (greedy choices and routing rarely
    near-ties)."""
    import math

    import transformers

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            elif "lm_head" in name or name.endswith("gate.weight"):  # logits and router logits of spread ~3
                p.normal_(0.0, 3.0 / math.sqrt(config.hidden_size))
            else:  # each product keeps the scale of its input
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))
    return model


def gpu_generator(model, name: str, max_seq_len: int, decode_batches: tuple[int, ...],
                  prefill_chunks: tuple[int, ...] = (), programmatic_launch: bool = False, prefetch_weights: int = 0):
    """(a Generator on the GPU, the build report) for a transformers causal LM in fp16, built through the Python
    API (no folder), with no database (``programmatic_launch``, ``prefetch_weights``: as compile_generation takes
    them)."""
    import tvm
    from tvm import relax

    from autosched.generation import Generator
    from autosched.generation.build import GenerationModel, compile_generation, generation_manifest
    from autosched.generation.decoder import config_from_hf, weights_from_hf
    from autosched.generation.model import LoadedModel
    from autosched.target import parse_target

    target = parse_target("cuda")
    gm = GenerationModel(name, model, config_from_hf(model.config, "float16"), [])
    executable, names, report = compile_generation(gm, target, None, decode_batches=decode_batches,
                                                   prefill_chunks=prefill_chunks,
                                                   programmatic_launch=programmatic_launch,
                                                   prefetch_weights=prefetch_weights)
    weights = weights_from_hf(model.state_dict(), gm.config)
    params = [tvm.runtime.from_dlpack(weights[n].contiguous()) for n in names]
    manifest = generation_manifest(gm, names, target, report, max_seq_len, max(decode_batches),
                                   decode_batches=decode_batches, prefill_chunks=prefill_chunks)
    device = tvm.cuda(0)
    return Generator.from_model(LoadedModel(relax.VirtualMachine(executable, device), params, manifest, device)), report


def assert_gpu_greedy_matches(model, prompts, results, new: int, max_margin: float) -> None:
    """Our greedy tokens of ``prompts`` equal transformers' (``model``, in half precision on the GPU) for ``new``
    tokens, or the first difference is a near-tie in transformers' logits (top-two margin under ``max_margin``,
    which the message reports otherwise)."""
    for prompt, result in zip(prompts, results):
        assert result.error is None
        ids = torch.tensor([prompt], device="cuda")
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                             output_scores=True, return_dict_in_generate=True)
        theirs = out.sequences[0, len(prompt):].tolist()
        diff = next((i for i, (a, b) in enumerate(zip(result.tokens, theirs)) if a != b), None)
        if diff is not None:
            top = out.scores[diff][0].float().topk(2).values
            margin = float(top[0] - top[1])
            assert margin < max_margin, f"{len(prompt)}-token prompt: token {diff} differs at a margin of {margin:.3f}"


def record_launches_behind(gen) -> list[bool]:
    """Spy on a run-ahead Generator's decode launches: the returned list gets, for each step launched ahead,
    whether it went behind another step still in flight (``Generator._launch``'s ``after``)."""
    behind = []
    launch = gen._launch
    gen._launch = lambda seqs, rows, after=None: behind.append(after is not None) or launch(seqs, rows, after)
    return behind


# A chat template in the ChatML style, taking tools (as templates that take them do): what apply_chat_template
# renders in the serving tests.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

TOKENIZER_TEXT = (
    "Once upon a time there was a little model that wanted to serve many clients at once. "
    "It learned to batch their requests, to share the pages of a common prompt, and to stop at the right word. "
    "Naïve café owners wrote “smart quotes”, emoji 🙂 and 中文 text, all of which must survive detokenization. "
    "The quick brown fox jumps over the lazy dog; JSON looks like {\"name\": \"value\", \"count\": 3}. ")


def train_tokenizer(folder, vocab_size: int = 512):
    """A byte-level BPE tokenizer trained here (``tokenizers``) on a short text, with ``<unk>``, ``<s>`` and
    ``</s>`` as ids 0, 1 and 2 (the tiny models' BOS 1 and EOS 2) and the ChatML markers, saved to ``folder``
    as transformers saves one (chat template included); returns transformers' tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>", "<|im_start|>",
                                                                         "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    syllables = ["ka", "lo", "mi", "ne", "ru", "sta", "ve", "zo", "pri", "gu", "tha", "bel", "dor", "fen", "wi"]
    words = [a + b + c for a in syllables for b in syllables for c in syllables[:5]]  # enough merges to fill it
    tokenizer.train_from_iterator([TOKENIZER_TEXT] * 20 + [" ".join(words[i:i + 40]) for i in range(0, len(words), 40)],
                                  trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
    return fast


def dequantize_weight(codes, scales, name: str, k: int, dtype: str, zeros=None):
    """The float weight [n, k] ``dequant_gemm`` computes with (each weight rounded to ``dtype``), as a float64
    torch tensor: for references. ``zeros``: int4's zero points [n, k / group] (None: 8)."""
    from autosched.generation.quantize import group_size, scheme

    s = scheme(name)
    group = group_size(name, k)
    if s.bits == 4:
        c = codes.to(torch.int16)
        values = torch.stack([c & 15, (c >> 4) & 15], dim=-1).reshape(c.shape[0], -1).double()
        values = values - (zeros.double().repeat_interleave(group, dim=1) if zeros is not None else 8.0)
    elif s.fmt == "e4m3":
        values = codes.view(torch.float8_e4m3fn).double()
    else:
        values = codes.double()
    w = values * scales.double().repeat_interleave(group, dim=1)
    return w.to(getattr(torch, dtype)).double()
