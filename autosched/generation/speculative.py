"""Speculative decoding: a draft proposes up to k tokens per sequence, the target model verifies them all in
one call for the whole batch, and the accepted ones are kept, so a step can make several tokens for the
cost of about one (at batch 1 a step reads every weight whatever its token count).

The output is the target's own: greedy, a proposal is kept while it is the target's greedy choice, and the
first disagreement is replaced by that choice; sampled, a proposal ``x`` is kept with probability
``min(1, p(x) / q(x))`` and the first rejected one replaced by a sample of ``normalize(max(0, p - q))``; when
all are kept, a bonus token is drawn from ``p`` (Leviathan et al. 2023; Chen et al. 2023). ``p`` and ``q``
are the target's and the draft's distributions after the request's temperature, top-k and top-p.

A step speculates only while it pays (:class:`Adaptation`): the proposals' recent acceptance gives the
tokens a speculative step is expected to make, against its cost in plain decode steps (the verify step and
a model draft's own steps, by weight bytes); where a draft stops agreeing, plain steps follow, with a
speculative one now and then to notice when it agrees again.

Drafts: :class:`PromptLookupDraft` (the continuation of the latest earlier occurrence of the sequence's last
n tokens: no second model, ``q`` one-hot) and :class:`ModelDraft` (another generation artifact of the same
vocabulary, with its own KV cache, rolled back to what the target kept).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from autosched.errors import UsageError

from . import scheduler
from .model import LoadedModel
from .request import SequenceState
from .sampler import distribution

# Deferred imports: numpy (imported where used: `autosched --help` stays fast).


@dataclass
class Proposal:
    """A draft's tokens for one sequence and, for a sampled sequence of a model draft, the distribution each
    was drawn from (None: the draft is deterministic, ``q`` is one-hot). Under a grammar: ``allowed``, the tokens
    it allows at each position up to the first proposal it rejects (see :func:`walk_grammar`), and ``cut_q``,
    the distribution of a sampled proposal cut there (the last draw is then from the residual with it)."""

    tokens: list[int]
    q_rows: list | None = None
    allowed: list | None = None
    cut_q: object = None


def walk_grammar(seq: SequenceState, proposal: Proposal, cut: bool) -> None:
    """The tokens ``seq``'s grammar allows at each position of ``proposal`` (after its token before it: the
    first, after the sequence's tokens), up to its first proposal the grammar rejects or the stop token that
    ends it; with ``cut``, the proposals from the rejected one on are dropped (a greedy verification would
    reject it, a sampled one too: the grammar gives it probability 0). The grammar state is rolled back to
    where it was."""
    grammar = seq.grammar
    allowed = [grammar.allowed()]
    taken = 0
    for token in proposal.tokens:
        if not allowed[-1][token] or not grammar.accept(token):
            break
        taken += 1
        if grammar.terminated:
            break
        allowed.append(grammar.allowed())
    grammar.rollback(taken)
    proposal.allowed = allowed
    if cut and taken < len(proposal.tokens):
        if proposal.q_rows is not None:
            proposal.cut_q = proposal.q_rows[taken]
            del proposal.q_rows[taken:]
        del proposal.tokens[taken:]


def masked(row, allowed):
    """A row of logits with -inf where ``allowed`` (a bool array, or None: all) is False."""
    import numpy as np

    if allowed is None:
        return row
    row = row.astype(np.float64)
    row[:allowed.size][~allowed] = -np.inf
    return row


def accept_greedy(proposals: list[int], target_tokens: list[int]) -> list[int]:
    """The tokens a greedy step makes: the proposals while each is the target's greedy choice
    (``target_tokens[i]``, its choice after the i-th token fed), then the target's own choice."""
    made = []
    for proposed, chosen in zip(proposals, target_tokens):
        if proposed != chosen:
            break
        made.append(proposed)
    made.append(target_tokens[len(made)])
    return made


def accept_sampled(proposals: list[int], p_rows, q_rows, rng, cut_q=None) -> list[int]:
    """The tokens a sampled step makes from ``proposals`` (drawn from ``q_rows``; None, or a row None: a
    deterministic proposal, its row one-hot) and the target's distributions ``p_rows`` (one more row than
    proposals): each proposal ``x`` kept with probability min(1, p(x) / q(x)); the first rejected one replaced
    by a draw from normalize(max(0, p - q)); a bonus draw from the last row of ``p`` when all are kept. The
    tokens so made are distributed as the target's own samples. ``cut_q``: the draft's distribution of a
    proposal after the last one, cut because ``p`` (under a grammar) gives it 0: it would be rejected, so the
    last draw is from normalize(max(0, p - cut_q))."""
    import numpy as np

    made = []
    for i, x in enumerate(proposals):
        p = np.asarray(p_rows[i], dtype=np.float64)
        if q_rows is None or q_rows[i] is None:
            q = np.zeros_like(p)
            q[x] = 1.0
        else:
            q = np.asarray(q_rows[i], dtype=np.float64)
        if rng.random() * q[x] < p[x]:  # u < p(x) / q(x), without dividing by a q(x) of 0
            made.append(int(x))
            continue
        residual = np.maximum(p - q, 0.0)
        total = residual.sum()
        if total <= 0:  # p == q up to rounding: a rejection is then (almost) impossible; draw from p
            residual, total = p, p.sum()
        made.append(int(rng.choice(len(p), p=residual / total)))
        return made
    p = np.asarray(p_rows[len(proposals)], dtype=np.float64)
    if cut_q is not None:
        residual = np.maximum(p - np.asarray(cut_q, dtype=np.float64), 0.0)
        if residual.sum() > 0:
            p = residual
    made.append(int(rng.choice(len(p), p=p / p.sum())))
    return made


class PromptLookupDraft:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last ``n``
    tokens (``n`` from ``max_ngram`` down to 1), in its own prompt and output. No model: it pays off where
    the output repeats its input (code edits, summaries quoting the text)."""

    def __init__(self, max_ngram: int = 3):
        self.max_ngram = max_ngram

    def propose(self, requests: list[tuple[SequenceState, int]]) -> list[Proposal]:
        return [Proposal(self.lookup(seq.context, k)) for seq, k in requests]

    def lookup(self, context: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens continuing ``context`` as it continued before."""
        if k < 1:
            return []
        for n in range(min(self.max_ngram, len(context) - 1), 0, -1):
            tail = context[-n:]
            for start in range(len(context) - n - 1, -1, -1):  # latest first; not the tail itself
                if context[start : start + n] == tail:
                    return context[start + n : start + n + k]
        return []

    def room(self, seq: SequenceState) -> int:
        """No limit of its own: it reads the sequence's tokens."""
        return 1 << 30

    def forget(self, seq_id: int) -> None:
        """Nothing is kept per sequence."""

    def clear(self) -> None:
        """Nothing is kept."""

    def prefill(self, requests) -> None:
        """Nothing to read ahead."""


# New tokens of a sequence up to which a draft feeds them by decode calls, one a call (a step leaves one, or
# two where every proposal was kept), rather than by a prefill call of symbolic shape.
STEP_FEED = 2


class ModelDraft:
    """A smaller generation artifact of the same vocabulary proposes the tokens: greedy for a greedy
    request, sampled from its own distribution (after the request's temperature, top-k, top-p) otherwise.
    Its KV cache holds each sequence's tokens as far as they agree with the target's: before it proposes,
    whatever the target did not keep is rolled back (``kv_state_popn``) and the new tokens are fed."""

    def __init__(self, model):
        self.model = model
        self.cached: dict[int, list[int]] = {}  # seq id -> the tokens in the draft's cache

    def room(self, seq: SequenceState) -> int:
        """Proposals the draft's longest sequence leaves room for (it feeds the context and k - 1 of them)."""
        return self.model.max_seq_len - len(seq.context) + 1

    def forget(self, seq_id: int) -> None:
        if self.cached.pop(seq_id, None) is not None:
            self.model.remove(seq_id)

    def clear(self) -> None:
        """Every sequence out of the draft's cache (see Generator.reset)."""
        self.model.clear()
        self.cached.clear()

    def propose(self, requests: list[tuple[SequenceState, int]]) -> list[Proposal]:
        """Up to k tokens for each (sequence, k): the sequences' new tokens fed (a prompt by a prefill call; the
        one or two tokens of a later step by decode calls, static where the draft has them), the first
        proposal from the last one's logits, then a decode call per further proposal."""
        proposals = [Proposal([], None if seq.sampling.greedy else []) for seq, _ in requests]
        active = [i for i, (_, k) in enumerate(requests) if k > 0]
        feeds = {i: self._sync(requests[i][0]) for i in active}
        self._prefill(requests, proposals, {i: tokens for i, tokens in feeds.items() if len(tokens) > STEP_FEED})
        # A later step's tokens: all accepted leaves the last proposal and the model's token to feed.
        steps = {i: tokens for i, tokens in feeds.items() if len(tokens) <= STEP_FEED}
        while any(len(tokens) > 1 for tokens in steps.values()):
            batch = [i for i, tokens in steps.items() if len(tokens) > 1]
            self._call(requests, proposals, batch, [[steps[i].pop(0)] for i in batch], prefill=False, propose=False)
        if steps:
            self._call(requests, proposals, list(steps), list(steps.values()), prefill=False)
        for step in range(1, max((k for _, k in requests), default=0)):
            batch = [i for i in active if requests[i][1] > step]
            if batch:
                self._call(requests, proposals, batch, [[proposals[i].tokens[-1]] for i in batch], prefill=False)
        return proposals

    def prefill(self, requests: list[tuple[SequenceState, int]]) -> None:
        """Feed the sequences' prompts (all but their last token, whose logits the first proposal needs) by
        prefill calls, before the step proper: what the prompt costs the draft is prefill time, not a step's."""
        feeds = {i: self._sync(seq)[:-1] for i, (seq, k) in enumerate(requests) if k > 0}
        self._prefill(requests, None, {i: tokens for i, tokens in feeds.items() if len(tokens) > STEP_FEED})

    def _prefill(self, requests, proposals, prompts: dict[int, list[int]]) -> None:
        """``prompts`` packed into prefill calls that fit the draft's prefill scratch space (a proposal from
        each prompt's last token unless ``proposals`` is None)."""
        while prompts:
            batch, room = [], self.model.max_seq_len
            for i, tokens in prompts.items():
                if batch and len(tokens) > room:
                    break
                batch.append(i)
                room -= len(tokens)
            feeds = [prompts.pop(i) for i in batch]
            self._call(requests, proposals, batch, feeds, prefill=True, propose=proposals is not None)

    def _sync(self, seq: SequenceState) -> list[int]:
        """Roll the draft's cache of ``seq`` back to where it agrees with the sequence's tokens; returns the
        tokens to feed (at least one: the logits of the last are what the first proposal is drawn from)."""
        context = seq.context
        if seq.seq_id not in self.cached:
            self.model.add(seq.seq_id)
            self.cached[seq.seq_id] = []
        cached = self.cached[seq.seq_id]
        same = 0
        for a, b in zip(cached, context):
            if a != b:
                break
            same += 1
        same = min(same, len(context) - 1)
        if len(cached) > same:
            self.model.popn(seq.seq_id, len(cached) - same)
            del cached[same:]
        return context[same:]

    def _call(self, requests, proposals, batch: list[int], feeds: list[list[int]], prefill: bool, propose: bool = True) -> None:
        """One draft call feeding ``feeds`` to the sequences ``batch``; a proposal for each from its last row
        (``propose=False``: the tokens only go into the cache)."""
        import numpy as np

        m = self.model
        seqs = [requests[i][0] for i in batch]
        ids = np.concatenate([np.asarray(f, dtype="int32") for f in feeds])
        lengths = [len(f) for f in feeds]
        function = "batch_prefill" if prefill else scheduler.decode_function(len(batch), m.decode_batches)
        logits = m.forward(function, [s.seq_id for s in seqs], lengths, ids, prefill)
        for seq, fed in zip(seqs, feeds):
            self.cached[seq.seq_id] += fed
        if not propose:
            return
        if all(seq.sampling.greedy for seq in seqs) and m.greedy_tokens is not None:
            picks = m.greedy_tokens(logits).numpy().reshape(-1)
            for i, pick in zip(batch, picks):
                proposals[i].tokens.append(int(pick))
            return
        rows = logits.numpy().reshape(len(batch), -1)
        for i, seq, row in zip(batch, seqs, rows):
            if seq.sampling.greedy:
                proposals[i].tokens.append(int(np.argmax(row)))
                continue
            q = distribution(row, seq.sampling)
            proposals[i].tokens.append(int(seq.rng.choice(len(q), p=q)))
            proposals[i].q_rows.append(q)


def static_verify_name(rows: int, proposals: int) -> str:
    """The name of the static function that verifies ``proposals`` tokens for each of ``rows`` sequences (the
    decoder builds it under this name)."""
    return f"verify_b{rows}_k{proposals}"


def verify_function(lengths: list[int], speculate, decode_batches) -> str:
    """The target's function for a speculative step feeding ``lengths`` tokens to its sequences: a static
    ``verify_b<n>_k<k>`` where every sequence gets k proposals and the artifact was built with ``--speculate k``
    and decode batch n (tuned kernels, CUDA graphs), else ``batch_prefill``."""
    k = lengths[0] - 1
    if all(n == k + 1 for n in lengths) and k in speculate and len(lengths) in decode_batches:
        return static_verify_name(len(lengths), k)
    return "batch_prefill"


def make_draft(draft, target) -> PromptLookupDraft | ModelDraft:
    """A draft from what ``Generator(draft=...)`` was given: ``"prompt-lookup"``, the folder of another
    generation artifact, a loaded model (``LoadedModel``) or a draft object. One-line errors for a draft
    that cannot serve ``target`` (another vocabulary, fewer sequences at once)."""
    if isinstance(draft, (PromptLookupDraft, ModelDraft)):
        return draft
    if draft == "prompt-lookup":
        return PromptLookupDraft()
    if isinstance(draft, (str, Path)):
        draft = LoadedModel.load(draft)
    if not isinstance(draft, LoadedModel):
        raise UsageError(
            f"draft must be 'prompt-lookup', a generation artifact's folder or a LoadedModel, not {type(draft).__name__}"
        )
    if draft.vocab != target.vocab:
        raise UsageError(
            f"the draft's vocabulary has {draft.vocab} tokens, the model's {target.vocab}: a draft must "
            "share the model's tokenizer (or use --prompt-lookup)"
        )
    if draft.max_batch < target.max_batch:
        raise UsageError(
            f"the draft takes {draft.max_batch} sequences at once, the model {target.max_batch}: rebuild "
            f"the draft with --max-batch {target.max_batch}"
        )
    if draft.window or draft.rope_switch is not None:
        raise UsageError(
            "a draft with a sliding window or longrope is not supported: its cache cannot roll back what the model rejects"
        )
    return ModelDraft(draft)


def check_speculation(speculate: int, target) -> None:
    """One-line errors for a number of proposals or a model speculation cannot serve."""
    if isinstance(speculate, bool) or not isinstance(speculate, int) or speculate < 1:
        raise UsageError(f"speculate must be a whole number of proposed tokens, at least 1 (got {speculate!r})")
    if speculate > target.max_seq_len - 2:  # a step feeds a token and the proposals after at least a prompt token
        raise UsageError(f"speculate {speculate} proposes more tokens a step than the artifact's --max-seq-len "
                         f"{target.max_seq_len} leaves room for: propose at most {max(target.max_seq_len - 2, 0)}")
    if target.window:
        raise UsageError(
            f"speculative decoding is not supported for a model with a sliding window "
            f"({target.window} tokens): its cache drops tokens that a rejection would need back"
        )
    if target.rope_switch is not None:
        raise UsageError(
            "speculative decoding is not supported for a longrope model: it picks its rotary factors from a whole prompt's length"
        )


# While speculation does not pay: plain decode steps between two speculative ones (probes of the draft).
PROBE_EVERY = 16
# A verify step's cost in plain decode steps: it reads the same weights as a decode step, and its few more
# tokens add attention and tensor-core work.
VERIFY_COST = 1.2
# How much of the acceptance seen so far a new speculative step keeps (the rest is the new step's).
DECAY = 0.7


def expected_tokens(acceptance: float, k: int) -> float:
    """The tokens a sequence makes in a speculative step of ``k`` proposals, each kept with probability
    ``acceptance`` until the first rejection, the target's own token included: 1 + a + ... + a^k."""
    return float(k + 1) if acceptance >= 1.0 else (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


class Adaptation:
    """Whether the next decode step speculates: while the tokens a speculative step is expected to make
    (:func:`expected_tokens` at the recent acceptance) are more than its ``cost`` in plain decode steps, it
    does; otherwise plain steps run, every ``probe_every``-th speculating again to measure the draft anew.
    Acceptance starts at 1 (a draft is trusted until it is rejected) and follows the recent steps (:data:`DECAY`). The
    decisions read proposals and acceptances only, never the clock: a seeded sampled run repeats exactly."""

    def __init__(self, k: int, cost: float = VERIFY_COST, probe_every: int = PROBE_EVERY, decay: float = DECAY):
        self.k, self.cost, self.probe_every, self.decay = k, cost, probe_every, decay
        self.kept = self.tried = 0.0  # proposals kept, and proposals judged (up to the first rejection), decayed
        self.plain_run = 0  # plain steps since the last speculative one

    @property
    def acceptance(self) -> float:
        return self.kept / self.tried if self.tried else 1.0

    def pays(self) -> bool:
        return expected_tokens(self.acceptance, self.k) > self.cost

    def speculate_now(self) -> bool:
        return self.pays() or self.plain_run >= self.probe_every

    def observe_plain(self) -> None:
        self.plain_run += 1

    def observe(self, outcomes: list[tuple[int, int]]) -> None:
        """A speculative step's (proposed, accepted) per sequence."""
        self.plain_run = 0
        self.kept *= self.decay
        self.tried *= self.decay
        for proposed, accepted in outcomes:
            self.kept += accepted
            self.tried += accepted + (accepted < proposed)  # the judged ones: every kept one and a rejected one


def speculation_cost(target, draft, k: int) -> float:
    """A speculative step's cost in the target's plain decode steps: the verify step, and for a model draft its
    k decode steps, each costing its weights' bytes over the target's (decode reads every weight once)."""
    if not isinstance(draft, ModelDraft):
        return VERIFY_COST
    return VERIFY_COST + k * _weight_bytes(draft.model) / max(_weight_bytes(target), 1)


def _weight_bytes(model) -> int:
    return sum(math.prod(int(d) for d in p.shape) * p.dtype.itemsize for p in model.params)


class Speculator:
    """The decode step of a generator that speculates: each decoding sequence gets up to ``k`` proposals from
    ``draft``, the target verifies every sequence's last token and proposals in one call (``batch_prefill``
    with the logits of every position), and each sequence keeps what the acceptance rule keeps; the rest
    leaves the target's cache (``kv_state_popn``). Sequences accept different numbers of tokens."""

    def __init__(self, model, draft, k: int, limits: scheduler.Limits, stats: scheduler.StepStats,
                 adaptive: bool = True):
        self.model, self.draft, self.k, self.limits, self.stats = model, draft, k, limits, stats
        self.adaptation = Adaptation(k, speculation_cost(model, draft, k)) if adaptive else None

    def never_pays(self) -> bool:
        """Whether an adaptive speculator's steps cost more than they can make with every proposal kept (the
        k + 1 tokens of a step): a draft as large as the model, say. It then decodes plainly, speculating
        only every ``PROBE_EVERY``-th step; a reply shorter than that has no speculative step."""
        return self.adaptation is not None and expected_tokens(1.0, self.k) <= self.adaptation.cost

    def wants_step(self) -> bool:
        """Whether the next decode step speculates (always, unless adaptive and it does not pay now)."""
        return self.adaptation is None or self.adaptation.speculate_now()

    def plain_step(self, rows: int) -> None:
        """A plain decode step of ``rows`` sequences ran instead of a speculative one."""
        self.stats.counts["plain_steps"] += 1
        self.stats.counts["plain_rows"] += rows
        if self.adaptation is not None:
            self.adaptation.observe_plain()

    def forget(self, seq_id: int) -> None:
        self.draft.forget(seq_id)

    def proposals_wanted(self, seq: SequenceState) -> int:
        """How many tokens to propose for ``seq``: k, fewer where the artifact's longest sequence or the
        draft's leave less room (0: a plain decode row in the same call), or, unless the artifact verifies k
        proposals in a static function, where the sequence's token budget needs fewer."""
        wanted = min(self.k, self.limits.max_seq_len - seq.length - 1, self.draft.room(seq))
        if self.k not in self.model.static_proposals:
            wanted = min(wanted, seq.max_new_tokens - len(seq.completion.tokens) - 1)
        return max(0, wanted)

    def fill(self, requests, proposals: list[Proposal]) -> None:
        """Where the artifact verifies k proposals in a static function, a draft's short proposals are
        filled up to what was wanted with its last token repeated (a deterministic guess, q one-hot): every
        row then has k and the static function runs (tuned kernels, CUDA graphs) for about the same cost."""
        if self.k not in self.model.static_proposals:
            return
        for (seq, wanted), proposal in zip(requests, proposals):
            missing = wanted - len(proposal.tokens)
            if missing > 0:
                proposal.tokens += [(proposal.tokens or seq.pending)[-1]] * missing
                if proposal.q_rows is not None:
                    proposal.q_rows += [None] * missing

    def step(self, decoding: list[SequenceState]) -> list[tuple[int, int]]:
        """One speculative step of the ``decoding`` sequences; returns the (sequence id, token) pairs made."""
        import numpy as np

        m, counts = self.model, self.stats.counts
        requests = [(seq, self.proposals_wanted(seq)) for seq in decoding]
        began = self.stats.clock()
        self.draft.prefill(requests)  # new prompts into the draft's cache: prefill time
        counts["prefill_s"] += self.stats.clock() - began
        began = self.stats.clock()
        proposals = self.draft.propose(requests)
        static = self.k in m.static_proposals
        if not static:  # the proposals a grammar rejects are cut (with a static verify function, rejected there)
            for (seq, _), proposal in zip(requests, proposals):
                if seq.grammar is not None:
                    walk_grammar(seq, proposal, cut=True)
        self.fill(requests, proposals)
        for (seq, _), proposal in zip(requests, proposals):
            if static and seq.grammar is not None:
                walk_grammar(seq, proposal, cut=False)
        parts = [(seq, 1 + len(p.tokens)) for (seq, _), p in zip(requests, proposals)]
        kept, _ = scheduler.admit(parts, m.free_pages(), self.limits, m.kv_pages)
        if not kept:
            return []
        proposal_of = {seq.seq_id: p for (seq, _), p in zip(requests, proposals)}
        seqs = [seq for seq, _ in kept]
        fed = [seq.pending + proposal_of[seq.seq_id].tokens for seq in seqs]
        lengths = [len(f) for f in fed]
        ids = np.concatenate([np.asarray(f, dtype="int32") for f in fed])
        function = verify_function(lengths, m.static_proposals, m.decode_batches)
        logits = m.forward(function, [s.seq_id for s in seqs], lengths, ids, prefill=True, every_position=True)
        starts = np.cumsum([0, *lengths])
        if (all(seq.sampling.greedy and seq.grammar is None for seq in seqs)
                and m.greedy_tokens is not None):
            counts["device_greedy_calls"] += 1
            choices = m.greedy_tokens(logits).numpy().reshape(-1)
            host = None
        else:
            counts["host_sample_calls"] += 1
            host = logits.numpy().reshape(len(ids), -1)
        made, outcomes = [], []
        for seq, start, length in zip(seqs, starts, lengths):
            proposal = proposal_of[seq.seq_id]
            allowed = proposal.allowed or []  # under a grammar: -inf where it does not allow a token
            rows = None if host is None else [masked(row, allowed[i] if i < len(allowed) else None)
                                              for i, row in enumerate(host[start : start + length])]
            if seq.sampling.greedy:
                picks = choices[start : start + length] if host is None else [np.argmax(row) for row in rows]
                tokens = accept_greedy(proposal.tokens, [int(t) for t in picks])
            else:
                p_rows = [distribution(row, seq.sampling) for row in rows]
                tokens = accept_sampled(proposal.tokens, p_rows, proposal.q_rows, seq.rng, proposal.cut_q)
            accepted = len(tokens) - 1
            m.popn(seq.seq_id, len(proposal.tokens) - accepted)  # the rejected proposals leave the cache
            seq.length += 1 + accepted
            seq.pending = []
            full = seq.length >= self.limits.max_seq_len  # no room to feed a last token: a plain step makes none
            counts["proposed_tokens"] += len(proposal.tokens)
            counts["accepted_tokens"] += accepted
            outcomes.append((len(proposal.tokens), accepted))
            for token in tokens[:-1] if full else tokens:
                seq.accept(token)
                made.append((seq.seq_id, token))
                if seq.completion.finished:
                    break
            if full and not seq.completion.finished:
                seq.completion.finish_reason = "max_seq_len"
        counts["speculative_steps"] += 1
        counts["speculative_rows"] += len(seqs)
        if self.adaptation is not None:
            self.adaptation.observe(outcomes)
        self.stats.record(False, began, len(made), function)
        return made
