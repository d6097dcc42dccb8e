"""The serving engine: one thread owns the :class:`~autosched.generation.Generator` and steps it while any
request is live; requests from any number of clients join the running batch at the next step (continuous
batching) and leave it the moment they finish, stop at a stop string or are aborted. Its API is asyncio's
(:meth:`Engine.generate` is an async iterator of outputs), as vLLM's ``AsyncLLMEngine`` is, and it knows
nothing of HTTP (:mod:`.app` does).

What a step made reaches each request's asyncio queue through its event loop's ``call_soon_threadsafe``. A
request waits (``--max-waiting`` of them at most) until the batch has a free row for each of its choices and
the KV cache has the pages its longest output could take, counting what every running sequence could still
take (so no running sequence ever finds the cache full); kept prefixes give their pages back first.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from autosched.errors import AutoschedError
from autosched.generation import scheduler
from autosched.generation.grammar import GrammarError, Grammars
from autosched.generation.request import GenerationError, Sampling, TokenLogprob

from .tokenizer import IncrementalDetokenizer, StopText


class EngineError(AutoschedError):
    """A request the engine refuses or could not serve: ``status`` is the HTTP status the server answers,
    ``param`` the request field at fault (OpenAI's error object)."""

    status = 500
    kind = "server_error"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class BadRequest(EngineError):
    status, kind = 400, "invalid_request_error"


class QueueFull(EngineError):
    status, kind = 429, "rate_limit_error"


class Unavailable(EngineError):
    status, kind = 503, "server_error"


@dataclass(frozen=True)
class RequestParams:
    """What a request asks of each of its ``n`` choices: up to ``max_tokens`` new tokens chosen by
    ``sampling`` (choice i samples with ``sampling.seed + i``), ending at the model's end-of-sequence tokens
    (unless ``ignore_eos``), at ``stop_token_ids`` or at ``stop`` strings (left out of the text)."""

    max_tokens: int
    sampling: Sampling = Sampling()
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass
class ChoiceDelta:
    """What one choice made since the last output: its new tokens, their text (which may lag the tokens: a
    character split over tokens, or text that could begin a stop string, waits) and log-probabilities, and
    why it ended, once it has (``stop``, ``length``, or ``error``)."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    """One output of a request: the choices that made something, the token counts so far (``cached_tokens``
    of the prompt came from the prefix cache) and, on its last output, ``finished`` (with ``error`` where it
    failed: ``status`` says how the server answers)."""

    choices: list[ChoiceDelta]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    finished: bool = False
    error: str | None = None
    status: int = 200


@dataclass
class EngineStats:
    """A snapshot of the engine for ``/metrics``: requests running and waiting, KV pages in use and in all,
    prompt tokens queried and found in the prefix cache, and where the engine's time went."""

    running: int = 0
    waiting: int = 0
    kv_pages_used: int = 0
    kv_pages: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    generator: dict = field(default_factory=dict)  # the generator's counts (:class:`~.scheduler.StepStats`)
    generator_seconds: float = 0.0  # in the generator's calls
    host_seconds: float = 0.0  # the engine's own work between them, while requests ran


class _Choice:
    """One sequence of a request in the generator, and its text so far."""

    def __init__(self, index: int, seq_id: int, tokenizer, stops):
        self.index, self.seq_id = index, seq_id
        self.detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.stop = StopText(stops)
        self.seen = 0  # tokens of the completion given out so far
        self.finish_reason: str | None = None

    def take(self, completion, stop_tokens) -> ChoiceDelta:
        """What ``completion`` (the generator's) made since the last take, with its text."""
        delta = ChoiceDelta(self.index, completion.tokens[self.seen:], logprobs=completion.logprobs[self.seen:])
        self.seen = len(completion.tokens)
        ended_by_token = completion.finish_reason == "stop" and completion.tokens[-1:] and \
            completion.tokens[-1] in stop_tokens
        for i, token in enumerate(delta.token_ids):
            if self.stop.stopped:
                break
            if ended_by_token and i == len(delta.token_ids) - 1:
                break  # the stop token's text is not part of the output
            if self.detokenizer is not None:
                delta.text += self.stop.add(self.detokenizer.add(token))
        if self.stop.stopped:
            self.finish_reason = "stop"
        elif completion.finished:
            self.finish_reason = {"max_seq_len": "length"}.get(completion.finish_reason, completion.finish_reason)
        if self.finish_reason is not None and self.finish_reason != "error":
            if self.detokenizer is not None and not self.stop.stopped:
                delta.text += self.stop.add(self.detokenizer.flush())
            delta.text += self.stop.finish()
        delta.finish_reason = self.finish_reason
        return delta


class _Request:
    def __init__(self, request_id: str, prompt: list[int], params: RequestParams, loop, arrived: float):
        self.request_id, self.prompt, self.params = request_id, prompt, params
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.choices: list[_Choice] = []
        self.arrived, self.first_token, self.last_token = arrived, None, None
        self.cached_tokens = 0
        self.done = False

    def completion_tokens(self) -> int:
        return sum(c.seen for c in self.choices)

    def send(self, output: RequestOutput) -> None:
        _deliver({self.loop: [(self.queue, output)]})


def _deliver(outputs: dict) -> None:
    """Each event loop's (queue, output) pairs put in their queues, with one wake-up of the loop for all (a
    wake-up is a write to the loop's socket: one a request at every step costs the engine's thread more than
    the rest of its work for the step)."""
    for loop, pairs in outputs.items():
        try:
            loop.call_soon_threadsafe(_put_all, pairs)
        except RuntimeError:  # its event loop is closed: nobody is listening any more
            pass


def _put_all(pairs) -> None:
    for queue, output in pairs:
        queue.put_nowait(output)


class Engine:
    """Serves generation requests from any number of asyncio clients with one :class:`Generator`.

    ``make_generator``: a function returning the generator, called in the engine's thread (where every call to
    TVM's runtime is then made), e.g. ``lambda: Generator(dir, prefix_cache=True)``; ``tokenizer``: a Hugging
    Face tokenizer for the outputs' text (None: token ids only); ``max_waiting``: requests waiting for a row
    beyond which a new one is refused (:class:`QueueFull`); ``clock``: what times the requests (time to first
    token, time per output token) for ``metrics`` (an object with ``finished(ttft, tpot, tokens)``)."""

    def __init__(self, make_generator: Callable[[], object], tokenizer=None, *, max_waiting: int = 1024,
                 clock: Callable[[], float] = time.monotonic, metrics=None):
        self._make_generator = make_generator
        self.tokenizer = tokenizer
        self.max_waiting = max_waiting
        self.clock = clock
        self.metrics = metrics
        self._lock = threading.Condition()
        self._inbox: list[tuple[str, object]] = []  # ("add", request) / ("abort", request id), for the thread
        self._waiting: deque[_Request] = deque()
        self._queued = 0  # submitted and not yet admitted (the inbox's and the waiting ones)
        self._running: dict[str, _Request] = {}
        self._by_seq: dict[int, tuple[_Request, _Choice]] = {}
        self._stopping = False
        self.draining = False
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._ids = itertools.count()
        self._stats = EngineStats()
        self._generator_seconds = self._host_seconds = 0.0  # metrics only: no decision reads them
        self.gen = None
        self._grammars = None  # made at the first request under a grammar
        self._grammars_lock = threading.Lock()

    # ---- life ------------------------------------------------------------------------------------

    def start(self) -> Engine:
        """Start the engine's thread and load the generator there; raises what loading raised."""
        self._thread = threading.Thread(target=self._run, name="autosched-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._load_error is not None:
            raise self._load_error
        g = self.gen
        self.max_seq_len, self.max_batch, self.vocab = g.max_seq_len, g.max_batch, g.vocab
        self.eos_token_ids = frozenset(g.eos_token_ids)
        return self

    def stop(self) -> None:
        """End every request (with an error where one was still running) and the engine's thread."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join()

    async def drain(self, timeout: float, poll: float = 0.05) -> bool:
        """Refuse new requests from now on (:class:`Unavailable`) and wait up to ``timeout`` seconds for the
        running and waiting ones to finish; whether they all did."""
        self.draining = True
        deadline = self.clock() + timeout
        while self.stats().running + self.stats().waiting and self.clock() < deadline:
            await asyncio.sleep(poll)
        return not (self.stats().running + self.stats().waiting)

    def stats(self) -> EngineStats:
        with self._lock:
            s = self._stats
            return replace(s, running=len(self._running), waiting=self._queued)

    # ---- requests --------------------------------------------------------------------------------

    def compile(self, grammar, param: str | None = None) -> None:
        """Compile a request's grammar (:class:`~autosched.generation.grammar.GrammarSpec`) now, kept for its
        sequences; a BadRequest with XGrammar's reason where it cannot be. Blocking: asyncio code calls it in a
        worker thread (``asyncio.to_thread``)."""
        if self.tokenizer is None:
            raise BadRequest("structured output needs the model's tokenizer, and this server has none: serve with "
                             "--tokenizer DIR", param)
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = Grammars(self.tokenizer, self.vocab, self.eos_token_ids)
                self.gen.use_grammars(self._grammars)  # its sequences' states, in the engine's thread
        try:
            self._grammars.compile(grammar)
        except GrammarError as exc:
            raise BadRequest(str(exc), param) from None

    def check(self, prompt: list[int], params: RequestParams) -> None:
        """A BadRequest for a request the artifact cannot serve, before it waits."""
        if not prompt:
            raise BadRequest("the prompt is empty: give at least one token", "prompt")
        bad = next((t for t in prompt if not 0 <= t < self.vocab), None)
        if bad is not None:
            raise BadRequest(f"token id {bad} is outside the vocabulary (0 to {self.vocab - 1})", "prompt")
        for token in params.stop_token_ids:
            if not 0 <= token < self.vocab:
                raise BadRequest(f"stop token id {token} is outside the vocabulary (0 to {self.vocab - 1})",
                                 "stop_token_ids")
        if len(prompt) >= self.max_seq_len:
            raise BadRequest(f"the prompt has {len(prompt)} tokens and the model's longest sequence is "
                             f"{self.max_seq_len} tokens, the prompt and its output together: shorten the prompt",
                             "prompt")
        if params.max_tokens < 1:
            raise BadRequest(f"max_tokens must be at least 1 (got {params.max_tokens})", "max_tokens")
        if len(prompt) + params.max_tokens > self.max_seq_len:
            raise BadRequest(f"the prompt has {len(prompt)} tokens and max_tokens asks {params.max_tokens} more, "
                             f"{len(prompt) + params.max_tokens} in all, past the model's longest sequence of "
                             f"{self.max_seq_len} tokens: ask at most {self.max_seq_len - len(prompt)}", "max_tokens")
        if not 1 <= params.n <= self.max_batch:
            raise BadRequest(f"n must be 1 to {self.max_batch} (the model's --max-batch), got {params.n}", "n")

    async def generate(self, prompt: list[int], params: RequestParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as its choices make tokens, the last one ``finished``. Raises
        :class:`EngineError` before the first output for a request refused (bad, queue full, draining).
        Closing the iterator early (a client gone) aborts the request and frees its pages. A grammar
        (``params.sampling.grammar``) is compiled first, in a worker thread."""
        self.check(prompt, params)
        if params.sampling.grammar is not None:
            await asyncio.to_thread(self.compile, params.sampling.grammar)  # the engine's thread only finds it
        request = _Request(request_id or f"req-{next(self._ids)}", list(prompt), params,
                           asyncio.get_running_loop(), self.clock())
        with self._lock:
            if self.draining or self._stopping:
                raise Unavailable("the server is shutting down: send the request to another replica or retry later")
            if self._queued >= self.max_waiting:
                raise QueueFull(f"{self._queued} requests are waiting, the server's --max-waiting: retry later")
            self._queued += 1
            self._inbox.append(("add", request))
            self._lock.notify()
        try:
            while True:
                output = await request.queue.get()
                yield output
                if output.finished:
                    return
        finally:
            if not request.done:
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        """End a request now, waiting or running (its sequences leave the cache)."""
        with self._lock:
            self._inbox.append(("abort", request_id))
            self._lock.notify()

    # ---- the engine's thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.gen = self._make_generator()
        except BaseException as exc:  # noqa: BLE001 - raised again by start(), in the caller's thread
            self._load_error = exc
            self._ready.set()
            return
        self._ready.set()
        self._update_stats()
        while True:
            with self._lock:
                while not (self._inbox or self._running or self._waiting or self._stopping):
                    self._lock.wait()
                inbox, self._inbox = self._inbox, []
                stopping = self._stopping
            for kind, item in inbox:
                if kind == "add":
                    self._waiting.append(item)
                else:
                    self._abort(item)
            if stopping:
                for request in list(self._waiting) + list(self._running.values()):
                    self._finish(request, "the server stopped before the request finished", 503)
                self._waiting.clear()
                return
            began, in_generator = time.perf_counter(), self._generator_seconds
            try:
                self._admit()
                if self._running:
                    self._step()
            except Exception as exc:  # noqa: BLE001 - a bug of ours fails the requests in hand, not the server
                self._fail_all(f"internal error: {type(exc).__name__}: {_first_line(exc)}", 500, waiting=True)
            self._update_stats()
            self._host_seconds += time.perf_counter() - began - (self._generator_seconds - in_generator)

    def _abort(self, request_id: str) -> None:
        for request in self._waiting:
            if request.request_id == request_id:
                self._waiting.remove(request)
                with self._lock:
                    self._queued -= 1
                request.done = True
                return
        request = self._running.pop(request_id, None)
        if request is not None:
            request.done = True
            for choice in request.choices:
                self._leave(choice)

    def _leave(self, choice: _Choice) -> None:
        """The choice's sequence out of the generator (live or finished)."""
        if self._by_seq.pop(choice.seq_id, None) is not None:
            self.gen.remove(choice.seq_id)

    def _pages_to_come(self) -> int:
        """The pages the running sequences could still take, each up to its longest output."""
        page = self.gen.limits.page_size
        total = 0
        for seq_id in self.gen.live:
            c = self.gen.completion(seq_id)
            request, _ = self._by_seq.get(seq_id, (None, None))
            if request is None:
                continue
            length = len(request.prompt) + len(c.tokens)
            final = min(len(request.prompt) + request.params.max_tokens, self.gen.max_seq_len)
            total += scheduler.pages_needed(length, max(final - length, 0), page)
        return total

    def _admit(self) -> None:
        g = self.gen
        while self._waiting:
            request = self._waiting[0]
            params = request.params
            if len(g.live) + params.n > g.max_batch:
                return
            page = g.limits.page_size
            need = params.n * scheduler.pages_needed(0, min(len(request.prompt) + params.max_tokens, g.max_seq_len), page)
            need += max(g.decode_batches, default=1)  # a decode step's padding rows take a page each
            if not g.make_room(self._pages_to_come() + need):
                if self._running:
                    return  # wait for running requests to give pages back
                self._waiting.popleft()
                with self._lock:
                    self._queued -= 1
                self._finish(request, f"the request needs {need} pages of the KV cache, which has {g.model.kv_pages}: "
                             "ask fewer max_tokens or fewer choices, or serve with more --kv-pages", 400)
                continue
            self._waiting.popleft()
            with self._lock:
                self._queued -= 1
            stop_tokens = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
            try:
                for i in range(params.n):
                    sampling = params.sampling
                    if i:
                        sampling = _with_seed(sampling, sampling.seed + i)
                    seq_id = g.add(request.prompt, params.max_tokens, sampling, sorted(stop_tokens))
                    choice = _Choice(i, seq_id, self.tokenizer, params.stop)
                    request.choices.append(choice)
                    self._by_seq[seq_id] = (request, choice)
            except GenerationError as exc:
                for choice in request.choices:
                    self._leave(choice)
                self._finish(request, str(exc), 400)
                continue
            request.cached_tokens = g.completion(request.choices[0].seq_id).cached_tokens
            request.stop_tokens = frozenset(stop_tokens)
            self._running[request.request_id] = request

    def _step(self) -> None:
        """A step of the generator, its outputs sent. Sequences that joined are prefilled first and their
        first tokens sent before the step that decodes every sequence: a new request's first token does not
        wait for the running ones' next token."""
        began = time.perf_counter()
        try:
            if self.gen.waiting:
                self.gen.prefill()
                self._generator_seconds += time.perf_counter() - began
                self._send_outputs()
                began = time.perf_counter()
            self.gen.step()
        except Exception as exc:  # noqa: BLE001 - the requests of this step fail; the engine goes on
            self._fail_all(f"the step failed: {type(exc).__name__}: {_first_line(exc)}", 500)
            return
        finally:
            self._generator_seconds += time.perf_counter() - began
        self._send_outputs()

    def _send_outputs(self) -> None:
        """What each running request made since its last output, sent to its client."""
        now = self.clock()
        outputs: dict = {}
        for request in list(self._running.values()):
            deltas, errors = [], []
            for choice in request.choices:
                if choice.finish_reason is not None:
                    continue
                completion = self.gen.completion(choice.seq_id)
                delta = choice.take(completion, request.stop_tokens)
                if delta.token_ids or delta.text or delta.finish_reason:
                    deltas.append(delta)
                if choice.finish_reason == "error":
                    errors.append(completion.error)
                if choice.finish_reason is not None:
                    self._leave(choice)
            if any(d.token_ids for d in deltas):
                request.first_token = request.first_token if request.first_token is not None else now
                request.last_token = now
            finished = all(c.finish_reason is not None for c in request.choices)
            if finished:
                del self._running[request.request_id]
                request.done = True
                self._observe(request)
            if deltas or finished:
                output = RequestOutput(deltas, len(request.prompt), request.completion_tokens(), request.cached_tokens,
                                       finished, errors[0] if errors else None, 500 if errors else 200)
                outputs.setdefault(request.loop, []).append((request.queue, output))
        _deliver(outputs)

    def _fail_all(self, reason: str, status: int, waiting: bool = False) -> None:
        """Fail every running request (and the waiting ones too, with ``waiting``), then start again from a
        clean cache: the call that failed left it as it was midway."""
        failed = list(self._running.values())
        if waiting:
            failed += list(self._waiting)
            with self._lock:
                self._queued -= len(self._waiting)
            self._waiting.clear()
        for request in failed:
            self._finish(request, reason, status)
        self._running.clear()
        self._by_seq.clear()
        self.gen.reset()

    def _finish(self, request: _Request, error: str, status: int) -> None:
        request.done = True
        request.send(RequestOutput([], len(request.prompt), request.completion_tokens(), request.cached_tokens,
                                   True, error, status))

    def _observe(self, request: _Request) -> None:
        if self.metrics is None or request.first_token is None:
            return
        tokens = max((c.seen for c in request.choices), default=0)
        tpot = (request.last_token - request.first_token) / (tokens - 1) if tokens > 1 else None
        self.metrics.finished(request.first_token - request.arrived, tpot, request.completion_tokens())

    def _update_stats(self) -> None:
        g = self.gen
        cache = g.prefix_cache
        with self._lock:
            self._stats = EngineStats(kv_pages_used=g.model.total_pages - g.model.free_pages(),
                                      kv_pages=g.model.total_pages,
                                      prefix_queried_tokens=cache.queried_tokens if cache is not None else 0,
                                      prefix_hit_tokens=cache.hit_tokens if cache is not None else 0,
                                      generator=dict(g.stats), generator_seconds=self._generator_seconds,
                                      host_seconds=self._host_seconds)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def _with_seed(sampling: Sampling, seed: int) -> Sampling:
    return replace(sampling, seed=seed)


def random_seed() -> int:
    """A seed for a request that gives none (OpenAI's: a different draw each time)."""
    return int.from_bytes(os.urandom(4), "little")
