"""The quality of a generation artifact: its perplexity over a text, from the logits of its prefill.

The text's tokens are cut into windows of at most ``window`` tokens, each prefilled as a fresh sequence by
``batch_prefill`` with the logits read at every position (the function takes the positions to read: a
generation step reads each prompt's last, an evaluation all of them). Position i predicts token i + 1, so a
window of w tokens scores w - 1 of them; the perplexity is exp of the mean negative log-likelihood over every
scored token, the log-softmax taken in float64 on the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autosched.errors import UsageError

# Deferred imports: numpy (imported where used: `autosched --help` stays fast).

# A sequence id away from a Generator's (0, 1, ...) and from the padding rows'.
EVAL_SEQUENCE_ID = 1 << 41


@dataclass
class Perplexity:
    perplexity: float
    mean_nll: float  # nats per scored token
    scored_tokens: int
    windows: int
    window: int

    def to_json(self) -> dict:
        return {
            "perplexity": self.perplexity,
            "mean_nll": self.mean_nll,
            "scored_tokens": self.scored_tokens,
            "windows": self.windows,
            "window": self.window,
        }


def window_limit(model, window: int | None) -> int:
    """The window an evaluation of ``model`` (a :class:`~.model.LoadedModel`) uses: ``window`` or the artifact's
    --max-seq-len; a one-line UsageError for one it cannot prefill in a call."""
    limit = model.max_seq_len
    if model.window:  # past a sliding window, a prefill goes a token a call (the Generator's way)
        limit = min(limit, model.window)
    if model.rope_switch is not None:  # longrope: one table per call, as transformers reads a whole sequence
        limit = min(limit, model.rope_switch)
    window = limit if window is None else window
    if not 2 <= window <= limit:
        raise UsageError(
            f"--max-seq-len {window} does not fit this artifact: an evaluation window holds 2 to {limit} "
            "tokens (the artifact's --max-seq-len, or its sliding window)"
        )
    return window


def all_logits(model, ids: list[int]):
    """The logits [len(ids), vocab] (float32, numpy) of one prefill of ``ids`` as a fresh sequence."""
    import numpy as np

    model.add(EVAL_SEQUENCE_ID)
    try:
        positions = np.arange(len(ids), dtype="int32")
        logits = model.forward("batch_prefill", [EVAL_SEQUENCE_ID], [len(ids)], ids, prefill=True, logit_positions=positions)
        return logits.numpy().reshape(len(ids), -1)
    finally:
        model.remove(EVAL_SEQUENCE_ID)


def perplexity(model, tokens: list[int], window: int | None = None) -> Perplexity:
    """The perplexity of ``model`` (a :class:`~.model.LoadedModel`) over ``tokens`` in windows of ``window``
    tokens (default: the artifact's --max-seq-len)."""
    import numpy as np

    window = window_limit(model, window)
    bad = [t for t in tokens if not 0 <= t < model.vocab]
    if bad:
        raise UsageError(f"token id {bad[0]} is outside the artifact's vocabulary (0 to {model.vocab - 1})")
    if len(tokens) < 2:
        raise UsageError(f"the text has {len(tokens)} token(s): a perplexity needs at least 2")
    total, scored, windows = 0.0, 0, 0
    for start in range(0, len(tokens), window):
        ids = tokens[start : start + window]
        if len(ids) < 2:  # a last lone token has nothing before it in its window
            break
        logits = all_logits(model, ids)[:-1].astype("float64")
        top = logits.max(axis=1, keepdims=True)
        log_norm = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
        total += float((log_norm - logits[np.arange(len(ids) - 1), ids[1:]]).sum())
        scored += len(ids) - 1
        windows += 1
    mean = total / scored
    return Perplexity(math.exp(mean), mean, scored, windows, window)
