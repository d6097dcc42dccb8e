"""Generating text from a generation artifact, with TVM's runtime and numpy alone: the public façade.

:class:`Generator` composes the parts a serving engine has: the loaded model (:mod:`.model`: its functions,
parameters and TVM's paged KV cache), the step scheduler (:mod:`.scheduler`: which sequences prefill in which
chunks, which decode, padding to the built batch sizes), the sampler (:mod:`.sampler`) and request state
(:mod:`.request`). Each :meth:`Generator.step` prefills the sequences added since the last step (their prompts
packed into one call) and decodes one token for every sequence that was already decoding (one call for the
whole batch): continuous batching in its simplest form.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from autosched.errors import UsageError

from . import scheduler
from .logit_rules import DeviceRules
from .model import LoadedModel, check_kv_pages
from .prefix_cache import PrefixCache
from .request import Completion, GenerationError, Sampling, SequenceState, is_token_id, token_ids
from .sampler import Sampler

__all__ = ["Completion", "GenerationError", "Generator", "Sampling", "check_kv_pages", "read_generation_manifest"]


class Generator:
    """A loaded generation artifact (``autosched build MODEL --generate``) and its KV cache.

    ``generate(prompts, ...)`` serves a list of token-id prompts, ``stream(...)`` yields tokens as they come,
    and ``add``/``step``/``remove`` drive sequences one step at a time (new requests join between steps). A
    sequence that finishes in a step leaves the cache, and its :meth:`completion` stays readable until
    :meth:`remove` takes it. ``kv_pages``: pages in the cache (default: room for ``max_batch`` sequences of
    ``max_seq_len`` tokens). ``clock``: what times the calls (see :meth:`timing`).

    ``run_ahead`` (default: on a CUDA build): a greedy decode step is launched before the tokens of the step
    before it are read (its ids are those tokens, still on the device; the step waits for them inside its
    call: :mod:`.barrier`), so the host's work between two steps overlaps the GPU's. The same tokens; a
    sequence that stops at a stop token has had one step more computed for it. False, and builds without the
    barrier: a step at a time. ``pad_prefill`` (default: on a CUDA build): a prefill call of fewer tokens than a
    static chunk (a prompt's last tokens after its whole chunks) is padded up to the smallest static chunk that
    holds them, to run its tuned kernels.

    ``draft``: decode speculatively (:mod:`.speculative`), the same tokens (greedy) or the same distribution
    (sampled) in fewer target steps: ``"prompt-lookup"`` (proposals copied from earlier in the sequence) or
    the folder of another generation artifact with the same vocabulary (a smaller model); ``speculate``:
    tokens proposed per step; ``adaptive``: plain steps where speculating does not pay (the draft's recent
    proposals mostly rejected).

    ``prefix_cache``: keep the pages of prompts served (and of finished sequences) for later prompts that start
    with the same tokens, which then prefill only the rest (:mod:`.prefix_cache`); the kept pages are given back,
    least recently used first, when a step needs them. Not for a model with a sliding window or longrope (their
    caches cannot share a prefix): there it stays off (``prefix_cache`` is then None).

    ``tokenizer``: a Hugging Face tokenizer (or its folder) for requests under a grammar (``Sampling(grammar=
    ...)``: :mod:`.grammar`); default: the artifact's own ``tokenizer/``, read when a grammar is first asked for.
    A step's logits of the tokens a sequence's grammar does not allow are set to -inf on the device, by a kernel
    compiled at the first grammar (:func:`~.grammar.device_mask`), the mask found on the host while the step
    runs; then its token is chosen as any other's (and a greedy step is launched ahead all the same: the mask
    of the step launched is found once the tokens of the step before are read). ``device_masks = False`` (or a
    kernel that cannot be compiled): those rows read their logits back and are masked and chosen on the host.
    """

    def __init__(self, artifact_dir: str | Path, kv_pages: int | None = None,
                 clock: Callable[[], float] = time.perf_counter, *, draft=None, speculate: int = 4,
                 adaptive: bool = True, run_ahead: bool | None = None, prefix_cache: bool = False, tokenizer=None):
        self._start(LoadedModel.load(artifact_dir, kv_pages), clock)
        self._tokenizer = tokenizer if tokenizer is not None else Path(artifact_dir) / "tokenizer"
        if prefix_cache:
            self.use_prefix_cache()
        if run_ahead is not None:
            self.run_ahead = run_ahead
        if draft is not None:
            self.speculate(draft, speculate, adaptive)

    def speculate(self, draft, k: int = 4, adaptive: bool = True) -> None:
        """Decode speculatively from now on with ``draft`` (as the constructor's) proposing ``k`` tokens a step;
        ``draft=None`` stops. ``adaptive``: a step speculates only while the draft's recent acceptance makes it
        pay (:class:`~.speculative.Adaptation`); False: every step does."""
        from .speculative import Speculator, check_speculation, make_draft

        if self._speculator is not None:
            for seq_id in list(self._seqs):
                self._speculator.forget(seq_id)
            self._speculator = None
        if draft is None:
            return
        check_speculation(k, self.model)
        self._speculator = Speculator(self.model, make_draft(draft, self.model), k, self.limits, self._stats,
                                      adaptive)

    def use_prefix_cache(self, on: bool = True) -> None:
        """Keep served prefixes from now on (see the class); ``on=False`` gives every kept page back."""
        if not on or self.model.window or self.model.rope_switch is not None:
            if self.prefix_cache is not None:
                for entry in self.prefix_cache.clear():
                    self.model.remove(entry.seq_id)
            self.prefix_cache = None
        elif self.prefix_cache is None:
            self.prefix_cache = PrefixCache(self.model.page_size)

    def use_grammars(self, grammars) -> None:
        """Compile requests' grammars with ``grammars`` (a :class:`~.grammar.Grammars`, shared with a server
        that compiles them before a request is queued), or with a tokenizer's (a tokenizer, or its folder)."""
        from .grammar import Grammars

        if grammars is None or isinstance(grammars, Grammars):
            self._grammars = grammars
        else:
            self._grammars, self._tokenizer = None, grammars

    @property
    def grammars(self):
        """The :class:`~.grammar.Grammars` that compiles requests' grammars (made at the first use, from the
        tokenizer); a GrammarError where there is no tokenizer."""
        if self._grammars is None:
            from .grammar import GrammarError, Grammars

            tokenizer = self._tokenizer
            if isinstance(tokenizer, (str, Path)):
                if not Path(tokenizer).is_dir():
                    raise GrammarError("a grammar needs the model's tokenizer: this artifact has none (build it from "
                                       "a model folder with its tokenizer, or give Generator(..., tokenizer=DIR))")
                from transformers import AutoTokenizer

                try:
                    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
                except Exception as exc:  # noqa: BLE001 - transformers' errors for a folder it cannot read vary
                    raise GrammarError(f"no tokenizer could be read from {tokenizer}: {exc}") from None
            if tokenizer is None:
                raise GrammarError("a grammar needs the model's tokenizer: give Generator.use_grammars(tokenizer)")
            self._grammars = Grammars(tokenizer, self.vocab, self.eos_token_ids)
        return self._grammars

    def make_room(self, pages: int) -> bool:
        """Give kept prefixes' pages back, least recently used first, until ``pages`` pages are free; whether
        they are."""
        while self.model.free_pages() < pages:
            entry = self.prefix_cache.least_recent() if self.prefix_cache is not None else None
            if entry is None:
                return False
            self.model.remove(entry.seq_id)
        return True

    def reset(self) -> None:
        """Every sequence and kept prefix out, the cache clean and every page free, after a call that failed
        midway (its state unknown): what the sequences made is lost."""
        self.model.clear()
        if self._speculator is not None:
            self._speculator.draft.clear()
        self._seqs.clear()
        self._done.clear()
        self._flight = None
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    @classmethod
    def from_model(cls, model: LoadedModel, clock: Callable[[], float] = time.perf_counter) -> Generator:
        """A generator over a model already loaded (:class:`~.model.LoadedModel`), e.g. one built in memory:
        ``LoadedModel(relax.VirtualMachine(compile_generation's executable, device), its parameters as TVM tensors
        on device, generation_manifest's manifest, device)``."""
        gen = cls.__new__(cls)
        gen._start(model, clock)
        return gen

    def _start(self, model: LoadedModel, clock: Callable[[], float] = time.perf_counter) -> None:
        self.model = model
        self.limits = scheduler.Limits(model.max_seq_len, model.page_size, model.decode_batches, model.prefill_chunks,
                                       model.window, model.window_chunk)
        self.sampler = Sampler(model.greedy_tokens, model.sample_tokens, model.device, model.staging)
        self.sampler.rules = DeviceRules(model, model.staging)  # its kernels compiled at a first row with rules
        self._stats = scheduler.StepStats(clock)
        self._seqs: dict[int, SequenceState] = {}  # in the cache
        self._done: dict[int, SequenceState] = {}  # finished and out of the cache, until removed
        self._next_id = 0
        self.completions: list[Completion] = []
        self._speculator = None
        # On a GPU the host's turn between two steps would leave it idle; on the CPU it is the same cores.
        self.run_ahead = model.on_gpu
        # A prefill call of a prompt's last few tokens padded up to a static chunk (see scheduler.prefill_padding):
        # on a GPU its tuned kernels; on the CPU the padding is as many tokens of work.
        self.pad_prefill = model.on_gpu and not model.window
        self._flight: Flight | None = None  # a decode step launched whose tokens are not read yet
        self.prefix_cache: PrefixCache | None = None
        self._tokenizer = None  # for requests under a grammar (see the class)
        self._grammars = None
        self.device_masks = True  # a grammar's mask applied on the device (see the class)

    # The artifact's facts a caller plans with (the rest: ``self.model``, the LoadedModel).

    @property
    def max_batch(self) -> int:
        """The most sequences live at once (``--max-batch``)."""
        return self.model.max_batch

    @property
    def max_seq_len(self) -> int:
        """The longest sequence, its prompt and output together (``--max-seq-len``)."""
        return self.model.max_seq_len

    @property
    def vocab(self) -> int:
        """The model's vocabulary size."""
        return self.model.vocab

    @property
    def eos_token_ids(self) -> frozenset:
        """The model's end-of-sequence tokens (a sequence stops at them unless given other stop tokens)."""
        return self.model.eos_token_ids

    @property
    def decode_batches(self) -> frozenset:
        """The decode batch sizes built with a static function (``--decode-batches``)."""
        return self.model.decode_batches

    @property
    def stats(self) -> dict:
        """Calls, tokens and seconds of prefill and decode since the generator was made (or reset_timing);
        speculating, the tokens proposed and accepted and the target's speculative steps too."""
        return self._stats.counts

    @property
    def speculation(self) -> dict | None:
        """Tokens proposed and accepted, the acceptance rate and the tokens a sequence made per target step,
        since the generator was made (or reset_timing); None when it does not speculate."""
        if self._speculator is None:
            return None
        return scheduler.speculation_counts(self._stats.counts)

    def reset_timing(self) -> None:
        self._stats.reset()

    # ---- sequences, one step at a time ------------------------------------------------------------

    @property
    def live(self) -> list[int]:
        """The ids of the sequences in the cache (decoding, waiting for their prefill, or held as parents)."""
        return list(self._seqs)

    @property
    def waiting(self) -> list[int]:
        """The ids of the sequences added and not yet prefilled."""
        return [seq_id for seq_id, seq in self._seqs.items() if not seq.prefilled]

    @property
    def finished(self) -> list[int]:
        """The ids of the sequences that finished and whose result :meth:`remove` has not yet taken."""
        return list(self._done)

    def add(self, prompt: Sequence[int], max_new_tokens: int = 32, sampling: Sampling | None = None,
            stop_tokens: Sequence[int] | None = None, parent: int | None = None) -> int:
        """Add a sequence; returns its id. ``parent``: a live sequence whose cached tokens come first (its
        pages are shared, not copied), ``prompt`` then continues it. ``max_new_tokens=0`` prefills only: the
        sequence stays as a parent for forks until :meth:`remove`. ``stop_tokens`` default to the model's
        end-of-sequence tokens. Raises :class:`GenerationError` for input the artifact cannot take."""
        import numpy as np

        prompt = token_ids(prompt)
        if len(self._seqs) >= self.max_batch:
            raise GenerationError(f"{self.max_batch} sequences are live, the artifact's --max-batch: remove one first "
                                  "(or rebuild with a larger --max-batch)")
        if not prompt:
            raise GenerationError("the prompt is empty: give at least one token id")
        bad = [t for t in prompt if not 0 <= t < self.vocab]
        if bad:
            raise GenerationError(f"token id {bad[0]} is outside the vocabulary (0 to {self.vocab - 1})")
        base = 0
        if parent is not None and self.model.window:
            raise GenerationError(f"forks of a prefix are not supported for a model with a sliding window "
                                  f"({self.model.window} tokens): TVM's windowed cache does not span a shared prefix's "
                                  "tokens and a sequence's own")
        if parent is not None and self.model.rope_switch is not None:
            raise GenerationError("forks of a prefix are not supported for a longrope model: it re-reads a whole "
                                  f"sequence with the long factors when it grows past {self.model.rope_switch} tokens")
        context = list(prompt)
        cached = None
        if parent is not None:
            parent_seq = self._get(parent)
            if parent_seq.pending:
                raise GenerationError(f"sequence {parent} has tokens not yet in the cache: fork it after a step")
            base = parent_seq.length
            context = parent_seq.context + context
        if base + len(prompt) > self.max_seq_len:
            raise GenerationError(f"the prompt has {base + len(prompt)} tokens, more than the artifact's --max-seq-len "
                                  f"{self.max_seq_len}: shorten it or rebuild with a larger --max-seq-len")
        if base + len(prompt) == self.max_seq_len and max_new_tokens > 0:
            raise GenerationError(f"the prompt has {self.max_seq_len} tokens, the artifact's --max-seq-len: no room is "
                                  "left for a new token; shorten it or rebuild with a larger --max-seq-len")
        if max_new_tokens < 0:
            raise GenerationError("max_new_tokens must be 0 or more")
        sampling = sampling or Sampling()
        stops = frozenset(self.eos_token_ids if stop_tokens is None else stop_tokens)
        grammar = None
        if sampling.grammar is not None and max_new_tokens > 0:
            try:
                grammar = self.grammars.state(sampling.grammar, stops)
            except UsageError as exc:  # a grammar that cannot compile, no tokenizer
                raise GenerationError(str(exc)) from None
            if self.device_masks and self.sampler.masks is None:
                from .grammar import device_mask

                self.sampler.masks = device_mask(self.model)  # compiled at the first grammar (None: masks on the host)
                self.device_masks = self.sampler.masks is not None
        if parent is None and self.prefix_cache is not None:
            cached = self.prefix_cache.match(prompt)
        seq_id = self._next_id
        self._next_id += 1
        if cached is not None:  # the prompt's first pages are a kept prefix's: forked, not prefilled again
            (entry, base), parent = cached, None
            prompt = prompt[base:]
            self.model.add(seq_id, entry.seq_id, base)
        else:
            self.model.add(seq_id, parent)
        self._seqs[seq_id] = SequenceState(seq_id, prompt, base, max_new_tokens, stops, sampling,
                                           rng=np.random.default_rng(sampling.seed), prompt_context=context,
                                           grammar=grammar)
        if cached is not None:
            self._seqs[seq_id].completion.cached_tokens = base
        return seq_id

    def remove(self, seq_id: int) -> Completion:
        """Take a sequence's result: a live sequence leaves the cache (its pages are freed once no fork shares
        them), a finished one is forgotten. Returns what it made."""
        if seq_id in self._done:
            return self._done.pop(seq_id).completion
        seq = self._get(seq_id)
        self.model.remove(seq_id)
        if self._speculator is not None:
            self._speculator.forget(seq_id)
        del self._seqs[seq_id]
        return seq.completion

    def completion(self, seq_id: int) -> Completion:
        """What a live sequence has made so far, or what a finished one made (until :meth:`remove`)."""
        if seq_id in self._done:
            return self._done[seq_id].completion
        return self._get(seq_id).completion

    def step(self) -> list[tuple[int, int]]:
        """Prefill the sequences added since the last step, then decode one token for every sequence that was
        decoding already. Returns the (sequence id, token) pairs made, in order. A finished sequence leaves
        the cache (unless it is held as a parent: ``max_new_tokens=0``); its result stays readable with
        :meth:`completion` until :meth:`remove`.

        A longrope model's sequence about to grow past the original context is read again from its first
        token, as a prompt (transformers' Phi-3 does the same): its cached keys were rotated with the short
        factors, and from then on every position uses the long ones."""
        return self._step(self._seqs)

    def prefill(self) -> list[tuple[int, int]]:
        """Prefill the sequences added since the last step, and nothing else: their first tokens, without
        waiting for a decode step of the others (a server sends them first). A decode step launched ahead is
        landed first; its tokens are among those returned."""
        return self._step(self.waiting)

    def _step(self, ids: Iterable[int]) -> list[tuple[int, int]]:
        """A step of the sequences ``ids`` only (others in the cache wait)."""
        seqs = [self._seqs[i] for i in list(ids) if i in self._seqs]
        if self.model.rope_switch is not None:
            for seq in scheduler.longrope_rereads(seqs, self.model.rope_switch):
                self.model.popn(seq.seq_id, seq.length)
                seq.pending, seq.cached, seq.length, seq.prefilled = seq.cached + seq.pending, [], 0, False
        made, served, landed = [], set(), []
        flight, self._flight = self._flight, None
        if flight is not None and not flight.continues(seqs):
            # Its tokens are this step's for its sequences, read before anything else runs.
            made += self._land(flight)
            served = {id(s) for s in flight.seqs}
            # those outside ``ids`` end here too where they finished (a prefill-only step lands a decode step)
            landed = [s for s in flight.seqs if self._seqs.get(s.seq_id) is s and all(s is not t for t in seqs)]
            flight = None
        decoding = [s for s in seqs if s.decoding and id(s) not in served]
        waiting = [s for s in seqs if not s.prefilled]
        if self.prefix_cache is not None:  # the pages this step may take, from kept prefixes where short
            page, k = self.limits.page_size, 1 + (self._speculator.k if self._speculator is not None else 0)
            self.make_room(sum(scheduler.pages_needed(s.length, k, page) for s in decoding)
                           + sum(scheduler.pages_needed(s.length, len(s.pending), page) for s in waiting)
                           + max(self.decode_batches, default=1))
        while waiting:
            parts, chunk = scheduler.next_prefill(waiting, self.limits)
            made += self._forward(parts, prefill=True, chunk=chunk)
            waiting = [s for s in waiting if not s.prefilled and not s.completion.finished]
        if flight is not None:
            made += self._fly(flight)
        elif (decoding and self._speculator is not None and all(s.sampling.speculates for s in decoding)
              and self._speculator.wants_step()):
            made += self._speculator.step(decoding)
        elif decoding and (rows := self._run_ahead_rows(decoding)) is not None:
            made += self._fly(self._launch(decoding, rows))
        elif decoding:
            made += self._forward([(s, 1) for s in decoding], prefill=False)
            if self._speculator is not None:
                self._speculator.plain_step(len(decoding))
        for seq in seqs + landed:
            if self.prefix_cache is not None and seq.prefilled and not seq.completion.error:
                if not seq.remembered:  # the prompt, once prefilled
                    seq.remembered = True
                    self._remember(seq, seq.prompt_context)
                if seq.completion.finish_reason in ("stop", "length"):  # and what the sequence made, for a next turn
                    self._remember(seq, seq.context[:seq.length])
            if seq.completion.finished and seq.max_new_tokens > 0:
                self.model.remove(seq.seq_id)
                if self._speculator is not None:
                    self._speculator.forget(seq.seq_id)
                self._done[seq.seq_id] = self._seqs.pop(seq.seq_id)
        return made

    # ---- whole requests ----------------------------------------------------------------------------

    def stream(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 32, *, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, seed: int = 0, stop_tokens: Sequence[int] | None = None,
               prefix: Sequence[int] | None = None, grammar=None) -> Iterator[tuple[int, int]]:
        """Yield (prompt index, token) as tokens are made, serving at most ``max_batch`` prompts at a time and
        admitting the next as one finishes. ``prefix``: tokens every prompt starts with, prefilled once and
        shared by forks. ``grammar``: a :class:`~.grammar.GrammarSpec` every output follows. A prompt the
        artifact cannot take ends with an error (see :meth:`completions`); the others go on. Request ``i``
        samples with seed ``seed + i``. Sequences added with :meth:`add` are not stepped (they wait for
        :meth:`step`); they count towards ``max_batch``."""
        if max_new_tokens < 1:  # a request that makes no token would never finish (add(..., 0) holds a prefix)
            raise GenerationError(f"max_new_tokens must be at least 1 (got {max_new_tokens})")
        if isinstance(prompts, (str, bytes)) or any(is_token_id(p) for p in prompts):
            raise GenerationError("prompts is a list of prompts, each a list of token ids: for one prompt, give "
                                  "[[1, 2, 3]], not [1, 2, 3]")
        completions = self.completions = [Completion() for _ in prompts]
        queue = list(enumerate(prompts))
        owner: dict[int, int] = {}
        root = None
        if prefix:
            root = self.add(prefix, max_new_tokens=0)
            self._step([root])
        try:
            while queue or owner:
                # With none of its own live, a prompt that finds the batch full (of add()'s sequences) ends with
                # add()'s error rather than waiting for a step that would never come.
                while queue and (len(self._seqs) < self.max_batch or not owner):
                    index, prompt = queue.pop(0)
                    sampling = Sampling(temperature, top_k, top_p, seed + index, grammar=grammar)
                    try:
                        seq_id = self.add(prompt, max_new_tokens, sampling, stop_tokens, parent=root)
                    except GenerationError as exc:
                        completions[index] = Completion(finish_reason="error", error=str(exc))
                        continue
                    owner[seq_id] = index
                    completions[index] = self._seqs[seq_id].completion
                if not owner:
                    break
                for seq_id, token in self._step(owner):  # only this call's sequences: not those of add()
                    yield owner[seq_id], token
                for seq_id in [s for s in owner if s not in self._seqs]:
                    self.remove(seq_id)  # finished: its result is in completions
                    del owner[seq_id]
        finally:
            for seq_id in list(owner) + ([root] if root is not None else []):
                if seq_id in self._seqs or seq_id in self._done:
                    self.remove(seq_id)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 32, **options) -> list[Completion]:
        """The completion of each prompt (options as :meth:`stream`)."""
        for _ in self.stream(prompts, max_new_tokens, **options):
            pass
        return list(self.completions)  # the caller's own list: a later call makes another

    def timing(self) -> dict:
        """Prefill time, time per decode step and tokens per second since the generator was made."""
        return self._stats.timing()

    # ---- inside ----------------------------------------------------------------------------------

    def _remember(self, seq: SequenceState, tokens: list[int]) -> None:
        """Keep the whole pages of ``tokens`` (the first tokens of ``seq`` in the cache) as a prefix."""
        entry = self.prefix_cache.add(tokens[:seq.length])
        if entry is not None:
            self.model.add(entry.seq_id, seq.seq_id, fork_at=len(entry.tokens))

    def _get(self, seq_id: int) -> SequenceState:
        if seq_id not in self._seqs:
            raise GenerationError(f"no live sequence {seq_id}: live are {sorted(self._seqs) or 'none'}")
        return self._seqs[seq_id]

    # ---- decode steps launched ahead (run_ahead) ---------------------------------------------------

    def _run_ahead_rows(self, seqs: list[SequenceState], flight: Flight | None = None) -> int | None:
        """The rows (padding included) of a greedy decode step of ``seqs`` that may be launched now, each with
        its next token pending or, behind ``flight``, with its token there not yet read; None where it may
        not: every sequence takes the step whole (room in the cache and in max_seq_len, its token wanted; none
        ends by length with the token in flight), the rows as in ``flight``, on a build with the step barrier."""
        m = self.model
        if not (self.run_ahead and m.step_barrier and self._speculator is None and m.rope_switch is None):
            return None
        in_flight = 0 if flight is None else 1
        if any(not s.sampling.greedy or not s.sampling.speculates or self.sampler.on_host(s)
               or len(s.completion.tokens) + in_flight >= s.max_new_tokens
               or s.length + 1 >= self.max_seq_len for s in seqs):
            return None
        need = sum(scheduler.pages_needed(s.length, 1, self.limits.page_size) for s in seqs)
        free = m.free_pages()
        rows = len(seqs) + scheduler.padding_rows(len(seqs), m.decode_batches, free - need)
        return rows if need <= free and (flight is None or rows == flight.rows) else None

    def _launch(self, seqs: list[SequenceState], rows: int, after: Flight | None = None) -> Flight:
        """Launch a greedy decode step of ``seqs`` in ``rows`` rows: their pending tokens from the host, or
        ``after``'s tokens on the device, which this step's barrier reads once ``after`` is done
        (:mod:`.barrier`)."""
        import numpy as np

        m = self.model
        pads = m.padding_ids(rows - len(seqs))
        function = scheduler.decode_function(rows, m.decode_batches)
        began = self._stats.clock()
        ids = after.tokens if after is not None else np.asarray([s.pending[0] for s in seqs] + [0] * len(pads),
                                                                  dtype="int32")
        logits = m.forward(function, [s.seq_id for s in seqs] + pads, [1] * rows, ids, False,
                           wait=None if after is None else after.wait)
        for pad in pads:
            m.popn(pad, 1)
        if after is None:
            for seq in seqs:
                seq.feed(1, keep_cached=False)
        flight = Flight(seqs, None, rows, function, bool(pads), began, logits=logits)
        if after is None or all(s.grammar is None for s in seqs):
            self._choose(flight)
        return flight  # under a grammar behind ``after``: chosen once after's tokens are read (see _fly)

    def _choose(self, flight: Flight) -> None:
        """Launch the choice of ``flight``'s tokens: its grammars' masks, then the greedy kernel."""
        m = self.model
        self.sampler.mask(flight.logits, flight.rows, flight.seqs, [True] * len(flight.seqs))
        self.stats["device_greedy_calls"] += 1
        flight.tokens = m.greedy_tokens(flight.logits)
        flight.marks = m.token_marks()
        flight.mark = flight.marks and flight.marks.mark(flight.tokens)

    def _fly(self, flight: Flight) -> list[tuple[int, int]]:
        """``flight``'s tokens (this step's), with the next step launched behind them first where it may be."""
        rows = self._run_ahead_rows(flight.seqs, flight)
        if rows is None:
            return self._land(flight)
        follow = self._launch(flight.seqs, rows, after=flight)
        made = self._accept(flight, flight.read())
        for seq in flight.seqs:
            if not seq.completion.finished:  # its token went into the step launched (one that stopped leaves)
                seq.feed(1, keep_cached=False)
        if follow.tokens is None:  # its grammars now know the tokens before: its masks, while it runs
            self._choose(follow)
        follow.began = self._stats.clock()  # steps in flight overlap: its time counts from here
        self._flight = follow
        return made

    def _land(self, flight: Flight) -> list[tuple[int, int]]:
        """``flight``'s tokens, waited for."""
        return self._accept(flight, flight.read())

    def _accept(self, flight: Flight, tokens) -> list[tuple[int, int]]:
        made = []
        for seq, token in zip(flight.seqs, tokens):
            if self._seqs.get(seq.seq_id) is seq and not seq.completion.finished:  # not removed meanwhile
                seq.accept(int(token))
                made.append((seq.seq_id, int(token)))
        self._stats.record(False, flight.began, len(flight.seqs), flight.function, flight.padded)
        return made

    def _forward(self, parts: list[tuple[SequenceState, int]], prefill: bool, chunk: int | None = None):
        """One call over ``parts``, (sequence, how many of its pending tokens to feed); returns the (sequence id,
        token) pairs sampled (for sequences whose pending tokens were all fed)."""
        import numpy as np

        m = self.model
        kept, free = scheduler.admit(parts, m.free_pages(), self.limits, m.kv_pages)
        if not kept:
            return []
        fed_tokens = sum(fed for _, fed in kept)
        if prefill:  # a dynamic call: one padding sequence up to a static chunk, where there is one
            padding = (scheduler.prefill_padding(fed_tokens, self.limits.prefill_chunks, free, self.limits.page_size)
                       if self.pad_prefill and fed_tokens != chunk else 0)
            pads, pad_lengths = (m.padding_ids(1), [padding]) if padding else ([], [])
            chunk = fed_tokens + padding if padding else chunk
        else:
            pads = m.padding_ids(scheduler.padding_rows(len(kept), m.decode_batches, free))
            pad_lengths = [1] * len(pads)
        seqs = [seq for seq, _ in kept]
        lengths = [fed for _, fed in kept] + pad_lengths
        ids = np.concatenate([np.asarray(seq.pending[:fed], dtype="int32") for seq, fed in kept]
                             + [np.zeros(sum(pad_lengths), dtype="int32")])
        rows = len(kept) + len(pads)
        function = (scheduler.prefill_function(int(ids.size), chunk) if prefill
                    else scheduler.decode_function(rows, m.decode_batches))
        # A token for each sequence whose pending tokens all go in now, unless it only holds a prefix or is full.
        complete = [fed == len(seq.pending) and seq.max_new_tokens > 0 for seq, fed in kept]
        wanted = [done and seq.length + fed < self.max_seq_len for (seq, fed), done in zip(kept, complete)]
        began = self._stats.clock()
        staged = self.sampler.stage(rows, seqs, wanted)  # before the call: see Sampler.stage
        logits = m.forward(function, [s.seq_id for s in seqs] + pads, lengths, ids, prefill)
        for pad, length in zip(pads, pad_lengths):  # the padding's tokens leave their (empty) sequences again
            m.popn(pad, length)
        for seq, fed in kept:
            seq.feed(fed, keep_cached=self.model.rope_switch is not None)
        for seq, done, want in zip(seqs, complete, wanted):
            if done and not want:
                seq.completion.finish_reason = "max_seq_len"  # a new token would pass the artifact's longest
        tokens = self.sampler.choose(logits, rows, seqs, wanted, self.stats, staged) if any(wanted) else []
        self._stats.record(prefill, began, fed_tokens if prefill else len(kept), function, bool(pads))
        made = []
        for seq, token in zip(seqs, tokens):
            if token is not None:
                seq.accept(token)
                made.append((seq.seq_id, token))
        return made


@dataclass
class Flight:
    """A greedy decode step launched whose tokens are not read yet: its sequences in row order (padding rows
    after them), the device tensor of every row's token, and what its time counts as."""

    seqs: list[SequenceState]
    tokens: object  # None until chosen (Generator._choose)
    rows: int
    function: str
    padded: bool
    began: float
    marks: object = None  # TokenMarks on a GPU, and the mark after this step's tokens
    mark: object = None
    _read: object = None
    logits: object = None

    def wait(self) -> None:
        """Until this step is done: the barrier of the step launched behind it calls this. With CUDA events
        the work queued after this step (the next step's first kernels) goes on; without, all of it is waited
        for (and the tokens read meanwhile)."""
        if self.mark is not None:
            self.marks.wait(self.mark)
        else:
            self.read()

    def read(self):
        """This step's tokens (numpy), once made."""
        if self._read is None:
            self._read = (self.marks.read(self.mark) if self.mark is not None
                          else self.tokens.numpy()).reshape(-1)
        return self._read

    def continues(self, seqs: list[SequenceState]) -> bool:
        """Whether a step of ``seqs`` is this one's sequences decoding on (none waits for a prefill, none
        joined, none left, none stopped or removed)."""
        unfinished = [s for s in seqs if not s.completion.finished]
        return len(unfinished) == len(self.seqs) and all(a is b for a, b in zip(unfinished, self.seqs))


def read_generation_manifest(path: str | Path) -> dict:
    """The manifest of a generation artifact; a one-line UsageError for a folder that is not one."""
    from autosched.artifact import read_manifest

    return read_manifest(path, "generation")
