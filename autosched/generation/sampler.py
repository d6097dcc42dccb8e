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


def distribution(logits, sampling):
    """The probabilities (numpy float64, summing to 1) of one row of logits after ``sampling``'s temperature,
    top-k and top-p: what a sampled token is drawn from. ``sampling`` must not be greedy."""
    import numpy as np

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
    return probs


def sample_host(logits, sampling, rng) -> int:
    """One token from one row of logits (numpy) as ``sampling`` asks, drawing from ``rng`` (numpy's Generator)."""
    import numpy as np

    if sampling.temperature == 0:
        return int(np.argmax(logits))
    probs = distribution(logits, sampling)
    return int(rng.choice(len(probs), p=probs))


class Sampler:
    """Tokens for the rows of a step, chosen on the device where the model runs: ``greedy_tokens`` where every
    row is greedy, ``sample_tokens`` otherwise (each sampled row draws one uniform number from its request's
    seeded stream on the host); one int a row comes back, not the logits. An artifact built before
    ``sample_tokens`` samples on the host from the logits."""

    def __init__(self, greedy_tokens=None, sample_tokens=None, device=None, staging=None):
        from .model import Staging

        self.greedy_tokens, self.sample_tokens, self.device = greedy_tokens, sample_tokens, device
        self.staging = staging or Staging(device)  # where the sampling parameters go on the device

    def choose(self, logits, rows: int, seqs: list, wanted: list[bool], counts: dict) -> list[int | None]:
        """A token for each of ``seqs`` that is ``wanted`` (None for the others), from the first rows of
        ``logits`` (a device tensor of ``rows`` rows, padding rows last). A request's random stream is drawn
        from only when it samples."""
        import numpy as np

        if self.greedy_tokens is not None and all(seq.sampling.temperature == 0 for seq in seqs):
            counts["device_greedy_calls"] += 1
            picks = self.greedy_tokens(logits).numpy().reshape(-1)
            return [int(picks[i]) if want else None for i, want in enumerate(wanted)]
        if self.sample_tokens is not None:
            params = np.zeros((rows, 4), dtype="float32")  # padding and unwanted rows: greedy
            for i, (seq, want) in enumerate(zip(seqs, wanted)):
                sp = seq.sampling
                if want and not sp.greedy:
                    params[i] = (sp.temperature, sp.top_k, sp.top_p, seq.rng.random())
            counts["device_sample_calls"] += 1
            picks = self.sample_tokens(logits, self.staging.put("sampling", params)).numpy().reshape(-1)
            return [int(picks[i]) if want else None for i, want in enumerate(wanted)]
        counts["host_sample_calls"] += 1
        host = logits.numpy().reshape(rows, -1)
        return [sample_host(host[i], seq.sampling, seq.rng) if want else None
                for i, (seq, want) in enumerate(zip(seqs, wanted))]


BISECTIONS = 40  # halvings of a threshold's interval: below float32's spacing for logits and probabilities


def sample_kernel(vocab: int, gpu: bool):
    """The PrimFunc ``(logits [n, vocab] float32, params [n, 4] float32) -> tokens [n] int32`` that chooses a
    token per row on the device. ``params`` holds each row's (temperature, top_k, top_p, uniform): a
    temperature of 0 is greedy (the first maximum, as numpy's argmax); else the row's logits divided by the
    temperature, kept to the ``top_k`` largest (0: all) and to the smallest set of the most likely tokens whose
    probability reaches ``top_p``, then the token at ``uniform`` (in [0, 1)) of their cumulative distribution in
    vocabulary order, as numpy's ``Generator.choice`` picks. No sort: each threshold is found by bisection
    (the k-th largest logit by counting, top-p's probability by summing). On a GPU each row is one thread
    block (blockIdx.x); its work is serial within the block for now."""
    from tvm.script import tirx as T

    @T.macro
    def row(logits, params, out, s, r):
        # s: 0 max, 1 lo, 2 hi, 3 mid, 4 count or mass, 5 total, 6 threshold on logits, 7 threshold on weights,
        # 8 running sum, 9 target
        s[0] = logits[r, 0]
        out[r] = 0
        for j in range(vocab):
            if logits[r, j] > s[0]:
                s[0] = logits[r, j]
                out[r] = T.Cast("int32", j)
        if params[r, 0] > T.float32(0):
            # top-k: the largest threshold that keeps at least k logits (all where k is 0 or the vocabulary)
            s[6] = T.min_value("float32")
            if params[r, 1] >= T.float32(1) and params[r, 1] < T.float32(vocab):
                s[1] = s[0]
                for j in range(vocab):
                    s[1] = T.min(s[1], logits[r, j])
                s[2] = s[0]
                for _ in range(BISECTIONS):
                    s[3] = (s[1] + s[2]) * T.float32(0.5)
                    s[4] = T.float32(0)
                    for j in range(vocab):
                        s[4] = s[4] + T.Select(logits[r, j] >= s[3], T.float32(1), T.float32(0))
                    if s[4] >= params[r, 1]:
                        s[1] = s[3]
                    else:
                        s[2] = s[3]
                s[6] = s[1]
            # weights exp((l - max) / temperature) of the kept logits; their total
            s[5] = T.float32(0)
            for j in range(vocab):
                s[5] = s[5] + T.Select(logits[r, j] >= s[6], T.exp((logits[r, j] - s[0]) / params[r, 0]), T.float32(0))
            # top-p: the largest weight threshold whose kept mass still reaches top_p of the total
            s[7] = T.float32(0)
            if params[r, 2] < T.float32(1):
                s[1] = T.float32(0)
                s[2] = T.float32(1)
                s[9] = params[r, 2] * s[5]
                for _ in range(BISECTIONS):
                    s[3] = (s[1] + s[2]) * T.float32(0.5)
                    s[4] = T.float32(0)
                    for j in range(vocab):
                        s[4] = s[4] + T.Select(
                            logits[r, j] >= s[6],
                            T.Select(T.exp((logits[r, j] - s[0]) / params[r, 0]) >= s[3],
                                     T.exp((logits[r, j] - s[0]) / params[r, 0]), T.float32(0)),
                            T.float32(0))
                    if s[4] >= s[9]:
                        s[1] = s[3]
                    else:
                        s[2] = s[3]
                s[7] = s[1]
                s[5] = T.float32(0)
                for j in range(vocab):
                    s[5] = s[5] + T.Select(
                        logits[r, j] >= s[6],
                        T.Select(T.exp((logits[r, j] - s[0]) / params[r, 0]) >= s[7],
                                 T.exp((logits[r, j] - s[0]) / params[r, 0]), T.float32(0)),
                        T.float32(0))
            # the first token whose cumulative weight passes uniform x total (the maximum if rounding runs out)
            s[9] = params[r, 3] * s[5]
            s[8] = T.float32(0)
            s[4] = T.float32(0)  # found
            for j in range(vocab):
                if s[4] == T.float32(0) and logits[r, j] >= s[6]:
                    if T.exp((logits[r, j] - s[0]) / params[r, 0]) >= s[7]:
                        s[8] = s[8] + T.exp((logits[r, j] - s[0]) / params[r, 0])
                        if s[8] > s[9]:
                            out[r] = T.Cast("int32", j)
                            s[4] = T.float32(1)

    if gpu:
        @T.prim_func(private=True)
        def sample_tokens(var_logits: T.handle, var_params: T.handle, var_out: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            n = T.int64()
            logits = T.match_buffer(var_logits, (n, vocab), "float32")
            params = T.match_buffer(var_params, (n, 4), "float32")
            out = T.match_buffer(var_out, (n,), "int32")
            for r in T.thread_binding(n, thread="blockIdx.x"):
                for _t in T.thread_binding(1, thread="threadIdx.x"):
                    s = T.alloc_buffer((10,), "float32", scope="local")
                    row(logits, params, out, s, r)
    else:
        @T.prim_func(private=True)
        def sample_tokens(var_logits: T.handle, var_params: T.handle, var_out: T.handle):
            T.func_attr({"tirx.noalias": True})
            n = T.int64()
            logits = T.match_buffer(var_logits, (n, vocab), "float32")
            params = T.match_buffer(var_params, (n, 4), "float32")
            out = T.match_buffer(var_out, (n,), "int32")
            for r in T.parallel(n):
                s = T.alloc_buffer((10,), "float32")
                row(logits, params, out, s, r)
    return sample_tokens.with_attr("op_pattern", 8)
