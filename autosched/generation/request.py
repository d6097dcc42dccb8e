"""Request and sequence state: what a caller asks for (:class:`Sampling`, stop tokens, a token budget) and
what a sequence has made so far (:class:`Completion`), apart from the model and the step scheduler."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from autosched.errors import AutoschedError, UsageError

from .grammar import GrammarSpec

if TYPE_CHECKING:
    from .grammar import GrammarState


class GenerationError(AutoschedError):
    """A request the generator cannot serve (bad input or a limit of the artifact); other sequences go on."""

    exit_code = 2


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: greedy when ``temperature`` is 0, else sampled from the logits divided
    by ``temperature``, kept to the tokens whose probability is at least ``min_p`` times the largest, to the
    ``top_k`` most likely (0: all) and to the smallest set whose probability reaches ``top_p``. ``seed`` makes a
    request's samples reproducible whatever else is in its batch.

    Before that, as OpenAI's API and vLLM define them: ``logit_bias`` ((token, bias) pairs) is added to the
    logits; ``repetition_penalty`` divides the positive logits (multiplies the negative ones) of every token of
    the prompt and the output; ``frequency_penalty`` times a token's count in the output, and
    ``presence_penalty`` once for any token in the output, are subtracted. ``logprobs``: report the chosen
    token's log-probability and the ``logprobs`` most likely tokens' (0: the chosen one only; None: none), from
    the model's own logits (before the rules above). ``grammar``: the output follows it
    (:class:`~.grammar.GrammarSpec`: a JSON schema, a regular expression, an EBNF grammar, a choice); each step's
    logits of the tokens it does not allow are -inf before every rule above but ``logprobs``."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    grammar: GrammarSpec | None = None

    def __post_init__(self):
        for wrong, what in ((not 0 <= self.temperature < math.inf,  # NaN too: no comparison holds for it
                             f"temperature must be 0 (greedy) or a finite number above it, got {self.temperature}"),
                            (self.top_k < 0, f"top_k must be 0 (no limit) or more, got {self.top_k}"),
                            (not 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
                            (not 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
                            (not 0 < self.repetition_penalty < math.inf,
                             f"repetition_penalty must be above 0 (1: none), got {self.repetition_penalty}"),
                            (not -2 <= self.frequency_penalty <= 2,
                             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
                            (not -2 <= self.presence_penalty <= 2,
                             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
                            (self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS,
                             f"logprobs must be 0 to {MAX_LOGPROBS} top tokens, got {self.logprobs}")):
            if wrong:
                raise UsageError(what)
        for token, bias in self.logit_bias:
            if not is_token_id(token) or token < 0 or not -100 <= bias <= 100:
                raise UsageError(f"logit_bias maps token ids (0 or more) to a bias in [-100, 100], got {token!r}: {bias!r}")
        if self.temperature == 0 and (self.top_k or self.top_p < 1 or self.min_p):
            raise UsageError(f"top_k {self.top_k}, top_p {self.top_p:g} and min_p {self.min_p:g} choose among tokens to "
                             "sample, and temperature 0 is greedy (no sampling): give a temperature above 0 (e.g. "
                             "--temperature 0.8), or leave top_k, top_p and min_p out")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise UsageError(f"seed must be a whole number, 0 or more (got {self.seed})")
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise UsageError(f"grammar is a GrammarSpec (autosched.generation.grammar), not {type(self.grammar).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_logits(self) -> bool:
        """Whether the row's logits go through rules beyond temperature, top-k and top-p (min_p, penalties,
        logit_bias, logprobs, a grammar): on the host, what :func:`~.sampler.processed_logits` applies."""
        return self.grammar is not None or not self.speculates

    @property
    def speculates(self) -> bool:
        """Whether a speculative step can choose its tokens: none of the rules that depend on each token before
        (min_p, penalties, logit_bias, logprobs; a grammar can: see :mod:`.speculative`)."""
        return not (self.min_p or self.repetition_penalty != 1 or self.frequency_penalty or self.presence_penalty
                    or self.logit_bias or self.logprobs is not None)


MAX_LOGPROBS = 20  # the most top tokens a step reports (OpenAI's limit)


@dataclass(frozen=True)
class TokenLogprob:
    """A chosen token's log-probability under the model, and the most likely tokens' (token, log-probability)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class Completion:
    """What one request produced: the new tokens and why it stopped (``length``: max_new_tokens reached;
    ``stop``: a stop token; ``max_seq_len``: the artifact's longest sequence; ``error``: see ``error``)."""

    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one a token, where Sampling.logprobs asks
    cached_tokens: int = 0  # of the prompt, read from a kept prefix rather than prefilled

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def fail(self, error: str) -> None:
        self.finish_reason, self.error = "error", error


@dataclass
class SequenceState:
    """One sequence in the cache: its tokens not yet fed, its length there, its limits and its completion."""

    seq_id: int
    pending: list[int]  # tokens not yet in the cache: the prompt (or a fork's suffix), then the last sample
    length: int  # tokens in the cache
    max_new_tokens: int
    stop_tokens: frozenset
    sampling: Sampling
    completion: Completion = field(default_factory=Completion)
    prefilled: bool = False
    cached: list[int] = field(default_factory=list)  # the tokens in the cache (for a re-read: see Generator.step)
    rng: object = None  # the request's own random stream (numpy, seeded by sampling.seed)
    prompt_context: list[int] = field(default_factory=list)  # a fork's parent tokens and the prompt
    next_logprob: TokenLogprob | None = None  # the sampler's, for the token accept() records next
    remembered: bool = False  # its prompt is in the prefix cache (Generator.prefix_cache)
    grammar: GrammarState | None = None  # where its output is in sampling.grammar (Generator.add makes it)
    token_counts: object = None  # its tokens as the device's penalties read them (logit_rules.TokenCounts)

    @property
    def context(self) -> list[int]:
        """Every token of the sequence: its parent's, its prompt, what it made (a draft reads them)."""
        return self.prompt_context + self.completion.tokens

    @property
    def decoding(self) -> bool:
        return self.prefilled and bool(self.pending) and not self.completion.finished

    def feed(self, fed: int, keep_cached: bool) -> None:
        """``fed`` of the pending tokens went into the cache."""
        self.length += fed
        if keep_cached:
            self.cached += self.pending[:fed]
        self.pending = self.pending[fed:]
        if not self.pending:
            self.prefilled = True

    def accept(self, token: int) -> None:
        """A token was sampled for this sequence: record it and decide whether the sequence ends (at a stop
        token; under a grammar, at the stop token that ends its output, whatever ``stop_tokens`` are)."""
        self.completion.tokens.append(token)
        if self.next_logprob is not None:
            self.completion.logprobs.append(self.next_logprob)
            self.next_logprob = None
        if self.grammar is not None and not self.grammar.accept(token):
            self.completion.fail(f"token {token} does not follow the request's grammar")
        elif token in self.stop_tokens or (self.grammar is not None and self.grammar.terminated):
            self.completion.finish_reason = "stop"
        elif len(self.completion.tokens) >= self.max_new_tokens:
            self.completion.finish_reason = "length"
        else:
            self.pending = [token]


def is_token_id(value) -> bool:
    """Whether ``value`` is one token id: a whole number (an int, a numpy or torch integer), not a bool."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def token_ids(prompt) -> list[int]:
    """A prompt as a list of ints; a GenerationError for text or ids that are not whole numbers (1.7 or "3"
    would otherwise be read as 1 and 3)."""
    if isinstance(prompt, (str, bytes)) or is_token_id(prompt) or not hasattr(prompt, "__iter__"):
        raise GenerationError(f"a prompt is a list of token ids, not {type(prompt).__name__}: tokenize text first "
                              "(the command line's --prompt with --tokenizer does)")
    prompt = list(prompt)
    bad = [t for t in prompt if not is_token_id(t)]
    if bad:
        raise GenerationError(f"token id {bad[0]!r} is not a whole number: a prompt is a list of int token ids")
    return [operator.index(t) for t in prompt]
