"""``autosched serve``: the OpenAI-compatible server over a tiny generation artifact, tested over HTTP with the
real ``openai`` client (sync and async) and a tokenizer trained here with ``tokenizers``: completions and chat,
streamed and not; concurrent requests given the tokens they get alone; seeded sampling that ignores its
batch; stop strings across token boundaries; log-probabilities and penalties against float64 references on
transformers' model; the prefix cache; disconnects, the queue's limit, bad input, a failing step and SIGTERM.

One artifact is built for the file; one server process (``autosched serve``) serves most tests, others run
an :class:`~autosched.serve.Engine` and its app in this process, where a test holds the engine's steps."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import threading

import numpy as np
import openai  # the client users reach the server with (the test extra installs it)
import pytest

from .helpers import cli, start, train_tokenizer

# The slow tier: one artifact build and three server processes (tests/test_serve_parts.py: the parts without).
pytestmark = [pytest.mark.xdist_group("serve-artifact"), pytest.mark.timeout(300), pytest.mark.slow]

transformers = pytest.importorskip("transformers", reason="pip install -e '.[test]' installs transformers")

MAX_SEQ_LEN, MAX_BATCH, PAGE = 128, 4, 16
API_KEY = "sk-test"
PROMPTS = ["Once upon a time", "The quick brown fox", "JSON looks like", "Naïve café owners wrote",
           "emoji 🙂 and 中文 text", "It learned to batch their requests"]


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    """(transformers' model, the artifact folder, the tokenizer): a tiny Llama whose folder holds a trained
    tokenizer with a chat template, built through the command line (which copies the tokenizer)."""
    import torch

    from autosched.examples.hf import TINY, _config

    root = tmp_path_factory.mktemp("serve")
    config, cls = _config("llama", TINY)
    torch.manual_seed(3)
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
            elif "norm" in name:
                p.normal_(1.0, 0.1)
    model.save_pretrained(root / "hf")
    tokenizer = train_tokenizer(root / "hf")
    cli("build", str(root / "hf"), "--generate", "-o", str(root / "art"), "--max-seq-len", str(MAX_SEQ_LEN),
        "--max-batch", str(MAX_BATCH), "--decode-batches", "1,2,4", "--prefill-chunks", "16",
        "--db", str(root / "none.db"))
    return model, root / "art", tokenizer


def _serve(*args):
    """``autosched serve ARGS`` started on a free port: (the process, its base URL)."""
    proc = start("serve", *args, "--port", "0")
    lines = []
    for line in proc.stderr:
        lines.append(line)
        found = re.search(r"at (http://[\d.]+:\d+/v1)", line)
        if found:
            return proc, found.group(1)
    raise AssertionError(f"the server did not start (exit {proc.wait()}):\n{''.join(lines)}")


@pytest.fixture(scope="session")
def server(built):
    proc, url = _serve(str(built[1]), "--api-key", API_KEY, "--served-model-name", "tiny")
    yield url
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)


@pytest.fixture(scope="session")
def plain_server(built):
    """A second server of the same artifact, without the prefix cache."""
    proc, url = _serve(str(built[1]), "--no-prefix-cache")
    yield url
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)


@pytest.fixture(scope="session")
def client(server):
    return openai.OpenAI(base_url=server, api_key=API_KEY, max_retries=0, timeout=120)


def _alone(artifact, prompts, new, **sampling):
    """Each prompt's tokens served alone (``new`` of them, or ``new[i]`` for prompt i) by a Generator of its own
    (no prefix cache), ignoring the end-of-sequence token as the requests do (``ignore_eos``)."""
    from autosched.generation import Generator, Sampling

    gen = Generator(artifact)
    out = []
    for i, prompt in enumerate(prompts):
        seq = gen.add(prompt, new[i] if isinstance(new, list) else new, Sampling(**sampling), stop_tokens=[])
        while seq in gen.live:
            gen.step()
        out.append(gen.remove(seq).tokens)
    return out


def _ids(tokenizer, text):
    return tokenizer.encode(text)


# ---- the API, whole and streamed -----------------------------------------------------------------------------

def test_completions_and_chat_whole_and_streamed_give_the_tokens_and_text_of_the_model(built, client):
    model, artifact, tokenizer = built
    assert [m.id for m in client.models.list().data] == ["tiny"]
    prompt = _ids(tokenizer, PROMPTS[0])
    (expected,) = _alone(artifact, [prompt], 12)
    whole = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = whole.choices[0]
    assert choice.token_ids == expected and choice.finish_reason == "length"
    assert choice.text == tokenizer.decode(expected, skip_special_tokens=True)
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(prompt), 12)

    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPTS[1]}]
    chat_prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                                   add_special_tokens=False)
    (expected,) = _alone(artifact, [chat_prompt], 10)
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                           extra_body={"return_token_ids": True, "ignore_eos": True})
    assert reply.choices[0].token_ids == expected and reply.usage.prompt_tokens == len(chat_prompt)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)
    streamed = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True}))
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == reply.choices[0].message.content
    assert streamed[-1].choices[0].finish_reason == "length"


def test_prompts_as_token_ids_lists_and_n_choices(built, client):
    _, artifact, tokenizer = built
    prompts = [_ids(tokenizer, p) for p in PROMPTS[:3]]
    expected = _alone(artifact, prompts, 6)
    out = client.completions.create(model="tiny", prompt=prompts, max_tokens=6, temperature=0, n=2,
                                    extra_body={"return_token_ids": True, "ignore_eos": True})
    assert [c.index for c in out.choices] == list(range(6))
    assert [c.token_ids for c in out.choices] == [e for e in expected for _ in range(2)]
    one = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=6, temperature=0,
                                    extra_body={"return_token_ids": True, "ignore_eos": True})
    assert one.choices[0].token_ids == expected[0]


def test_64_concurrent_greedy_requests_each_get_the_tokens_they_get_alone(built, server):
    """Async clients, many more requests than the artifact's batch: they queue, join the running batch at
    its next step (decode batches of 1, 2, 4 and prefill chunks shared), and leave it as they finish."""
    _, artifact, tokenizer = built
    rng = np.random.default_rng(0)
    prompts = [_ids(tokenizer, PROMPTS[i % len(PROMPTS)]) + rng.integers(3, 500, size=int(rng.integers(1, 20))).tolist()
               for i in range(64)]
    lengths = [int(n) for n in rng.integers(4, 24, size=64)]
    expected = _alone(artifact, prompts, lengths)

    async def run():
        aclient = openai.AsyncOpenAI(base_url=server, api_key=API_KEY, max_retries=0, timeout=120)

        async def one(prompt, n, stream):
            if not stream:
                out = await aclient.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0,
                                                       extra_body={"return_token_ids": True, "ignore_eos": True})
                return out.choices[0].token_ids
            tokens = []
            async for chunk in await aclient.completions.create(
                    model="tiny", prompt=prompt, max_tokens=n, temperature=0, stream=True,
                    extra_body={"return_token_ids": True, "ignore_eos": True}):
                tokens += chunk.choices[0].token_ids if chunk.choices else []
            return tokens

        try:
            return await asyncio.gather(*(one(p, n, i % 2) for i, (p, n) in enumerate(zip(prompts, lengths))))
        finally:
            await aclient.close()

    assert asyncio.run(run()) == expected


def test_a_seeded_sampled_request_gets_its_tokens_whatever_shares_its_batch(built, server):
    _, artifact, tokenizer = built
    prompt = _ids(tokenizer, PROMPTS[2])
    ask = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0.9, "top_p": 0.95, "seed": 1234,
           "extra_body": {"return_token_ids": True, "top_k": 50, "ignore_eos": True}}

    async def run(company: int):
        aclient = openai.AsyncOpenAI(base_url=server, api_key=API_KEY, max_retries=0, timeout=120)
        # greedy and sampled company, some of it choosing on the host (log-probabilities)
        others = [aclient.completions.create(model="tiny", prompt=_ids(tokenizer, PROMPTS[i % 6]), max_tokens=20,
                                             temperature=0.7 if i % 2 else 0, seed=i, logprobs=2 if i % 3 else None,
                                             extra_body={"ignore_eos": True})
                  for i in range(company)]
        try:
            results = await asyncio.gather(aclient.completions.create(**ask), *others)
        finally:
            await aclient.close()
        return results[0].choices[0].token_ids

    alone = asyncio.run(run(0))
    assert len(set(alone)) > 3
    assert asyncio.run(run(7)) == alone


def test_stop_strings_across_token_boundaries_end_the_text_before_them(built, client):
    _, artifact, tokenizer = built
    prompt = _ids(tokenizer, PROMPTS[3])
    pieces = [c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True, extra_body={"ignore_eos": True})]
    text = "".join(pieces)
    # a stop string of the last character of one streamed piece and the first of the next
    at = next(i for i in range(len(pieces) - 1) if pieces[i] and pieces[i + 1] and sum(map(len, pieces[:i])) > 3)
    stop = pieces[at][-1] + pieces[at + 1][0]
    expected = text[:text.index(stop)]
    for stream in (False, True):
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=[stop, "zzzz"],
                                        stream=stream, extra_body={"ignore_eos": True})
        chunks = list(out) if stream else [out]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs_equal_a_float64_log_softmax_of_the_model(built, server, client):
    """Log-probabilities (found on the device: no step reads its logits back) against transformers' float64."""
    import torch

    model, _, tokenizer = built
    host_calls = _metric(server, "autosched_generator_host_sample_calls_total")
    prompt = _ids(tokenizer, PROMPTS[4])
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=3,
                                    extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = out.choices[0]
    tokens = choice.token_ids
    with torch.no_grad():
        logits = model.double()(torch.tensor([prompt + tokens])).logits[0]
        model.float()
    reference = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1).numpy()
    got = np.asarray(choice.logprobs.token_logprobs)
    assert np.abs(got - reference[np.arange(len(tokens)), tokens]).max() < 1e-3
    # the top tokens (chat's list; the completions' dict folds tokens of the same text)
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0, logprobs=True,
                                          top_logprobs=3, extra_body={"return_token_ids": True, "ignore_eos": True})
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                              add_special_tokens=False)
    tokens = chat.choices[0].token_ids
    with torch.no_grad():
        logits = model.double()(torch.tensor([prompt + tokens])).logits[0]
        model.float()
    reference = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1).numpy()
    for step, entry in enumerate(chat.choices[0].logprobs.content):
        assert abs(entry.logprob - reference[step, tokens[step]]) < 1e-3
        top = [t.logprob for t in entry.top_logprobs]
        assert np.abs(np.asarray(top) - np.sort(reference[step])[::-1][:3]).max() < 1e-3
    assert _metric(server, "autosched_generator_host_sample_calls_total") == host_calls


def test_penalties_and_logit_bias_change_the_tokens_as_the_same_rule_on_transformers_logits(built, server, client):
    """The rules (applied on the device: no step reads its logits back) as the same rules on transformers'."""
    import torch

    model, _, tokenizer = built
    host_calls = _metric(server, "autosched_generator_host_sample_calls_total")
    prompt = _ids(tokenizer, PROMPTS[5])
    rules = {"frequency_penalty": 0.8, "presence_penalty": 0.5, "logit_bias": {"7": 4.0, "300": -100.0},
             "extra_body": {"repetition_penalty": 1.3, "return_token_ids": True, "ignore_eos": True}}
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0, **rules)
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
    tokens = []
    with torch.no_grad():
        for _ in range(20):
            logits = model(torch.tensor([prompt + tokens])).logits[0, -1].double().numpy()
            logits[7] += 4.0
            logits[300] -= 100.0
            seen = np.unique(prompt + tokens)
            logits[seen] = np.where(logits[seen] > 0, logits[seen] / 1.3, logits[seen] * 1.3)
            counts = np.bincount(tokens, minlength=logits.size)
            logits -= 0.8 * counts + 0.5 * (counts > 0)
            tokens.append(int(np.argmax(logits)))
    assert out.choices[0].token_ids == tokens
    assert plain.choices[0].token_ids != tokens
    assert _metric(server, "autosched_generator_host_sample_calls_total") == host_calls


def test_prefix_caching_reuses_a_shared_system_prompt_with_the_same_tokens(built, server, client, plain_server):
    _, artifact, tokenizer = built
    system = tokenizer.encode(" ".join(["Respond kindly and briefly to the user."] * 6))[:70]
    prompts = [system + _ids(tokenizer, p) for p in PROMPTS[:4]]
    expected = _alone(artifact, prompts, 8)
    hits_before = _metric(server, "autosched_prefix_cache_hit_tokens_total")
    prefilled_before = _metric(server, "autosched_generator_prefill_tokens_total")
    got, cached = [], []
    for prompt in prompts:
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                        extra_body={"return_token_ids": True, "ignore_eos": True})
        got.append(out.choices[0].token_ids)
        cached.append(out.usage.prompt_tokens_details.cached_tokens)
    assert got == expected
    assert cached[1:] == [len(system) // PAGE * PAGE] * 3  # the system prompt's whole pages, after the first
    assert _metric(server, "autosched_prefix_cache_hit_tokens_total") - hits_before >= 3 * (len(system) // PAGE * PAGE)
    assert 0 < _metric(server, "autosched_prefix_cache_hit_rate") <= 1
    # only what the cache did not hold was prefilled, and the engine says where its time went
    prefilled = _metric(server, "autosched_generator_prefill_tokens_total") - prefilled_before
    assert prefilled == sum(map(len, prompts)) - sum(cached)
    assert _metric(server, "autosched_engine_generator_seconds_total") > 0
    assert _metric(server, "autosched_engine_host_seconds_total") > 0
    plain = openai.OpenAI(base_url=plain_server, api_key="none", max_retries=0, timeout=120)
    for prompt, tokens in zip(prompts, expected):
        out = plain.completions.create(model="art", prompt=prompt, max_tokens=8, temperature=0,
                                       extra_body={"return_token_ids": True, "ignore_eos": True})
        assert out.choices[0].token_ids == tokens and out.usage.prompt_tokens_details.cached_tokens == 0
    assert _metric(plain_server, "autosched_prefix_cache_hit_tokens_total") == 0


def test_the_prefix_cache_gives_pages_back_when_the_cache_runs_short(built):
    """A cache of few pages: kept prefixes are evicted for new sequences, and the tokens stay those without."""
    from autosched.generation import Generator

    _, artifact, tokenizer = built
    pages = MAX_SEQ_LEN // PAGE + 4
    gen = Generator(artifact, kv_pages=pages, prefix_cache=True)
    prompts = [_ids(tokenizer, p) * 4 for p in PROMPTS]
    got = [gen.generate([p], 8)[0] for p in prompts]
    assert [c.error for c in got] == [None] * len(prompts)
    assert [c.tokens for c in got] == _alone(artifact, prompts, 8)
    assert len(gen.prefix_cache) < 2 * len(prompts)  # some were evicted
    gen.use_prefix_cache(False)
    assert gen.model.free_pages() == gen.model.total_pages


def test_bad_input_gets_its_status_and_openai_error_and_the_server_keeps_serving(built, server, client):
    import httpx

    _, artifact, tokenizer = built
    headers = {"Authorization": f"Bearer {API_KEY}"}
    cases = [
        ({"prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": [3, 512]}, 400, "prompt"),
        ({"prompt": list(range(3, 5 + MAX_SEQ_LEN))}, 400, "prompt"),
        ({"prompt": [3, 4], "max_tokens": MAX_SEQ_LEN}, 400, "max_tokens"),
        ({"prompt": "x", "n": MAX_BATCH + 1}, 400, "n"),
        ({"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
        ({"prompt": "x", "echo": True}, 400, "echo"),
        ({"model": "gpt-4", "prompt": "x"}, 404, "model"),
        ({}, 400, "prompt"),
    ]
    with httpx.Client(base_url=server.removesuffix("/v1"), timeout=60) as http:
        for body, status, param in cases:
            answer = http.post("/v1/completions", json=body, headers=headers)
            error = answer.json()["error"]
            assert (answer.status_code, error["param"]) == (status, param), (body, answer.text)
            assert error["message"] and error["type"] and "\n" not in error["message"]
        too_long = http.post("/v1/completions", json={"prompt": list(range(3, 5 + MAX_SEQ_LEN))}, headers=headers)
        assert f"{MAX_SEQ_LEN + 2} tokens" in too_long.json()["error"]["message"]  # both lengths said
        assert f"{MAX_SEQ_LEN} tokens" in too_long.json()["error"]["message"]
        assert http.post("/v1/completions", content=b"{not json", headers=headers).status_code == 400
        assert http.post("/v1/completions", json={"prompt": "x"}).status_code == 401
        assert http.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer no"}).status_code == 401
        assert http.get("/health").json() == {"status": "ok"}
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[], max_tokens=2)
    port = server.rsplit(":", 1)[1].split("/")[0]
    taken = cli("serve", str(artifact), "--port", port, check=False)  # the port this server holds
    assert taken.returncode == 2 and taken.stderr.count("\n") == 1 and f"could not listen on 127.0.0.1:{port}" in taken.stderr
    out = client.completions.create(model="tiny", prompt="still here", max_tokens=2, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop")


def _metric(server, name: str) -> float:
    import httpx

    text = httpx.get(server.removesuffix("/v1") + "/metrics").text
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    assert found, f"{name} is not in /metrics"
    return float(found.group(1))


def test_a_client_that_disconnects_mid_stream_frees_its_sequence_and_pages(plain_server):
    import httpx

    server = plain_server  # no kept prefixes: idle, no page is in use
    assert _metric(server, "autosched_kv_cache_pages_used") == 0
    body = {"prompt": [5, 6, 7, 8] * 5, "max_tokens": 100, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=server.removesuffix("/v1"), timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
    # The engine frees them at its next step after the disconnect (bounded wait: not a timing assertion).
    for _ in range(600):
        if _metric(server, "autosched_num_requests_running") == 0:
            break
        threading.Event().wait(0.05)
    assert _metric(server, "autosched_num_requests_running") == 0
    assert _metric(server, "autosched_kv_cache_pages_used") == 0


# ---- in this process: the engine held between steps -----------------------------------------------------------

class _Served:
    """An engine and its app, served by uvicorn in a thread of this process on a free port."""

    def __init__(self, engine, **app_options):
        import uvicorn

        from autosched.serve import create_app

        self.engine = engine.start()
        self.server = uvicorn.Server(uvicorn.Config(create_app(engine, "tiny", **app_options), host="127.0.0.1",
                                                    port=0, log_level="error", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            threading.Event().wait(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def close(self):
        self.server.should_exit = True
        self.thread.join()
        self.engine.stop()


class _Gate:
    """A generator whose steps wait for the test (the real generator, held between its steps)."""

    def __init__(self, gen):
        self.gen, self.open = gen, threading.Semaphore(0)
        self.fail_next = False

    def __getattr__(self, name):
        return getattr(self.gen, name)

    def step(self):
        self.open.acquire()
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("a kernel failed")
        return self.gen.step()


def test_past_max_waiting_a_request_gets_429_with_retry_after_and_draining_gets_503(built):
    import httpx

    from autosched.generation import Generator
    from autosched.serve import Engine

    _, artifact, tokenizer = built
    gate = []
    engine = Engine(lambda: gate.append(_Gate(Generator(artifact))) or gate[0], tokenizer, max_waiting=2)
    served = _Served(engine)
    try:
        body = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}

        async def run():
            async with httpx.AsyncClient(base_url=served.url, timeout=60) as http:
                held = [asyncio.ensure_future(http.post("/v1/completions", json=body))]
                while engine.stats().running < 1:  # admitted; the engine waits in its first step
                    await asyncio.sleep(0.01)
                held += [asyncio.ensure_future(http.post("/v1/completions", json=body)) for _ in range(2)]
                while engine.stats().waiting < 2:  # --max-waiting 2 reached
                    await asyncio.sleep(0.01)
                refused = await http.post("/v1/completions", json=body)
                engine.draining = True
                unavailable = await http.post("/v1/completions", json=body)
                health = await http.get("/health")
                for _ in range(100):
                    gate[0].open.release()
                done = await asyncio.gather(*held)
                return refused, unavailable, health, done

        refused, unavailable, health, done = asyncio.run(run())
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert unavailable.status_code == 503 and health.status_code == 503
        assert [r.status_code for r in done] == [200] * 3
    finally:
        served.close()


def test_a_step_that_fails_fails_its_requests_with_500_and_the_engine_goes_on_with_a_clean_cache(built):
    import httpx

    from autosched.generation import Generator
    from autosched.serve import Engine

    _, artifact, tokenizer = built
    gate = []
    engine = Engine(lambda: gate.append(_Gate(Generator(artifact))) or gate[0], tokenizer)
    served = _Served(engine)
    try:
        body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "return_token_ids": True, "ignore_eos": True}

        async def run():
            async with httpx.AsyncClient(base_url=served.url, timeout=60) as http:
                failing = asyncio.ensure_future(http.post("/v1/completions", json=body))
                while engine.stats().running < 1:
                    await asyncio.sleep(0.01)
                gate[0].fail_next = True
                gate[0].open.release()
                failed = await failing
                for _ in range(10):
                    gate[0].open.release()
                return failed, await http.post("/v1/completions", json=body)

        failed, after = asyncio.run(run())
        assert failed.status_code == 500 and "a kernel failed" in failed.json()["error"]["message"]
        assert after.status_code == 200
        assert after.json()["choices"][0]["token_ids"] == _alone(artifact, [[5, 6, 7]], 4)[0]
        for _ in range(600):  # the engine's books follow its last step (bounded wait: not a timing assertion)
            if engine.stats().kv_pages_used == 0:
                break
            threading.Event().wait(0.01)
        assert engine.stats().kv_pages_used == 0
    finally:
        served.close()


def test_an_oversized_body_gets_413(built):
    import httpx

    from autosched.generation import Generator
    from autosched.serve import Engine

    _, artifact, tokenizer = built
    served = _Served(Engine(lambda: Generator(artifact), tokenizer), max_body_bytes=1000)
    try:
        answer = httpx.post(served.url + "/v1/completions", json={"prompt": "x" * 2000})
        assert answer.status_code == 413 and answer.json()["error"]["code"] == 413
    finally:
        served.close()


def test_sigterm_drains_running_requests_then_exits_0(built):
    import httpx

    _, artifact, tokenizer = built
    proc, url = _serve(str(artifact), "--drain-timeout", "60")
    prompt = [5, 6, 7, 8]
    (expected,) = _alone(artifact, [prompt], 40)
    tokens = []
    with httpx.Client(timeout=60) as http:
        body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "stream": True, "ignore_eos": True,
                "return_token_ids": True}
        with http.stream("POST", url + "/completions", json=body) as r:
            for line in r.iter_lines():
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                if not tokens:
                    proc.send_signal(signal.SIGTERM)
                tokens += json.loads(line[5:])["choices"][0]["token_ids"]
    assert tokens == expected  # the request ran to its end after the signal
    assert proc.wait(timeout=60) == 0
    assert "draining" in proc.stderr.read()


# ---- structured output (XGrammar) and tool calls --------------------------------------------------------------

def _run_all(gen, requests):
    """Each (prompt, max_new_tokens, Sampling) of ``requests`` through ``gen``, up to its batch at once (later
    ones joining as earlier ones finish); their completions in order."""
    queue, live, done = list(enumerate(requests)), {}, {}
    while queue or live:
        while queue and len(live) < gen.max_batch:
            i, (prompt, new, sampling) = queue.pop(0)
            live[gen.add(prompt, new, sampling)] = i
        gen.step()
        for seq in [s for s in live if s not in gen.live]:
            done[live.pop(seq)] = gen.remove(seq)
    return [done[i] for i in range(len(requests))]


def _text(tokenizer, tokens):
    return tokenizer.decode(tokens, skip_special_tokens=True)


def test_200_random_json_schemas_sampled_at_temperature_1_all_end_and_validate(built):
    """Nested objects, arrays with min/max items, enums, numbers and integers with ranges, required and optional
    fields, strings with a pattern or a length; each output sampled (temperature 1, its own seed) by the
    Generator, four at a time, under its schema: every one ends at the stop token, parses and validates."""
    import jsonschema

    from autosched.generation import Generator, Sampling
    from autosched.generation.grammar import GrammarSpec

    from .json_schemas import random_schema

    _, artifact, tokenizer = built
    gen = Generator(artifact)  # the artifact's own tokenizer compiles the grammars
    prompt = _ids(tokenizer, "JSON:")
    schemas = [random_schema(i) for i in range(200)]
    results = _run_all(gen, [(prompt, MAX_SEQ_LEN - len(prompt), Sampling(1.0, seed=i, grammar=GrammarSpec.json_schema(s)))
                             for i, s in enumerate(schemas)])
    for schema, result in zip(schemas, results):
        text = _text(tokenizer, result.tokens)
        assert result.finish_reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)
    assert len({_text(tokenizer, r.tokens) for r in results}) > 150  # sampled, not one answer


def test_regex_choice_and_ebnf_outputs_match(built):
    from autosched.generation import Generator, Sampling
    from autosched.generation.grammar import GrammarSpec

    _, artifact, tokenizer = built
    gen = Generator(artifact)
    prompt = _ids(tokenizer, PROMPTS[1])
    regexes = [r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)", r"\d{3}-\d{4}", r"(kalo|mine)( (kalo|mine)){0,3}", r"[A-Z][a-zé ]{0,8}\."]
    choices = ["yes", "no", "maybe not", "“quoted”", "a\\b \"c\""]
    ebnf = 'root ::= "(" item ("," item){0,2} ")"\nitem ::= [0-9]{1,2} | "x"'
    requests = [(prompt, 60, Sampling(1.0, seed=s, grammar=GrammarSpec.regex(r))) for r in regexes for s in range(3)]
    requests += [(prompt, 30, Sampling(1.0, seed=s, grammar=GrammarSpec.choice(choices))) for s in range(8)]
    requests += [(prompt, 40, Sampling(1.0, seed=s, grammar=GrammarSpec.ebnf(ebnf))) for s in range(4)]
    requests += [(prompt, 60, Sampling(grammar=GrammarSpec.regex(r))) for r in regexes]  # greedy
    results = _run_all(gen, requests)
    texts = [_text(tokenizer, r.tokens) for r in results]
    assert all(r.finish_reason == "stop" for r in results), list(zip(texts, [r.finish_reason for r in results]))
    for text, (_, _, sampling) in zip(texts, requests):
        spec = sampling.grammar
        if spec.kind == "regex":
            assert re.fullmatch(spec.text, text), (spec.text, text)
        elif spec.kind == "choice":
            assert text in choices
        else:
            assert re.fullmatch(r"\((\d{1,2}|x)(,(\d{1,2}|x)){0,2}\)", text), text


def test_a_batch_mixing_constrained_and_free_requests_gives_the_free_ones_their_tokens_alone(built):
    from autosched.generation import Generator, Sampling
    from autosched.generation.grammar import GrammarSpec

    from .json_schemas import random_schema

    _, artifact, tokenizer = built
    free = [(_ids(tokenizer, PROMPTS[0]), 24, Sampling()),
            (_ids(tokenizer, PROMPTS[2]), 24, Sampling(0.9, top_p=0.9, seed=5))]
    gen = Generator(artifact)
    alone = [gen.generate([p], n, temperature=s.temperature, top_p=s.top_p, seed=s.seed, stop_tokens=[])[0].tokens
             for p, n, s in free]
    for constrained in ([Sampling(1.0, seed=3, grammar=GrammarSpec.json_schema(random_schema(7))),
                         Sampling(grammar=GrammarSpec.regex(r"[a-z]{3,20}"))],
                        [Sampling(grammar=GrammarSpec.choice(["ka", "lo"])), Sampling(1.0, seed=1,
                                                                                       grammar=GrammarSpec.json_object())]):
        seqs = [gen.add(p, n, s, stop_tokens=[]) for p, n, s in free[:1]]
        seqs += [gen.add(_ids(tokenizer, PROMPTS[3]), 40, s) for s in constrained]
        seqs += [gen.add(p, n, s, stop_tokens=[]) for p, n, s in free[1:]]
        while any(s in gen.live for s in seqs):
            gen.step()
        got = [gen.remove(s).tokens for s in seqs]
        assert [got[0], got[-1]] == alone


def test_masks_on_the_device_behind_steps_launched_ahead_and_on_the_host_give_the_same_tokens(built):
    """A grammar's mask applied by the kernel on the device (the default), the same with greedy steps
    launched before the tokens of the step before are read (each step's masks found once they are), and
    applied on the host to logits read back: the same greedy tokens; a row that also asks for log-probabilities
    is chosen on the host, its mask there, beside rows masked on the device."""
    from autosched.generation import Generator, GrammarSpec, Sampling

    from .helpers import record_launches_behind
    from .json_schemas import random_schema

    _, artifact, tokenizer = built
    prompt = _ids(tokenizer, "JSON:")
    requests = [(prompt, 60, Sampling(grammar=GrammarSpec.json_schema(random_schema(i)))) for i in range(3)]
    requests += [(prompt, 60, Sampling(grammar=GrammarSpec.regex(r"[a-z]{3,9}"))), (prompt, 30, Sampling())]
    device = Generator(artifact, run_ahead=False)
    expected = _run_all(device, requests)
    assert device.sampler.masks is not None and device.stats["host_sample_calls"] == 0
    ahead = Generator(artifact, run_ahead=True)
    behind = record_launches_behind(ahead)
    assert [r.tokens for r in _run_all(ahead, requests)] == [r.tokens for r in expected]
    assert sum(behind) > 10  # steps of constrained rows launched behind the step before
    host = Generator(artifact)
    host.device_masks = False
    assert [r.tokens for r in _run_all(host, requests)] == [r.tokens for r in expected]
    assert host.sampler.masks is None and host.stats["host_sample_calls"] > 0
    mixed = _run_all(Generator(artifact), [(prompt, 60, Sampling(grammar=requests[0][2].grammar, logprobs=2))]
                     + requests[1:4])
    assert [r.tokens for r in mixed] == [r.tokens for r in expected[:4]]
    assert len(mixed[0].logprobs) == len(mixed[0].tokens) and mixed[0].logprobs[0].top


def test_constraints_with_speculation_give_the_tokens_they_give_without_greedy(built):
    """Prompt lookup proposes 3 tokens a step; the grammar cuts the proposals it rejects before verification,
    the target's logits are masked at every position and the grammar's state rolls back with the rejected
    tokens: the same greedy tokens as plain decoding, constrained and free rows sharing the steps."""
    from autosched.generation import Generator, Sampling
    from autosched.generation.grammar import GrammarSpec

    from .json_schemas import random_schema

    _, artifact, tokenizer = built
    example = '{"name":"kalo","tags":["kalo","mine","kalo"],"count":3} {"name":"mine","tags":["kalo","mine"]} '
    prompt = _ids(tokenizer, example)
    tags = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "tags": {
        "type": "array", "items": {"enum": ["kalo", "mine"]}, "minItems": 1, "maxItems": 6}}, "required": ["name", "tags"]}
    specs = [GrammarSpec.json_schema(tags), GrammarSpec.regex(r"(kalo|mine|,|\[|\]|\"){4,30}"),
             GrammarSpec.choice(['{"name":"kalo"}', '{"name":"mine"}'])]
    specs += [GrammarSpec.json_schema(random_schema(i)) for i in range(5)]
    requests = [(prompt, 60, Sampling(grammar=s)) for s in specs] + [(prompt, 20, Sampling())]
    plain = _run_all(Generator(artifact), requests)
    speculating = Generator(artifact, draft="prompt-lookup", speculate=3, adaptive=False)
    assert [r.tokens for r in _run_all(speculating, requests)] == [r.tokens for r in plain]
    assert all(r.finish_reason == "stop" for r in plain[:-1])
    assert speculating.stats["speculative_steps"] > 0 and speculating.stats["accepted_tokens"] > 0


def test_json_schemas_regex_and_choice_through_the_openai_client(built, client):
    import jsonschema

    from .json_schemas import random_schema

    _, _, tokenizer = built
    messages = [{"role": "user", "content": "JSON, please"}]
    for seed in range(4):
        schema = random_schema(1000 + seed)
        out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=100, temperature=1, seed=seed,
                                             response_format={"type": "json_schema", "json_schema": {
                                                 "name": "thing", "schema": schema, "strict": True}})
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    schema = random_schema(2000)
    out = client.completions.create(model="tiny", prompt="JSON:", max_tokens=100, temperature=1, seed=1, n=2,
                                    extra_body={"guided_json": schema})
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.text), schema)
    schema = random_schema(2001)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=100, temperature=1,
                                                 seed=2, stream=True, extra_body={"structured_outputs": {"json": schema}}))
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks)), schema)
    assert chunks[-1].choices[0].finish_reason == "stop"
    for fields, check in [({"guided_regex": r"\d{3}-[a-z]{2}"}, lambda t: re.fullmatch(r"\d{3}-[a-z]{2}", t)),
                          ({"structured_outputs": {"regex": r"(ka|lo){2}"}}, lambda t: t in ("kaka", "kalo", "loka", "lolo")),
                          ({"guided_choice": ["red", "green", "blue sky"]}, lambda t: t in ("red", "green", "blue sky")),
                          ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
                          ({"guided_grammar": 'root ::= "x" [0-9]'}, lambda t: re.fullmatch(r"x[0-9]", t))]:
        for seed in range(2):
            out = client.completions.create(model="tiny", prompt="Say:", max_tokens=30, temperature=1, seed=seed,
                                            extra_body=fields)
            assert out.choices[0].finish_reason == "stop" and check(out.choices[0].text), (fields, out.choices[0].text)
    objects = [client.chat.completions.create(model="tiny", messages=messages, max_tokens=100, temperature=1,
                                              seed=seed, response_format={"type": "json_object"}).choices[0]
               for seed in range(4)]
    stopped = [c for c in objects if c.finish_reason == "stop"]
    assert stopped and all(isinstance(json.loads(c.message.content), dict) for c in stopped)
    text = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                          response_format={"type": "text"})
    assert text.choices[0].message.content is not None


def test_a_schema_or_grammar_xgrammar_cannot_compile_gets_400_with_its_reason_and_the_server_keeps_serving(server, client):
    import httpx

    headers = {"Authorization": f"Bearer {API_KEY}"}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}
    cases = [
        ("/v1/chat/completions", chat | {"response_format": bad_schema}, "response_format", 'Unsupported type "strin"'),
        ("/v1/chat/completions", chat | {"response_format": {"type": "xml"}}, "response_format", "json_schema"),
        ("/v1/completions", {"prompt": "x", "guided_regex": "a(b"}, "guided_regex", "parenthesis is not closed"),
        ("/v1/completions", {"prompt": "x", "guided_grammar": "root ::= foo"}, "guided_grammar", 'Rule "foo" is not defined'),
        ("/v1/completions", {"prompt": "x", "guided_json": "{not json"}, "guided_json", "not JSON"),
        ("/v1/completions", {"prompt": "x", "guided_json": {"$ref": "#/nope"}}, "guided_json", "nope"),
        ("/v1/completions", {"prompt": "x", "guided_choice": []}, "guided_choice", "choice"),
        ("/v1/completions", {"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "give one"),
        ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
         "one of"),
        ("/v1/chat/completions", chat | {"tool_choice": "required"}, "tool_choice", "needs tools"),
        ("/v1/chat/completions", chat | {"tools": [{"type": "function", "function": {"name": "f"}}],
                                         "tool_choice": {"type": "function", "function": {"name": "g"}}},
         "tool_choice", "not one of the tools"),
        ("/v1/chat/completions", chat | {"tools": [{"type": "function"}]}, "tools.0", "function"),
    ]
    with httpx.Client(base_url=server.removesuffix("/v1"), timeout=60) as http:
        for path, body, param, said in cases:
            answer = http.post(path, json=body, headers=headers)
            error = answer.json()["error"]
            assert (answer.status_code, error["param"]) == (400, param), (body, answer.text)
            assert said in error["message"] and "\n" not in error["message"], error["message"]
            assert "/project/" not in error["message"]  # XGrammar's reason, without its C++ source line
        stream = http.post("/v1/chat/completions", json=chat | {"response_format": bad_schema, "stream": True},
                           headers=headers)
        assert stream.status_code == 400  # before the stream starts
    out = client.completions.create(model="tiny", prompt="still here", max_tokens=3, temperature=0,
                                    extra_body={"guided_regex": "[a-z]+"})
    assert out.choices[0].text.isalpha()


# A template that renders tools by name and parameter names: short enough for the tiny model's 128 tokens.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t.function.name }}("
    "{{ t.function.parameters.properties | list | join(',') }}) {% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

TOOLS = [  # names the tiny tokenizer writes in few tokens
    {"type": "function", "function": {"name": "fox", "description": "Finds a fox", "parameters": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 3},
                                         "count": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["name"]}}},
    {"type": "function", "function": {"name": "value", "parameters": {
        "type": "object", "properties": {"count": {"type": "integer", "minimum": -9, "maximum": 9},
                                         "name": {"enum": ["kalo", "mine"]}, "ok": {"type": "boolean"}},
        "required": ["count", "name"]}}},
]


@pytest.fixture
def tools_server(built):
    """A server of the artifact (in this process) whose tokenizer's template takes tools (TOOLS_TEMPLATE)."""
    from autosched.generation import Generator
    from autosched.serve import Engine

    _, artifact, _ = built
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(artifact / "tokenizer"))
    tokenizer.chat_template = TOOLS_TEMPLATE
    served = _Served(Engine(lambda: Generator(artifact), tokenizer))
    yield served.url + "/v1", tokenizer
    served.close()


def _check_calls(calls):
    import jsonschema

    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), parameters[call.function.name])
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def test_tool_choice_required_and_named_always_give_well_formed_calls_whole_and_streamed(tools_server):
    url, tokenizer = tools_server
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Weather?"}]
    ask = {"model": "tiny", "messages": messages, "temperature": 1, "tools": TOOLS}  # max_tokens: what is left
    names = set()
    for seed in range(6):
        out = client.chat.completions.create(**ask, seed=seed, tool_choice="required", parallel_tool_calls=False)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice.message.content
        (call,) = _check_calls(choice.message.tool_calls)
        names.add(call[0])
        if seed < 3:  # streamed: the same call, in one delta.tool_calls when the output ends
            chunks = list(client.chat.completions.create(**ask, seed=seed, tool_choice="required",
                                                         parallel_tool_calls=False, stream=True))
            deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
            assert not any(c.choices[0].delta.content for c in chunks)
            assert _check_calls(deltas) == [call] and [d.index for d in deltas] == [0]
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert names == {"fox", "value"}
    for seed in range(3):
        out = client.chat.completions.create(**ask, seed=seed, tool_choice={"type": "function",
                                                                             "function": {"name": "value"}})
        assert out.choices[0].finish_reason == "tool_calls"
        assert [name for name, _ in _check_calls(out.choices[0].message.tool_calls)] == ["value"]
    # the tools went through the template; "none" leaves them out
    with_tools = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "fox(name,count) value(count,name,ok)" in with_tools
    none = client.chat.completions.create(**ask, tool_choice="none")
    assert out.usage.prompt_tokens == len(tokenizer.encode(with_tools, add_special_tokens=False))
    assert none.usage.prompt_tokens < out.usage.prompt_tokens and none.choices[0].message.tool_calls is None


def test_auto_reads_a_call_in_the_output_and_tool_messages_go_back_in_the_next_turn(tools_server):
    url, tokenizer = tools_server
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Count"}]
    # auto holds nothing: an output held to a call's shape (here by guided_json) is read as a call
    call_shape = {"type": "object", "properties": {"name": {"const": "value"}, "arguments": TOOLS[1]["function"]["parameters"]},
                  "required": ["name", "arguments"]}
    out = client.chat.completions.create(model="tiny", messages=messages, temperature=1, seed=1, tools=TOOLS,
                                         extra_body={"guided_json": call_shape})
    assert out.choices[0].finish_reason == "tool_calls"
    ((name, arguments),) = _check_calls(out.choices[0].message.tool_calls)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, temperature=1, seed=1, tools=TOOLS,
                                                 stream=True, extra_body={"guided_json": call_shape}))
    assert _check_calls([d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]) == [(name, arguments)]
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0, tools=TOOLS)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason in ("stop", "length")
    streamed = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                   tools=TOOLS, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == plain.choices[0].message.content
    # the next turn: the assistant's call and the tool's answer
    call = out.choices[0].message.tool_calls[0]
    turn = messages + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                       {"role": "tool", "tool_call_id": call.id, "content": "3"}]
    reply = client.chat.completions.create(model="tiny", messages=turn, max_tokens=5, temperature=0, tools=TOOLS)
    expected = tokenizer.apply_chat_template(turn, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>tool\n3<|im_end|>" in expected
    assert reply.usage.prompt_tokens == len(tokenizer.encode(expected, add_special_tokens=False))


def test_generate_takes_a_json_schema_a_grammar_or_a_regex_and_exits_2_for_one_that_cannot_compile(built, tmp_path):
    import jsonschema

    from .helpers import cli

    _, artifact, tokenizer = built
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}}, "required": ["n", "ok"]}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    (tmp_path / "g.ebnf").write_text('root ::= "<" [a-c]{1,3} ">"')
    for option, value, check in [("--json-schema", str(tmp_path / "s.json"),
                                  lambda t: jsonschema.validate(json.loads(t), schema) is None),
                                 ("--grammar", str(tmp_path / "g.ebnf"), lambda t: re.fullmatch("<[a-c]{1,3}>", t)),
                                 ("--regex", "[0-9]{2}x", lambda t: re.fullmatch("[0-9]{2}x", t))]:
        out = cli("generate", str(artifact), "--prompt-ids", "5,6,7", "--prompt-ids", "8,9", option, value,
                  "--temperature", "1", "--max-new-tokens", "60", "--format", "json")
        for row in json.loads(out.stdout)["completions"]:
            assert row["finish_reason"] == "stop"
            assert check(_text(tokenizer, row["tokens"])), row
    (tmp_path / "bad.json").write_text('{"type": "strin"}')
    for option, value, said in [("--json-schema", str(tmp_path / "bad.json"), 'Unsupported type "strin"'),
                                ("--regex", "a(b", "parenthesis is not closed"),
                                ("--grammar", str(tmp_path / "missing.ebnf"), "No such file")]:
        out = cli("generate", str(artifact), "--prompt-ids", "5,6,7", option, value, check=False)
        assert out.returncode == 2 and said in out.stderr and out.stderr.count("\n") == 1, out.stderr


@pytest.mark.gpu
def test_the_server_on_the_gpu_gives_concurrent_clients_the_tokens_they_get_alone():
    """A 2-layer Llama in fp16 on the GPU (CUDA graphs at decode batches 1, 2, 4, 8; a prefill chunk of 64;
    steps launched ahead), its engine and app served in this process: 32 concurrent clients, greedy, prompts of
    different lengths, each given the tokens the same generator gives it alone; a shared prefix hits the cache."""
    import transformers

    from autosched.serve import Engine

    from .helpers import gpu_generator, random_on_gpu

    model = random_on_gpu(transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_attention_heads=16,
                                                   num_key_value_heads=8, num_hidden_layers=2, vocab_size=8000))
    gen, _ = gpu_generator(model, "llama-2-layers", 256, (1, 2, 4, 8), prefill_chunks=(64,))
    shared = [(13 * i + 7) % 8000 for i in range(40)]
    prompts = [(shared if i % 2 else []) + [(31 * i + 17 * j + 3) % 8000 for j in range(3 + i % 11)] for i in range(32)]
    lengths = [8 + i % 17 for i in range(32)]
    expected = []
    for prompt, n in zip(prompts, lengths):  # alone, one at a time, without the prefix cache
        expected.append(gen.generate([prompt], n, stop_tokens=[])[0].tokens)
    gen.use_prefix_cache()
    served = _Served(Engine(lambda: gen))
    try:
        async def run():
            aclient = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=300)

            async def one(prompt, n):
                out = await aclient.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0,
                                                       extra_body={"return_token_ids": True, "ignore_eos": True})
                return out.choices[0].token_ids, out.usage.prompt_tokens_details.cached_tokens

            try:
                return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths)))
            finally:
                await aclient.close()

        results = asyncio.run(run())
        assert [tokens for tokens, _ in results] == expected
        assert sum(cached for _, cached in results) > 0
    finally:
        served.close()
