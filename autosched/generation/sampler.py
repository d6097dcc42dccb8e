"""Choosing each sequence's next token from a step's logits.

Greedy choice on the device (``greedy_tokens``): each row's first index of its largest logit (numpy's
``argmax``), so that a greedy step reads back one token per sequence instead of the whole [sequences,
vocabulary] logits. Sampling (temperature, top-k, top-p) on the host from the logits (:func:`sample_host`),
each request from its own seeded random stream.

The greedy kernel is one kernel over a symbolic number of rows. On a GPU each row is one CTA whose threads scan the vocabulary
side by side and meet in a cross-thread reduction of (index, value) pairs (TVM's default schedules give a
reduction of symbolic rows one thread per row, which walks the whole vocabulary alone).
"""

from __future__ import annotations

THREADS = 1024  # per row: a 32000-token vocabulary is 32 coalesced loads a thread


def greedy_kernel(vocab: int, gpu: bool):
    """The PrimFunc ``(logits [n, vocab] float32) -> (index [n] int32, value [n] float32)``, scheduled for a
    GPU if ``gpu`` (else as written, for the CPU's compiler)."""
    from tvm import s_tir, te, tirx

    n = tirx.Var("n", "int64")
    logits = te.placeholder((n, vocab), "float32", name="logits")

    def combine(x, y):  # keep x where larger, or equal at a smaller index: the first maximum
        keep = tirx.Or(x[1] > y[1], tirx.And(x[1] == y[1], x[0] < y[0]))
        return tirx.Select(keep, x[0], y[0]), tirx.Select(x[1] > y[1], x[1], y[1])

    def identity(index_dtype, value_dtype):
        return tirx.const(-1, index_dtype), tirx.min_value(value_dtype)

    first_max = te.comm_reducer(combine, identity, name="first_max")
    k = te.reduce_axis((0, vocab), name="k")
    index, value = te.compute((n,), lambda i: first_max((k.var.astype("int32"), logits[i, k]), axis=k), name="best")
    # The value is an output too: on a GPU the reduction's second result cannot live in a buffer of its own.
    # Opaque to fusion, and without the ``main`` symbol TE gives it (the module names it).
    func = te.create_prim_func([logits, index, value]).with_attr("op_pattern", 8).without_attr("global_symbol")
    if not gpu:
        return func
    sch = s_tir.Schedule(func)
    block = sch.get_sblock("best")
    row, column = sch.get_loops(block)
    _, lane = sch.split(column, [None, THREADS])
    sch.bind(row, "blockIdx.x")
    sch.bind(lane, "threadIdx.x")
    return sch.mod["main"].with_attr("tirx.is_scheduled", True).without_attr("global_symbol")


def sample_host(logits, sampling, rng) -> int:
    """One token from one row of logits (numpy) as ``sampling`` asks, drawing from ``rng`` (numpy's Generator)."""
    import numpy as np

    if sampling.temperature == 0:
        return int(np.argmax(logits))
    scores = logits.astype(np.float64) / sampling.temperature
    if sampling.top_k:
        cut = np.partition(scores, -sampling.top_k)[-sampling.top_k]
        scores = np.where(scores >= cut, scores, -np.inf)
    probs = np.exp(scores - scores.max())
    probs /= probs.sum()
    if sampling.top_p < 1:
        order = np.argsort(-probs)
        keep = np.cumsum(probs[order]) - probs[order] < sampling.top_p  # the smallest prefix reaching top_p
        mask = np.zeros_like(probs, dtype=bool)
        mask[order[keep]] = True
        probs = np.where(mask, probs, 0.0)
        probs /= probs.sum()
    return int(rng.choice(len(probs), p=probs))


class Sampler:
    """Tokens for the rows of a step: on the device where the artifact has ``greedy_tokens`` and every row is
    greedy (one int a row comes back), else on the host from the logits."""

    def __init__(self, greedy_tokens=None):
        self.greedy_tokens = greedy_tokens

    def choose(self, logits, rows: int, seqs: list, wanted: list[bool], counts: dict) -> list[int | None]:
        """A token for each of ``seqs`` that is ``wanted`` (None for the others), from the first rows of
        ``logits`` (a device tensor of ``rows`` rows, padding rows last). A request's random stream is drawn
        from only when it samples."""
        if self.greedy_tokens is not None and all(seq.sampling.temperature == 0 for seq in seqs):
            counts["device_greedy_calls"] += 1
            picks = self.greedy_tokens(logits).numpy().reshape(-1)
            return [int(picks[i]) if want else None for i, want in enumerate(wanted)]
        counts["host_sample_calls"] += 1
        host = logits.numpy().reshape(rows, -1)
        return [sample_host(host[i], seq.sampling, seq.rng) if want else None
                for i, (seq, want) in enumerate(zip(seqs, wanted))]
