"""The step scheduler, in plain Python: which sequences a step prefills and in which chunks, which decode,
how a decode batch is padded up to a batch size the artifact has a static function for, and which sequences
the cache has no room for. It knows sequences (:class:`~.request.SequenceState`) and numbers, not TVM; the
model (:mod:`.model`) runs what it plans. :class:`StepStats` times the calls with an injected clock."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from .request import SequenceState


@dataclass(frozen=True)
class Limits:
    """What the artifact can run: its longest sequence, its cache's page size, its static decode batch sizes
    and prefill chunk lengths, a sliding window (0: none) and how many tokens a windowed sequence's prefill call
    may take past its first window (a build masks its cached keys to the window: up to a window; older: 1)."""

    max_seq_len: int
    page_size: int
    decode_batches: frozenset = frozenset()
    prefill_chunks: tuple[int, ...] = ()
    window: int = 0
    window_chunk: int = 1


def pages_needed(length: int, tokens: int, page_size: int) -> int:
    """New pages a sequence of ``length`` cached tokens needs to take ``tokens`` more."""
    have = -(-length // page_size)
    return -(-(length + tokens) // page_size) - have


def next_prefill(waiting: Sequence[SequenceState], limits: Limits) -> tuple[list[tuple[SequenceState, int]], int | None]:
    """One prefill call over the ``waiting`` sequences: (sequence, how many of its pending tokens), and the
    static chunk length the call fills (None: a dynamic call). The prompts are packed: chunks of exactly a
    static length while enough tokens wait (a prompt may span two chunks), then whole prompts up to
    ``max_seq_len`` tokens a call. In a sliding window a sequence's first call takes up to a window of its
    tokens, later ones up to ``window_chunk`` (a call's new tokens attend to each other unmasked: more than a
    window of them would see past it)."""
    total = sum(len(s.pending) for s in waiting)
    chunk = max((t for t in limits.prefill_chunks if t <= total), default=None)
    parts: list[tuple[SequenceState, int]] = []
    room = chunk or limits.max_seq_len
    for seq in waiting:
        if limits.window:
            want = min(len(seq.pending), limits.window if seq.length == 0 else limits.window_chunk)
        else:
            want = len(seq.pending)
        take = min(want, room)
        if chunk is None and parts and take < want:
            break
        parts.append((seq, take))
        room -= take
        if room == 0:
            break
    return parts, chunk


def admit(parts: Iterable[tuple[SequenceState, int]], free_pages: int, limits: Limits,
          kv_pages: int) -> tuple[list[tuple[SequenceState, int]], int]:
    """The parts the cache has room for, and the pages left after them. A sequence that would grow past
    ``max_seq_len`` ends with ``max_seq_len``; one the cache has no pages for ends with an error (the rest
    of the batch goes on)."""
    kept = []
    for seq, tokens in parts:
        need = pages_needed(seq.length, tokens, limits.page_size)
        if seq.length + tokens > limits.max_seq_len:
            seq.completion.finish_reason = "max_seq_len"
        elif need > free_pages:
            seq.completion.fail(f"the KV cache is out of pages ({kv_pages} in all): fewer or shorter sequences at once")
        else:
            free_pages -= need
            kept.append((seq, tokens))
    return kept, free_pages


def padding_rows(rows: int, decode_batches: Iterable[int], free_pages: int) -> int:
    """How many empty rows pad a decode step of ``rows`` sequences up to the smallest batch with a static
    function (tuned kernels, CUDA graphs; a decode step reads the weights once whatever its rows, so a padded
    step costs about what the unpadded one would). Each padding row appends one token, removed again after
    the step: it needs a free page. 0 where no static batch holds ``rows`` or the pages are short."""
    pads = min((b for b in decode_batches if b >= rows), default=rows) - rows
    return 0 if pads > free_pages else pads


def decode_function(rows: int, decode_batches: Iterable[int]) -> str:
    """The artifact's function for a decode step of ``rows`` rows: its static one if it has it."""
    return f"decode_b{rows}" if rows in set(decode_batches) else "batch_decode"


def prefill_padding(tokens: int, prefill_chunks: Iterable[int], free_pages: int, page_size: int) -> int:
    """How many padding tokens (one empty sequence, emptied again after the call) take a dynamic prefill call of
    ``tokens`` tokens up to the smallest static chunk that holds them (its tuned kernels: a call of a few tokens
    left over from a prompt's chunks would otherwise run the dynamic function's default kernels); 0 where no
    chunk holds them or the cache has no pages for the padding."""
    pads = min((c for c in prefill_chunks if c >= tokens), default=tokens) - tokens
    return 0 if pages_needed(0, pads, page_size) > free_pages else pads


def prefill_function(tokens: int, chunk: int | None) -> str:
    """The function for a prefill call of ``tokens`` tokens: a chunk of a static length runs its own (tuned
    kernels), unless a sequence was dropped from it."""
    return f"prefill_t{chunk}" if chunk is not None and tokens == chunk else "batch_prefill"


def longrope_rereads(seqs: Iterable[SequenceState], switch: int) -> list[SequenceState]:
    """The sequences of a longrope model about to grow past the original context ``switch``: read again from
    their first token with the long factors (as transformers' Phi-3 does)."""
    return [s for s in seqs if s.prefilled and s.pending and not s.completion.finished
            and s.length <= switch < s.length + len(s.pending)]


@dataclass
class StepStats:
    """Calls, tokens and seconds of prefill and decode; ``clock`` is injected (tests give a fake one)."""

    clock: Callable[[], float] = time.perf_counter
    counts: dict = field(default_factory=dict)

    def __post_init__(self):
        self.reset()

    def reset(self) -> None:
        self.counts = {"prefill_calls": 0, "prefill_tokens": 0, "prefill_s": 0.0, "decode_steps": 0,
                       "static_decode_steps": 0, "padded_decode_steps": 0, "static_prefill_calls": 0,
                       "decode_tokens": 0, "decode_s": 0.0, "device_greedy_calls": 0,
                       "device_sample_calls": 0, "host_sample_calls": 0, "speculative_steps": 0,
                       "speculative_rows": 0, "proposed_tokens": 0, "accepted_tokens": 0, "plain_steps": 0,
                       "plain_rows": 0}

    def record(self, prefill: bool, began: float, tokens: int, function: str, padded: bool = False) -> None:
        """A call that began at ``began`` (this clock) and fed ``tokens`` tokens (prefill) or rows (decode)."""
        c = self.counts
        elapsed = self.clock() - began
        if prefill:
            c["prefill_calls"] += 1
            c["prefill_tokens"] += tokens
            c["prefill_s"] += elapsed
            c["static_prefill_calls"] += function != "batch_prefill"
        else:
            c["decode_steps"] += 1
            c["decode_tokens"] += tokens
            c["decode_s"] += elapsed
            c["static_decode_steps"] += function not in ("batch_decode", "batch_prefill")
            c["padded_decode_steps"] += padded

    def timing(self) -> dict:
        """Prefill time, time per decode step and tokens per second."""
        c = self.counts
        steps = max(c["decode_steps"], 1)
        out = {"prefill_ms": 1e3 * c["prefill_s"], "prefill_tokens": c["prefill_tokens"],
               "ms_per_step": 1e3 * c["decode_s"] / steps, "decode_steps": c["decode_steps"],
               "tokens_per_s": c["decode_tokens"] / c["decode_s"] if c["decode_s"] else 0.0}
        if c["speculative_steps"]:
            out |= speculation_counts(c)
        return out


def speculation_counts(c: dict) -> dict:
    """What speculation did: tokens proposed and accepted, the tokens a sequence made per target step (one
    without speculation), and the decode steps that did not speculate because it did not pay."""
    return {"proposed_tokens": c["proposed_tokens"], "accepted_tokens": c["accepted_tokens"],
            "acceptance_rate": c["accepted_tokens"] / c["proposed_tokens"] if c["proposed_tokens"] else 0.0,
            "tokens_per_step": c["decode_tokens"] / max(c["speculative_rows"] + c["plain_rows"], 1),
            "speculative_steps": c["speculative_steps"], "plain_steps": c["plain_steps"]}
