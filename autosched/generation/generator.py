"""Generating text from a generation artifact, with TVM's runtime and numpy alone.

The KV cache is TVM's paged one (``vm.builtin.paged_attention_kv_cache_create``, made by the artifact's
``create_paged_kv_cache``): sequences are added, forked (children share the parent's pages, nothing is
copied) and removed through the runtime's ``vm.builtin.kv_state_*`` functions. Each :meth:`Generator.step`
prefills the sequences added since the last step (their prompts packed into one call) and decodes one token
for every sequence that was already decoding (one call for the whole batch): continuous batching in its
simplest form. A step whose sequences all decode greedily chooses their tokens on the device and reads
back one token per sequence; sampling runs on the host from the step's logits.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from autosched.errors import AutoschedError, UsageError

from .build import FORMAT, MANIFEST

# Sequence ids of the padding rows (see Generator._padding), far from those of requests (0, 1, 2, ...).
PAD_SEQUENCE_IDS = 1 << 40


class GenerationError(AutoschedError):
    """A request the generator cannot serve (bad input or a limit of the artifact); other sequences go on."""

    exit_code = 2


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: greedy when ``temperature`` is 0, else sampled from the logits divided
    by ``temperature``, kept to the ``top_k`` most likely (0: all) and to the smallest set whose probability
    reaches ``top_p``. ``seed`` makes a request's samples reproducible whatever else is in its batch."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        for wrong, what in ((self.temperature < 0, f"temperature must be 0 (greedy) or more, got {self.temperature}"),
                            (self.top_k < 0, f"top_k must be 0 (no limit) or more, got {self.top_k}"),
                            (not 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")):
            if wrong:
                raise UsageError(what)
        if self.temperature == 0 and (self.top_k or self.top_p < 1):
            raise UsageError(f"top_k {self.top_k} and top_p {self.top_p:g} choose among tokens to sample, and temperature "
                             "0 is greedy (no sampling): give a temperature above 0 (e.g. --temperature 0.8), or leave "
                             "top_k and top_p out")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise UsageError(f"seed must be a whole number, 0 or more (got {self.seed})")


@dataclass
class Completion:
    """What one request produced: the new tokens and why it stopped (``length``: max_new_tokens reached;
    ``stop``: a stop token; ``max_seq_len``: the artifact's longest sequence; ``error``: see ``error``)."""

    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class _Sequence:
    seq_id: int
    pending: list[int]  # tokens not yet in the cache: the prompt (or a fork's suffix), then the last sample
    length: int  # tokens in the cache
    max_new_tokens: int
    stop_tokens: frozenset
    sampling: Sampling
    rng: object
    completion: Completion
    prefilled: bool = False
    cached: list[int] = field(default_factory=list)  # the tokens in the cache (for a re-read: see Generator.step)


class Generator:
    """A loaded generation artifact (``autosched build MODEL --generate``) and its KV cache.

    ``generate(prompts, ...)`` serves a list of token-id prompts, ``stream(...)`` yields tokens as they come,
    and ``add``/``step``/``remove`` drive sequences one step at a time (new requests join between steps).
    ``kv_pages``: pages in the cache (default: room for ``max_batch`` sequences of ``max_seq_len`` tokens).
    """

    def __init__(self, artifact_dir: str | Path, kv_pages: int | None = None):
        from tvm import relax

        from autosched.pipeline.artifact import artifact_device, load_library, load_params

        if kv_pages is not None:
            check_kv_pages(kv_pages)
        rebuild = "rebuild the artifact with `autosched build MODEL --generate`"
        path = Path(artifact_dir)
        manifest = read_generation_manifest(path)
        device = artifact_device(manifest, path)
        library, params = path / manifest["library"], path / manifest["params"]
        for needed in (library, params):
            if not needed.exists():
                raise UsageError(f"{needed} is missing: {rebuild}")
        module = relax.VirtualMachine(load_library(library, rebuild), device)
        saved = load_params(params, rebuild)
        missing = [name for name in manifest["param_order"] if name not in saved]
        if missing:
            raise UsageError(f"{params} lacks {len(missing)} of the {len(manifest['param_order'])} parameters "
                             f"{MANIFEST} names (a truncated file?): {rebuild}")
        self._start(module, [saved[name].copyto(device) for name in manifest["param_order"]], manifest, device, kv_pages)

    @classmethod
    def in_memory(cls, executable, params: list, manifest: dict, device, kv_pages: int | None = None) -> Generator:
        """A generator over a build that was never written (``compile_generation``'s executable, the
        parameters as TVM tensors on ``device``, ``generation_manifest``'s manifest): for benchmarks."""
        from tvm import relax

        gen = cls.__new__(cls)
        gen._start(relax.VirtualMachine(executable, device), params, manifest, device, kv_pages)
        return gen

    def _start(self, vm, params: list, manifest: dict, device, kv_pages: int | None) -> None:
        import tvm

        from autosched.target import use_all_cpu_threads
        from autosched.tvm_adapter import kv_cache_runtime

        if kv_pages is not None:
            check_kv_pages(kv_pages)
        if manifest["target"]["kind"] == "llvm":
            use_all_cpu_threads()  # as the kernels were tuned and timed; before the first kernel runs
        self.manifest, self.vm, self.params, self.device = manifest, vm, params, device
        m = manifest
        self.vocab = m["decoder"]["vocab"]
        self.max_seq_len, self.max_batch, self.page_size = m["max_seq_len"], m["max_batch"], m["page_size"]
        self.eos_token_ids = frozenset(m.get("eos_token_ids", []))
        self.decode_batches = frozenset(m.get("decode_batches", []))
        # Phi-3's longrope: transformers re-reads a sequence with the long factors when it grows past the
        # original context (Phi3ForCausalLM.prepare_inputs_for_generation drops the cache then); so does step().
        scaling = m["decoder"].get("rope_scaling") or {}
        self.rope_switch = scaling.get("original_max_position_embeddings") if scaling.get("rope_type") == "longrope" else None
        # A model with a sliding window: each sequence's cache keeps the window - 1 tokens before the newest (TVM's
        # sliding window; pages that leave it are freed). A call's tokens see all of those, and each other
        # causally: exact for a sequence's first window of tokens at once, then one token a call (see step()).
        self.window = m["decoder"].get("sliding_window") or 0
        self.prefill_chunks = tuple(m.get("prefill_chunks", []))
        pages_per_seq = -(-self.max_seq_len // self.page_size)
        self.kv_pages = kv_pages or pages_per_seq * self.max_batch
        shape = tvm.runtime.ShapeTuple
        # Room for the padding rows of a decode step (see _padding) beside max_batch live sequences.
        self._pad_ids: list[int] = []
        seqs = self.max_batch + max(self.decode_batches, default=1) - 1
        # A model with windowed and global layers has a cache for each (the windowed one second), driven together.
        decoder = m["decoder"]
        layers = decoder.get("sliding_layers") or []
        two = bool(self.window) and 0 < len(layers) < decoder["layers"]
        # The cache's scratch space holds one prefill call: a prompt, or a static chunk of packed prompts.
        prefill_tokens = max((self.max_seq_len, *self.prefill_chunks))
        sizes = (shape([seqs]), shape([self.kv_pages * self.page_size]), shape([prefill_tokens]), shape([self.page_size]))
        self.caches = [self.vm["create_paged_kv_cache"](*sizes, shape([1 if self.window and not two else 0]))]
        if two:
            self.caches.append(self.vm["create_window_cache"](*sizes, shape([1])))
        runtime = kv_cache_runtime()

        def each(role):  # the runtime function, on every cache
            function = runtime[role]
            return lambda *args: [function(cache, *args) for cache in self.caches][0]

        self._add, self._fork, self._remove = each("add_sequence"), each("fork_sequence"), each("remove_sequence")
        self._begin, self._end, self._popn = each("begin_forward"), each("end_forward"), each("popn")
        self._free_pages = runtime["free_pages"]  # of the main cache
        self._enable_window = runtime["enable_sliding_window"]
        self._shape = shape
        # Greedy choices made on the device (artifacts built before it lack the function: the host chooses).
        try:
            self._greedy = self.vm["greedy_tokens"]
        except (AttributeError, KeyError, RuntimeError):
            self._greedy = None
        self._seqs: dict[int, _Sequence] = {}
        self._next_id = 0
        self.completions: list[Completion] = []
        self.reset_timing()

    def reset_timing(self) -> None:
        self.stats = {"prefill_calls": 0, "prefill_tokens": 0, "prefill_s": 0.0, "decode_steps": 0,
                      "static_decode_steps": 0, "padded_decode_steps": 0, "static_prefill_calls": 0,
                      "decode_tokens": 0, "decode_s": 0.0, "device_greedy_calls": 0}

    # ---- sequences, one step at a time ------------------------------------------------------------

    @property
    def live(self) -> list[int]:
        """The ids of the sequences in the cache (decoding, waiting for their prefill, or held as parents)."""
        return list(self._seqs)

    def add(self, prompt: Sequence[int], max_new_tokens: int = 32, sampling: Sampling | None = None,
            stop_tokens: Sequence[int] | None = None, parent: int | None = None) -> int:
        """Add a sequence; returns its id. ``parent``: a live sequence whose cached tokens come first (its
        pages are shared, not copied), ``prompt`` then continues it. ``max_new_tokens=0`` prefills only: the
        sequence stays as a parent for forks until :meth:`remove`. ``stop_tokens`` default to the model's
        end-of-sequence tokens. Raises :class:`GenerationError` for input the artifact cannot take."""
        import numpy as np

        prompt = _token_ids(prompt)
        if len(self._seqs) >= self.max_batch:
            raise GenerationError(f"{self.max_batch} sequences are live, the artifact's --max-batch: remove one first "
                                  "(or rebuild with a larger --max-batch)")
        if not prompt:
            raise GenerationError("the prompt is empty: give at least one token id")
        bad = [t for t in prompt if not 0 <= t < self.vocab]
        if bad:
            raise GenerationError(f"token id {bad[0]} is outside the vocabulary (0 to {self.vocab - 1})")
        base = 0
        if parent is not None and self.window:
            raise GenerationError(f"forks of a prefix are not supported for a model with a sliding window "
                                  f"({self.window} tokens): the cache drops a sequence's tokens as they leave it")
        if parent is not None and self.rope_switch is not None:
            raise GenerationError("forks of a prefix are not supported for a longrope model: it re-reads a whole "
                                  f"sequence with the long factors when it grows past {self.rope_switch} tokens")
        if parent is not None:
            parent_seq = self._get(parent)
            if parent_seq.pending:
                raise GenerationError(f"sequence {parent} has tokens not yet in the cache: fork it after a step")
            base = parent_seq.length
        if base + len(prompt) > self.max_seq_len:
            raise GenerationError(f"the prompt has {base + len(prompt)} tokens, more than the artifact's --max-seq-len "
                                  f"{self.max_seq_len}: shorten it or rebuild with a larger --max-seq-len")
        if base + len(prompt) == self.max_seq_len and max_new_tokens > 0:
            raise GenerationError(f"the prompt has {self.max_seq_len} tokens, the artifact's --max-seq-len: no room is "
                                  "left for a new token; shorten it or rebuild with a larger --max-seq-len")
        if max_new_tokens < 0:
            raise GenerationError("max_new_tokens must be 0 or more")
        seq_id = self._next_id
        self._next_id += 1
        if parent is None:
            self._add(seq_id)
            if self.window:  # on the windowed cache (the last)
                self._enable_window(self.caches[-1], seq_id, self.window - 1, 0)  # TVM's window: the tokens before
        else:
            self._fork(parent, seq_id, -1)
        sampling = sampling or Sampling()
        stops = frozenset(self.eos_token_ids if stop_tokens is None else stop_tokens)
        self._seqs[seq_id] = _Sequence(seq_id, prompt, base, max_new_tokens, stops, sampling,
                                       np.random.default_rng(sampling.seed), Completion())
        return seq_id

    def remove(self, seq_id: int) -> Completion:
        """Drop a sequence from the cache (its pages are freed once no fork shares them); returns what it made."""
        seq = self._get(seq_id)
        self._remove(seq_id)
        del self._seqs[seq_id]
        return seq.completion

    def completion(self, seq_id: int) -> Completion:
        return self._get(seq_id).completion

    def step(self) -> list[tuple[int, int]]:
        """Prefill the sequences added since the last step, then decode one token for every sequence that was
        decoding already. Returns the (sequence id, token) pairs made, in order. A finished sequence is
        removed from the cache (unless it is held as a parent: ``max_new_tokens=0``).

        A longrope model's sequence about to grow past the original context is read again from its first
        token, as a prompt (transformers' Phi-3 does the same): its cached keys were rotated with the short
        factors, and from then on every position uses the long ones."""
        if self.rope_switch is not None:
            for seq in self._seqs.values():
                if (seq.prefilled and seq.pending and seq.completion.finish_reason is None
                        and seq.length <= self.rope_switch < seq.length + len(seq.pending)):
                    self._popn(seq.seq_id, seq.length)
                    seq.pending, seq.cached, seq.length, seq.prefilled = seq.cached + seq.pending, [], 0, False
        decoding = [s for s in self._seqs.values() if s.prefilled and s.pending and s.completion.finish_reason is None]
        waiting = [s for s in self._seqs.values() if not s.prefilled]
        made = []
        while waiting:
            # The prompts, packed: chunks of exactly a static length while enough tokens wait (a prompt may span
            # two chunks), then whole prompts up to --max-seq-len tokens a call.
            total = sum(len(s.pending) for s in waiting)
            chunk = max((t for t in self.prefill_chunks if t <= total), default=None)
            parts, room = [], chunk or self.max_seq_len
            for seq in waiting:
                # In a window: a sequence's first call takes up to a window of its tokens, then one a call.
                want = (min(len(seq.pending), self.window) if seq.length == 0 else 1) if self.window else len(seq.pending)
                take = min(want, room)
                if chunk is None and parts and take < want:
                    break
                parts.append((seq, take))
                room -= take
                if room == 0:
                    break
            made += self._forward(parts, prefill=True, chunk=chunk)
            waiting = [s for s in waiting if not s.prefilled and s.completion.finish_reason is None]
        if decoding:
            made += self._forward([(s, 1) for s in decoding], prefill=False)
        for seq in list(self._seqs.values()):
            if seq.completion.finish_reason is not None and seq.max_new_tokens > 0:
                self.remove(seq.seq_id)
        return made

    # ---- whole requests ----------------------------------------------------------------------------

    def stream(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 32, *, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, seed: int = 0, stop_tokens: Sequence[int] | None = None,
               prefix: Sequence[int] | None = None) -> Iterator[tuple[int, int]]:
        """Yield (prompt index, token) as tokens are made, serving at most ``max_batch`` prompts at a time and
        admitting the next as one finishes. ``prefix``: tokens every prompt starts with, prefilled once and
        shared by forks. A prompt the artifact cannot take ends with an error (see :meth:`completions`); the
        others go on. Request ``i`` samples with seed ``seed + i``."""
        if max_new_tokens < 1:  # a request that makes no token would never finish (add(..., 0) holds a prefix)
            raise GenerationError(f"max_new_tokens must be at least 1 (got {max_new_tokens})")
        if isinstance(prompts, (str, bytes)) or any(_is_token_id(p) for p in prompts):
            raise GenerationError("prompts is a list of prompts, each a list of token ids: for one prompt, give "
                                  "[[1, 2, 3]], not [1, 2, 3]")
        self.completions = [Completion() for _ in prompts]
        queue = list(enumerate(prompts))
        owner: dict[int, int] = {}
        root = None
        if prefix:
            root = self.add(prefix, max_new_tokens=0)
            self.step()
        try:
            while queue or owner:
                while queue and len(self._seqs) < self.max_batch:
                    index, prompt = queue.pop(0)
                    sampling = Sampling(temperature, top_k, top_p, seed + index)
                    try:
                        seq_id = self.add(prompt, max_new_tokens, sampling, stop_tokens, parent=root)
                    except GenerationError as exc:
                        self.completions[index] = Completion(finish_reason="error", error=str(exc))
                        continue
                    owner[seq_id] = index
                    self.completions[index] = self._seqs[seq_id].completion
                if not owner:
                    break
                for seq_id, token in self.step():
                    if seq_id in owner:
                        yield owner[seq_id], token
                for seq_id in [s for s in owner if s not in self._seqs]:
                    del owner[seq_id]
        finally:
            for seq_id in list(owner) + ([root] if root is not None else []):
                if seq_id in self._seqs:
                    self.remove(seq_id)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 32, **options) -> list[Completion]:
        """The completion of each prompt (options as :meth:`stream`)."""
        for _ in self.stream(prompts, max_new_tokens, **options):
            pass
        return self.completions

    def timing(self) -> dict:
        """Prefill time, time per decode step and tokens per second since the generator was made."""
        s = self.stats
        steps = max(s["decode_steps"], 1)
        return {"prefill_ms": 1e3 * s["prefill_s"], "prefill_tokens": s["prefill_tokens"],
                "ms_per_step": 1e3 * s["decode_s"] / steps, "decode_steps": s["decode_steps"],
                "tokens_per_s": s["decode_tokens"] / s["decode_s"] if s["decode_s"] else 0.0}

    # ---- inside ----------------------------------------------------------------------------------

    def _get(self, seq_id: int) -> _Sequence:
        if seq_id not in self._seqs:
            raise GenerationError(f"no live sequence {seq_id}: live are {sorted(self._seqs) or 'none'}")
        return self._seqs[seq_id]

    def _pages_needed(self, seq: _Sequence, tokens: int) -> int:
        have = -(-seq.length // self.page_size)
        return -(-(seq.length + tokens) // self.page_size) - have

    def _padding(self, n: int, free_pages: int) -> list[int]:
        """The ids of empty sequences whose rows pad a decode step of ``n`` sequences up to the smallest batch
        with a static function (tuned kernels, CUDA graphs; a decode step reads the weights once whatever
        its rows, so a padded step costs about what the unpadded one would). Each padding row appends one
        token, removed again after the step: it needs a free page for the step. None where no static batch
        holds ``n`` or the pages are short."""
        pads = min((b for b in self.decode_batches if b >= n), default=n) - n
        if pads == 0 or pads > free_pages:
            return []
        while len(self._pad_ids) < pads:
            self._pad_ids.append(PAD_SEQUENCE_IDS + len(self._pad_ids))
            self._add(self._pad_ids[-1])
        return self._pad_ids[:pads]

    def _forward(self, parts: list[tuple[_Sequence, int]], prefill: bool, chunk: int | None = None):
        """One call over ``parts``, (sequence, how many of its pending tokens to feed); returns the (sequence id,
        token) pairs sampled (for sequences whose pending tokens were all fed)."""
        import numpy as np
        import tvm

        # A sequence the cache has no room for ends with an error; the rest of the batch goes on.
        free = int(self._free_pages(self.caches[0]))
        kept, feed = [], {}
        for seq, tokens in parts:
            need = self._pages_needed(seq, tokens)
            if seq.length + tokens > self.max_seq_len:
                seq.completion.finish_reason = "max_seq_len"
            elif need > free:
                seq.completion.finish_reason = "error"
                seq.completion.error = (f"the KV cache is out of pages ({self.kv_pages} in all): fewer or shorter "
                                        "sequences at once")
            else:
                free -= need
                kept.append(seq)
                feed[seq.seq_id] = tokens
        if not kept:
            return []
        pads = [] if prefill else self._padding(len(kept), free)
        lengths = [feed[s.seq_id] for s in kept] + [1] * len(pads)
        ids = np.concatenate([np.asarray(s.pending[:feed[s.seq_id]], dtype="int32") for s in kept]
                             + [np.zeros(len(pads), dtype="int32")])
        began = time.perf_counter()
        self._begin(self._shape([s.seq_id for s in kept] + pads), self._shape(lengths))
        input_ids = tvm.runtime.tensor(ids, self.device)
        if prefill:
            last = tvm.runtime.tensor(np.cumsum(lengths, dtype="int32") - 1, self.device)
            # A chunk of a static length runs its own function (tuned kernels), unless a sequence was dropped.
            name = f"prefill_t{chunk}" if chunk is not None and int(ids.size) == chunk else "batch_prefill"
            self.stats["static_prefill_calls"] += name != "batch_prefill"
            logits, *self.caches = self.vm[name](input_ids, last, *self.caches, self.params)
        else:
            # A batch size with a static function of its own runs it (tuned kernels, CUDA graphs).
            rows = len(kept) + len(pads)
            name = f"decode_b{rows}" if rows in self.decode_batches else "batch_decode"
            self.stats["static_decode_steps"] += name != "batch_decode"
            self.stats["padded_decode_steps"] += bool(pads)
            logits, *self.caches = self.vm[name](input_ids, *self.caches, self.params)
        self._end()
        for pad in pads:  # the padding rows' token leaves their (empty) sequences again
            self._popn(pad, 1)
        # A step whose sequences all decode greedily reads back a token per row, not the logits.
        greedy = self._greedy is not None and all(seq.sampling.temperature == 0 for seq in kept)
        if greedy:
            picks = self._greedy(logits).numpy().reshape(-1)[:len(kept)]
            self.stats["device_greedy_calls"] += 1
        else:
            logits = logits.numpy().reshape(len(kept) + len(pads), -1)[:len(kept)]
        elapsed = time.perf_counter() - began
        key = "prefill" if prefill else "decode"
        self.stats[f"{key}_s"] += elapsed
        if prefill:
            self.stats["prefill_calls"] += 1
            self.stats["prefill_tokens"] += int(ids.size)
        else:
            self.stats["decode_steps"] += 1
            self.stats["decode_tokens"] += len(kept)
        made = []
        for i, seq in enumerate(kept):
            fed = feed[seq.seq_id]
            seq.length += fed
            if self.rope_switch is not None:
                seq.cached += seq.pending[:fed]
            seq.pending = seq.pending[fed:]
            if seq.pending:  # the rest of its prompt comes in the next chunk
                continue
            seq.prefilled = True
            if seq.max_new_tokens == 0:
                continue
            if seq.length >= self.max_seq_len:  # a new token would make the sequence longer than the artifact's
                seq.completion.finish_reason = "max_seq_len"
                continue
            token = int(picks[i]) if greedy else _sample(logits[i], seq.sampling, seq.rng)
            seq.completion.tokens.append(token)
            made.append((seq.seq_id, token))
            if token in seq.stop_tokens:
                seq.completion.finish_reason = "stop"
            elif len(seq.completion.tokens) >= seq.max_new_tokens:
                seq.completion.finish_reason = "length"
            else:
                seq.pending = [token]
        return made


def _is_token_id(value) -> bool:
    """Whether ``value`` is one token id: a whole number (an int, a numpy or torch integer), not a bool."""
    import operator

    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _token_ids(prompt) -> list[int]:
    """A prompt as a list of ints; a GenerationError for text or ids that are not whole numbers (1.7 or "3"
    would otherwise be read as 1 and 3)."""
    import operator

    if isinstance(prompt, (str, bytes)) or _is_token_id(prompt) or not hasattr(prompt, "__iter__"):
        raise GenerationError(f"a prompt is a list of token ids, not {type(prompt).__name__}: tokenize text first "
                              "(the command line's --prompt with --tokenizer does)")
    prompt = list(prompt)
    bad = [t for t in prompt if not _is_token_id(t)]
    if bad:
        raise GenerationError(f"token id {bad[0]!r} is not a whole number: a prompt is a list of int token ids")
    return [operator.index(t) for t in prompt]


def _sample(logits, sampling: Sampling, rng) -> int:
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


def check_kv_pages(kv_pages) -> None:
    """``kv_pages``: a whole number of pages, at least 1 (None: the default)."""
    if isinstance(kv_pages, bool) or not isinstance(kv_pages, int) or kv_pages < 1:
        raise UsageError(f"kv_pages must be a whole number of pages, at least 1 (got {kv_pages!r}); leave it out for "
                         "room for max_batch sequences of max_seq_len tokens")


def read_generation_manifest(path: Path) -> dict:
    """The manifest of a generation artifact; a one-line UsageError for a folder that is not one."""
    manifest_path = Path(path) / MANIFEST
    if Path(path).exists() and not Path(path).is_dir():
        raise UsageError(f"{path} is a file, not an artifact: give the folder `autosched build MODEL --generate -o DIR` wrote")
    if not manifest_path.exists():
        raise UsageError(f"{path} is not an autosched build (no {MANIFEST}): run `autosched build MODEL --generate -o {path}`")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"{manifest_path} is not valid JSON ({exc.msg if hasattr(exc, 'msg') else exc}): rebuild the "
                         "artifact") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise UsageError(f"{path} was built without --generate: rebuild it with `autosched build MODEL --generate`")
    from autosched.pipeline.artifact import check_manifest_version

    check_manifest_version(manifest, manifest_path)
    return manifest
