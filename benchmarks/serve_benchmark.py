"""Serving load generator: an HTTP client of any OpenAI-compatible server (``autosched serve ARTIFACT``,
``transformers serve``, vLLM, ...) that sends streamed ``/v1/completions`` requests and reports throughput and
latency.

Load: ``--num-requests`` requests with Poisson arrivals at ``--rate`` requests/s (several rates: one run each;
``inf``: all at once), or a fixed ``--concurrency`` (each of C clients sends its next request when its last one
ends); ``--duration`` stops sending once that many seconds have passed. Prompt lengths and output lengths are
log-normal (``--prompt-len`` / ``--output-len`` their medians, ``--*-sigma`` the sigma of their logarithm),
rounded and clipped to ``--*-min`` / ``--*-max``; ``--shared-prefix N`` puts the same N tokens (a system
prompt) before every prompt, whose own part has the drawn length. Everything is drawn from one seeded numpy
generator (``--seed``): the same arguments give the same prompts and the same arrivals (at any rate, the
arrivals are the same unit-rate draw scaled by 1/rate).

Prompts (``--prompt-mode``):
  ids   token ids (``prompt`` as a list of ints): exact lengths, no tokenizer needed. Random ids in
        [``--id-low``, ``--vocab-size``), or, with ``--tokenizer DIR``, the ids of the text prompts below
        (BOS included, as a server tokenizing that text makes them), so that a run in ids mode and one in
        text mode send the same tokens.
  text  text made of common English words (WORDS), one word per intended token: in Llama's and in
        ``_random_hf_model.py``'s tokenizers each of them, after a space, is one token. The lengths are then
        right within the BOS and the tokenizer's merges; the table reports the prompt tokens the server
        counted (``usage.prompt_tokens``), not the intended ones.
Each request: ``stream=True``, ``stream_options={"include_usage": True}``, ``temperature=0``, ``max_tokens`` = the
drawn output length, and, so that outputs have that length (``--eos``): ``ignore`` (default) sends
``ignore_eos: true`` (vLLM's field, which autosched serve takes); ``hf`` sends transformers serve's
``generation_config`` with ``eos_token_id: -1`` (continuous batching: no end-of-sequence token) and
``min_new_tokens`` (its sequential path); ``keep`` (``--no-ignore-eos``) sends neither, and outputs may end
early (the summary counts them: ``short_outputs``).

Per request: the send time, the arrival of each chunk carrying text, the output tokens (``usage``); from
these: time to first token (TTFT), time per output token TPOT = (last chunk - first chunk) / (tokens - 1),
inter-token latency ITL = the gaps between chunks; per run: output tokens/s and requests/s over the run
(first send to last end), and the p50 / p99 (numpy percentiles, linear) of each. A server may join several
tokens into one chunk when its stream falls behind, and a client that falls behind reads several chunks at once:
TPOT counts the server's tokens (usage) between the first chunk and the last, ITL the gaps between chunks as
they were read, so ITL's percentiles can differ from TPOT's either way.

``--sweep-p99-tpot-bound MS``: the highest Poisson rate whose p99 TPOT stays within MS: runs at
``--sweep-start``, doubling while within the bound (up to ``--sweep-max-rate``; halving first if the start is
not), then ``--sweep-steps`` bisections between the last rate within the bound and the first beyond it.

``--server-cmd "CMD"`` starts the server (``{port}`` and ``{host}`` in CMD are replaced), waits for
``GET /v1/models`` to answer (up to ``--server-timeout`` seconds), sends ``--warmup`` requests, runs the load,
and stops it (SIGTERM to its process group, SIGKILL 15 s later); its output goes to ``--server-log``. Without
it, the server at ``--base-url`` (or ``--host``/``--port``) is used as it is. ``--table A.json B.json ...``
prints the runs of earlier ``--out`` files as one Markdown table, and sends nothing.

transformers serve (transformers 5.25, read in transformers/cli/serve.py and cli/serving/):
  * ``transformers serve FOLDER`` preloads a local ``save_pretrained`` folder (its tokenizer too) and serves
    only it: a request's ``model`` must be FOLDER as given (GET /v1/models lists it; ``--model`` defaults to
    the first model listed). ``--host``, ``--port``, ``--device``, ``--dtype``.
  * ``--continuous-batching`` (paged attention, tuned with ``--cb-block-size``, ``--cb-num-blocks``,
    ``--cb-max-batch-tokens``, ``--cb-max-memory-percent``, ``--cb-use-cuda-graph``; its cache shares the blocks
    of a common prefix between requests). Without it, one worker thread generates one request after another.
  * ``/v1/completions`` takes ``prompt`` as a string only (a list or token ids: 400 "prompt must be a string"),
    so it needs ``--prompt-mode text``. A field outside OpenAI's schema (``ignore_eos``) is refused with 422;
    ``generation_config`` (a JSON string of generate()'s settings) is its way: ``--eos hf``. With continuous
    batching a request's ``eos_token_id`` and ``max_new_tokens`` are used, ``min_new_tokens`` is not.
  * It streams one event per token unless tokens queued up while the client read (then one event with their
    text joined), and ends with a chunk of ``finish_reason`` and, asked, one of ``usage``.

    python benchmarks/serve_benchmark.py --base-url http://127.0.0.1:8000/v1 --concurrency 1,16 --num-requests 64
    python benchmarks/serve_benchmark.py --server-cmd "transformers serve /models/llama --port {port} \\
        --continuous-batching" --port 8001 --prompt-mode text --eos hf --rate 1,2,4 --out hf.json
    python benchmarks/serve_benchmark.py --server-cmd "python3 -m autosched serve ART --port {port}" \\
        --sweep-p99-tpot-bound 40 --out ours.json
    python benchmarks/serve_benchmark.py --table ours.json hf.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

# Common English words, each one token after a space in Llama's tokenizer (and in _random_hf_model.py's).
WORDS = ("the of and to in is it you that he was for on are with as his they be at one have this from or had by "
         "not what all were we when your can said there use an each which she do how their if will up other about "
         "out many then them these so some her would make like him into time has look two more write go see number "
         "no way could people my than first water been call who its now find long down day did get come made may "
         "part").split()

PERCENTILES = (50, 99)


# ----- workload (pure) -----

@dataclass
class Workload:
    """What the requests are: how many, their lengths' distributions, the prompts' shared prefix, the seed."""

    num_requests: int = 64
    prompt_len: float = 512  # median of the log-normal prompt lengths (tokens after the shared prefix)
    prompt_sigma: float = 0.5
    prompt_min: int = 1
    prompt_max: int = 2048
    output_len: float = 128  # median of the log-normal output lengths
    output_sigma: float = 0.5
    output_min: int = 1
    output_max: int = 1024
    shared_prefix: int = 0
    vocab_size: int = 32000
    id_low: int = 100  # random ids start here, above the special tokens most vocabularies begin with
    seed: int = 0


@dataclass
class RequestSpec:
    """One request: its prompt (token ids or text), its intended prompt tokens, and max_tokens."""

    index: int
    prompt: list[int] | str
    prompt_len: int
    output_len: int


def lognormal_lengths(rng: np.random.Generator, n: int, median: float, sigma: float, low: int, high: int) -> np.ndarray:
    """``n`` integer lengths: log-normal with this ``median`` (the exp of the log's mean) and ``sigma`` (the log's
    standard deviation; 0: all the median), rounded, clipped to [low, high]."""
    if median <= 0 or sigma < 0 or low > high:
        raise ValueError(f"a length distribution needs median > 0, sigma >= 0, min <= max (got {median}, {sigma}, "
                         f"{low}, {high})")
    draws = rng.lognormal(mean=math.log(median), sigma=sigma, size=n)
    return np.clip(np.rint(draws), low, high).astype(np.int64)


def unit_poisson_gaps(rng: np.random.Generator, n: int) -> np.ndarray:
    """The gaps before each of ``n`` requests in a Poisson process of rate 1 (exponential, mean 1 s); the
    first is 0: the first request goes at once."""
    gaps = rng.exponential(1.0, size=n)
    if n:
        gaps[0] = 0.0
    return gaps


def arrival_times(unit_gaps: np.ndarray, rate: float) -> np.ndarray:
    """Send times (s from the start) at ``rate`` requests/s from unit-rate gaps; ``inf``: all at 0."""
    if rate <= 0:
        raise ValueError(f"a rate must be positive (got {rate})")
    if math.isinf(rate):
        return np.zeros(len(unit_gaps))
    return np.cumsum(unit_gaps) / rate


def word_text(rng: np.random.Generator, n: int) -> list[str]:
    """``n`` words drawn from WORDS."""
    return [WORDS[i] for i in rng.integers(0, len(WORDS), size=n)]


def make_requests(w: Workload, mode: str = "ids", tokenize: Callable[[str], list[int]] | None = None
                  ) -> tuple[list[RequestSpec], np.ndarray]:
    """The requests of workload ``w`` and the unit-rate gaps of their arrivals, all from one generator seeded
    with ``w.seed``. ``mode`` "ids": prompts of token ids (random in [id_low, vocab_size), or ``tokenize`` of the
    text prompts where given); "text": prompts as text, one word per intended token. The shared prefix (the
    same ``w.shared_prefix`` tokens or words) comes first in every prompt; the drawn length is the rest."""
    if mode not in ("ids", "text"):
        raise ValueError(f"prompt mode is ids or text (got {mode!r})")
    if not 0 <= w.id_low < w.vocab_size:
        raise ValueError(f"random ids need 0 <= id_low < vocab_size (got {w.id_low}, {w.vocab_size})")
    rng = np.random.default_rng(w.seed)
    prompt_lens = lognormal_lengths(rng, w.num_requests, w.prompt_len, w.prompt_sigma, w.prompt_min, w.prompt_max)
    output_lens = lognormal_lengths(rng, w.num_requests, w.output_len, w.output_sigma, w.output_min, w.output_max)
    gaps = unit_poisson_gaps(rng, w.num_requests)
    words = mode == "text" or tokenize is not None
    prefix = word_text(rng, w.shared_prefix) if words else rng.integers(w.id_low, w.vocab_size, w.shared_prefix).tolist()
    specs = []
    for i, (n, out) in enumerate(zip(prompt_lens.tolist(), output_lens.tolist())):
        if words:
            text = " ".join(prefix + word_text(rng, n))
            prompt: list[int] | str = text if mode == "text" else list(tokenize(text))
        else:
            prompt = prefix + rng.integers(w.id_low, w.vocab_size, n).tolist()
        specs.append(RequestSpec(i, prompt, w.shared_prefix + n, out))
    return specs, gaps


# ----- records and statistics (pure) -----

@dataclass
class RequestRecord:
    """What one request did, in seconds of the client's monotonic clock (time.perf_counter)."""

    index: int
    prompt_len: int  # intended prompt tokens
    max_tokens: int
    send: float
    chunks: list[float] = field(default_factory=list)  # arrival of each chunk that carried text
    end: float | None = None
    output_tokens: int | None = None  # usage.completion_tokens (None: no usage came)
    prompt_tokens: int | None = None  # usage.prompt_tokens
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None and bool(self.chunks)

    @property
    def tokens(self) -> int:
        """The output tokens: the server's count, or the chunks where it gave none."""
        return self.output_tokens if self.output_tokens is not None else len(self.chunks)


def ttft(r: RequestRecord) -> float:
    """Time to first token: the first chunk's arrival after the send."""
    return r.chunks[0] - r.send


def tpot(r: RequestRecord) -> float | None:
    """Time per output token after the first: (last chunk - first chunk) / (tokens - 1); None for 1 token."""
    if r.tokens < 2:
        return None
    return (r.chunks[-1] - r.chunks[0]) / (r.tokens - 1)


def itl(r: RequestRecord) -> list[float]:
    """Inter-token latencies: the gaps between consecutive chunks."""
    return np.diff(np.asarray(r.chunks, dtype=float)).tolist()


def percentiles(values, qs=PERCENTILES) -> dict[str, float]:
    """{"p50": ..., "p99": ...} of ``values`` (numpy's linear percentiles), NaN where there are none."""
    arr = np.asarray(list(values), dtype=float)
    return {f"p{q:g}": float(np.percentile(arr, q)) if arr.size else float("nan") for q in qs}


def summarize(records: list[RequestRecord]) -> dict:
    """A run's statistics: counts, duration (first send to last end, failed requests included), throughput,
    and TTFT, TPOT, ITL and end-to-end latency in ms (mean, p50, p99) over the requests that succeeded."""
    done = [r for r in records if r.ok]
    ends = [r.end for r in records if r.end is not None]  # failed requests' too: the run lasts until they end
    duration = (max(ends) - min(r.send for r in records)) if done else float("nan")
    out_tokens = sum(r.tokens for r in done)

    def ms(values) -> dict:
        values = [1e3 * v for v in values]
        return {"mean": float(np.mean(values)) if values else float("nan"), **percentiles(values)}

    usage_prompts = [r.prompt_tokens for r in done if r.prompt_tokens is not None]
    return {
        "requests": len(records), "completed": len(done), "failed": len(records) - len(done),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "short_outputs": sum(r.tokens < r.max_tokens for r in done),
        "no_usage": sum(r.output_tokens is None for r in done),
        "duration_s": duration,
        "requests_per_s": len(done) / duration if done else float("nan"),
        "output_tokens_per_s": out_tokens / duration if done else float("nan"),
        "output_tokens": out_tokens,
        "mean_prompt_tokens": float(np.mean(usage_prompts)) if usage_prompts else float("nan"),
        "mean_intended_prompt_tokens": float(np.mean([r.prompt_len for r in records])) if records else float("nan"),
        "mean_output_tokens": out_tokens / len(done) if done else float("nan"),
        "ttft_ms": ms(ttft(r) for r in done),
        "tpot_ms": ms(t for r in done if (t := tpot(r)) is not None),
        "itl_ms": ms(g for r in done for g in itl(r)),
        "e2e_ms": ms(r.end - r.send for r in done),
    }


def sweep_rates(run_at: Callable[[float], dict], bound_ms: float, start: float = 1.0, max_rate: float = 256.0,
                steps: int = 3) -> tuple[float | None, list[tuple[float, dict]]]:
    """The highest rate whose run keeps p99 TPOT within ``bound_ms`` (with no failed request): ``run_at(rate)``
    returns a run's summary. From ``start``, doubling while within the bound, up to ``max_rate`` (halving first,
    ``steps`` times at most, while the start is not within it), then ``steps`` bisections between the last rate
    within the bound and the first beyond it. Returns (that rate or None, every (rate, summary) run)."""
    runs: list[tuple[float, dict]] = []

    def within(rate: float) -> bool:
        summary = run_at(rate)
        runs.append((rate, summary))
        p99 = summary["tpot_ms"]["p99"]
        return summary["completed"] > 0 and summary["failed"] == 0 and not math.isnan(p99) and p99 <= bound_ms

    good, bad = None, None
    rate = start
    if within(rate):
        good = rate
        while rate * 2 <= max_rate:
            rate *= 2
            if not within(rate):
                bad = rate
                break
            good = rate
    else:
        bad = rate
        for _ in range(steps):
            rate /= 2
            if within(rate):
                good = rate
                break
            bad = rate
    if good is not None and bad is not None:
        for _ in range(steps):
            mid = (good + bad) / 2
            if within(mid):
                good = mid
            else:
                bad = mid
    return good, runs


def _cell(value: float, digits: int = 1) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def markdown_table(runs: list[dict]) -> str:
    """One row per run (the dicts of :func:`run_entry`): server, load, requests, throughput, TTFT, TPOT, ITL."""
    lines = ["| server | load | ok / sent | prompt / output tok | req/s | output tok/s | TTFT p50 / p99 ms "
             "| TPOT p50 / p99 ms | ITL p50 / p99 ms |", "|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        s = run["summary"]
        rate = run.get("rate")
        load = (("all at once" if math.isinf(rate) else f"rate {rate:g}/s") if rate is not None
                else f"concurrency {run['concurrency']}")
        if rate is not None and run.get("concurrency"):
            load += f", at most {run['concurrency']}"
        short = f" ({s['short_outputs']} short)" if s.get("short_outputs") else ""
        prompt = s["mean_prompt_tokens"]
        prompt_cell = _cell(prompt, 0) if not math.isnan(prompt) else f"~{_cell(s['mean_intended_prompt_tokens'], 0)}"
        lines.append(
            f"| {run.get('label', '')} | {load} | {s['completed']} / {s['requests']}{short} | {prompt_cell} / "
            f"{_cell(s['mean_output_tokens'], 0)} | {_cell(s['requests_per_s'], 2)} | {_cell(s['output_tokens_per_s'])} | "
            f"{_cell(s['ttft_ms']['p50'])} / {_cell(s['ttft_ms']['p99'])} | {_cell(s['tpot_ms']['p50'], 2)} / "
            f"{_cell(s['tpot_ms']['p99'], 2)} | {_cell(s['itl_ms']['p50'], 2)} / {_cell(s['itl_ms']['p99'], 2)} |")
    return "\n".join(lines)


# ----- the client -----

def request_body(spec: RequestSpec, eos: str) -> dict:
    """The fields beyond OpenAI's that make the output ``spec.output_len`` tokens long (``eos``: ignore, hf, keep)."""
    if eos == "ignore":
        return {"ignore_eos": True}
    if eos == "hf":
        return {"generation_config": json.dumps({"eos_token_id": -1, "min_new_tokens": spec.output_len})}
    return {}


async def send_one(client, model: str, spec: RequestSpec, eos: str) -> RequestRecord:
    """One streamed completion, timed from its send (a request that waited for a free slot of --concurrency
    counts from when it went)."""
    record = RequestRecord(spec.index, spec.prompt_len, spec.output_len, time.perf_counter())
    try:
        stream = await client.completions.create(
            model=model, prompt=spec.prompt, max_tokens=spec.output_len, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body=request_body(spec, eos) or None)
        async for chunk in stream:
            now = time.perf_counter()
            if any(getattr(c, "text", None) for c in chunk.choices or ()):
                record.chunks.append(now)
            if getattr(chunk, "usage", None) is not None:
                record.output_tokens = chunk.usage.completion_tokens
                record.prompt_tokens = chunk.usage.prompt_tokens
        record.end = time.perf_counter()
        if not record.chunks:
            record.error = "no text came"
    except Exception as exc:  # noqa: BLE001 - a failed request is counted and reported, not fatal
        record.error = f"{type(exc).__name__}: {str(exc)[:200]}"
        record.end = time.perf_counter()
    return record


async def run_load(client, model: str, specs: list[RequestSpec], eos: str, arrivals: np.ndarray | None = None,
                   concurrency: int | None = None, duration: float | None = None) -> list[RequestRecord]:
    """Sends ``specs``: at ``arrivals`` (s from the start; with ``concurrency`` also at most that many at once),
    or, without arrivals, from ``concurrency`` clients one request after another. No request is sent once
    ``duration`` seconds have passed; those sent finish."""
    began = time.perf_counter()
    expired = (lambda: time.perf_counter() - began >= duration) if duration else (lambda: False)
    if arrivals is None:
        queue = list(reversed(specs))
        records: list[RequestRecord] = []

        async def worker():
            while queue and not expired():
                records.append(await send_one(client, model, queue.pop(), eos))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return sorted(records, key=lambda r: r.index)
    limit = asyncio.Semaphore(concurrency) if concurrency else None

    async def limited(spec):
        if limit is None:
            return await send_one(client, model, spec, eos)
        async with limit:
            return await send_one(client, model, spec, eos)

    tasks = []
    for spec, at in zip(specs, arrivals.tolist()):
        delay = began + at - time.perf_counter()
        if duration and at >= duration:
            break
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(limited(spec)))
    return list(await asyncio.gather(*tasks))


def make_client(base_url: str, api_key: str, timeout: float):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=timeout, max_retries=0)


async def first_model(base_url: str, api_key: str) -> str:
    client = make_client(base_url, api_key, 30)
    try:
        models = await client.models.list()
        return models.data[0].id
    finally:
        await client.close()


# ----- the server process -----

class Server:
    """A server process started from ``cmd`` (its own process group), its output in ``log``; ``wait_ready``
    polls ``GET {base_url}/models``; ``stop`` ends the group."""

    def __init__(self, cmd: str, log: str):
        self.cmd, self.log_path = cmd, log
        self.log = open(log, "ab")
        self.proc = subprocess.Popen(shlex.split(cmd), stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, base_url: str, timeout: float) -> float:
        """Seconds until the server answered; raises if it exits or takes longer than ``timeout``."""
        import httpx

        began = time.perf_counter()
        while time.perf_counter() - began < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}) before answering: "
                                   f"{self.tail()}")
            try:
                if httpx.get(f"{base_url.rstrip('/')}/models", timeout=5).status_code == 200:
                    return time.perf_counter() - began
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the server did not answer GET /v1/models in {timeout:g} s: {self.tail()}")

    def tail(self, lines: int = 15) -> str:
        self.log.flush()
        text = Path(self.log_path).read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        self.log.close()


# ----- the command line -----

def parse_list(text: str, kind=float) -> list:
    return [kind(x) for x in text.split(",") if x.strip()]


def run_entry(label: str, rate: float | None, concurrency: int | None, records: list[RequestRecord],
              save_requests: bool) -> dict:
    entry = {"label": label, "rate": rate, "concurrency": concurrency, "summary": summarize(records)}
    if save_requests:
        entry["requests"] = [asdict(r) for r in records]
    return entry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_argument_group("the server")
    where.add_argument("--base-url", help="the server's OpenAI API root (default http://HOST:PORT/v1)")
    where.add_argument("--host", default="127.0.0.1")
    where.add_argument("--port", type=int, default=8000)
    where.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "none"))
    where.add_argument("--model", help="the request's model (default: the first GET /v1/models lists)")
    where.add_argument("--server-cmd", help="start this server first ({port}, {host} replaced), stop it at the end")
    where.add_argument("--server-log", default="server.log", help="the started server's output (default server.log)")
    where.add_argument("--server-timeout", type=float, default=900, help="seconds to wait for it (default 900)")
    where.add_argument("--label", help="the server's name in the table (default: the model)")
    load = parser.add_argument_group("the load")
    load.add_argument("--rate", help="Poisson arrival rates, requests/s, comma-separated, one run each; inf: all at once")
    load.add_argument("--concurrency", help="fixed concurrencies, comma-separated, one run each (with --rate: at most "
                      "that many requests in flight, one value)")
    load.add_argument("--num-requests", type=int, default=64)
    load.add_argument("--duration", type=float, help="send no request after this many seconds of a run")
    load.add_argument("--warmup", type=int, default=2, help="requests sent (at once) before the runs, not counted")
    load.add_argument("--sweep-p99-tpot-bound", type=float, metavar="MS",
                      help="find the highest rate whose p99 TPOT stays within MS (doubling, then bisecting)")
    load.add_argument("--sweep-start", type=float, default=1.0)
    load.add_argument("--sweep-max-rate", type=float, default=256.0)
    load.add_argument("--sweep-steps", type=int, default=3)
    load.add_argument("--request-timeout", type=float, default=600)
    shape = parser.add_argument_group("the requests")
    shape.add_argument("--prompt-len", type=float, default=512, help="median prompt tokens (after the shared prefix)")
    shape.add_argument("--prompt-sigma", type=float, default=0.5)
    shape.add_argument("--prompt-min", type=int, default=1)
    shape.add_argument("--prompt-max", type=int, default=2048)
    shape.add_argument("--output-len", type=float, default=128, help="median output tokens")
    shape.add_argument("--output-sigma", type=float, default=0.5)
    shape.add_argument("--output-min", type=int, default=1)
    shape.add_argument("--output-max", type=int, default=1024)
    shape.add_argument("--shared-prefix", type=int, default=0, help="tokens of a system prompt every prompt starts with")
    shape.add_argument("--prompt-mode", choices=("ids", "text"), default="ids")
    shape.add_argument("--tokenizer", help="with --prompt-mode ids: a local tokenizer folder; the ids are those of the "
                       "text prompts")
    shape.add_argument("--vocab-size", type=int, default=32000, help="random ids below this (default 32000)")
    shape.add_argument("--id-low", type=int, default=100, help="random ids from this (default 100)")
    shape.add_argument("--eos", choices=("ignore", "hf", "keep"), default="ignore",
                       help="make outputs max_tokens long: ignore_eos (ignore), transformers' generation_config (hf), "
                            "or not (keep)")
    shape.add_argument("--no-ignore-eos", dest="eos", action="store_const", const="keep", help="--eos keep")
    shape.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the runs as JSON here")
    parser.add_argument("--save-requests", action="store_true", help="also every request's record in --out")
    parser.add_argument("--table", nargs="+", metavar="JSON", help="print the runs of these --out files as one table")
    args = parser.parse_args(argv)

    if args.table:
        runs = [run for path in args.table for run in json.loads(Path(path).read_text())["runs"]]
        print(markdown_table(runs))
        return 0
    rates = [float(r) for r in parse_list(args.rate, str)] if args.rate else []
    concurrencies = parse_list(args.concurrency, int) if args.concurrency else []
    if not rates and not concurrencies and args.sweep_p99_tpot_bound is None:
        parser.error("give --rate, --concurrency or --sweep-p99-tpot-bound")
    poisson = bool(rates) or args.sweep_p99_tpot_bound is not None
    if poisson and len(concurrencies) > 1:
        parser.error("with --rate or --sweep-p99-tpot-bound, --concurrency is one limit on the requests in flight")
    if args.sweep_p99_tpot_bound is not None and rates:
        parser.error("--sweep-p99-tpot-bound chooses the rates: no --rate")
    if args.tokenizer and args.prompt_mode != "ids":
        parser.error("--tokenizer makes the token ids of --prompt-mode ids (text prompts are tokenized by the server)")
    base_url = args.base_url or f"http://{args.host}:{args.port}/v1"
    workload = Workload(args.num_requests, args.prompt_len, args.prompt_sigma, args.prompt_min, args.prompt_max,
                        args.output_len, args.output_sigma, args.output_min, args.output_max, args.shared_prefix,
                        args.vocab_size, args.id_low, args.seed)
    tokenize = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
        tokenize = lambda text: tok(text)["input_ids"]
    specs, gaps = make_requests(workload, args.prompt_mode, tokenize)
    warm_specs, _ = make_requests(Workload(**{**asdict(workload), "num_requests": args.warmup, "seed": args.seed + 1,
                                              "shared_prefix": 0}), args.prompt_mode, tokenize)

    server = None
    result = {"base_url": base_url, "args": vars(args), "workload": asdict(workload), "runs": []}
    if args.prompt_mode == "text":
        result["note"] = "text prompts: one word per intended token; prompt tokens as the server counted them"
    try:
        if args.server_cmd:
            cmd = args.server_cmd.replace("{port}", str(args.port)).replace("{host}", args.host)
            print(f"starting: {cmd}", file=sys.stderr, flush=True)
            server = Server(cmd, args.server_log)
            result["server_cmd"] = cmd
            result["server_ready_s"] = server.wait_ready(base_url, args.server_timeout)
            print(f"server answered after {result['server_ready_s']:.1f} s", file=sys.stderr, flush=True)
        model = args.model or asyncio.run(first_model(base_url, args.api_key))
        label = args.label or model
        result["model"] = model

        def save():
            if args.out:
                Path(args.out).write_text(json.dumps(result, indent=1))

        async def one_run(rate: float | None, concurrency: int | None) -> list[RequestRecord]:
            client = make_client(base_url, args.api_key, args.request_timeout)
            try:
                arrivals = arrival_times(gaps, rate) if rate is not None else None
                return await run_load(client, model, specs, args.eos, arrivals, concurrency, args.duration)
            finally:
                await client.close()

        def run(rate: float | None, concurrency: int | None) -> dict:
            entry = run_entry(label, rate, concurrency, asyncio.run(one_run(rate, concurrency)), args.save_requests)
            result["runs"].append(entry)
            save()
            s = entry["summary"]
            print(f"{label} rate={rate} concurrency={concurrency}: {s['completed']}/{s['requests']} ok, "
                  f"{s['output_tokens_per_s']:.1f} output tok/s, TTFT p50 {s['ttft_ms']['p50']:.1f} ms, "
                  f"TPOT p50/p99 {s['tpot_ms']['p50']:.2f}/{s['tpot_ms']['p99']:.2f} ms"
                  + (f", errors: {s['errors']}" if s["errors"] else ""), file=sys.stderr, flush=True)
            return s

        if args.warmup:
            async def warm():
                client = make_client(base_url, args.api_key, args.request_timeout)
                try:
                    return await run_load(client, model, warm_specs, args.eos, np.zeros(len(warm_specs)))
                finally:
                    await client.close()

            warmed = asyncio.run(warm())
            errors = {r.error for r in warmed if r.error}
            if errors:
                print(f"warm-up errors: {sorted(errors)}", file=sys.stderr, flush=True)
                result["warmup_errors"] = sorted(errors)
                save()
                if not any(r.ok for r in warmed):
                    print("no warm-up request succeeded: stopping", file=sys.stderr)
                    return 2
        limit = concurrencies[0] if poisson and concurrencies else None
        for rate in rates:
            run(rate, limit)
        if not poisson:
            for c in concurrencies:
                run(None, c)
        if args.sweep_p99_tpot_bound is not None:
            best, _ = sweep_rates(lambda r: run(r, limit), args.sweep_p99_tpot_bound, args.sweep_start,
                                  args.sweep_max_rate, args.sweep_steps)
            result["sweep"] = {"p99_tpot_bound_ms": args.sweep_p99_tpot_bound, "best_rate": best}
            print(f"highest rate within p99 TPOT {args.sweep_p99_tpot_bound:g} ms: {best}", file=sys.stderr)
        save()
    finally:
        if server is not None:
            server.stop()
    print(markdown_table(result["runs"]))
    if result.get("note"):
        print(f"\n{result['note']}")
    if "sweep" in result:
        print(f"\nhighest rate within p99 TPOT {result['sweep']['p99_tpot_bound_ms']:g} ms: {result['sweep']['best_rate']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
