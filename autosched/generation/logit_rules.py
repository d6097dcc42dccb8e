"""A request's rules on a step's logits, applied on the device where the model runs, compiled there at their
first use (as vLLM's and MLC-LLM's samplers apply them on the GPU):

- :func:`penalty_kernel`: ``logit_bias``, then the repetition penalty, then the frequency and presence penalties,
  in place, one thread an entry: the host lists each row's tokens that a rule touches (its bias's tokens, the
  tokens of its context, those of its output with their counts), so that no two threads write one logit;
- :func:`logprob_kernel`: the log-probability of each row's chosen token and its ``MAX_LOGPROBS`` most likely
  tokens, from the model's logits (a copy taken before any rule, as OpenAI reports them); one small array a row
  comes back, not the logits.

The rules as the host applies them (float64): :func:`~.sampler.processed_logits` and
:func:`~.sampler.token_logprob`.
"""

from __future__ import annotations

from .request import MAX_LOGPROBS, TokenLogprob
from .runtime_kernels import compiled_at_first_use
from .sampler import row_reductions

# Deferred imports: numpy, tvm (imported where used: `autosched --help` stays fast).

PENALTY_THREADS = 256  # entries a CTA


def penalty_kernel(vocab: int, gpu: bool):
    """The PrimFunc ``main(logits [n, vocab] float32, rows [m] int32, tokens [m] int32, terms [m, 3] float32)``
    that applies, in place, entry ``e``'s rules to ``logits[rows[e], tokens[e]]``: ``terms[e]`` = (the bias
    added, the repetition penalty (1: none) dividing a positive logit and multiplying a negative one, the
    frequency and presence penalties' sum subtracted). The entries must name each (row, token) once."""
    from tvm.script import tirx as T

    @T.macro
    def entry(logits, rows, tokens, terms, e):
        biased = logits[rows[e], tokens[e]] + terms[e, 0]
        repeated = T.Select(biased > T.float32(0), biased / terms[e, 1], biased * terms[e, 1])
        logits[rows[e], tokens[e]] = repeated - terms[e, 2]

    if gpu:
        @T.prim_func
        def main(var_logits: T.handle, var_rows: T.handle, var_tokens: T.handle, var_terms: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            n, m = T.int64(), T.int64()
            logits = T.match_buffer(var_logits, (n, vocab), "float32")
            rows = T.match_buffer(var_rows, (m,), "int32")
            tokens = T.match_buffer(var_tokens, (m,), "int32")
            terms = T.match_buffer(var_terms, (m, 3), "float32")
            for b in T.thread_binding((m + PENALTY_THREADS - 1) // PENALTY_THREADS, thread="blockIdx.x"):
                for t in T.thread_binding(PENALTY_THREADS, thread="threadIdx.x"):
                    if b * PENALTY_THREADS + t < m:
                        entry(logits, rows, tokens, terms, b * PENALTY_THREADS + t)
    else:
        @T.prim_func
        def main(var_logits: T.handle, var_rows: T.handle, var_tokens: T.handle, var_terms: T.handle):
            T.func_attr({"tirx.noalias": True})
            n, m = T.int64(), T.int64()
            logits = T.match_buffer(var_logits, (n, vocab), "float32")
            rows = T.match_buffer(var_rows, (m,), "int32")
            tokens = T.match_buffer(var_tokens, (m,), "int32")
            terms = T.match_buffer(var_terms, (m, 3), "float32")
            for e in T.serial(m):
                entry(logits, rows, tokens, terms, e)
    return main


LOGPROB_THREADS = 1024  # a row's CTA: a 32000-token vocabulary is 32 coalesced loads a thread a pass


def logprob_kernel(vocab: int, gpu: bool, top: int = MAX_LOGPROBS):
    """The PrimFunc ``main(logits [n, vocab] float32, chosen [n] int32, values [n, top + 1] float32, tokens
    [n, top] int32)``: each row's log-softmax at its chosen token (``values[:, 0]``) and at its ``top`` most
    likely tokens (``values[:, 1:]``, ``tokens``: by value, then by the smaller id, as the host orders them).
    No sort: the top tokens are ``top`` passes, each the row's first maximum after the one before in that
    order. On a GPU a row is a CTA whose threads meet in the sampler's block reductions
    (:func:`~.sampler.row_reductions`); on the CPU one thread a row."""
    from tvm.script import tirx as T

    width = LOGPROB_THREADS if gpu else 1
    share = (vocab + width - 1) // width
    scope = "local" if gpu else "global"
    ops = row_reductions(gpu, width, vocab)
    block_allreduce, block_first_max = ops.block_allreduce, ops.block_first_max

    @T.macro
    def row(logits, chosen, values, tokens, r, t, scratch_value, scratch_index):
        best = T.alloc_buffer((1,), "float32", scope=scope)
        index = T.alloc_buffer((1,), "int32", scope=scope)
        total = T.alloc_buffer((1,), "float32", scope=scope)
        norm = T.alloc_buffer((1,), "float32", scope=scope)  # log of the softmax's denominator
        before = T.alloc_buffer((1,), "float32", scope=scope)  # the last pass's value and index
        before_index = T.alloc_buffer((1,), "int32", scope=scope)
        best[0] = T.float32("-inf")
        for i in range(share):
            if i * width + t < vocab:
                best[0] = T.max(best[0], logits[r, i * width + t])
        block_allreduce(best, scratch_value, t, T.max, T.float32("-inf"))
        total[0] = T.float32(0)
        for i in range(share):
            if i * width + t < vocab:
                total[0] = total[0] + T.exp(logits[r, i * width + t] - best[0])
        block_allreduce(total, scratch_value, t, T.Add, T.float32(0))
        norm[0] = best[0] + T.log(total[0])
        if t == 0:
            values[r, 0] = logits[r, chosen[r]] - norm[0]
        before[0] = T.float32("inf")
        before_index[0] = -1
        for p in range(top):
            best[0] = T.float32("-inf")
            index[0] = vocab  # none yet
            for i in range(share):
                j = i * width + t
                if j < vocab:
                    v = logits[r, j]
                    if v < before[0] or (v == before[0] and j > before_index[0]):
                        if v > best[0] or index[0] == vocab:  # j grows: a tie keeps the first
                            best[0] = v
                            index[0] = j
            block_first_max(best, index, scratch_value, scratch_index, t)
            if t == 0:
                values[r, p + 1] = best[0] - norm[0]
                tokens[r, p] = index[0]
            before[0] = best[0]
            before_index[0] = index[0]

    if gpu:
        @T.prim_func
        def main(var_logits: T.handle, var_chosen: T.handle, var_values: T.handle, var_tokens: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            n = T.int64()
            logits = T.match_buffer(var_logits, (n, vocab), "float32")
            chosen = T.match_buffer(var_chosen, (n,), "int32")
            values = T.match_buffer(var_values, (n, top + 1), "float32")
            tokens = T.match_buffer(var_tokens, (n, top), "int32")
            for r in T.thread_binding(n, thread="blockIdx.x"):
                for t in T.thread_binding(LOGPROB_THREADS, thread="threadIdx.x"):
                    scratch_value = T.alloc_buffer((32,), "float32", scope="shared")  # a value a warp
                    scratch_index = T.alloc_buffer((32,), "int32", scope="shared")
                    row(logits, chosen, values, tokens, r, t, scratch_value, scratch_index)
    else:
        @T.prim_func
        def main(var_logits: T.handle, var_chosen: T.handle, var_values: T.handle, var_tokens: T.handle):
            T.func_attr({"tirx.noalias": True})
            n = T.int64()
            logits = T.match_buffer(var_logits, (n, vocab), "float32")
            chosen = T.match_buffer(var_chosen, (n,), "int32")
            values = T.match_buffer(var_values, (n, top + 1), "float32")
            tokens = T.match_buffer(var_tokens, (n, top), "int32")
            for r in T.parallel(n):
                row(logits, chosen, values, tokens, r, 0, None, None)
    return main


class TokenCounts:
    """The tokens of a sequence's context (for the repetition penalty) and those it made, with their counts
    (frequency and presence penalties), brought up to date at each step with the tokens since the last: not
    counted again over a context of thousands of tokens at every step."""

    def __init__(self, seq):
        self.present = set(seq.prompt_context)
        self.made: dict[int, int] = {}
        self.seen = 0  # tokens of the completion counted

    @classmethod
    def of(cls, seq) -> TokenCounts:
        """``seq``'s counts (kept on it), up to its last token; counted afresh where its completion was cut."""
        counts = seq.token_counts
        tokens = seq.completion.tokens
        if counts is None or counts.seen > len(tokens):
            counts = cls(seq)
        for token in tokens[counts.seen:]:
            counts.present.add(token)
            counts.made[token] = counts.made.get(token, 0) + 1
        counts.seen = len(tokens)
        return counts


class DeviceRules:
    """The penalties, bias and log-probabilities of a step's rows on ``model``'s device: :meth:`apply` before
    the token is chosen, :meth:`logprobs` after (from :meth:`keep_raw`'s copy of the logits)."""

    def __init__(self, model, staging):
        self.model, self.staging = model, staging
        self._penalize = self._logprobs = None

    @staticmethod
    def applies(sampling) -> bool:
        """Whether a row's rules (other than sampling's own) are all ones applied here."""
        return not sampling.min_p

    def ready(self) -> bool:
        """Compiles the kernels (the first time); whether they are there."""
        if self._penalize is None:
            self._penalize = compiled_at_first_use(self.model, "penalties and logit bias", penalty_kernel) or False
            self._logprobs = compiled_at_first_use(self.model, "log-probabilities", logprob_kernel) or False
        return bool(self._penalize and self._logprobs)

    @staticmethod
    def entries(seq):
        """(tokens, terms) of one row: each token a rule touches once, with its bias, repetition penalty and
        subtracted frequency and presence penalties (numpy)."""
        import numpy as np

        sp = seq.sampling
        bias = dict(sp.logit_bias)
        counts = seq.token_counts = TokenCounts.of(seq)
        repeated = counts.present if sp.repetition_penalty != 1 else set()
        made = counts.made if sp.frequency_penalty or sp.presence_penalty else {}
        tokens = sorted(set(bias) | repeated | set(made))
        terms = np.asarray([(bias.get(t, 0.0), sp.repetition_penalty if t in repeated else 1.0,
                             sp.frequency_penalty * made.get(t, 0) + sp.presence_penalty * (made.get(t, 0) > 0))
                            for t in tokens], dtype=np.float32).reshape(-1, 3)
        return np.asarray(tokens, dtype=np.int32), terms

    def apply(self, logits, rows: list[int], seqs: list) -> None:
        """Each of ``seqs``' rules applied in place to its row of ``logits`` (a device view [rows, vocab])."""
        import numpy as np

        parts = []
        for row, seq in zip(rows, seqs):
            tokens, terms = self.entries(seq)
            inside = tokens < self.model.vocab  # a bias may name ids past the model's logits: they have none
            parts.append((row, tokens[inside], terms[inside]))
        if not any(tokens.size for _, tokens, _ in parts):
            return
        row_ids = np.concatenate([np.full(tokens.size, row, dtype=np.int32) for row, tokens, _ in parts])
        tokens = np.concatenate([tokens for _, tokens, _ in parts])
        terms = np.concatenate([terms for _, _, terms in parts])
        self._penalize(logits, self.staging.put("rule_rows", row_ids), self.staging.put("rule_tokens", tokens),
                       self.staging.put("rule_terms", terms))

    def keep_raw(self, logits, rows: int):
        """A copy of ``logits`` (a device view [rows, vocab]) before any rule, for :meth:`logprobs`."""
        raw = self.staging.empty("raw_logits", (rows, self.model.vocab), "float32")
        logits.copyto(raw)
        return raw

    def logprobs(self, raw, picks, rows: list[int], seqs: list) -> None:
        """Each of ``seqs``' chosen token's log-probability and its most likely tokens' (as many as it asks),
        from ``raw`` (:meth:`keep_raw`) and every row's pick (numpy), kept for its next accept."""
        import numpy as np

        n = raw.shape[0]
        chosen = self.staging.put("logprob_chosen", np.asarray(picks, dtype=np.int32).reshape(-1)[:n])
        values = self.staging.empty("logprob_values", (n, MAX_LOGPROBS + 1), "float32")
        tokens = self.staging.empty("logprob_tokens", (n, MAX_LOGPROBS), "int32")
        self._logprobs(raw, chosen, values, tokens)
        values, tokens = values.numpy(), tokens.numpy()
        for row, seq in zip(rows, seqs):
            top = seq.sampling.logprobs
            seq.next_logprob = TokenLogprob(float(values[row, 0]), tuple(
                (int(t), float(v)) for t, v in zip(tokens[row, :top], values[row, 1:top + 1])))
