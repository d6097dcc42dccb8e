"""The OpenAI-compatible HTTP API over an :class:`~.engine.Engine` (FastAPI): ``/v1/models``,
``/v1/completions``, ``/v1/chat/completions`` (whole or streamed as server-sent events), ``/health`` and
``/metrics``. Every refusal is OpenAI's error object with its status (400 bad field, 401 key, 404 model,
413 body, 429 queue, 503 shutting down); a request that fails inside the engine gets 500 (or an error event
where it was streaming) and the others go on."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from autosched.generation.grammar import GrammarSpec
from autosched.generation.request import Sampling

from .engine import BadRequest, EngineError, RequestOutput, RequestParams, random_seed
from .metrics import ServerMetrics
from .protocol import ERROR_KINDS, ChatCompletionRequest, CompletionRequest, error_body
from .structured import StructuredError, ToolPlan, request_grammar, template_message
from .tokenizer import render_chat

MAX_BODY_BYTES = 32 << 20  # a request body past this is refused (413)


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.param, self.headers = status, param, headers or {}


class _GuardAndCount:
    """The API key check on ``/v1/`` and the count of answers by endpoint and status, as plain ASGI: Starlette's
    ``BaseHTTPMiddleware`` would pass every chunk of a stream through a task and a queue of its own."""

    def __init__(self, app, api_key: str | None, metrics: ServerMetrics):
        self.app, self.api_key, self.metrics = app, api_key, metrics

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/v1/"):
            return await self.app(scope, receive, send)
        status = 500  # where the app sends nothing

        async def counting(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if self.api_key is not None and given != f"Bearer {self.api_key}":
                response = error_response(401, "the API key is missing or wrong: send it as 'Authorization: Bearer KEY'")
                await response(scope, receive, counting)
            else:
                await self.app(scope, receive, counting)
        finally:
            self.metrics.requests.labels(path, str(status)).inc()


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, ERROR_KINDS.get(status, "server_error"), param, status), status_code=status,
                        headers=headers)


def create_app(engine, model_name: str, *, api_key: str | None = None, metrics: ServerMetrics | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, retry_after: int = 1) -> FastAPI:
    """The server's app over a started ``engine``, serving ``model_name``."""
    app = FastAPI(title="autosched", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = metrics or ServerMetrics(engine)
    app.state.engine, app.state.metrics = engine, metrics
    tokenizer = engine.tokenizer
    created = int(time.time())

    app.add_middleware(_GuardAndCount, api_key=api_key, metrics=metrics)

    @app.exception_handler(HTTPError)
    async def on_http_error(_request: Request, exc: HTTPError):
        return error_response(exc.status, str(exc), exc.param, exc.headers)

    @app.exception_handler(EngineError)
    async def on_engine_error(_request: Request, exc: EngineError):
        headers = {"Retry-After": str(retry_after)} if exc.status == 429 else None
        return error_response(exc.status, str(exc), exc.param, headers)

    @app.exception_handler(404)
    async def not_found(request: Request, _exc):
        return error_response(404, f"no such endpoint: {request.method} {request.url.path}")

    @app.exception_handler(405)
    async def not_allowed(request: Request, _exc):
        return error_response(405, f"{request.url.path} does not take {request.method}")

    @app.get("/health")
    async def health():
        if engine.draining:
            return error_response(503, "the server is shutting down")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "autosched", "max_model_len": engine.max_seq_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = _parse(CompletionRequest, await _read_json(request, max_body_bytes))
        _check_model(body.model, model_name)
        for name, wrong in (("echo", body.echo), ("suffix", body.suffix is not None),
                            ("best_of", body.best_of not in (None, body.n))):
            if wrong:
                raise HTTPError(400, f"{name} is not supported by this server: leave it out", name)
        prompts = _prompts(body.prompt, tokenizer)
        grammar, param = _structured(body)
        params = _params(body, body.max_tokens, body.logprobs, engine, prompts, grammar)
        await _compile(engine, grammar, param)
        rid = f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            return _sse(_stream_completions(engine, prompts, params, rid, model_name, created, body, tokenizer))
        outputs = await _until_done_or_gone(request, _collect(engine, prompts, params, rid))
        choices, usage = [], _Usage()
        for p, (prompt, result) in enumerate(zip(prompts, outputs)):
            usage.add(prompt, result)
            choices += [_completion_choice(p * params.n + c.index, c, body, tokenizer, prompt) for c in result.choices]
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name,
                "choices": choices, "usage": usage.body()}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = _parse(ChatCompletionRequest, await _read_json(request, max_body_bytes))
        _check_model(body.model, model_name)
        if tokenizer is None:
            raise HTTPError(400, "this server has no tokenizer, so no chat template: serve with --tokenizer DIR, or "
                            "build the artifact from a model folder with its tokenizer", "messages")
        messages = [template_message(_message(m)) for m in body.messages]
        try:
            tools = ToolPlan(body.tools, body.tool_choice, body.parallel_tool_calls)
        except StructuredError as exc:
            raise HTTPError(400, str(exc), exc.param) from None
        grammar, param = _structured(body)
        if tools.grammar is not None:
            if grammar is not None:
                raise HTTPError(400, f"tool_choice {tools.mode!r} and {param} both constrain the output: give one",
                                param)
            grammar, param = tools.grammar, "tools"
        try:
            prompt = render_chat(tokenizer, messages, tools=tools.template_tools,
                                 add_generation_prompt=body.add_generation_prompt, **(body.chat_template_kwargs or {}))
        except ValueError as exc:
            raise HTTPError(400, str(exc), "messages") from None
        except Exception as exc:  # noqa: BLE001 - a template error (jinja2) is the request's
            raise HTTPError(400, f"the chat template failed on these messages: {exc}", "messages") from None
        top = body.top_logprobs if body.logprobs else None
        if body.top_logprobs is not None and not body.logprobs:
            raise HTTPError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if body.logprobs and top is None:
            top = 0
        params = _params(body, body.max_completion_tokens or body.max_tokens, top, engine, [prompt], grammar)
        await _compile(engine, grammar, param)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            return _sse(_stream_chat(engine, prompt, params, rid, model_name, body, tokenizer, tools))
        (result,) = await _until_done_or_gone(request, _collect(engine, [prompt], params, rid))
        usage = _Usage()
        usage.add(prompt, result)
        choices = []
        for c in result.choices:
            message, finish_reason = {"role": "assistant", "content": c.text}, c.finish_reason
            calls = tools.calls(c.text) if tools.reads_calls and finish_reason == "stop" else None
            if calls:
                message, finish_reason = {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
            choice = {"index": c.index, "message": message,
                      "logprobs": {"content": _chat_logprobs(c.token_ids, c.logprobs, tokenizer)} if body.logprobs
                      else None, "finish_reason": finish_reason}
            if body.return_token_ids:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model_name,
                "choices": choices, "usage": usage.body()}

    return app


# ---- reading requests -------------------------------------------------------------------------------

async def _read_json(request: Request, limit: int) -> dict:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HTTPError(413, f"the request body has {declared} bytes, more than this server takes ({limit})")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPError(413, f"the request body is larger than this server takes ({limit} bytes)")
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as exc:
        raise HTTPError(400, f"the request body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "the request body must be a JSON object")
    return body


def _parse(model, body: dict):
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        raise HTTPError(400, f"{param}: {first['msg']}" if param else first["msg"], param) from None


def _check_model(name: str | None, served: str) -> None:
    if name is not None and name != served:
        raise HTTPError(404, f"the model '{name}' does not exist: this server serves '{served}'", "model")


def _prompts(prompt, tokenizer) -> list[list[int]]:
    """A completion request's prompts as token ids: a string, a list of strings, token ids, or a list of those."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompt = [prompt]
    if not prompt:
        raise HTTPError(400, "the prompt is empty: give text or token ids", "prompt")
    out = []
    for p in prompt:
        if isinstance(p, str):
            if tokenizer is None:
                raise HTTPError(400, "this server has no tokenizer: give the prompt as token ids, or serve with "
                                "--tokenizer DIR", "prompt")
            p = tokenizer.encode(p)
        out.append(list(p))
    return out


def _message(message) -> dict:
    """A chat message as the template takes it: content parts joined into text."""
    out = message.model_dump(exclude_none=True)
    content = out.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise HTTPError(400, f"only text content parts are supported (got type {part.get('type')!r})",
                                "messages")
            texts.append(part["text"])
        out["content"] = "".join(texts)
    return out


def _structured(body) -> tuple[GrammarSpec | None, str | None]:
    """The grammar a request's structured-output fields ask for (None: none), and the field that asks."""
    try:
        grammar = request_grammar(body)
    except StructuredError as exc:
        raise HTTPError(400, str(exc), exc.param) from None
    if grammar is None:
        return None, None
    fields = ("response_format", "guided_json", "guided_regex", "guided_grammar", "guided_choice", "structured_outputs")
    return grammar, next(f for f in fields if getattr(body, f) is not None)


async def _compile(engine, grammar: GrammarSpec | None, param: str | None) -> None:
    """Compile a request's grammar before it waits or streams (a worker thread: XGrammar takes milliseconds to
    seconds); a grammar XGrammar cannot compile is the request's 400."""
    if grammar is not None:
        await asyncio.to_thread(engine.compile, grammar, param)


def _params(body, max_tokens: int | None, logprobs: int | None, engine, prompts: list[list[int]],
            grammar: GrammarSpec | None = None) -> RequestParams:
    """The engine's parameters of a request (the same for each of its prompts), checked."""
    if max_tokens is None:  # as much as the longest prompt leaves room for
        max_tokens = max(1, engine.max_seq_len - max(len(p) for p in prompts))
    greedy = body.temperature == 0
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    bias = []
    for key, value in (body.logit_bias or {}).items():
        if not key.lstrip("-").isdigit() or not 0 <= int(key) < engine.vocab:
            raise HTTPError(400, f"logit_bias key {key!r} is not a token id of the vocabulary (0 to {engine.vocab - 1})",
                            "logit_bias")
        if not -100 <= value <= 100:
            raise HTTPError(400, f"logit_bias of token {key} is {value}, outside [-100, 100]", "logit_bias")
        bias.append((int(key), float(value)))
    try:
        sampling = Sampling(body.temperature, 0 if greedy else max(body.top_k, 0), 1.0 if greedy else body.top_p,
                            body.seed if body.seed is not None else random_seed(),
                            min_p=0.0 if greedy else body.min_p, repetition_penalty=body.repetition_penalty,
                            frequency_penalty=body.frequency_penalty, presence_penalty=body.presence_penalty,
                            logit_bias=tuple(bias), logprobs=logprobs, grammar=grammar)
    except Exception as exc:  # noqa: BLE001 - Sampling's UsageError names the field
        raise HTTPError(400, str(exc)) from None
    params = RequestParams(max_tokens, sampling, body.n, tuple(stop), tuple(body.stop_token_ids or ()), body.ignore_eos)
    for prompt in prompts:
        engine.check(prompt, params)
    return params


# ---- running them -----------------------------------------------------------------------------------

class _Result:
    """A choice's whole output, gathered."""

    def __init__(self, index: int):
        self.index, self.token_ids, self.text, self.logprobs, self.finish_reason = index, [], "", [], None


class _Gathered:
    def __init__(self, n: int):
        self.choices = [_Result(i) for i in range(n)]
        self.completion_tokens = self.cached_tokens = 0


async def _collect(engine, prompts, params: RequestParams, rid: str) -> list[_Gathered]:
    async def one(i, prompt):
        gathered = _Gathered(params.n)
        async for out in engine.generate(prompt, params, f"{rid}-{i}"):
            _raise_failed(out)
            for d in out.choices:
                c = gathered.choices[d.index]
                c.token_ids += d.token_ids
                c.text += d.text
                c.logprobs += d.logprobs
                c.finish_reason = d.finish_reason or c.finish_reason
            gathered.completion_tokens, gathered.cached_tokens = out.completion_tokens, out.cached_tokens
        return gathered

    tasks = [asyncio.ensure_future(one(i, p)) for i, p in enumerate(prompts)]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


def _raise_failed(out: RequestOutput) -> None:
    if out.error is not None:
        if out.status == 400:
            raise BadRequest(out.error)
        error = EngineError(out.error)
        error.status = out.status
        raise error


async def _until_done_or_gone(request: Request, work):
    """``work``'s result, or its cancellation (the engine's requests aborted) when the client disconnects."""
    task = asyncio.ensure_future(work)

    async def gone():
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        raise HTTPError(499, "the client disconnected")
    return task.result()


class _Usage:
    def __init__(self):
        self.prompt = self.completion = self.cached = 0

    def add(self, prompt, gathered) -> None:
        self.prompt += len(prompt)
        self.completion += gathered.completion_tokens
        self.cached += gathered.cached_tokens

    def body(self) -> dict:
        return {"prompt_tokens": self.prompt, "completion_tokens": self.completion,
                "total_tokens": self.prompt + self.completion,
                "prompt_tokens_details": {"cached_tokens": self.cached}}


def _sse(events: AsyncIterator[dict]) -> StreamingResponse:
    async def lines():
        async for event in events:
            yield f"data: {json.dumps(event, separators=(',', ':'))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _merged(engine, prompts, params, rid) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) of every prompt's request as they come."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, prompt):
        try:
            async for out in engine.generate(prompt, params, f"{rid}-{i}"):
                await queue.put((i, out))
        except EngineError as exc:
            await queue.put((i, RequestOutput([], len(prompt), 0, 0, True, str(exc), exc.status)))

    tasks = [asyncio.ensure_future(pump(i, p)) for i, p in enumerate(prompts)]
    try:
        for _ in range(sum(1 for _ in prompts)):
            while True:
                i, out = await queue.get()
                yield i, out
                if out.finished:
                    break
    finally:
        for task in tasks:
            task.cancel()


def _completion_choice(index: int, made, body, tokenizer, prompt: list[int] | None = None) -> dict:
    """A completion's choice (whole) or its chunk (streamed): what one choice ``made`` (its text, tokens and
    log-probabilities, and why it ended); its prompt's ids too, where given."""
    choice = {"index": index, "text": made.text,
              "logprobs": _completion_logprobs(made.token_ids, made.logprobs, tokenizer)
              if body.logprobs is not None else None, "finish_reason": made.finish_reason}
    if body.return_token_ids:
        choice["token_ids"] = made.token_ids
        if prompt is not None:
            choice["prompt_token_ids"] = prompt
    return choice


def _stream_error(out: RequestOutput) -> dict:
    return error_body(out.error, ERROR_KINDS.get(out.status, "server_error"), None, out.status)


async def _stream_completions(engine, prompts, params, rid, model_name, created, body, tokenizer):
    usage = _Usage()
    finished = 0
    async for p, out in _merged(engine, prompts, params, rid):
        if out.error is not None:
            yield _stream_error(out)
            return
        choices = [_completion_choice(p * params.n + d.index, d, body, tokenizer) for d in out.choices]
        if choices:
            yield {"id": rid, "object": "text_completion", "created": created, "model": model_name, "choices": choices}
        if out.finished:
            finished += 1
            usage.prompt += out.prompt_tokens
            usage.completion += out.completion_tokens
            usage.cached += out.cached_tokens
    if (body.stream_options or {}).get("include_usage"):
        yield {"id": rid, "object": "text_completion", "created": created, "model": model_name, "choices": [],
               "usage": usage.body()}


async def _stream_chat(engine, prompt, params, rid, model_name, body, tokenizer, tools):
    created = int(time.time())
    held = {i: "" for i in range(params.n)} if tools.reads_calls else {}  # text that may still be a call

    def chunk(choices, **extra):
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                "choices": choices} | extra

    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                 for i in range(params.n)])
    usage = _Usage()
    async for _, out in _merged(engine, [prompt], params, rid):
        if out.error is not None:
            yield _stream_error(out)
            return
        choices = []
        for d in out.choices:
            text, finish_reason, delta = d.text, d.finish_reason, {}
            if d.index in held:  # held back while it may be a call; read as one at the end
                text = held.pop(d.index) + text
                if finish_reason is None and tools.may_be_call(text):
                    held[d.index], text = text, ""
                elif finish_reason == "stop" and (calls := tools.calls(text)):
                    text, finish_reason = "", "tool_calls"
                    delta["tool_calls"] = [call | {"index": i} for i, call in enumerate(calls)]
            if text:
                delta["content"] = text
            if not (delta or finish_reason or body.logprobs or body.return_token_ids):
                continue  # its text held back
            choice = {"index": d.index, "delta": delta,
                      "logprobs": {"content": _chat_logprobs(d.token_ids, d.logprobs, tokenizer)} if body.logprobs
                      else None, "finish_reason": finish_reason}
            if body.return_token_ids:
                choice["token_ids"] = d.token_ids
            choices.append(choice)
        if choices:
            yield chunk(choices)
        if out.finished:
            usage.prompt, usage.completion, usage.cached = out.prompt_tokens, out.completion_tokens, out.cached_tokens
    if (body.stream_options or {}).get("include_usage"):
        yield chunk([], usage=usage.body())


# ---- log-probabilities as OpenAI writes them -------------------------------------------------------

def _token_text(token: int, tokenizer) -> str:
    return tokenizer.decode([token]) if tokenizer is not None else f"token_id:{token}"


def _completion_logprobs(token_ids, logprobs, tokenizer) -> dict:
    tokens = [_token_text(t, tokenizer) for t in token_ids]
    offsets, at = [], 0
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{_token_text(t, tokenizer): v for t, v in lp.top} for lp in logprobs],
            "text_offset": offsets}


def _chat_logprobs(token_ids, logprobs, tokenizer) -> list[dict]:
    def entry(token, value):
        text = _token_text(token, tokenizer)
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

    return [entry(t, lp.logprob) | {"top_logprobs": [entry(u, v) for u, v in lp.top]}
            for t, lp in zip(token_ids, logprobs)]
