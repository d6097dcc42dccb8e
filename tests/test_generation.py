"""Text generation from a built artifact: TVM's paged KV cache under our decoder gives the tokens
transformers' own ``generate()`` gives, for batches of prompts of different lengths, sequences that join
mid-batch and prompts forked from a shared prefix; bad input ends one request with its error while the
others go on.

Each model is a tiny transformers model whose random weights are made large enough that greedy decoding
wanders over the vocabulary (the default initialisation repeats one token), saved with ``save_pretrained``
and built from that folder, as a user's downloaded model would be."""

from __future__ import annotations

import json
import re

import pytest

from .helpers import assert_gpu_greedy_matches, cli, record_launches_behind, transformers_greedy

# The slow tier (--dist loadgroup) runs this file's tests in one process, so that the artifact of the
# module's `built` fixture (a generation build) is built once, not once in each process; the fixture lives for
# the process's session, as that process runs other files' tests between this file's.
pytestmark = pytest.mark.xdist_group("generation-artifact")

transformers = pytest.importorskip("transformers", reason="pip install -e '.[test]' installs transformers")

MAX_SEQ_LEN, MAX_BATCH, NEW = 96, 4, 32
PROMPTS = [[5, 7, 9, 11, 13, 2, 8], [100, 200], [3] * 17 + [4], [42, 43, 44, 45, 46]]


def _saved_model(family: str, folder):
    """A tiny ``family`` model with lively random weights, saved to ``folder``; returns the torch model."""
    import torch

    from autosched.examples.hf import TINY, _config

    config, cls = _config(family, TINY)
    torch.manual_seed(1)
    model = cls(config).eval()
    # A tied LM head favours the token just read unless the weights are larger still.
    std = 0.3 if family in ("gpt2", "gemma") else 0.08
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, std)
            elif "norm" in name or "ln_" in name:
                p.normal_(1.0 if family != "gemma" else 0.0, 0.1)
            else:
                p.normal_(0.0, 0.02)
    model.save_pretrained(folder)
    return model


def _reference(model, prompt, new=NEW):
    return transformers_greedy(model, prompt, new)


@pytest.fixture(scope="session", params=["llama"])
def built(request, tmp_path_factory):
    return _build(request.param, tmp_path_factory)


def _build(family, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"gen-{family}")
    model = _saved_model(family, root / "hf")
    # Up to two live sequences decode through a static function (one padded to two), more through the dynamic one;
    # prompts are prefilled in chunks of exactly 8 tokens (a prompt spanning chunks), the rest dynamically.
    cli("build", str(root / "hf"), "--generate", "-o", str(root / "art"), "--max-seq-len", str(MAX_SEQ_LEN),
        "--max-batch", str(MAX_BATCH), "--decode-batches", "2", "--prefill-chunks", "8", "--db", str(root / "tuning.db"))
    return model, root / "art"


def _check_family(model, artifact):
    from autosched.generation import Generator

    gen = Generator(artifact)
    results = gen.generate(PROMPTS, NEW)
    assert gen.stats["static_prefill_calls"] == 4  # 32 prompt tokens: four chunks of 8
    # Every call that made tokens chose them on the device (read back a token per row, not the logits); a
    # chunk that ends no prompt reads nothing back.
    assert gen.stats["device_greedy_calls"] > gen.stats["decode_steps"] > 0 and gen.stats["host_sample_calls"] == 0
    for prompt, result in zip(PROMPTS, results):
        assert result.error is None
        assert result.tokens == _reference(model, prompt), prompt
    assert len(set(results[0].tokens)) > 3  # the weights make greedy decoding move: a comparison that can fail


def test_greedy_tokens_match_transformers_for_a_batch_of_prompts(built):
    _check_family(*built)


def test_a_prefill_of_fewer_tokens_than_a_chunk_is_padded_up_to_it(built):
    """pad_prefill (a GPU build's default): the tokens a prompt leaves after its whole chunks of 8, and prompts
    shorter than a chunk, are prefilled through prefill_t8 with a padding sequence: every prefill call is a
    static one, the tokens are transformers' (sequences that join mid-decode included), and the cache's pages
    are all free again at the end."""
    from autosched.generation import Generator

    model, artifact = built
    gen = Generator(artifact)
    gen.pad_prefill = True
    free = gen.model.free_pages()
    ids = [gen.add(p, 10) for p in PROMPTS[:2]]  # 7 + 2 tokens: one call of 9, a chunk and 1 token left
    made = {i: [] for i in ids}
    for seq_id, token in gen.step():
        made[seq_id].append(token)
    late = gen.add(PROMPTS[2], 10)  # 18 tokens, while the others decode: two chunks and 2 tokens
    made[late] = []
    while gen.live:
        for seq_id, token in gen.step():
            made[seq_id].append(token)
    for seq_id, prompt in zip(ids + [late], PROMPTS[:3]):
        assert made[seq_id] == _reference(model, prompt, 10)
    assert gen.stats["static_prefill_calls"] == gen.stats["prefill_calls"] >= 5
    assert gen.stats["prefill_tokens"] == sum(map(len, PROMPTS[:3]))  # the padding is no prompt token
    assert gen.model.free_pages() == free
    plain = Generator(artifact)
    plain.generate(PROMPTS[:3], 10)
    assert plain.stats["static_prefill_calls"] < plain.stats["prefill_calls"]  # without: dynamic calls


def test_a_decode_step_is_padded_up_to_a_static_batch(built):
    """One live sequence decodes through decode_b2 with a padding row (an empty sequence whose token is
    removed after each step): the same tokens, and the padding never shows."""
    from autosched.generation import Generator

    model, artifact = built
    gen = Generator(artifact)
    result = gen.generate([PROMPTS[1]], 12)[0]
    assert result.tokens == _reference(model, PROMPTS[1], 12)
    assert gen.stats["padded_decode_steps"] == gen.stats["static_decode_steps"] == 11
    assert gen.live == [] and len(gen.completions) == 1


def test_the_loaded_model_holds_the_cache_and_runs_one_call(built):
    """LoadedModel on its own: the artifact's facts, its functions (greedy_tokens and sample_tokens
    included), sequences in the cache and their pages, padding sequences kept empty, and one prefill call
    whose logits hold a row per sequence."""

    from autosched.generation.model import PAD_SEQUENCE_IDS, LoadedModel

    model, artifact = built
    m = LoadedModel.load(artifact)
    assert (m.max_seq_len, m.max_batch, m.vocab) == (MAX_SEQ_LEN, MAX_BATCH, 512)
    assert m.greedy_tokens is not None and m.sample_tokens is not None and m.function("no_such_function") is None
    free = m.free_pages()
    m.add(0)
    m.add(1)
    logits = m.forward("batch_prefill", [0, 1], [3, 2], [5, 7, 9, 100, 200], prefill=True)
    rows = logits.numpy().reshape(2, -1)
    assert rows.shape == (2, 512)
    assert int(rows[1].argmax()) == _reference(model, [100, 200], 1)[0]
    assert m.free_pages() == free - 2
    assert m.padding_ids(2) == [PAD_SEQUENCE_IDS, PAD_SEQUENCE_IDS + 1] and m.padding_ids(1) == [PAD_SEQUENCE_IDS]
    m.remove(0)
    m.remove(1)
    assert m.free_pages() == free


def test_a_verify_call_gives_every_positions_logits_and_popn_takes_tokens_back(built):
    """What speculative decoding stands on: a prefill over tokens appended to cached sequences returns the
    logits of every position (transformers' logits there), and ``kv_state_popn`` takes tokens back out of the
    cache so that the next call continues from the kept ones."""
    import numpy as np
    import torch

    from autosched.generation.model import LoadedModel

    model, artifact = built
    m = LoadedModel.load(artifact)
    m.add(0)
    m.add(1)
    m.forward("batch_prefill", [0, 1], [3, 2], [5, 7, 9, 100, 200], prefill=True)
    free = m.free_pages()
    rows = m.forward("batch_prefill", [0, 1], [3, 2], [11, 13, 2, 1, 2], prefill=True, every_position=True)
    with torch.no_grad():
        theirs = [model(torch.tensor([ids])).logits[0].numpy() for ids in ([5, 7, 9, 11, 13, 2], [100, 200, 1, 2])]
    ours = rows.numpy().reshape(5, -1)
    np.testing.assert_allclose(ours[:3], theirs[0][-3:], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(ours[3:], theirs[1][-2:], rtol=1e-4, atol=1e-4)
    m.popn(0, 2)  # sequence 0 keeps 11, sequence 1 keeps 1
    m.popn(1, 1)
    again = m.forward("batch_prefill", [0, 1], [1, 1], [4, 6], prefill=True).numpy().reshape(2, -1)
    with torch.no_grad():
        theirs = [model(torch.tensor([ids])).logits[0, -1].numpy() for ids in ([5, 7, 9, 11, 4], [100, 200, 1, 6])]
    np.testing.assert_allclose(again, np.stack(theirs), rtol=1e-4, atol=1e-4)
    m.remove(0)
    m.remove(1)
    assert m.free_pages() >= free


def test_a_finished_result_stays_readable_until_removed_and_stream_leaves_added_sequences_alone(built):
    """After step() a finished sequence's completion (tokens, finish_reason, error) is readable until
    remove() takes it; stream(prefix=...) steps only its own sequences, not those the caller added; generate
    returns a list of its own, which later calls leave as it was."""
    from autosched.generation import GenerationError, Generator

    model, artifact = built
    gen = Generator(artifact)
    a = gen.add(PROMPTS[1], 3)
    while a in gen.live:
        gen.step()
    assert gen.finished == [a] and gen.completion(a).finish_reason == "length"
    assert gen.completion(a).tokens == _reference(model, PROMPTS[1], 3)
    assert gen.remove(a).tokens == _reference(model, PROMPTS[1], 3) and gen.finished == []
    with pytest.raises(GenerationError, match=f"no live sequence {a}"):
        gen.completion(a)
    # A sequence the cache ran out of pages for keeps its error too.
    small = Generator(artifact, kv_pages=1)
    b = small.add([3] * 60, 4)  # more pages than the cache holds
    small.step()
    assert b not in small.live and small.completion(b).finish_reason == "error"
    assert "out of pages" in small.completion(b).error
    # The caller's own sequence waits while stream serves its prompts, with or without a prefix.
    mine = gen.add(PROMPTS[0], 4)
    streamed = gen.generate([[9, 8, 7]], 4, prefix=[1, 2, 3, 4, 5])
    assert streamed[0].tokens == _reference(model, [1, 2, 3, 4, 5, 9, 8, 7], 4)
    assert gen.live == [mine] and gen.completion(mine).tokens == [] and gen.stats["decode_steps"] > 0
    while mine in gen.live:
        gen.step()
    assert gen.remove(mine).tokens == _reference(model, PROMPTS[0], 4)
    # A batch the caller filled with add() leaves no room: stream's prompts end with that error, not silently.
    held = [gen.add([1, 2], 4) for _ in range(MAX_BATCH)]
    assert "sequences are live, the artifact's --max-batch" in gen.generate([[5]], 2)[0].error
    for seq_id in held:
        gen.remove(seq_id)
    # generate's lists are the caller's own.
    first = gen.generate(PROMPTS[:2], 4)
    second = gen.generate(PROMPTS[2:], 4)
    assert first is not second and first is not gen.completions
    assert [r.tokens for r in first] == [_reference(model, p, 4) for p in PROMPTS[:2]]
    assert [r.tokens for r in second] == [_reference(model, p, 4) for p in PROMPTS[2:]]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "gpt2", "mistral", "gemma", "phi3"])
def test_every_family_matches_transformers(family, tmp_path_factory):
    _check_family(*_build(family, tmp_path_factory))


@pytest.mark.slow
def test_a_sequence_added_mid_batch_and_forks_of_a_prefix_match_transformers(built):
    """Continuous batching: a sequence joins while two others decode; and two prompts continue one prefilled
    prefix whose pages they share."""
    from autosched.generation import Generator

    model, artifact = built
    gen = Generator(artifact)
    a, b = gen.add(PROMPTS[0], NEW), gen.add(PROMPTS[1], NEW)
    for _ in range(5):
        gen.step()
    c = gen.add(PROMPTS[2], NEW)
    completions = {seq_id: gen.completion(seq_id) for seq_id in (a, b, c)}
    while gen.live:
        gen.step()
    # finished sequences leave the cache; what they made stays on their completions
    for seq_id, prompt in zip((a, b, c), PROMPTS):
        assert completions[seq_id].tokens == _reference(model, prompt)
    results = gen.generate([[9, 8, 7], [6]], NEW, prefix=[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17])
    assert results[0].tokens == _reference(model, list(range(1, 18)) + [9, 8, 7])
    assert results[1].tokens == _reference(model, list(range(1, 18)) + [6])


@pytest.mark.slow
def test_add_and_step_give_each_sequence_its_own_tokens(built):
    from autosched.generation import Generator

    model, artifact = built
    gen = Generator(artifact)
    ids = [gen.add(PROMPTS[0], NEW), gen.add(PROMPTS[1], NEW)]
    made = {i: [] for i in ids}
    for _ in range(3):
        for seq_id, token in gen.step():
            made[seq_id].append(token)
    late = gen.add(PROMPTS[3], NEW)
    made[late] = []
    while gen.live:
        for seq_id, token in gen.step():
            made[seq_id].append(token)
    assert made[ids[0]] == _reference(model, PROMPTS[0])
    assert made[ids[1]] == _reference(model, PROMPTS[1])
    assert made[late] == _reference(model, PROMPTS[3])
    assert gen.live == [] and gen.timing()["decode_steps"] > 0
    assert 0 < gen.stats["static_decode_steps"] < gen.stats["decode_steps"]  # decode_b2 ran, and batch_decode


@pytest.mark.slow
def test_more_prompts_than_the_batch_are_served_in_turn_and_stream_in_order(built):
    from autosched.generation import Generator

    model, artifact = built
    gen = Generator(artifact)
    prompts = PROMPTS + [[7, 7, 7], [8]]  # 6 prompts, --max-batch 4
    streamed = {i: [] for i in range(len(prompts))}
    for index, token in gen.stream(prompts, 8):
        streamed[index].append(token)
    for i, prompt in enumerate(prompts):
        assert streamed[i] == gen.completions[i].tokens == _reference(model, prompt, 8)


def test_sampling_is_reproducible_and_top_k_1_is_greedy(built):
    from autosched.generation import Generator

    _, artifact = built
    gen = Generator(artifact)
    first = gen.generate(PROMPTS, 16, temperature=1.0, top_p=0.9, seed=7)
    again = gen.generate(PROMPTS[:1], 16, temperature=1.0, top_p=0.9, seed=7)  # request 0 alone: same seed
    assert first[0].tokens == again[0].tokens
    other = gen.generate(PROMPTS[:1], 16, temperature=1.0, top_p=0.9, seed=8)
    assert other[0].tokens != first[0].tokens
    greedy = gen.generate(PROMPTS, 16)  # chosen on the device by greedy_tokens; top-k 1 below by sample_tokens
    assert [r.tokens for r in gen.generate(PROMPTS, 16, temperature=0.7, top_k=1)] == [r.tokens for r in greedy]
    # Every sampled token was chosen on the device: no step read the logits back.
    assert gen.stats["device_sample_calls"] > 0 and gen.stats["host_sample_calls"] == 0


def test_stop_tokens_end_a_sequence(built):
    from autosched.generation import Generator

    _, artifact = built
    gen = Generator(artifact)
    free = gen.generate(PROMPTS[:1], NEW, stop_tokens=[])[0].tokens
    stop = free[5]
    stopped = gen.generate(PROMPTS[:1], NEW, stop_tokens=[stop])[0]
    assert stopped.tokens == free[:free.index(stop) + 1] and stopped.finish_reason == "stop"


def test_bad_requests_end_with_their_error_and_the_others_go_on(built):
    from autosched.generation import GenerationError, Generator

    model, artifact = built
    gen = Generator(artifact)
    results = gen.generate([PROMPTS[0], [1] * (MAX_SEQ_LEN + 1), [5, 512 + 3], []], 8)
    assert results[0].tokens == _reference(model, PROMPTS[0], 8)
    assert "more than the artifact's --max-seq-len 96" in results[1].error
    # A prompt of exactly --max-seq-len tokens leaves no room for a token: an error, not an empty completion.
    assert "no room is left for a new token" in gen.generate([[3] * MAX_SEQ_LEN], 4)[0].error
    assert "token id 515 is outside the vocabulary (0 to 511)" in results[2].error
    assert "the prompt is empty" in results[3].error
    # a sequence that reaches --max-seq-len stops there
    long = gen.generate([[3] * (MAX_SEQ_LEN - 4)], 50)[0]
    assert len(long.tokens) == 4 and long.finish_reason == "max_seq_len"
    for _ in range(MAX_BATCH):
        gen.add([1, 2], 4)
    with pytest.raises(GenerationError, match="4 sequences are live, the artifact's --max-batch"):
        gen.add([1, 2], 4)
    with pytest.raises(GenerationError, match="no live sequence 999"):
        gen.remove(999)
    # A request for no new tokens would never finish: refused at once.
    with pytest.raises(GenerationError, match="max_new_tokens must be at least 1"):
        gen.generate([PROMPTS[0]], 0)


@pytest.mark.slow
def test_a_cache_out_of_pages_ends_the_sequence_that_needs_one(built):
    """A few 16-token pages: a short sequence fits in its one page and finishes; a long one runs out of pages
    and ends with the error, keeping the tokens it made."""
    from autosched.generation import Generator

    model, artifact = built
    gen = Generator(artifact, kv_pages=3)
    short, long = gen.add([1, 2, 3], 10), gen.add([4] * 30, 60)
    results = {short: gen.completion(short), long: gen.completion(long)}
    while gen.live:
        gen.step()
    assert results[long].finish_reason == "error" and "the KV cache is out of pages (3 in all)" in results[long].error
    assert results[long].tokens == _reference(model, [4] * 30, 60)[:len(results[long].tokens)]
    assert results[short].finish_reason == "length" and results[short].tokens == _reference(model, [1, 2, 3], 10)


def test_the_command_line_generates_and_reports_bad_input_in_one_line(built):
    _, artifact = built
    out = cli("generate", str(artifact), "--prompt-ids", "5,7,9", "--prompt-ids", "1", "--max-new-tokens", "4",
              "--format", "json")
    data = json.loads(out.stdout)
    assert [len(c["tokens"]) for c in data["completions"]] == [4, 4] and data["timing"]["decode_steps"] == 3
    text = cli("generate", str(artifact), "--prompt-ids", "5,7,9", "--max-new-tokens", "3", "--no-run-ahead")
    assert "tokens/s" in text.stderr and text.stdout.startswith("[0] ")
    assert "[0] ended: --max-new-tokens reached" in text.stderr  # why each sequence ended
    # A prompt the artifact cannot take is bad input as any other: one line on stderr, nothing on stdout (issue 70).
    for prompt, says in ((",".join(["3"] * MAX_SEQ_LEN), "no room is left for a new token"),
                         (",".join(["3"] * (MAX_SEQ_LEN + 1)), "more than the artifact's --max-seq-len 96"),
                         ("5,99999", "token id 99999 is outside the vocabulary (0 to 511)")):
        wrong = cli("generate", str(artifact), "--prompt-ids", "1", "--prompt-ids", prompt, check=False)
        lines = wrong.stderr.strip().splitlines()
        assert wrong.returncode == 2 and len(lines) == 1 and says in lines[0] and not wrong.stdout, wrong
        assert lines[0].startswith("autosched: error: --prompt-ids ")
    bad = cli("generate", str(artifact), "--prompt-ids", "5,x", check=False)
    assert bad.returncode == 2 and "comma-separated token ids" in bad.stderr
    missing = cli("generate", str(artifact.parent / "nothere"), "--prompt-ids", "1", check=False)
    assert missing.returncode == 2 and "no manifest.json" in missing.stderr
    plain = cli("generate", str(artifact), "--prompt", "hello", check=False)
    assert plain.returncode == 2 and "--prompt needs --tokenizer" in plain.stderr
    none = cli("generate", str(artifact), "--prompt-ids", "1", "--max-new-tokens", "0", check=False)
    assert none.returncode == 2 and "--max-new-tokens must be at least 1 (got 0)" in none.stderr
    for args, says in ((["--temperature", "-1"], "temperature must be 0 (greedy) or a finite number above it, got -1"),
                       (["--temperature", "nan"], "temperature must be 0 (greedy) or a finite number above it, got nan"),
                       (["--temperature", "inf"], "temperature must be 0 (greedy) or a finite number above it, got inf"),
                       (["--top-k", "-2"], "top_k must be 0 (no limit) or more, got -2"),
                       (["--top-p", "2"], "top_p must be in (0, 1], got 2"),
                       (["--stop-ids", "7,512"], "--stop-ids 7,512: token id 512 is outside the vocabulary (0 to 511)"),
                       (["--speculate", "100000", "--prompt-lookup"], f"propose at most {MAX_SEQ_LEN - 2}")):
        wrong = cli("generate", str(artifact), "--prompt-ids", "1", *args, check=False)
        lines = wrong.stderr.strip().splitlines()
        assert wrong.returncode == 2 and len(lines) == 1 and says in lines[0], wrong.stderr


def test_the_command_line_reads_a_local_tokenizer(built, tmp_path):
    """--tokenizer DIR --prompt TEXT: the text's ids are the prompt, and the tokens come back as text too."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model, artifact = built
    words = Tokenizer(models.WordLevel({"[UNK]": 0, **{f"w{i}": i for i in range(1, 512)}}, unk_token="[UNK]"))
    words.pre_tokenizer, words.decoder = pre_tokenizers.Whitespace(), decoders.WordPiece()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]").save_pretrained(tmp_path / "tok")
    out = json.loads(cli("generate", str(artifact), "--tokenizer", str(tmp_path / "tok"), "--prompt", "w5 w7 w9",
                         "--max-new-tokens", "4", "--format", "json").stdout)["completions"][0]
    assert out["prompt_ids"] == [5, 7, 9] and out["tokens"] == _reference(model, [5, 7, 9], 4)
    assert out["text"] == " ".join(f"w{t}" for t in out["tokens"])
    # --stream with a tokenizer: the text as it comes, after the prompt's index.
    streamed = cli("generate", str(artifact), "--tokenizer", str(tmp_path / "tok"), "--prompt", "w5 w7 w9",
                   "--max-new-tokens", "4", "--stream")
    assert streamed.stdout == f"[0] {out['text']}\n"
    # A folder without a tokenizer (the model's own, here) is named in one line, not transformers' five.
    model_folder = artifact.parent / "hf"
    proc = cli("generate", str(artifact), "--tokenizer", str(model_folder), "--prompt", "w5", check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and f"--tokenizer {model_folder} holds no tokenizer" in lines[0]


def test_generate_stream_prints_each_token_as_it_comes(built, monkeypatch):
    """--stream: each token is on stdout before the next is made, after its prompt's index (a prompt whose tokens
    follow each other on one line); --format json: a JSON line per token, then the completions."""
    import sys

    from autosched.generation import Generator

    _, artifact = built
    printed_before = []  # what stdout held when each token was made
    stream = Generator.stream

    def watched(self, *args, **kwargs):
        for item in stream(self, *args, **kwargs):
            printed_before.append(sys.stdout.getvalue())
            yield item

    monkeypatch.setattr(Generator, "stream", watched)
    one = cli("generate", str(artifact), "--prompt-ids", "5,7,9", "--max-new-tokens", "4", "--stream")
    tokens = one.stdout.split()[1:]
    assert one.stdout.startswith("[0] ") and one.stdout.count("\n") == 1 and len(tokens) == 4
    assert [p.split()[1:] for p in printed_before] == [tokens[:i] for i in range(4)]  # token i-1 shown when i came
    assert tokens == list(map(str, _reference(built[0], [5, 7, 9], 4)))
    two = cli("generate", str(artifact), "--prompt-ids", "5,7,9", "--prompt-ids", "1", "--max-new-tokens", "2",
              "--stream")
    assert [line.split()[0] for line in two.stdout.splitlines()] == ["[0]", "[1]", "[0]", "[1]"]
    lines = cli("generate", str(artifact), "--prompt-ids", "5,7,9", "--max-new-tokens", "2", "--stream", "--format",
                "json").stdout.splitlines()
    events, last = [json.loads(line) for line in lines[:-1]], json.loads(lines[-1])
    assert events == [{"index": 0, "token": t} for t in last["completions"][0]["tokens"]] and len(events) == 2


def test_build_refuses_limits_the_model_cannot_take(tmp_path):
    _saved_model("gpt2", tmp_path / "gpt2")
    out = cli("build", str(tmp_path / "gpt2"), "--generate", "-o", str(tmp_path / "art"), "--max-seq-len", "5000",
              "--db", str(tmp_path / "t.db"), check=False)
    assert out.returncode == 2 and "4096 learned positions: use --max-seq-len 4096 or less" in out.stderr
    assert not (tmp_path / "art").exists()
    odd = cli("build", "tiny-llama", "--generate", "-o", str(tmp_path / "art2"), "--db", str(tmp_path / "t.db"), check=False)
    assert odd.returncode == 2 and "not a transformers causal LM" in odd.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_half_precision_generation_on_the_gpu_matches_transformers(family, tmp_path):
    """fp16 on the GPU: the first 16 greedy tokens of every prompt are transformers' (on the same GPU), or the
    first difference is a near-tie of transformers' own logits. Decode steps are launched ahead by default on
    the GPU (run_ahead: each step's ids its predecessor's tokens on the device, the barrier inside the step
    waiting for them): the same tokens as a step at a time, with prompts that join as others finish."""
    import torch

    from autosched.generation import Generator

    model = _saved_model(family, tmp_path / "hf")
    cli("build", str(tmp_path / "hf"), "--generate", "--target", "cuda", "--dtype", "float16", "-o",
        str(tmp_path / "art"), "--max-seq-len", str(MAX_SEQ_LEN), "--max-batch", str(MAX_BATCH),
        "--db", str(tmp_path / "t.db"))
    model = model.to("cuda", torch.float16)
    gen = Generator(tmp_path / "art")
    assert gen.run_ahead  # a CUDA build's default
    results = gen.generate(PROMPTS, 16)
    assert_gpu_greedy_matches(model, PROMPTS, results, 16, max_margin=0.05)
    prompts = PROMPTS + [[7, 7, 7], [8]]
    ahead = [r.tokens for r in gen.generate(prompts, 24)]
    gen.run_ahead = False
    assert [r.tokens for r in gen.generate(prompts, 24)] == ahead


@pytest.mark.slow
def test_tune_model_generate_tunes_the_decode_step_and_build_uses_its_records(built, tmp_path):
    """The static decode function's kernels are tasks like any model's: tuned, stored, then applied by the
    generation build, which still gives transformers' tokens."""
    from autosched.generation import Generator

    model, _ = built
    db = str(tmp_path / "tuning.db")
    folder = tmp_path / "hf"
    _saved_model("llama", folder)
    tuned = cli("tune-model", str(folder), "--generate", "--decode-batches", "2", "--max-batch", str(MAX_BATCH),
                "--trials", "24", "--db", db, "--format", "json")
    rows = json.loads(tuned.stdout)
    assert sum(r["trials"] for r in rows) == 24
    assert all(r["searched"] in ("yes", "no (default point)") if r["trials"] else r["searched"] == "no (not measured)"
               for r in rows)
    said = " ".join(tuned.stderr.split())
    assert re.search(r"a decode step at batch 2: [\d.]+ ms in its tunable kernels", said), said
    assert f"autosched build {folder} --generate --decode-batches 2 --max-batch {MAX_BATCH} --db {db} -o DIR" in said
    cli("build", str(folder), "--generate", "--decode-batches", "2", "--db", db, "-o", str(tmp_path / "art"),
        "--max-seq-len", str(MAX_SEQ_LEN), "--max-batch", str(MAX_BATCH))
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert len(manifest["tuned_kernels"]) >= 5
    results = Generator(tmp_path / "art").generate(PROMPTS[:2], 16)
    assert [r.tokens for r in results] == [_reference(model, p, 16) for p in PROMPTS[:2]]


@pytest.mark.slow
def test_a_build_for_sm_90_runs_every_linear_layer_of_its_static_functions_on_our_workloads():
    """Built here without a GPU (scheduled, not compiled): in the decode steps and the prefill chunk every
    product with a weight and every RMSNorm (with the residual add before it) is one of our workloads (a
    decode step's rows on hopper_gemm's swapped kernel,
    one row left to the GEMV space, the gate and up projections one swiglu_gemm: the chunk's on hopper_gemm, a
    decode step's of 2-8 rows on the streaming swiglu_gemv, with no kernel of their own for SiLU·up; a single
    row's stay one GEMV over the stacked weight, then SiLU·up); the dynamic
    functions keep TVM's matmul kernels, and so does the chunk's LM head, over the last token of each of a
    symbolic number of prompts."""
    from autosched.examples.hf import TINY, _config
    from autosched.generation.build import lower_generation, schedule_generation
    from autosched.generation.decoder import config_from_hf
    from autosched.pipeline.tasks import kernel_calls
    from autosched.target import parse_target

    target = parse_target("cuda:sm_90a", require_device=False)
    cfg = config_from_hf(_config("llama", TINY)[0], "float16")
    lowered, _ = lower_generation(cfg, target, decode_batches=(1, 4), prefill_chunks=(128,))
    _, report, _ = schedule_generation(lowered, None, target)
    for function in ("decode_b1", "decode_b4", "prefill_t128"):
        called = kernel_calls(lowered, lambda name, function=function: name == function)
        left = [k for k in called if "matmul" in k.lower()]  # TVM's matmul kernels
        assert len(left) == (1 if function == "prefill_t128" else 0), (function, left)
        ours = {report.workloads[k]["workload"].split("[")[0] for k in called if k in report.workloads}
        norms = {"rmsnorm", "add_rmsnorm"}  # the first layer's norm; each residual add with the norm after it
        fused = function != "decode_b1"
        assert ours == {"gemm"} | ({"swiglu_gemm"} if fused else set()) | norms, function
        assert not [k for k in called if k.startswith("rms_norm")], function  # TVM's RMSNorm kernels
        silu_up = [k for k in called if "silu" in k or "split" in k or "multiply" in k]
        assert len(silu_up) == (0 if fused else 1), (function, silu_up)
        assert not [k for k in called if "add" in k and not k.startswith("autosched_add_rmsnorm")], function
    spaces = {(w["workload"].split(",")[0], w["space"], w["schedule"]) for w in report.workloads.values()}
    assert ("gemm[m=4", "hopper_gemm", "default point") in spaces
    assert ("gemm[m=1", "gpu_gemv", "TVM default (dlight)") in spaces
    assert ("swiglu_gemm[m=128", "hopper_gemm", "default point") in spaces
    assert ("swiglu_gemm[m=4", "swiglu_gemv", "default point") in spaces
    assert ("rmsnorm[m=4", "gpu_rows", "TVM default (dlight)") in spaces  # tunable, dlight's until tuned
    assert ("add_rmsnorm[m=4", "gpu_rows", "TVM default (dlight)") in spaces
    dynamic = kernel_calls(lowered, lambda name: name == "batch_decode")
    assert any("matmul" in k.lower() for k in dynamic)


@pytest.mark.slow  # a whole build's CUDA compile: the slow tier keeps the fast one under three minutes
def test_a_llama_3_1_build_compiles_for_sm_90():
    """Llama 3's rotary scaling with heads of 128 (Llama-3.1-8B's) compiles for sm_90a: TVM's tree-attention
    kernel, which inlines the scaled rotation, broke TVM's common-subexpression pass and is compiled apart
    without it (generation never calls it: its speculative steps are chains)."""
    import transformers

    from autosched.generation.attention import TREE_ROLE
    from autosched.generation.build import GenerationModel, compile_generation
    from autosched.generation.decoder import config_from_hf
    from autosched.target import parse_target

    config = transformers.LlamaConfig(
        hidden_size=512, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256, vocab_size=1000,
        num_hidden_layers=1, max_position_embeddings=131072, rope_parameters={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192, "rope_theta": 500000.0})
    model = GenerationModel("llama3.1", transformers.LlamaForCausalLM(config), config_from_hf(config, "float16"), [])
    executable, _, report = compile_generation(model, parse_target("cuda:sm_90a", require_device=False), None,
                                               decode_batches=(1,), prefill_chunks=(64,))
    assert "batch_tree_attn" in report.attention[TREE_ROLE] and executable is not None


def test_tuning_weighs_a_decode_steps_kernels_by_the_decode_steps_per_prefill(tmp_path):
    """A prompt is prefilled once and decoded token by token: a kernel of the decode step weighs its calls
    times ``decode_steps``, one of the prefill chunk its calls, one in both the sum. A bad count is refused
    in one line before the model loads."""
    from autosched.examples.hf import TINY, _config
    from autosched.generation.build import DEFAULT_DECODE_STEPS, generation_tasks, lower_generation
    from autosched.generation.decoder import config_from_hf
    from autosched.pipeline.tasks import kernel_calls
    from autosched.target import parse_target

    cfg = config_from_hf(_config("llama", TINY)[0], "float32")
    lowered, _ = lower_generation(cfg, parse_target("llvm"), decode_batches=(1,), prefill_chunks=(8,))
    decode = kernel_calls(lowered, lambda name: name == "decode_b1")
    prefill = kernel_calls(lowered, lambda name: name == "prefill_t8")
    for steps in (1, 5, DEFAULT_DECODE_STEPS):
        tasks = generation_tasks(lowered, steps) if steps != DEFAULT_DECODE_STEPS else generation_tasks(lowered)
        for task in tasks:
            names = [task.name, *task.meta.get("aliases", [])]
            assert task.weight == sum(steps * decode[n] + prefill[n] for n in names), task.name
        assert any(decode[t.name] and not prefill[t.name] for t in tasks)
        assert any(prefill[t.name] and not decode[t.name] for t in tasks)
    for bad in ("0", "-3"):
        proc = cli("tune-model", "hf-llama", "--generate", "--decode-steps", bad, "--trials", "1",
                   "--db", str(tmp_path / "t.db"), check=False)
        assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
        assert "--decode-steps must be a whole number of steps, at least 1" in proc.stderr


@pytest.mark.slow
def test_a_decode_step_of_a_few_rows_for_sm_90_runs_gate_up_and_silu_as_one_streaming_kernel():
    """A ``cuda:sm_90`` build without a GPU: decode_b4's gate and up projections and SiLU·up are one swiglu_gemm task
    (the two weights stacked, [2n, k]) that swiglu_gemv serves, with no kernel of their own for SiLU·up, and its
    default point compiles for sm_90a without spills; decode_b1 and a CPU build of the same model keep them
    unfused (a gemm of the stacked weight, then split, SiLU and multiply)."""
    from autosched.cuda_tools import cuda_source
    from autosched.examples.hf import TINY, _config
    from autosched.generation.build import generation_tasks, lower_generation
    from autosched.generation.decoder import config_from_hf
    from autosched.pipeline.tasks import kernel_calls
    from autosched.target import parse_target

    from .nvcc import nvcc_compile

    cfg = config_from_hf(_config("llama", TINY)[0], "float16")
    target = parse_target("cuda:sm_90", require_device=False)
    lowered, _ = lower_generation(cfg, target, decode_batches=(1, 4))
    called = kernel_calls(lowered, lambda name: name == "decode_b4")
    assert not [k for k in called if "silu" in k or "split" in k or "multiply" in k], called
    single = kernel_calls(lowered, lambda name: name == "decode_b1")
    assert not [k for k in single if "swiglu" in k] and [k for k in single if "silu" in k and "multiply" in k]
    fused = [t for t in generation_tasks(lowered) if t.workload is not None and t.workload.op == "swiglu_gemm"]
    assert [t.workload.shape_dict for t in fused] == [{"m": 4, "n": cfg.mlp, "k": cfg.hidden}]
    space = fused[0].space(target)
    assert space.name == "swiglu_gemv"
    point = space.default()
    report = nvcc_compile(cuda_source(space.apply(point), target, {}, space.codegen), "sm_90a")
    assert report.ok and report.spills == 0, report.log[-2000:]
    cpu, _ = lower_generation(cfg, parse_target("llvm"), decode_batches=(1,))
    called = kernel_calls(cpu, lambda name: name == "decode_b1")
    assert not [k for k in called if "swiglu" in k] and [k for k in called if "silu" in k and "multiply" in k], called


def test_the_command_line_refuses_bad_numbers_and_options_in_one_line(built, tmp_path):
    """Ids that are negative, empty between commas, fractional or not numbers; a negative seed; --top-k or
    --top-p without a temperature (they would be silently greedy): one line each, exit 2."""
    _, artifact = built
    for args, says in ((["--prompt-ids", "-1,2"], "-1 is negative: token ids are 0 or more"),
                       (["--prompt-ids", "1,,2"], "an empty item between commas"),
                       (["--prompt-ids", "1.5,2"], "'1.5' is not a whole number"),
                       (["--prompt-ids", "a"], "'a' is not a whole number"),
                       (["--prompt-ids", "1", "--stop-ids", "-3"], "--stop-ids '-3' should be comma-separated token ids"),
                       (["--prompt-ids", "1", "--seed", "-1"], "seed must be a whole number, 0 or more (got -1)"),
                       (["--prompt-ids", "1", "--top-k", "50"], "give a temperature above 0 (e.g. --temperature 0.8)"),
                       (["--prompt-ids", "1", "--top-p", "0.9"], "give a temperature above 0 (e.g. --temperature 0.8)")):
        proc = cli("generate", str(artifact), *args, check=False)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and says in lines[0], (args, proc.stderr)
    sampled = cli("generate", str(artifact), "--prompt-ids", "1", "--top-k", "50", "--temperature", "0.8",
                  "--max-new-tokens", "2")
    assert sampled.stdout.startswith("[0] ")
    db = tmp_path / "tune.db"
    db.write_bytes(b"")
    proc = cli("generate", str(db), "--prompt-ids", "1", check=False)
    assert proc.returncode == 2 and "is a file, not an artifact" in proc.stderr and "-o tune.db" not in proc.stderr


def test_the_api_refuses_what_it_would_misread(built):
    """A flat list of ids is not a list of prompts; a fractional or text id is not truncated to a number;
    numpy ids are ids; kv_pages, seed and top_k without a temperature are checked."""
    import numpy as np

    from autosched.errors import UsageError
    from autosched.generation import GenerationError, Generator

    model, artifact = built
    for pages in (-1, 0, 2.5):
        with pytest.raises(UsageError, match="kv_pages must be a whole number of pages, at least 1"):
            Generator(artifact, kv_pages=pages)
    gen = Generator(artifact)
    with pytest.raises(GenerationError, match=r"for one prompt, give \[\[1, 2, 3\]\], not \[1, 2, 3\]"):
        gen.generate([1, 2, 3], 2)
    with pytest.raises(GenerationError, match="a list of prompts"):
        gen.generate("hello", 2)
    fractional, text, numpy = gen.generate([[1.7, 2], ["3", 4], np.array([5, 7, 9])], 2)
    assert "token id 1.7 is not a whole number" in fractional.error and "token id '3'" in text.error
    assert numpy.error is None and numpy.tokens == _reference(model, [5, 7, 9], 2)
    with pytest.raises(UsageError, match="seed must be a whole number"):
        gen.generate([[1, 2]], 2, seed=-1)
    with pytest.raises(UsageError, match="give a temperature above 0"):
        gen.generate([[1, 2]], 2, top_k=5)


def test_a_damaged_generation_artifact_is_named_in_one_line(built, tmp_path):
    """As `run` does for a model build: an empty or corrupt library, a truncated or empty parameter file, a
    manifest of an unknown version; one line naming the file, exit 2."""
    import os
    import shutil

    _, artifact = built
    manifest = json.loads((artifact / "manifest.json").read_text())
    library, params = manifest["library"], manifest["params"]
    good_params = (artifact / params).read_bytes()
    cases = [(library, b"", library), (library, os.urandom(4096), library),
             (params, good_params[:len(good_params) // 2], params), (params, b"", params)]
    for name, content, named in cases:
        art = tmp_path / "art"
        shutil.rmtree(art, ignore_errors=True)
        shutil.copytree(artifact, art)
        (art / name).write_bytes(content)
        proc = cli("generate", str(art), "--prompt-ids", "1", check=False)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and str(art / named) in lines[0], (name, proc.stderr)
        assert "internal error" not in lines[0] and "rebuild" in lines[0]
    art = tmp_path / "versioned"
    shutil.copytree(artifact, art)
    (art / "manifest.json").write_text(json.dumps({**manifest, "version": 2}))
    proc = cli("generate", str(art), "--prompt-ids", "1", check=False)
    assert proc.returncode == 2 and "manifest version 2" in proc.stderr
    # And `run` on a generation artifact says which command reads it.
    proc = cli("run", str(artifact), check=False)
    assert proc.returncode == 2 and f"autosched generate {artifact}" in proc.stderr


def _one_line_error(*args) -> str:
    """Run a command that must fail on bad input: one line on stderr, exit 2; returns the line."""
    proc = cli(*args, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "internal error" not in lines[0], (args, proc.stderr)
    return lines[0]


def test_a_library_cut_short_or_parameters_of_another_build_are_named_in_one_line(built, tmp_path):
    """A library cut short (which TVM's loader maps, the process dying of SIGBUS, exit 135, where it reads past
    the end) or of other bytes, for generate, eval and run; a build from before sizes were recorded (the ELF
    header's size); parameters of another build (another dtype, another shape); a manifest field of the wrong
    type: one line each, exit 2 (issue 70)."""
    import itertools
    import shutil

    import tvm

    from .test_new_user import _artifact

    _, artifact = built
    manifest = json.loads((artifact / "manifest.json").read_text())
    name, size = manifest["library"], manifest["files"][manifest["library"]]["bytes"]
    library = (artifact / name).read_bytes()
    assert len(library) == size and manifest["param_shapes"]
    copies = itertools.count()
    ids = tmp_path / "ids.txt"
    ids.write_text("1 2 3 4")

    def copy(**changes):
        art = tmp_path / f"art{next(copies)}"
        shutil.copytree(artifact, art)
        (art / "manifest.json").write_text(json.dumps({k: v for k, v in {**manifest, **changes}.items() if v is not None}))
        return art

    for cut in (4096, 600_000):
        art = copy()
        (art / name).write_bytes(library[:cut])
        for command in (("generate", str(art), "--prompt-ids", "1"), ("eval", str(art), "--token-ids", str(ids))):
            assert f"{art / name} is {cut} bytes, not the {size} that manifest.json records" in _one_line_error(*command)
    art = copy()
    (art / name).write_bytes(library[:-1] + bytes([library[-1] ^ 0xFF]))
    assert "is not the library this build wrote" in _one_line_error("generate", str(art), "--prompt-ids", "1")
    old = copy(files=None, param_shapes=None)  # as builds wrote them before
    (old / name).write_bytes(library[:600_000])
    assert f"{old / name} is cut short (600000 bytes of the {size}" in _one_line_error("generate", str(old), "--prompt-ids", "1")
    model = _artifact(tmp_path / "model")
    (model / "model.so").write_bytes(library[:4096])
    assert f"{model / 'model.so'} is cut short" in _one_line_error("run", str(model))

    saved = tvm.runtime.load_param_dict((artifact / "params.bin").read_bytes())
    half = {k: tvm.runtime.tensor(v.numpy().astype("float16")) for k, v in saved.items()}
    art = copy()
    (art / "params.bin").write_bytes(tvm.runtime.save_param_dict(half))
    assert "params.bin is" in _one_line_error("generate", str(art), "--prompt-ids", "1")
    key, (shape, dtype) = next((k, v) for k, v in manifest["param_shapes"].items() if len(set(v[0])) == 2)
    turned = {**saved, key: tvm.runtime.tensor(saved[key].numpy().reshape(shape[::-1]))}  # as many bytes
    art = copy()
    (art / "params.bin").write_bytes(tvm.runtime.save_param_dict(turned))
    line = _one_line_error("generate", str(art), "--prompt-ids", "1")
    assert f"its parameter {key} is {dtype}{shape[::-1]} where manifest.json says {dtype}{shape}" in line
    for field, value in (("max_batch", "x"), ("max_seq_len", 0), ("param_order", "p0")):
        art = copy(**{field: value})
        assert f"manifest.json: {field} is {json.dumps(value)}, not" in _one_line_error("generate", str(art), "--prompt-ids", "1")


def test_an_interrupted_build_leaves_the_artifact_as_it_was(built, tmp_path, monkeypatch):
    """Ctrl-C (SIGINT, sent by a hook in the writer) just after params.bin of a rebuild over an earlier build:
    that build is whole and generates; into a new folder: no folder; nothing is left beside either. A folder a
    killed build staged is removed by the next build. (The library is the fixture's, exported again: no compile.)"""
    import shutil
    import signal
    import subprocess

    import autosched.artifact
    import autosched.generation.build
    from autosched.generation.build import GenerationReport

    from .test_new_user import _listing

    _, artifact = built
    manifest = json.loads((artifact / "manifest.json").read_text())

    class Library:
        def export_library(self, path):
            shutil.copy(artifact / manifest["library"], path)

    monkeypatch.setattr(autosched.generation.build, "compile_generation",
                        lambda *args, **kwargs: (Library(), manifest["param_names"], GenerationReport()))
    built_with = ["--max-seq-len", str(MAX_SEQ_LEN), "--max-batch", str(MAX_BATCH), "--decode-batches", "2",
                  "--prefill-chunks", "8"]

    def build(out, *options, interrupt_at=None):
        def hook(step):
            if step == interrupt_at:
                signal.raise_signal(signal.SIGINT)

        monkeypatch.setattr(autosched.artifact, "WRITE_HOOK", hook)
        handler = signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C's KeyboardInterrupt
        try:
            return cli("build", str(artifact.parent / "hf"), "--generate", "-o", str(out), "--db", str(tmp_path / "t.db"),
                       *built_with, *options, check=False)
        finally:
            signal.signal(signal.SIGINT, handler)

    folder = tmp_path / "builds"
    folder.mkdir()
    bold = folder / "bold"
    shutil.copytree(artifact, bold)
    before = _listing(folder)
    proc = build(bold, "--dtype", "float16", interrupt_at="params.bin")  # new parameters, unlike the old ones
    assert proc.returncode == 130 and "interrupted" in proc.stderr
    assert _listing(folder) == before
    assert cli("generate", str(bold), "--prompt-ids", "5,7,9", "--max-new-tokens", "2").stdout.startswith("[0] ")
    proc = build(folder / "new", interrupt_at=manifest["library"])
    assert proc.returncode == 130 and _listing(folder) == before
    # A build killed (SIGKILL: no cleanup) left its staging folder; the next build removes it.
    dead = subprocess.Popen(["true"])  # a process id no process has now
    dead.wait()
    (folder / f".new.autosched-partial-{dead.pid}-0a1b2c3d").mkdir()
    (folder / f".new.autosched-partial-{dead.pid}-0a1b2c3d" / "params.bin").write_bytes(b"half")
    build(folder / "new")
    assert sorted(p.name for p in folder.iterdir()) == ["bold", "new"]
    assert cli("generate", str(folder / "new"), "--prompt-ids", "5,7,9", "--max-new-tokens", "2").stdout == \
        cli("generate", str(artifact), "--prompt-ids", "5,7,9", "--max-new-tokens", "2").stdout


def test_speculation_with_a_draft_that_cannot_pay_says_so_and_its_timing_keeps_the_counts(built, tmp_path):
    """The model as its own draft (sampled, as issue 70 ran it): its four steps and the verify step cost more
    than the five tokens a step can make, so the generator decodes plainly (a speculative step only every 16th,
    which a short reply never reaches). It says so in a warning, and the timing still reports speculation:
    none proposed, every step plain. And eval given both --text and --token-ids says that, in one line."""
    _, artifact = built
    proc = cli("generate", str(artifact), "--prompt-ids", "5,7,9", "--max-new-tokens", "4", "--temperature", "0.7",
               "--speculate", "4", "--draft", str(artifact))
    said = " ".join(proc.stderr.split())
    assert "warning: speculating with this draft cannot pay" in said and "--always-speculate" in said, said
    assert "speculating: 0 of 0 proposed tokens accepted" in said and "3 of 3 steps plain" in said, said
    data = json.loads(cli("generate", str(artifact), "--prompt-ids", "5,7,9", "--max-new-tokens", "4", "--temperature",
                          "0.7", "--speculate", "4", "--draft", str(artifact), "--format", "json").stdout)
    assert data["timing"]["proposed_tokens"] == 0 and data["timing"]["plain_steps"] == 3
    ids = tmp_path / "ids.txt"
    ids.write_text("1 2 3")
    line = _one_line_error("eval", str(artifact), "--text", str(ids), "--token-ids", str(ids))
    assert "--text and --token-ids are two ways to give the text to evaluate: give one of them" in line


def test_build_checks_its_options_before_it_loads_the_model(tmp_path, monkeypatch):
    """Options every generation build must meet are checked before the model's export (seconds; minutes for a
    large model) and before the warning that no tuning database exists: one line each (issue 70)."""
    import autosched.generation.build

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(autosched.generation.build, "load_generation_model", loaded)
    for options, says in ((["--max-seq-len", "0"], "--max-seq-len must be at least 1 (got 0)"),
                          (["--max-batch", "0"], "--max-batch must be at least 1 (got 0)"),
                          (["--speculate", "0"], "--speculate takes numbers of proposed tokens, each at least 1"),
                          (["--max-batch", "4", "--decode-batches", "2,8"], "--decode-batches must lie between 1 and "
                                                                            "--max-batch 4"),
                          (["--dtype", "float64"], "unsupported dtype 'float64'"),
                          (["--quantize", ""], "--quantize '' is not a scheme")):
        line = _one_line_error("build", "hf-llama", "--generate", "-o", str(tmp_path / "art"), "--db",
                               str(tmp_path / "none.db"), *options)
        assert says in line, line
    assert not (tmp_path / "art").exists()


def test_the_greedy_kernel_takes_the_first_maximum_and_gives_each_row_a_gpu_block():
    import numpy as np
    import tvm

    from autosched.generation.sampler import THREADS, greedy_kernel

    vocab = 1000

    def named(gpu):  # the build names the kernel; compiled alone it needs a symbol of its own
        return tvm.IRModule({"main": greedy_kernel(vocab, gpu).with_attr("global_symbol", "main")})

    run = tvm.compile(named(False), target=tvm.target.Target({"kind": "llvm"}))
    logits = np.random.default_rng(0).standard_normal((6, vocab)).astype("float32")
    logits[1, [10, 700]] = logits[1].max() + 1  # a tie: the first index wins, as numpy's argmax
    logits[2] = 0.0
    index, value = tvm.runtime.empty((6,), "int32"), tvm.runtime.empty((6,), "float32")
    run(tvm.runtime.tensor(logits), index, value)
    assert index.numpy().tolist() == logits.argmax(-1).tolist() and index.numpy()[1] == 10
    # On a GPU: a CTA of THREADS threads per row, meeting in a cross-thread reduction (not one thread a row).
    cuda = tvm.compile(named(True), target=tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}))
    source = cuda.mod.imports[0].inspect_source()
    assert f"__launch_bounds__({THREADS})" in source and "__shfl" in source and "blockIdx.x" in source


def test_the_sampling_kernel_matches_host_sampling_for_the_same_uniforms_and_compiles_for_cuda():
    """sample_tokens (greedy, temperature, top-k, top-p; thresholds by bisection, no sort) picks the token
    numpy's host sampling picks for the same uniform draw; the CUDA form gives each row a thread block."""
    import numpy as np
    import tvm

    from autosched.generation.request import Sampling
    from autosched.generation.sampler import sample_host, sample_kernel

    vocab = 1000

    def named(gpu):
        return tvm.IRModule({"main": sample_kernel(vocab, gpu).with_attr("global_symbol", "main")})

    class Uniform:  # numpy's Generator.choice with a given uniform draw
        def __init__(self, u):
            self.u = u

        def choice(self, n, p):
            cdf = np.cumsum(p)
            return int(np.searchsorted(cdf / cdf[-1], self.u, side="right"))

    rng = np.random.default_rng(0)
    logits = (3 * rng.standard_normal((8, vocab))).astype("float32")
    params = np.array([[0, 0, 1, 0], [1, 0, 1, 0.3], [0.7, 5, 1, 0.9], [1, 0, 0.5, 0.5], [1.3, 20, 0.8, 0.1],
                       [1, 1, 1, 0.99], [2, 0, 0.9, 0.7], [0.5, 3, 0.6, 0.2]], dtype="float32")
    run = tvm.compile(named(False), target=tvm.target.Target({"kind": "llvm"}))
    out = tvm.runtime.empty((8,), "int32")
    run(tvm.runtime.tensor(logits), tvm.runtime.tensor(params), out)
    expected = [int(np.argmax(logits[0]))] + [
        sample_host(logits[i], Sampling(float(t), int(k), float(p)), Uniform(float(u)))
        for i, (t, k, p, u) in enumerate(params) if i]
    assert out.numpy().tolist() == expected
    cuda = tvm.compile(named(True), target=tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}))
    assert "blockIdx.x" in cuda.mod.imports[0].inspect_source()


MARGIN = 2e-5  # how far a test's uniforms and top_p values stay from where float32 and float64 may part ways


def _sampling_case(vocab: int, seed: int = 0):
    """(logits, params, tokens): rows of every kind the sampling kernel serves (greedy with a tie for the
    maximum; temperature alone; top-k of 1, of a few with a tie at the k-th logit, of the whole vocabulary;
    top-p down to 1e-6; both together) at uniforms 0, 0.999999 and random ones, and the token numpy's host
    sampling (float64) picks for each. The kernel sums in float32, so a uniform or top_p within rounding of a
    cumulative probability could legitimately fall on the other side: random uniforms are drawn again, and
    top_p moved, until MARGIN away from every such boundary. A uniform of 0 picks the first kept token in
    both; 0.999999 is given a row whose last token is its most likely one, so it lands inside that token."""
    import numpy as np

    from autosched.generation.request import Sampling
    from autosched.generation.sampler import distribution

    rng = np.random.default_rng(seed)
    settings = [(0, 0, 1), (1, 0, 1), (0.7, 1, 1), (1, 5, 1), (1.3, 50, 1), (1, vocab, 1), (1, 0, 1e-6),
                (1, 0, 0.5), (0.8, 0, 0.9), (0.5, 0, 0.99), (2, 0, 0.3), (0.5, 20, 0.6), (1, 3, 0.3)]
    rows = [(t, k, p, u) for t, k, p in settings for u in (0.0, 0.999999, None, None)]
    logits = (3 * rng.standard_normal((len(rows), vocab))).astype("float32")
    params = np.zeros((len(rows), 4), dtype="float32")
    tokens = []
    for r, (t, k, p, u) in enumerate(rows):
        row = logits[r]
        if t == 0:  # two equal maxima: the first one is greedy's
            first = int(rng.integers(vocab // 2))
            row[[first, first + 1 + int(rng.integers(vocab // 2))]] = row.max() + 1
            params[r] = (0, 0, 1, 0)
            tokens.append(first)
            continue
        if u == 0.999999:
            row[-1] = row.max() + 1
        if 1 < k < vocab and p == 1:  # the k-th and (k+1)-th largest logits equal: top-k keeps both
            order = np.argsort(-row)
            row[order[k]] = row[order[k - 1]]
        temperature = float(np.float32(t))
        if p < 1:  # the nearest top_p MARGIN away from every cumulative mass of the most likely tokens
            masses = np.cumsum(np.sort(distribution(row, Sampling(temperature, k, 1.0)))[::-1])
            p = next(q for q in (p + 2 * MARGIN * step for step in sorted(range(-500, 501), key=abs))
                     if 0 < q < 1 and np.abs(masses - float(np.float32(q))).min() >= MARGIN)
        top_p = float(np.float32(p))
        probs = distribution(row, Sampling(temperature, k, top_p))
        cdf = np.cumsum(probs)
        cdf /= cdf[-1]
        inner = cdf[(probs > 0) & (cdf < cdf[-1])]  # where one kept token's share ends and the next begins

        def near_a_boundary(u, inner=inner):
            return inner.size and np.abs(inner - float(np.float32(u))).min() < MARGIN

        if u is None:
            u = rng.random()
            while near_a_boundary(u):
                u = rng.random()
        assert u == 0 or not near_a_boundary(u), (r, u)
        params[r] = (t, k, p, u)
        tokens.append(int(np.searchsorted(cdf, float(np.float32(u)), side="right")))
    return logits, params, tokens


def test_the_sampling_kernel_picks_the_host_token_on_rows_of_every_kind():
    """The CPU form of sample_tokens (the same code as the GPU's, one thread a row) on the rows of
    ``_sampling_case``: greedy ties, top-k ties, top_k 1, tiny top_p, uniforms 0 and 0.999999."""
    import tvm

    from autosched.generation.sampler import sample_kernel

    vocab = 1000
    logits, params, tokens = _sampling_case(vocab)
    mod = tvm.IRModule({"main": sample_kernel(vocab, False).with_attr("global_symbol", "main")})
    run = tvm.compile(mod, target=tvm.target.Target({"kind": "llvm"}))
    out = tvm.runtime.empty((len(tokens),), "int32")
    run(tvm.runtime.tensor(logits), tvm.runtime.tensor(params), out)
    assert out.numpy().tolist() == tokens


@pytest.mark.parametrize("vocab", [1000, 32000, 128256])
def test_the_sampling_kernel_compiles_for_sm90a_with_a_cta_of_threads_a_row(vocab):
    """Without a GPU: the CUDA form of sample_tokens gives each row a CTA of SAMPLE_THREADS threads (not one
    thread a row) that meet in warp shuffles and shared memory, and nvcc compiles it for sm_90a without
    spills, at vocabularies of Llama 2 (32000) and Llama 3 (128256)."""
    import tvm

    from autosched.cuda_tools import cuda_source
    from autosched.generation.sampler import SAMPLE_THREADS, sample_kernel
    from autosched.target import parse_target

    from .nvcc import nvcc_compile

    mod = tvm.IRModule({"sample_tokens": sample_kernel(vocab, True).with_attr("global_symbol", "sample_tokens")})
    source = cuda_source(mod, parse_target("cuda:sm_90a", require_device=False))
    assert SAMPLE_THREADS >= 256 and f"__launch_bounds__({SAMPLE_THREADS}, 1)" in source
    assert all(f in source for f in ("__shfl_xor_sync", "__shfl_up_sync", "__syncthreads()", "__shared__"))
    report = nvcc_compile(source, "sm_90a")
    assert report.ok and report.spills == 0, report.log[-2000:]


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [1000, 32000, 50257])
def test_the_sampling_kernel_on_the_gpu_picks_the_host_token_on_rows_of_every_kind(vocab):
    """The CUDA kernel (a CTA a row: parallel passes, the pick by a scan) on the rows of two
    ``_sampling_case`` draws picks numpy's float64 host token for each row's uniform: greedy's first of tied
    maxima, top-k's ties at the k-th logit, top_k 1, top_p 1e-6, uniforms 0 and 0.999999. Uniforms and top_p
    are kept ``MARGIN`` away from the cumulative probabilities where float32 sums may legitimately part from
    float64. A vocabulary of 1000 leaves most threads without a token; 50257 is no multiple of the CTA."""
    import numpy as np
    import torch
    import tvm

    from autosched.generation.sampler import sample_kernel
    from autosched.target import compile_module, parse_target

    cases = [_sampling_case(vocab, seed) for seed in (0, 1)]
    logits, params = (np.concatenate([case[i] for case in cases]) for i in (0, 1))
    tokens = [token for case in cases for token in case[2]]
    mod = tvm.IRModule({"sample_tokens": sample_kernel(vocab, True).with_attr("global_symbol", "sample_tokens")})
    run = compile_module(mod, parse_target("cuda"))
    out = torch.full((len(tokens),), -1, dtype=torch.int32, device="cuda")
    args = [torch.from_numpy(logits).cuda(), torch.from_numpy(params).cuda(), out]
    run["sample_tokens"](*(tvm.runtime.from_dlpack(t) for t in args))
    torch.cuda.synchronize()
    picked = out.cpu().tolist()
    wrong = [(r, params[r].tolist(), picked[r], tokens[r]) for r in range(len(tokens)) if picked[r] != tokens[r]]
    assert not wrong, wrong  # (row, (temperature, top_k, top_p, uniform), picked, host's)


def test_decode_steps_launched_ahead_give_the_same_tokens(built):
    """run_ahead: each greedy decode step is launched before the tokens of the step before are read (its ids
    are those tokens on the device; its barrier reads them inside the call). The tokens are those of a step at
    a time, through stop tokens, lengths that end apart, sequences that join as others finish (6 prompts, 4 at
    a time) and a step with a sampled request among greedy ones; and most steps were launched ahead."""
    from autosched.generation import Generator

    model, artifact = built
    prompts = PROMPTS + [[7, 7, 7], [8]]
    plain = Generator(artifact)
    assert not plain.run_ahead  # a CPU build's default: the host and the model share the cores
    expected = [r.tokens for r in plain.generate(prompts, 12)]
    gen = Generator(artifact, run_ahead=True)
    launched = record_launches_behind(gen)
    assert [r.tokens for r in gen.generate(prompts, 12)] == expected
    assert sum(launched) > len(launched) // 2 > 0  # most steps went ahead of the one before
    assert expected[0] == _reference(model, prompts[0], 12)
    stop = expected[0][4]  # a stop token mid-way: the step launched behind it is thrown away
    assert gen.generate(prompts[:2], 12, stop_tokens=[stop])[0].tokens == expected[0][:5]
    assert [r.tokens for r in gen.generate(prompts[:3], 12)] == expected[:3]  # after a thrown-away step
    mixed = gen.generate(prompts[:2], 6, temperature=0.7, top_k=1)  # sampled: a step at a time, same tokens
    assert [r.tokens for r in mixed] == [t[:6] for t in expected[:2]]
    # A sequence longer than another ends by length while the other decodes ahead.
    gen.add(prompts[0], max_new_tokens=3)
    gen.add(prompts[1], max_new_tokens=9)
    made = {}
    while gen.live:
        for seq_id, token in gen.step():
            made.setdefault(seq_id, []).append(token)
        for seq_id in gen.finished:
            gen.remove(seq_id)
    assert sorted(made.values(), key=len) == [expected[0][:3], expected[1][:9]]


def test_penalties_bias_and_logprobs_on_the_device_give_the_hosts_tokens_and_logprobs(built):
    """Rows with logit bias, repetition, frequency and presence penalties and log-probabilities, beside a
    plain greedy row and a row held to min_p (which stays on the host), in prefill and decode steps: the
    device's rules (logit_rules) give the tokens the host's float64 rules give, log-probabilities within
    float32 rounding, and no step of the device run read its logits back but the min_p row's."""
    import numpy as np

    from autosched.generation import Generator
    from autosched.generation.request import Sampling

    _, artifact = built
    requests = [Sampling(logit_bias=((3, 4.0), (9, -100.0)), logprobs=3), Sampling(repetition_penalty=1.4),
                Sampling(frequency_penalty=1.5, presence_penalty=0.5, logprobs=0), Sampling()]

    def run(device: bool, with_min_p: bool):
        gen = Generator(artifact)
        if not device:
            gen.sampler.rules = None  # every rule on the host, from the logits read back
        rows = requests[:3] + [Sampling(temperature=0.8, min_p=0.2, seed=4)] if with_min_p else requests
        ids = [gen.add(prompt, 12, sampling) for prompt, sampling in zip(PROMPTS, rows)]
        while gen.live:
            gen.step()
        return [gen.remove(i) for i in ids], gen.stats["host_sample_calls"]

    host, _ = run(False, False)
    device, host_calls = run(True, False)
    assert host_calls == 0
    assert [c.tokens for c in device] == [c.tokens for c in host]
    plain = [c.tokens for c in Generator(artifact).generate(PROMPTS[:3], 12)]
    assert all(p != c.tokens for p, c in zip(plain, device[:3]))  # the rules changed what greedy makes
    for d, h in zip(device, host):
        assert len(d.logprobs) == len(h.logprobs)
        for a, b in zip(d.logprobs, h.logprobs):
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            np.testing.assert_allclose([a.logprob] + [v for _, v in a.top], [b.logprob] + [v for _, v in b.top],
                                       rtol=1e-4, atol=1e-4)
    assert len(device[0].logprobs) == 12 and len(device[0].logprobs[0].top) == 3
    mixed, host_calls = run(True, True)
    assert [c.tokens for c in mixed[:3]] == [c.tokens for c in host[:3]] and host_calls > 0


def test_prefill_makes_only_the_joined_sequences_first_tokens_and_lands_a_step_in_flight(built):
    """Generator.prefill (the server's first step for requests that join): the sequences added since the last
    step get their first token and the running ones none, except the tokens of a step launched ahead, which
    it lands; with a prefix cache, a sequence that finished in that landed step is kept for a next turn. The
    tokens are those of plain steps."""
    from autosched.generation import Generator

    model, artifact = built
    gen = Generator(artifact, run_ahead=True, prefix_cache=True)
    page = gen.limits.page_size
    prompts = [[(5 * i) % 97 + 3 for i in range(2 * page - 2)], PROMPTS[1]]  # a page, and two with 2 tokens made
    expected = [r.tokens for r in Generator(artifact).generate(prompts, 8)]
    first = gen.add(prompts[0], 3)
    made = {first: []}
    for _ in range(2):  # its prefill, then a decode step launched ahead
        for seq_id, token in gen.step():
            made[seq_id].append(token)
    assert gen._flight is not None and gen.waiting == []
    late = gen.add(prompts[1], 8)
    made[late] = []
    assert gen.waiting == [late]
    for seq_id, token in gen.prefill():
        made[seq_id].append(token)
    assert len(made[late]) == 1 and len(made[first]) == 3 and gen.waiting == []  # the flight's token, the last
    assert first in gen.finished and first not in gen.live  # it ended in the landed step and left the cache
    assert gen.prefix_cache.match(prompts[0] + made[first])[1] == 2 * page  # its two pages kept for a next turn
    while gen.live:
        for seq_id, token in gen.step():
            made[seq_id].append(token)
    assert made[first] == expected[0][:3] and made[late] == expected[1]
    assert gen.prefill() == []  # nothing waiting: nothing runs


@pytest.mark.gpu
def test_token_marks_read_a_steps_tokens_without_waiting_for_the_work_after_them():
    """The CUDA events of decode steps launched ahead: a mark after a tensor of tokens waits for the work before
    it and reads the tokens back from pinned memory, while work queued after the mark goes on."""
    import numpy as np
    import tvm

    from autosched import tvm_adapter
    from autosched.generation.cuda_events import TokenMarks

    tokens = tvm.runtime.tensor(np.arange(37, dtype="int32") * 3, tvm.cuda())
    marks = TokenMarks.open()
    assert marks is not None
    first = marks.mark(tokens)
    later = tvm.runtime.tensor(np.full(1 << 24, 7, dtype="int32"), tvm.cuda())  # queued after the mark
    marks.wait(first)
    assert (marks.read(first) == np.arange(37) * 3).all()
    second = marks.mark(tvm_adapter.tensor_view(later, (5,)))
    assert (marks.read(second) == 7).all()


@pytest.mark.gpu
def test_pinned_uploads_copy_behind_the_queued_work_and_reuse_their_slots():
    """Staging.put(wait=False) on a GPU: each array lands in its device buffer after the work queued before it,
    through pinned slots taken in turn (more uploads than slots, one larger than a slot's first size)."""
    import numpy as np
    import tvm

    from autosched.generation.cuda_events import SLOT_BYTES, SLOTS, PinnedUploads
    from autosched.generation.model import Staging

    uploads = PinnedUploads.open()
    assert uploads is not None
    staging = Staging(tvm.cuda(), lambda: uploads)
    busy = tvm.runtime.tensor(np.zeros(1 << 24, dtype="int32"), tvm.cuda())  # work queued before the copies
    arrays = [np.arange(n, dtype="int32") * (i + 1) for i, n in enumerate([5, 1000, SLOT_BYTES, 7, 3 * SLOT_BYTES // 4, 9])]
    assert len(arrays) > SLOTS
    views = [staging.put(f"upload{i}", a, wait=False) for i, a in enumerate(arrays)]
    for a, view in zip(arrays, views):
        assert np.array_equal(view.numpy(), a)
    assert busy.numpy()[0] == 0


def test_a_put_that_does_not_wait_is_a_put_where_there_is_no_gpu():
    import numpy as np
    import tvm

    from autosched.generation.model import Staging

    staging = Staging(tvm.cpu(), lambda: None)
    array = np.arange(12, dtype="int32").reshape(3, 4)
    assert np.array_equal(staging.put("x", array, wait=False).numpy(), array)
    assert np.array_equal(Staging(tvm.cpu()).put("x", array, wait=False).numpy(), array)
