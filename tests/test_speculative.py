"""Speculative decoding: the acceptance rules (greedy keeps the target's tokens; sampled keeps the target's
distribution, checked by a chi-square test that a wrong rule fails), prompt lookup's proposals, and, in the
slow tier, whole artifacts: a draft artifact (a smaller model of the same vocabulary) and prompt lookup give
the plain greedy tokens, and transformers', for a batch of prompts, at k = 1, 3 and 5."""

from __future__ import annotations

import json

import numpy as np
import pytest

from autosched.generation.speculative import PromptLookupDraft, accept_greedy, accept_sampled, verify_function

from .helpers import cli, transformers_greedy

# The slow tier (--dist loadgroup) runs this file's tests in one process, so that the target and draft
# artifacts (two generation builds) are built once, not once in each process.
pytestmark = pytest.mark.xdist_group("speculative-artifacts")

# --- the acceptance rules, on given distributions (numpy) -------------------------------------------------------

VOCAB = 6
TRIALS = 20_000
P = np.array(
    [
        [0.30, 0.05, 0.25, 0.10, 0.20, 0.10],
        [0.1, 0.2, 0.3, 0.1, 0.2, 0.1],
        [0.5, 0.1, 0.1, 0.1, 0.1, 0.1],
        [0.2, 0.2, 0.2, 0.2, 0.1, 0.1],
    ]
)
Q = np.array([[0.05, 0.40, 0.05, 0.30, 0.10, 0.10], [0.3, 0.1, 0.1, 0.3, 0.1, 0.1], [0.1, 0.5, 0.1, 0.1, 0.1, 0.1]])


def _first_tokens(rule, deterministic: bool, seed: int = 0) -> np.ndarray:
    """How often each token came first out of ``TRIALS`` speculative steps of 3 proposals under ``rule``:
    proposals drawn from Q's rows (or, ``deterministic``, fixed ones with one-hot q, as prompt lookup makes)."""
    rng = np.random.default_rng(seed)
    counts = np.zeros(VOCAB)
    for _ in range(TRIALS):
        if deterministic:
            proposals, q_rows = [1, 3, 1], None
        else:
            proposals, q_rows = [int(rng.choice(VOCAB, p=q)) for q in Q], Q
        made = rule(proposals, P, q_rows, rng)
        counts[made[0]] += 1
    return counts


def _always_accept(proposals, p_rows, q_rows, rng):
    """A wrong rule: every proposal kept, then a draw from the target's last row."""
    return list(proposals) + [int(rng.choice(VOCAB, p=p_rows[len(proposals)]))]


@pytest.mark.parametrize("deterministic", [False, True], ids=["draft-model", "prompt-lookup"])
def test_sampled_acceptance_keeps_the_target_distribution_and_a_wrong_rule_does_not(deterministic):
    from scipy.stats import chisquare

    right = chisquare(_first_tokens(accept_sampled, deterministic), TRIALS * P[0])
    wrong = chisquare(_first_tokens(_always_accept, deterministic), TRIALS * P[0])
    assert right.pvalue > 1e-3, right
    assert wrong.pvalue < 1e-6, wrong


def test_sampled_acceptance_makes_a_bonus_token_only_when_every_proposal_is_kept():
    rng = np.random.default_rng(0)
    p = np.eye(VOCAB)[[2, 4, 5]]  # the target is certain: proposals 2 and 4 are kept, the bonus is 5
    assert accept_sampled([2, 4], p, None, rng) == [2, 4, 5]
    assert accept_sampled([2, 3], p, None, rng) == [2, 4]  # 3 has probability 0: rejected, replaced by p's 4
    assert accept_sampled([2, 4], p, [np.full(VOCAB, 1 / VOCAB), None], rng) == [2, 4, 5]  # a filled-up proposal


def test_a_proposal_cut_by_a_grammar_draws_the_last_token_from_the_residual_as_its_rejection_would():
    """The draft drew x from q, and the grammar gives x probability 0: cut before verification, the step's
    last token is drawn from normalize(max(0, p - q)), the draw a rejection of x would have made."""
    rng = np.random.default_rng(0)
    p = np.asarray([[0.5, 0.5, 0, 0, 0, 0]])
    q = np.asarray([0.6, 0.1, 0, 0.3, 0, 0])  # its proposal (token 3, say) was cut
    draws = [accept_sampled([], p, [], rng, cut_q=q)[0] for _ in range(2000)]
    assert set(draws) == {1}  # max(0, p - q) is token 1's alone
    assert {accept_sampled([], p, None, rng)[0] for _ in range(200)} == {0, 1}  # without the cut: p itself


def test_greedy_acceptance_keeps_proposals_while_they_are_the_targets_choice():
    assert accept_greedy([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all kept, and a bonus token
    assert accept_greedy([4, 9, 6], [4, 5, 6, 7]) == [4, 5]  # the first disagreement replaced
    assert accept_greedy([], [8]) == [8]  # no proposals: a plain decode step
    assert accept_greedy([1], [2, 3]) == [2]


def test_prompt_lookup_proposes_what_followed_the_latest_match_of_the_longest_tail():
    draft = PromptLookupDraft()
    context = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 4, 2, 3]
    assert draft.lookup(context, 2) == [7, 8]  # tail (4, 2, 3) unseen; (2, 3) last seen before 7, 8
    assert draft.lookup([5, 6, 5, 6, 1, 5, 6], 4) == [1, 5, 6]  # stops at the end of the context
    assert draft.lookup([1, 2, 3, 4], 3) == []  # the last token never came before
    assert draft.lookup([1, 2, 1], 0) == []
    assert draft.lookup([7, 1, 7, 2, 7], 1) == [2]  # a 1-gram: the latest occurrence


def test_a_speculative_step_verifies_through_a_static_function_only_where_one_was_built():
    assert verify_function([4, 4], {3}, {1, 2}) == "verify_b2_k3"
    assert verify_function([4, 2], {3}, {1, 2}) == "batch_prefill"  # sequences with fewer proposals
    assert verify_function([4, 4, 4], {3}, {1, 2}) == "batch_prefill"  # no static batch of 3
    assert verify_function([2], {3}, {1}) == "batch_prefill"  # k = 1 was not built


def test_the_timing_says_what_speculation_did():
    from autosched.generation.scheduler import StepStats

    ticks = iter([0.0, 1.0, 2.0, 4.0])
    stats = StepStats(clock=lambda: next(ticks))
    assert "proposed_tokens" not in stats.timing()
    stats.counts.update(speculative_steps=2, speculative_rows=4, proposed_tokens=12, accepted_tokens=6)
    stats.record(False, stats.clock(), 5, "verify_b2_k3")
    stats.record(False, stats.clock(), 5, "batch_prefill")
    timing = stats.timing()
    assert timing["acceptance_rate"] == 0.5 and timing["tokens_per_step"] == 2.5
    assert stats.counts["static_decode_steps"] == 1


def test_speculation_stops_while_the_draft_is_rejected_and_resumes_when_it_agrees():
    """The policy of an adaptive speculator (decisions from proposals and acceptances alone): the first step
    speculates; while the expected tokens of a step (1 + a + ... + a^k at the recent acceptance a) are not
    more than its cost, plain steps run, every 16th speculating again; kept proposals bring it back."""
    from autosched.generation.speculative import PROBE_EVERY, Adaptation, expected_tokens

    assert expected_tokens(1.0, 4) == 5 and expected_tokens(0.0, 4) == 1 and expected_tokens(0.5, 2) == 1.75
    policy = Adaptation(k=4, cost=1.2)
    assert policy.speculate_now()
    policy.observe([(4, 0), (4, 0)])  # both rejected at once: acceptance 0, a step makes 1 token for 1.2
    decisions = []
    for _ in range(2 * (PROBE_EVERY + 1) + 1):
        decisions.append(policy.speculate_now())
        if decisions[-1]:
            policy.observe([(4, 0)])
        else:
            policy.observe_plain()
    assert decisions == ([False] * PROBE_EVERY + [True]) * 2 + [False]
    policy.plain_run = PROBE_EVERY
    assert policy.speculate_now()
    policy.observe([(4, 4), (4, 4)])  # the draft agrees again: every proposal kept
    assert policy.acceptance > 0.5 and policy.speculate_now()
    cheap = Adaptation(k=4, cost=1.0)  # a step that costs no more than a plain one pays at any acceptance
    cheap.observe([(4, 1)])
    assert cheap.speculate_now()


def test_a_model_drafts_steps_count_in_the_cost_of_a_speculative_step():
    from autosched.generation.speculative import VERIFY_COST, ModelDraft, PromptLookupDraft, speculation_cost

    class Weights:  # a model's parameters as speculation_cost reads them
        def __init__(self, *shapes):
            import numpy as np
            import tvm

            self.params = [tvm.runtime.tensor(np.zeros(s, "float16")) for s in shapes]

    target, draft = Weights((64, 64), (64, 192)), Weights((64, 32))  # 16384 and 2048 weights
    assert speculation_cost(target, PromptLookupDraft(), 4) == VERIFY_COST
    assert speculation_cost(target, ModelDraft(draft), 4) == pytest.approx(VERIFY_COST + 4 * 2048 / 16384)


def test_a_build_refuses_speculation_it_cannot_serve_in_one_line():
    from dataclasses import replace

    from autosched.errors import UsageError
    from autosched.examples.hf import TINY, _config
    from autosched.generation.build import lower_generation
    from autosched.generation.decoder import config_from_hf
    from autosched.target import parse_target

    cfg = config_from_hf(_config("llama", TINY)[0], "float32")
    with pytest.raises(UsageError, match="each at least 1"):
        lower_generation(cfg, parse_target("llvm"), (1,), (), (0,))
    with pytest.raises(UsageError, match="not supported for a model with a sliding window"):
        lower_generation(replace(cfg, sliding_window=64), parse_target("llvm"), (1,), (), (3,))


# --- whole artifacts (slow tier) --------------------------------------------------------------------------------

MAX_SEQ_LEN, MAX_BATCH, NEW = 96, 4, 32
PROMPTS = [[5, 7, 9, 11, 13, 2, 8], [100, 200], [3] * 17 + [4], [42, 43, 44, 45, 46, 42, 43]]


def _truncated_draft(model, folder):
    """The target's first layer alone, with its embeddings and head: a smaller model of the same vocabulary
    that agrees with the target often, but not always."""
    import copy

    import torch

    config = copy.deepcopy(model.config)
    config.num_hidden_layers = 1
    draft = type(model)(config).eval()
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("model.layers.1.")}
    with torch.no_grad():
        draft.load_state_dict(state)
    draft.save_pretrained(folder)


@pytest.fixture(scope="session")  # the process runs other files' tests between this file's: built once
def artifacts(tmp_path_factory):
    """(transformers model, target artifact built with --speculate 3, draft artifact)."""
    from .test_generation import _saved_model

    root = tmp_path_factory.mktemp("spec")
    model = _saved_model("llama", root / "hf")
    _truncated_draft(model, root / "draft-hf")
    common = ("--max-seq-len", str(MAX_SEQ_LEN), "--max-batch", str(MAX_BATCH))
    cli("build", str(root / "hf"), "--generate", "-o", str(root / "art"), *common, "--decode-batches", "1,4", "--speculate", "3",
        "--db", str(root / "t.db"))
    cli("build", str(root / "draft-hf"), "--generate", "-o", str(root / "draft"), *common, "--decode-batches", "4",
        "--db", str(root / "t.db"))
    return model, root / "art", root / "draft"


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculative_decoding_gives_the_plain_greedy_tokens(artifacts, k):
    """A batch of prompts of different lengths, 32 new tokens: with the draft artifact and with prompt lookup
    the tokens are the plain greedy ones and transformers'; sequences accept different numbers of tokens."""
    from autosched.generation import Generator

    model, target, draft = artifacts
    reference = [transformers_greedy(model, p, NEW) for p in PROMPTS]
    plain = Generator(target)
    assert [r.tokens for r in plain.generate(PROMPTS, NEW)] == reference
    assert plain.speculation is None
    for kind in (draft, "prompt-lookup"):
        gen = Generator(target, draft=kind, speculate=k, adaptive=False)  # every step speculates
        assert [r.tokens for r in gen.generate(PROMPTS, NEW)] == reference, (kind, k)
        spec = gen.speculation
        assert 0 < spec["accepted_tokens"] < spec["proposed_tokens"], (kind, spec)
        assert spec["tokens_per_step"] > 1 and gen.stats["speculative_steps"] == gen.stats["decode_steps"]
        # k = 3 was built: every row gets 3 proposals (prompt lookup's filled up), the static verify_b4_k3 runs.
        assert (gen.stats["static_decode_steps"] > 0) == (k == 3), kind


@pytest.mark.slow
def test_speculation_serves_joins_and_forks_and_the_draft_cache_follows(artifacts):
    """Continuous batching with a draft model: a sequence added mid-way, a fork of a prefix and a finished
    sequence's removal; each makes the plain greedy tokens, and the draft's cache empties with the target's."""
    from autosched.generation import Generator

    model, target, draft = artifacts
    gen = Generator(target, draft=draft, speculate=3)
    a = gen.add(PROMPTS[0], 12)
    gen.step()
    gen.step()
    b = gen.add(PROMPTS[1], 10)
    while gen.live:
        gen.step()
    assert gen.remove(a).tokens == transformers_greedy(model, PROMPTS[0], 12)
    assert gen.remove(b).tokens == transformers_greedy(model, PROMPTS[1], 10)
    assert gen._speculator.draft.cached == {}
    prefix = [9, 8, 7, 6, 5]
    results = gen.generate([[1, 2], [3]], 16, prefix=prefix)
    assert [r.tokens for r in results] == [transformers_greedy(model, prefix + p, 16) for p in ([1, 2], [3])]


@pytest.mark.slow
def test_speculation_under_a_grammar_gives_the_plain_tokens_through_the_static_verify_and_a_draft_model(artifacts,
                                                                                                     tmp_path):
    """Constrained rows in the static verify_b4_k3 (prompt lookup's proposals filled up, those the grammar
    rejects rejected by the masked verification) and with the draft artifact at k = 2 (its proposals cut where
    the grammar rejects them, the last draw from the residual): greedy, the plain constrained tokens; sampled,
    outputs that follow the grammar."""
    from autosched.generation import Generator, Sampling
    from autosched.generation.grammar import GrammarSpec

    from .helpers import train_tokenizer

    _, target, draft = artifacts
    tokenizer = train_tokenizer(tmp_path)  # the tiny models' 512 tokens
    specs = [GrammarSpec.regex(r"[a-z]{2,12}( [a-z]{1,5}){0,3}"), GrammarSpec.choice(["kalo mine", "kalo ru", "zo"]),
             GrammarSpec.json_schema({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                                                       "s": {"type": "string", "maxLength": 4}},
                                      "required": ["n", "s"]})]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(specs))] + [PROMPTS[0]]

    def run(gen, sampled=False):
        gen.use_grammars(tokenizer)
        seqs = [gen.add(p, 24, Sampling(1.0 if sampled else 0.0, seed=i, grammar=s))
                for i, (p, s) in enumerate(zip(prompts, specs))] + [gen.add(prompts[-1], 16)]
        while gen.live:
            gen.step()
        return [gen.remove(s) for s in seqs]

    plain = run(Generator(target))
    for kind, k in (("prompt-lookup", 3), (draft, 2)):  # k = 2: not built, the proposals are cut and verified dynamically
        gen = Generator(target, draft=kind, speculate=k, adaptive=False)
        assert [r.tokens for r in run(gen)] == [r.tokens for r in plain], kind
        assert gen.stats["speculative_steps"] > 0 and (gen.stats["static_decode_steps"] > 0) == (k == 3)
        for result, spec in zip(run(Generator(target, draft=kind, speculate=k, adaptive=False), sampled=True), specs):
            text = tokenizer.decode(result.tokens, skip_special_tokens=True)
            assert result.finish_reason in ("stop", "length") and result.error is None, text
            if result.finish_reason == "stop" and spec.kind == "json_schema":
                assert set(json.loads(text)) == {"n", "s"}
            elif result.finish_reason == "stop" and spec.kind == "choice":
                assert text in ("kalo mine", "kalo ru", "zo")


@pytest.mark.slow
def test_speculation_stops_where_plain_decoding_does(artifacts):
    """At the artifact's longest sequence (fewer proposals as it nears, none past it) and at a stop token in
    the middle of a step's accepted tokens, the tokens and the reason are the plain ones."""
    from autosched.generation import Generator

    _, target, draft = artifacts
    prompts = [list(range(1, MAX_SEQ_LEN - 6)), [7] * (MAX_SEQ_LEN - 3), [5, 6]]
    plain = Generator(target)
    reference = [(r.tokens, r.finish_reason) for r in plain.generate(prompts, NEW)]
    assert [reason for _, reason in reference] == ["max_seq_len", "max_seq_len", "length"]
    stops = [reference[2][0][5], reference[2][0][9]]
    stopped = plain.generate([[5, 6]], NEW, stop_tokens=stops)[0]
    assert stopped.finish_reason == "stop"
    for kind in (target, draft, "prompt-lookup"):  # the target as its own draft: every proposal accepted
        gen = Generator(target, draft=kind, speculate=3)
        assert [(r.tokens, r.finish_reason) for r in gen.generate(prompts, NEW)] == reference, kind
        assert gen.generate([[5, 6]], NEW, stop_tokens=stops)[0] == stopped, kind


@pytest.mark.slow
def test_an_adaptive_speculator_decodes_plainly_while_its_draft_is_rejected(artifacts):
    """A draft that proposes what the model does not choose: after its first rejections most steps are plain
    decode steps (a speculative one every 16th), the tokens the plain greedy ones; a draft that replays the
    model's own tokens at no cost (every proposal kept) speculates at every step, and the model as its own
    draft does not pay (its three steps and the verify step cost more than the four tokens they make)."""
    from autosched.generation import Generator

    model, target, _ = artifacts
    reference = [transformers_greedy(model, p, NEW) for p in PROMPTS]

    class Contrary(PromptLookupDraft):
        def lookup(self, context, k):
            return [0] * k if k > 0 else []

    gen = Generator(target, draft=Contrary(), speculate=3)
    assert [r.tokens for r in gen.generate(PROMPTS, NEW)] == reference
    spec = gen.speculation
    assert spec["plain_steps"] > 4 * spec["speculative_steps"] > 0, spec

    class Replay(PromptLookupDraft):
        def lookup(self, context, k):
            for prompt, tokens in zip(PROMPTS, reference):
                full = prompt + tokens
                if full[:len(context)] == context:
                    return full[len(context):len(context) + k]
            return []

    replay = Generator(target, draft=Replay(), speculate=3)
    assert [r.tokens for r in replay.generate(PROMPTS, NEW)] == reference
    assert replay.speculation["plain_steps"] == 0 and replay.speculation["tokens_per_step"] > 3
    itself = Generator(target, draft=target, speculate=3)
    assert [r.tokens for r in itself.generate(PROMPTS, NEW)] == reference
    assert itself.speculation["plain_steps"] > 4 * itself.speculation["speculative_steps"]


@pytest.mark.slow
def test_sampled_speculative_decoding_runs_and_is_reproducible_with_a_seed(artifacts):
    from autosched.generation import Generator

    _, target, draft = artifacts
    runs = []
    for kind in (draft, draft, "prompt-lookup"):
        gen = Generator(target, draft=kind, speculate=3)
        results = gen.generate(PROMPTS[:2], 16, temperature=0.8, top_k=50, seed=7)
        assert all(r.error is None and len(r.tokens) == 16 for r in results)
        assert gen.speculation["proposed_tokens"] > 0
        runs.append([r.tokens for r in results])
    assert runs[0] == runs[1]


@pytest.mark.slow
def test_the_command_line_speculates_and_refuses_bad_options_in_one_line(artifacts, tmp_path):
    model, target, draft = artifacts
    out = cli(
        "generate",
        str(target),
        "--prompt-ids",
        "5,7,9",
        "--max-new-tokens",
        "8",
        "--speculate",
        "3",
        "--draft",
        str(draft),
        "--format",
        "json",
    )
    data = json.loads(out.stdout)
    assert data["completions"][0]["tokens"] == transformers_greedy(model, [5, 7, 9], 8)
    assert data["timing"]["proposed_tokens"] > 0 and "tokens_per_step" in data["timing"]
    text = cli("generate", str(target), "--prompt-ids", "1,2,1,2", "--speculate", "2", "--prompt-lookup")
    assert "proposed tokens accepted" in text.stderr and "steps plain" in text.stderr
    always = json.loads(cli("generate", str(target), "--prompt-ids", "1,2,1,2", "--max-new-tokens", "8", "--speculate",
                            "2", "--prompt-lookup", "--always-speculate", "--format", "json").stdout)
    assert always["timing"]["plain_steps"] == 0 and always["timing"]["speculative_steps"] > 0
    for args, says in (
        (["--speculate", "0", "--prompt-lookup"], "--speculate must be at least 1"),
        (["--speculate", "2"], "--speculate needs a draft"),
        (["--prompt-lookup"], "--prompt-lookup needs --speculate K"),
        (["--always-speculate"], "--always-speculate needs --speculate K"),
        (["--speculate", "2", "--prompt-lookup", "--draft", str(draft)], "two kinds of draft"),
        (["--speculate", "2", "--draft", str(tmp_path)], "manifest"),
    ):
        bad = cli("generate", str(target), "--prompt-ids", "1,2", *args, check=False)
        assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
        assert says in bad.stderr, bad.stderr


@pytest.mark.slow
def test_a_draft_of_another_vocabulary_is_refused_in_one_line(artifacts, tmp_path):
    import torch

    from autosched.examples.hf import _config

    _, target, _ = artifacts
    config, cls = _config("llama", dict(hidden=32, heads=2, kv_heads=1, mlp=64, vocab=256))
    torch.manual_seed(0)
    cls(config).eval().save_pretrained(tmp_path / "hf")
    cli(
        "build",
        str(tmp_path / "hf"),
        "--generate",
        "-o",
        str(tmp_path / "art"),
        "--max-seq-len",
        "32",
        "--max-batch",
        str(MAX_BATCH),
        "--decode-batches",
        "1",
        "--db",
        str(tmp_path / "t.db"),
    )
    bad = cli("generate", str(target), "--prompt-ids", "1,2", "--speculate", "2", "--draft", str(tmp_path / "art"), check=False)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "the draft's vocabulary has 256 tokens, the model's 512" in bad.stderr


@pytest.mark.slow
def test_a_build_for_sm_90_compiles_the_static_verify_function_on_our_workloads(tmp_path):
    """Built here without a GPU: ``--speculate 3`` at decode batch 2 adds ``verify_b2_k3``, a prefill of 8
    tokens whose linear layers are our workloads (the LM head at 8 rows: logits at every position), and the
    whole artifact compiles and exports for sm_90 (the CUDA binary is made where it loads)."""
    from autosched.examples.hf import TINY, _config
    from autosched.generation.build import compile_generation, load_generation_model, lower_generation, schedule_generation
    from autosched.generation.decoder import config_from_hf
    from autosched.pipeline.tasks import kernel_calls
    from autosched.target import parse_target

    from .test_generation import _saved_model

    target = parse_target("cuda:sm_90a", require_device=False)
    cfg = config_from_hf(_config("llama", TINY)[0], "float16")
    lowered, _ = lower_generation(cfg, target, decode_batches=(2,), speculate=(3,))
    _, report, _ = schedule_generation(lowered, None, target)
    called = kernel_calls(lowered, lambda name: name == "verify_b2_k3")
    ours = {report.workloads[k]["workload"] for k in called if k in report.workloads}
    assert any(w.startswith("gemm[m=8,") for w in ours), ours  # every position's logits: 8 rows of the LM head
    assert not [k for k in called if "matmul" in k.lower()]
    _saved_model("llama", tmp_path / "hf")
    model = load_generation_model(str(tmp_path / "hf"), "float16")
    executable, _, _ = compile_generation(
        model, parse_target("cuda:sm_90", require_device=False), None, decode_batches=(1,), speculate=(3,)
    )
    assert "verify_b1_k3" in executable.as_text()
    executable.export_library(str(tmp_path / "generate.so"))
    assert (tmp_path / "generate.so").stat().st_size > 0


@pytest.mark.gpu
def test_greedy_speculative_decoding_on_the_gpu_gives_the_plain_greedy_tokens(tmp_path):
    """fp16 on the GPU: speculative greedy (draft artifact, prompt lookup) gives the plain greedy tokens, or
    the first difference is a near-tie of transformers' logits (the verify call's kernels differ from the
    decode step's, and fp16 rounds)."""
    import torch

    from autosched.generation import Generator

    from .test_generation import _saved_model

    model = _saved_model("llama", tmp_path / "hf")
    _truncated_draft(model, tmp_path / "draft-hf")
    common = ("--target", "cuda", "--dtype", "float16", "--max-seq-len", str(MAX_SEQ_LEN), "--max-batch", str(MAX_BATCH))
    cli("build", str(tmp_path / "hf"), "--generate", "-o", str(tmp_path / "art"), *common, "--speculate", "3",
        "--db", str(tmp_path / "t.db"))
    cli("build", str(tmp_path / "draft-hf"), "--generate", "-o", str(tmp_path / "draft"), *common, "--db", str(tmp_path / "t.db"))
    model = model.to("cuda", torch.float16)
    plain = [r.tokens for r in Generator(tmp_path / "art").generate(PROMPTS, NEW)]
    for kind in (tmp_path / "draft", "prompt-lookup"):
        gen = Generator(tmp_path / "art", draft=kind, speculate=3)
        for prompt, ours, theirs in zip(PROMPTS, [r.tokens for r in gen.generate(PROMPTS, NEW)], plain):
            diff = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
            if diff is not None:
                ids = torch.tensor([prompt + theirs[:diff]], device="cuda")
                with torch.no_grad():
                    top = model(ids).logits[0, -1].float().topk(2).values
                assert float(top[0] - top[1]) < 0.05, f"{kind} {prompt}: token {diff} differs away from a near-tie"
            else:
                assert ours == theirs
        assert gen.speculation["accepted_tokens"] > 0
