"""Choosing each sequence's next token from a step's logits.

Greedy choice on the device (``greedy_tokens``): each row's first index of its largest logit (numpy's
``argmax``), so that a greedy step reads back one token per sequence instead of the whole [sequences,
vocabulary] logits. Sampling (temperature, top-k, top-p) on the device too (``sample_tokens``), from one
uniform number a row drawn on the host from the request's own seeded stream; on the host from the logits
(:func:`sample_host`) for an artifact built without it.

A request's penalties, logit bias and log-probabilities are applied on the device too
(:mod:`.logit_rules`); min_p, and every rule where those kernels cannot be compiled, on the host from the
logits read back (:func:`choose_on_host`).

Both kernels are one kernel over a symbolic number of rows. On a GPU each row is one CTA whose threads scan
the vocabulary side by side and meet in block-wide reductions (TVM's default schedules give a reduction of
symbolic rows one thread per row, which walks the whole vocabulary alone).
"""

from __future__ import annotations

from autosched.tvm_adapter import tensor_view

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
    min-p, top-k and top-p (in that order, as vLLM applies them): what a sampled token is drawn from.
    ``sampling`` must not be greedy."""
    import numpy as np

    scores = logits.astype(np.float64) / sampling.temperature
    if sampling.min_p:
        # p >= min_p * p_max, in logits: score >= max + log(min_p)
        scores = np.where(scores >= scores.max() + np.log(sampling.min_p), scores, -np.inf)
    if sampling.top_k:
        cut = np.partition(scores, -sampling.top_k)[-sampling.top_k]
        scores = np.where(scores >= cut, scores, -np.inf)
    probs = np.exp(scores - scores.max())
    probs /= probs.sum()
    if sampling.top_p < 1:
        order = np.argsort(-probs, kind="stable")
        keep = np.cumsum(probs[order]) - probs[order] < sampling.top_p  # the smallest prefix reaching top_p
        mask = np.zeros_like(probs, dtype=bool)
        mask[order[keep]] = True
        probs = np.where(mask, probs, 0.0)
        probs /= probs.sum()
    return probs


def sample_host(logits, sampling, rng) -> int:
    """One token from one row of logits (numpy) as ``sampling`` asks, drawing from ``rng`` (numpy's Generator)."""
    import numpy as np

    if sampling.greedy:
        return int(np.argmax(logits))
    probs = distribution(logits, sampling)
    return int(rng.choice(len(probs), p=probs))


def processed_logits(logits, seq, allowed=None):
    """One row of logits (float64) after the request's grammar (-inf for the tokens it does not allow next:
    ``allowed``, a bool array, or the sequence's grammar state's), logit bias and repetition, frequency and
    presence penalties (:class:`~.request.Sampling`), given the sequence's tokens so far."""
    import numpy as np

    sp = seq.sampling
    scores = logits.astype(np.float64)
    if seq.grammar is not None:
        if allowed is None:
            allowed = seq.grammar.allowed()
        scores[:allowed.size][~allowed] = -np.inf
    if sp.logit_bias:
        tokens = np.asarray([t for t, _ in sp.logit_bias if t < scores.size], dtype=np.int64)
        np.add.at(scores, tokens, [b for t, b in sp.logit_bias if t < scores.size])
    if sp.repetition_penalty != 1:
        seen = np.unique(np.asarray(seq.context, dtype=np.int64))
        values = scores[seen]
        scores[seen] = np.where(values > 0, values / sp.repetition_penalty, values * sp.repetition_penalty)
    if sp.frequency_penalty or sp.presence_penalty:
        counts = np.bincount(np.asarray(seq.completion.tokens, dtype=np.int64), minlength=scores.size)[:scores.size]
        scores -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0)
    return scores


def token_logprob(logits, token: int, top: int):
    """The log-probability of ``token`` under one row of logits, and the ``top`` most likely tokens' (by value,
    then by the smaller id), in float64."""
    import numpy as np

    from .request import TokenLogprob

    scores = logits.astype(np.float64)
    shifted = scores - scores.max()
    logprobs = shifted - np.log(np.exp(shifted).sum())
    best = np.lexsort((np.arange(scores.size), -logprobs))[:top] if top else []
    return TokenLogprob(float(logprobs[token]), tuple((int(t), float(logprobs[t])) for t in best))


class Sampler:
    """Tokens for the rows of a step, chosen on the device where the model runs: ``greedy_tokens`` where every
    row is greedy, ``sample_tokens`` otherwise (each sampled row draws one uniform number from its request's
    seeded stream on the host); one int a row comes back, not the logits. An artifact built before
    ``sample_tokens`` samples on the host from the logits. ``masks``: a function that sets the logits of the
    tokens a row's grammar does not allow to -inf on the device (:func:`~.grammar.device_mask`); without it
    rows under a grammar are masked and chosen on the host."""

    def __init__(self, greedy_tokens=None, sample_tokens=None, device=None, staging=None):
        from .model import Staging

        self.greedy_tokens, self.sample_tokens, self.device = greedy_tokens, sample_tokens, device
        self.staging = staging or Staging(device)  # where the sampling parameters go on the device
        self.masks = None
        self.rules = None  # penalties, bias and log-probabilities on the device (:class:`~.logit_rules.DeviceRules`)

    def on_host(self, seq) -> bool:
        """Whether ``seq``'s token is chosen on the host from its logits: a grammar without :attr:`masks`, or
        rules (:attr:`~.request.Sampling.needs_logits`) that :attr:`rules` does not apply (min_p; all of them
        where its kernels are not there)."""
        sp = seq.sampling
        if seq.grammar is not None and self.masks is None:
            return True
        return not sp.speculates and not (self.rules is not None and self.rules.applies(sp) and self.rules.ready())

    def on_device(self, seqs: list) -> str:
        """Where a step's tokens are chosen: ``greedy`` (every row greedy, on the device), ``sample`` (on the
        device) or ``host`` (an artifact built before ``sample_tokens``). Rows that need their logits
        (:meth:`on_host`) are chosen on the host whatever this says, the others the same way whether such rows
        share their step or not."""
        plain = [seq for seq in seqs if not self.on_host(seq)]
        if self.greedy_tokens is not None and all(seq.sampling.greedy for seq in plain):
            return "greedy"
        return "sample" if self.sample_tokens is not None else "host"

    def stage(self, rows: int, seqs: list, wanted: list[bool]):
        """The sampling parameters of a step on the device (None where the step does not sample on the device),
        each sampled row's uniform number drawn now. Call it before the step's model call: a copy to the device
        waits for the work queued before it, so made after the call it would wait for the whole step before
        the sampling kernel could be launched."""
        import numpy as np

        if not any(wanted) or self.on_device(seqs) != "sample":
            return None
        params = np.zeros((rows, 4), dtype="float32")  # padding, unwanted and host rows: greedy
        for i, (seq, want) in enumerate(zip(seqs, wanted)):
            sp = seq.sampling
            if want and not sp.greedy and not self.on_host(seq):
                params[i] = (sp.temperature, sp.top_k, sp.top_p, seq.rng.random())
        return self.staging.put("sampling", params)

    def mask(self, logits, rows: int, seqs: list, wanted: list[bool]) -> None:
        """Set the logits of the tokens the grammars of ``seqs`` (those ``wanted`` and not on the host) do not
        allow to -inf, on the device, in place (the tokens allowed found on the host meanwhile)."""
        import numpy as np

        masked = [i for i, (seq, want) in enumerate(zip(seqs, wanted))
                  if want and seq.grammar is not None and not self.on_host(seq)]
        if not masked:
            return
        bitmask = np.full((rows, seqs[masked[0]].grammar.grammars.words), -1, dtype=np.int32)  # others: all allowed
        for i in masked:
            if not seqs[i].grammar.terminated:  # (one that ended in a step launched ahead: its token is not kept)
                seqs[i].grammar.fill(bitmask, i)
        width = int(np.prod(logits.shape)) // rows  # a prefill's logits are [1, rows, vocab]
        # queued behind the step (the mask is found while it runs): the host does not wait for the step here
        self.masks(tensor_view(logits, (rows, width)), self.staging.put("bitmask", bitmask, wait=False))

    def choose(self, logits, rows: int, seqs: list, wanted: list[bool], counts: dict,
               staged=None) -> list[int | None]:
        """A token for each of ``seqs`` that is ``wanted`` (None for the others), from the first rows of
        ``logits`` (a device tensor of ``rows`` rows, padding rows last). A request's random stream is drawn
        from only when it samples; ``staged``: :meth:`stage`'s parameters for this step (staged here if None).
        Rows that need their logits on the host (:meth:`on_host`) read them back (every row's, once) and are
        chosen by :func:`choose_on_host`. The tokens a grammar allows are found first, while the step may still
        run on the device, and masked there (:meth:`mask`) or on the host; then penalties and bias are applied
        on the device (:attr:`rules`), and log-probabilities found there from a copy of the logits taken first."""
        import numpy as np

        where = self.on_device(seqs)
        on_host = [want and (where == "host" or self.on_host(seq)) for seq, want in zip(seqs, wanted)]
        ruled = [i for i, (seq, want, here) in enumerate(zip(seqs, wanted, on_host))
                 if want and not here and not seq.sampling.speculates]  # rows whose rules the device applies
        logprob_rows = [i for i in ruled if seqs[i].sampling.logprobs is not None]
        raw = None
        if where != "host":
            if ruled:
                view = tensor_view(logits, (rows, int(np.prod(logits.shape)) // rows))
                raw = self.rules.keep_raw(view, rows) if logprob_rows else None  # before any rule
            self.mask(logits, rows, seqs, [want and not here for want, here in zip(wanted, on_host)])
            if ruled:
                self.rules.apply(view, ruled, [seqs[i] for i in ruled])
        allowed = [seq.grammar.allowed() if here and seq.grammar is not None else None
                   for seq, here in zip(seqs, on_host)]
        if where == "greedy":
            counts["device_greedy_calls"] += 1
            picks = self.greedy_tokens(logits).numpy().reshape(-1)
        elif where == "sample":
            counts["device_sample_calls"] += 1
            params = staged if staged is not None else self.stage(rows, seqs, wanted)
            picks = self.sample_tokens(logits, params).numpy().reshape(-1)
        else:
            picks = None
        if raw is not None:
            self.rules.logprobs(raw, picks, logprob_rows, [seqs[i] for i in logprob_rows])
        host = None
        if any(on_host):
            counts["host_sample_calls"] += 1
            host = logits.numpy().reshape(rows, -1)
        return [choose_on_host(host[i], seq, allowed[i]) if here else int(picks[i]) if want else None
                for i, (seq, want, here) in enumerate(zip(seqs, wanted, on_host))]


def choose_on_host(logits, seq, allowed=None) -> int:
    """The token of one row of logits (numpy) for ``seq``, its request's every rule applied (``allowed``: the
    tokens its grammar allows, where found already), drawing from its random stream when it samples; its
    log-probabilities kept for :meth:`~.request.SequenceState.accept`."""
    import numpy as np

    sp = seq.sampling
    scores = processed_logits(logits, seq, allowed) if sp.needs_logits else logits
    if sp.greedy:
        token = int(np.argmax(scores))
    else:
        probs = distribution(scores, sp)
        token = int(seq.rng.choice(len(probs), p=probs))
    if sp.logprobs is not None:
        seq.next_logprob = token_logprob(logits, token, sp.logprobs)
    return token


BISECTIONS = 40  # halvings of a threshold's interval: below float32's spacing for logits and probabilities
FULL_WARP = 0xFFFFFFFF  # every lane of a warp takes part in its shuffles
# A sampled row's CTA: one of 1024 caps a thread at 64 registers, fewer than the sampling passes take
# without spilling at some vocabulary sizes (nvcc unrolls them as far as their trip count allows).
SAMPLE_THREADS = 512


def row_reductions(gpu: bool, width: int, vocab: int):
    """TVMScript macros over one row of ``vocab`` logits by a CTA of ``width`` threads on a GPU (on the CPU one
    thread a row, where they do nothing): ``block_allreduce``, ``block_bounds`` (a sum, minimum and maximum
    through the same two barriers), ``block_first_max`` (the largest value at its smallest index) and
    ``block_exclusive_scan``: warp shuffles, then one value a warp through shared memory, after which every
    thread holds the same result."""
    from types import SimpleNamespace

    from tvm.script import tirx as T

    warps = width // 32

    def shuffle_xor(value, k):  # the value of the lane whose index differs in bit k
        return T.tvm_warp_shuffle_xor(T.uint32(FULL_WARP), value, T.shift_left(1, k), 32, 32)

    def shuffle_up(value, offset):  # the value of the lane ``offset`` lanes lower (its own in the lowest lanes)
        return T.tvm_warp_shuffle_up(T.uint32(FULL_WARP), value, offset, 32, 32)

    @T.macro
    def warp_allreduce(value, combine):
        # a butterfly: every lane ends with the same value, combine being commutative
        for k in T.unroll(5):
            value[0] = combine(value[0], shuffle_xor(value[0], k))

    @T.macro
    def block_allreduce(value, scratch, t, combine, identity):
        if gpu:
            warp_allreduce(value, combine)
            if t % 32 == 0:
                scratch[t // 32] = value[0]
            T.tvm_storage_sync("shared")
            value[0] = T.if_then_else(t % 32 < warps, scratch[t % 32], identity)
            warp_allreduce(value, combine)
            T.tvm_storage_sync("shared")  # scratch is free for the next reduction

    @T.macro
    def block_bounds(total, least, most, scratch_total, scratch_least, scratch_most, t):
        # a bisection step's sum, minimum and maximum, through the same two barriers
        if gpu:
            warp_allreduce(total, T.Add)
            warp_allreduce(least, T.min)
            warp_allreduce(most, T.max)
            if t % 32 == 0:
                scratch_total[t // 32] = total[0]
                scratch_least[t // 32] = least[0]
                scratch_most[t // 32] = most[0]
            T.tvm_storage_sync("shared")
            total[0] = T.if_then_else(t % 32 < warps, scratch_total[t % 32], T.float32(0))
            least[0] = T.if_then_else(t % 32 < warps, scratch_least[t % 32], T.float32("inf"))
            most[0] = T.if_then_else(t % 32 < warps, scratch_most[t % 32], T.float32("-inf"))
            warp_allreduce(total, T.Add)
            warp_allreduce(least, T.min)
            warp_allreduce(most, T.max)
            T.tvm_storage_sync("shared")

    @T.macro
    def warp_first_max(value, index):
        for k in T.unroll(5):
            other_value = shuffle_xor(value[0], k)
            other_index = shuffle_xor(index[0], k)
            if other_value > value[0] or (other_value == value[0] and other_index < index[0]):
                value[0] = other_value
                index[0] = other_index

    @T.macro
    def block_first_max(value, index, scratch_value, scratch_index, t):
        # the largest value at its smallest index: the row's first maximum, in every thread
        if gpu:
            warp_first_max(value, index)
            if t % 32 == 0:
                scratch_value[t // 32] = value[0]
                scratch_index[t // 32] = index[0]
            T.tvm_storage_sync("shared")
            value[0] = T.if_then_else(t % 32 < warps, scratch_value[t % 32], T.float32("-inf"))
            index[0] = T.if_then_else(t % 32 < warps, scratch_index[t % 32], vocab)
            warp_first_max(value, index)
            T.tvm_storage_sync("shared")

    @T.macro
    def warp_inclusive_scan(value, lane):
        for k in T.unroll(5):
            before = shuffle_up(value[0], T.shift_left(1, k))
            value[0] = value[0] + T.Select(lane >= T.shift_left(1, k), before, T.float32(0))

    @T.macro
    def block_exclusive_scan(value, total, scratch, t):
        # value: this thread's, then the sum of the values of the threads before it; total: the sum of all
        if gpu:
            lane = t % 32
            warp_inclusive_scan(value, lane)
            if lane == 31:
                scratch[t // 32] = value[0]
            lower = shuffle_up(value[0], 1)
            value[0] = T.Select(lane > 0, lower, T.float32(0))  # exclusive within the warp
            T.tvm_storage_sync("shared")
            total[0] = T.if_then_else(lane < warps, scratch[lane], T.float32(0))
            warp_inclusive_scan(total, lane)  # every warp scans the warps' sums alike
            warp_start = T.tvm_warp_shuffle(T.uint32(FULL_WARP), total[0], T.max(t // 32 - 1, 0), 32, 32)
            value[0] = value[0] + T.Select(t >= 32, warp_start, T.float32(0))
            total[0] = T.tvm_warp_shuffle(T.uint32(FULL_WARP), total[0], warps - 1, 32, 32)
            T.tvm_storage_sync("shared")
        else:
            total[0] = value[0]
            value[0] = T.float32(0)

    return SimpleNamespace(block_allreduce=block_allreduce, block_bounds=block_bounds, block_first_max=block_first_max,
                           block_exclusive_scan=block_exclusive_scan)


def sample_kernel(vocab: int, gpu: bool):
    """The PrimFunc ``(logits [n, vocab] float32, params [n, 4] float32) -> tokens [n] int32`` that chooses a
    token per row on the device. ``params`` holds each row's (temperature, top_k, top_p, uniform): a
    temperature of 0 is greedy (the first maximum, as numpy's argmax); else the row's logits divided by the
    temperature, kept to the ``top_k`` largest (0: all) and to the smallest set of the most likely tokens whose
    probability reaches ``top_p``, then the token at ``uniform`` (in [0, 1)) of their cumulative distribution in
    vocabulary order, as numpy's ``Generator.choice`` picks. No sort: each threshold is found by bisection
    (the k-th largest logit by counting, top-p's probability by summing), ``BISECTIONS`` halvings at most: they
    stop once no later halving could change which tokens the threshold keeps, so the tokens are those of
    every halving done.

    On a GPU each row is one CTA of ``SAMPLE_THREADS`` threads. Every pass over the vocabulary is a strided
    loop per thread and a block-wide reduction (warp shuffles, then one value a warp through shared memory)
    after which every thread holds the same maximum, count or sum, so all take the same bisection decisions.
    The pick: each thread sums a contiguous slice of the vocabulary, an exclusive scan of the slice sums says
    where each slice's cumulative weight starts, each thread walks its own slice, and the first token found
    wins. Sums are float32 in another order than the host's float64, so a uniform or top_p within rounding of
    a cumulative probability may fall on the other side. On the CPU the same code runs with one thread a row
    (reductions and scan are then nothing)."""
    from tvm.script import tirx as T

    width = SAMPLE_THREADS if gpu else 1  # threads a row
    share = (vocab + width - 1) // width  # tokens a thread: strided in the passes, contiguous in the pick
    scope = "local" if gpu else "global"

    def weight(logits, params, top, r, j):  # exp((logit - max) / temperature): the largest weight is 1
        return T.exp((logits[r, j] - top[0]) / params[r, 0])

    def kept(logits, params, top, cut_logit, cut_weight, r, j):  # the weight of a token both cuts keep, else 0
        w = weight(logits, params, top, r, j)
        return T.Select(logits[r, j] >= cut_logit[0], T.Select(w >= cut_weight[0], w, T.float32(0)), T.float32(0))

    ops = row_reductions(gpu, width, vocab)
    block_allreduce, block_bounds, block_first_max = ops.block_allreduce, ops.block_bounds, ops.block_first_max
    block_exclusive_scan = ops.block_exclusive_scan

    @T.macro
    def row(logits, params, out, r, t, scratch_value, scratch_least, scratch_most, scratch_index):
        top = T.alloc_buffer((1,), "float32", scope=scope)  # the largest logit
        best = T.alloc_buffer((1,), "int32", scope=scope)  # its first index, then the chosen token
        lo = T.alloc_buffer((1,), "float32", scope=scope)
        hi = T.alloc_buffer((1,), "float32", scope=scope)
        mid = T.alloc_buffer((1,), "float32", scope=scope)
        acc = T.alloc_buffer((1,), "float32", scope=scope)  # a count, a mass, a running sum
        total = T.alloc_buffer((1,), "float32", scope=scope)
        goal = T.alloc_buffer((1,), "float32", scope=scope)  # the mass top-p must reach, the pick's target
        # A bisection's bounds: the smallest value lo keeps (-inf until lo moves) and the largest one hi cuts
        # (inf until hi moves). Where they are equal, that value alone lies between lo and hi: it is the last
        # one kept, so no later halving changes which tokens the threshold keeps, and the halvings stop. They
        # stop too where the midpoint rounds to lo: every later halving would keep lo as it is.
        least_kept = T.alloc_buffer((1,), "float32", scope=scope)
        most_cut = T.alloc_buffer((1,), "float32", scope=scope)
        count_lo = T.alloc_buffer((1,), "float32", scope=scope)  # how many logits lo keeps
        least = T.alloc_buffer((1,), "float32", scope=scope)
        most = T.alloc_buffer((1,), "float32", scope=scope)
        cut_logit = T.alloc_buffer((1,), "float32", scope=scope)
        cut_weight = T.alloc_buffer((1,), "float32", scope=scope)
        found = T.alloc_buffer((1,), "int32", scope=scope)
        top[0] = T.float32("-inf")
        best[0] = vocab  # none yet
        for i in range(share):
            if i * width + t < vocab:
                if logits[r, i * width + t] > top[0] or best[0] == vocab:
                    top[0] = logits[r, i * width + t]
                    best[0] = i * width + t
        block_first_max(top, best, scratch_value, scratch_index, t)
        if params[r, 0] > T.float32(0):
            # top-k: the largest threshold that keeps at least k logits (all where k is 0 or the vocabulary)
            cut_logit[0] = T.min_value("float32")
            if params[r, 1] >= T.float32(1) and params[r, 1] < T.float32(vocab):
                lo[0] = top[0]
                for i in range(share):
                    if i * width + t < vocab:
                        lo[0] = T.min(lo[0], logits[r, i * width + t])
                block_allreduce(lo, scratch_value, t, T.min, T.float32("inf"))
                hi[0] = top[0]
                least_kept[0] = T.float32("-inf")
                most_cut[0] = T.float32("inf")
                count_lo[0] = T.float32(vocab)
                for _ in range(BISECTIONS):
                    # they stop too once lo keeps exactly k: a larger threshold keeping k or more keeps those k
                    if (least_kept[0] != most_cut[0] and count_lo[0] != params[r, 1]
                            and (lo[0] + hi[0]) * T.float32(0.5) != lo[0]):
                        mid[0] = (lo[0] + hi[0]) * T.float32(0.5)
                        acc[0] = T.float32(0)
                        least[0] = T.float32("inf")
                        most[0] = T.float32("-inf")
                        for i in range(share):
                            if i * width + t < vocab:
                                logit = logits[r, i * width + t]
                                acc[0] = acc[0] + T.Select(logit >= mid[0], T.float32(1), T.float32(0))
                                least[0] = T.min(least[0], T.Select(logit >= mid[0], logit, T.float32("inf")))
                                most[0] = T.max(most[0], T.Select(logit < mid[0], logit, T.float32("-inf")))
                        block_bounds(acc, least, most, scratch_value, scratch_least, scratch_most, t)
                        if acc[0] >= params[r, 1]:
                            lo[0] = mid[0]
                            least_kept[0] = least[0]
                            count_lo[0] = acc[0]
                        else:
                            hi[0] = mid[0]
                            most_cut[0] = most[0]
                cut_logit[0] = lo[0]
            # top-p: the largest weight threshold whose kept mass still reaches top_p of the kept total
            cut_weight[0] = T.float32(0)
            if params[r, 2] < T.float32(1):
                acc[0] = T.float32(0)
                for i in range(share):
                    if i * width + t < vocab:
                        acc[0] = acc[0] + kept(logits, params, top, cut_logit, cut_weight, r, i * width + t)
                block_allreduce(acc, scratch_value, t, T.Add, T.float32(0))
                goal[0] = params[r, 2] * acc[0]
                lo[0] = T.float32(0)
                hi[0] = T.float32(1)
                least_kept[0] = T.float32("-inf")
                most_cut[0] = T.float32("inf")
                for _ in range(BISECTIONS):
                    if least_kept[0] != most_cut[0] and (lo[0] + hi[0]) * T.float32(0.5) != lo[0]:
                        mid[0] = (lo[0] + hi[0]) * T.float32(0.5)
                        acc[0] = T.float32(0)
                        least[0] = T.float32("inf")
                        most[0] = T.float32("-inf")
                        for i in range(share):
                            if i * width + t < vocab:
                                if logits[r, i * width + t] >= cut_logit[0]:  # a token top-k keeps
                                    w = weight(logits, params, top, r, i * width + t)
                                    acc[0] = acc[0] + T.Select(w >= mid[0], w, T.float32(0))
                                    least[0] = T.min(least[0], T.Select(w >= mid[0], w, T.float32("inf")))
                                    most[0] = T.max(most[0], T.Select(w < mid[0], w, T.float32("-inf")))
                        block_bounds(acc, least, most, scratch_value, scratch_least, scratch_most, t)
                        if acc[0] >= goal[0]:
                            lo[0] = mid[0]
                            least_kept[0] = least[0]
                        else:
                            hi[0] = mid[0]
                            most_cut[0] = most[0]
                cut_weight[0] = lo[0]
            # the first token whose cumulative weight passes uniform x total (the maximum if rounding runs out)
            acc[0] = T.float32(0)
            for i in range(share):
                if t * share + i < vocab:
                    acc[0] = acc[0] + kept(logits, params, top, cut_logit, cut_weight, r, t * share + i)
            block_exclusive_scan(acc, total, scratch_value, t)
            goal[0] = params[r, 3] * total[0]
            found[0] = vocab
            for i in range(share):
                if t * share + i < vocab and found[0] == vocab:
                    acc[0] = acc[0] + kept(logits, params, top, cut_logit, cut_weight, r, t * share + i)
                    if acc[0] > goal[0]:
                        found[0] = t * share + i
            block_allreduce(found, scratch_index, t, T.min, vocab)
            if found[0] < vocab:
                best[0] = found[0]
        if t == 0:
            out[r] = best[0]

    if gpu:
        @T.prim_func(private=True)
        def sample_tokens(var_logits: T.handle, var_params: T.handle, var_out: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            n = T.int64()
            logits = T.match_buffer(var_logits, (n, vocab), "float32")
            params = T.match_buffer(var_params, (n, 4), "float32")
            out = T.match_buffer(var_out, (n,), "int32")
            for r in T.thread_binding(n, thread="blockIdx.x"):
                for t in T.thread_binding(SAMPLE_THREADS, thread="threadIdx.x"):
                    # __launch_bounds__'s minimum of one CTA an SM: without it nvcc caps the registers for four,
                    # and spills
                    T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", 1)
                    scratch_value = T.alloc_buffer((32,), "float32", scope="shared")  # a value a warp
                    scratch_least = T.alloc_buffer((32,), "float32", scope="shared")
                    scratch_most = T.alloc_buffer((32,), "float32", scope="shared")
                    scratch_index = T.alloc_buffer((32,), "int32", scope="shared")
                    row(logits, params, out, r, t, scratch_value, scratch_least, scratch_most, scratch_index)
    else:
        @T.prim_func(private=True)
        def sample_tokens(var_logits: T.handle, var_params: T.handle, var_out: T.handle):
            T.func_attr({"tirx.noalias": True})
            n = T.int64()
            logits = T.match_buffer(var_logits, (n, vocab), "float32")
            params = T.match_buffer(var_params, (n, 4), "float32")
            out = T.match_buffer(var_out, (n,), "int32")
            for r in T.parallel(n):
                row(logits, params, out, r, 0, None, None, None, None)
    return sample_tokens.with_attr("op_pattern", 8)
