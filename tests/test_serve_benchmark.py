"""benchmarks/serve_benchmark.py's pure core: the workload it draws (lengths, arrivals, prompts), the statistics
of request records, the rate sweep and the table; and its driver over a fake client (no network, no clock read
by an assertion)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "serve_benchmark.py"
_spec = importlib.util.spec_from_file_location("serve_benchmark", _PATH)
sb = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("serve_benchmark", sb)  # dataclasses look their module up by name
_spec.loader.exec_module(sb)


def record(send, chunks, tokens, max_tokens=None, **more):
    return sb.RequestRecord(0, 8, max_tokens if max_tokens is not None else tokens, send, list(chunks),
                            end=chunks[-1] if chunks else send, output_tokens=tokens, **more)


def test_lognormal_lengths_have_the_median_and_stay_within_their_bounds():
    rng = np.random.default_rng(0)
    lengths = sb.lognormal_lengths(rng, 20000, 512, 0.5, 16, 2048)
    assert lengths.dtype == np.int64
    assert np.percentile(lengths, 50) == pytest.approx(512, rel=0.03)
    assert abs(np.std(np.log(lengths)) - 0.5) < 0.02
    clipped = sb.lognormal_lengths(np.random.default_rng(0), 2000, 512, 2.0, 100, 600)
    assert clipped.min() == 100 and clipped.max() == 600
    assert set(sb.lognormal_lengths(rng, 10, 128, 0.0, 1, 1024).tolist()) == {128}
    with pytest.raises(ValueError):
        sb.lognormal_lengths(rng, 10, 128, 0.5, 200, 100)


def test_poisson_arrivals_have_the_rates_mean_gap_and_scale_with_it():
    gaps = sb.unit_poisson_gaps(np.random.default_rng(1), 20000)
    assert gaps[0] == 0 and (gaps >= 0).all()
    at4 = sb.arrival_times(gaps, 4.0)
    assert at4[0] == 0 and (np.diff(at4) >= 0).all()
    assert abs(np.diff(at4).mean() - 0.25) < 0.01
    # the coefficient of variation of exponential gaps is 1
    assert abs(np.diff(at4).std() / np.diff(at4).mean() - 1) < 0.03
    np.testing.assert_allclose(sb.arrival_times(gaps, 8.0), at4 / 2)
    assert not sb.arrival_times(gaps, math.inf).any()
    with pytest.raises(ValueError):
        sb.arrival_times(gaps, 0)


def test_id_prompts_share_the_prefix_and_have_the_drawn_lengths():
    w = sb.Workload(num_requests=50, prompt_len=32, output_len=16, shared_prefix=24, vocab_size=512, id_low=10, seed=3)
    specs, gaps = sb.make_requests(w)
    assert len(specs) == len(gaps) == 50
    prefix = specs[0].prompt[:24]
    for spec in specs:
        assert spec.prompt[:24] == prefix
        assert len(spec.prompt) == spec.prompt_len >= 24 + 1
        assert all(10 <= t < 512 for t in spec.prompt)
        assert 1 <= spec.output_len <= w.output_max
    assert len({tuple(s.prompt[24:]) for s in specs}) == 50  # the rest differs
    again, again_gaps = sb.make_requests(w)
    assert [s.prompt for s in again] == [s.prompt for s in specs] and (again_gaps == gaps).all()  # seeded
    other, _ = sb.make_requests(sb.Workload(**{**w.__dict__, "seed": 4}))
    assert [s.prompt for s in other] != [s.prompt for s in specs]


def test_text_prompts_have_a_word_per_token_and_tokenized_ones_the_same_words():
    w = sb.Workload(num_requests=5, prompt_len=20, output_len=8, shared_prefix=6, seed=0)
    texts, _ = sb.make_requests(w, "text")
    for spec in texts:
        words = spec.prompt.split(" ")
        assert len(words) == spec.prompt_len and set(words) <= set(sb.WORDS)
        assert words[:6] == texts[0].prompt.split(" ")[:6]
    vocab = {word: i for i, word in enumerate(sb.WORDS)}
    ids, _ = sb.make_requests(w, "ids", tokenize=lambda text: [vocab[x] for x in text.split(" ")])
    assert [[sb.WORDS[i] for i in s.prompt] for s in ids] == [s.prompt.split(" ") for s in texts]
    with pytest.raises(ValueError):
        sb.make_requests(w, "chat")


def test_statistics_of_known_records():
    # tokens at 0.1 (first), then gaps of 0.01 s: TPOT 10 ms, ITL 10 ms, TTFT 100 ms
    a = record(0.0, [0.1 + 0.01 * i for i in range(11)], 11)
    # 2 chunks carrying 5 tokens (the server joined them): TPOT (0.5 - 0.3) / 4
    b = record(1.0, [1.3, 1.5], 5)
    one = record(2.0, [2.2], 1)  # a single token: no TPOT, no ITL
    failed = sb.RequestRecord(3, 8, 4, 2.4, end=2.5, error="APIError: 500")  # the run ends with it
    assert sb.ttft(a) == pytest.approx(0.1) and sb.tpot(a) == pytest.approx(0.01)
    assert sb.itl(a) == pytest.approx([0.01] * 10)
    assert sb.tpot(b) == pytest.approx(0.05) and sb.itl(b) == pytest.approx([0.2])
    assert sb.tpot(one) is None and sb.itl(one) == []
    s = sb.summarize([a, b, one, failed])
    assert (s["requests"], s["completed"], s["failed"]) == (4, 3, 1)
    assert s["errors"] == ["APIError: 500"]
    assert s["duration_s"] == pytest.approx(2.5)  # first send (0) to last end (2.5)
    assert s["output_tokens"] == 17
    assert s["output_tokens_per_s"] == pytest.approx(17 / 2.5) and s["requests_per_s"] == pytest.approx(3 / 2.5)
    assert s["ttft_ms"]["p50"] == pytest.approx(200) and s["ttft_ms"]["mean"] == pytest.approx(200)
    assert s["tpot_ms"]["p50"] == pytest.approx(30) and s["tpot_ms"]["p99"] == pytest.approx(10 + 0.99 * 40)
    assert s["itl_ms"]["p50"] == pytest.approx(10) and s["itl_ms"]["p99"] == pytest.approx(10 + 0.9 * 190)
    assert s["short_outputs"] == 0 and s["no_usage"] == 0


def test_percentiles_are_numpys_linear_ones_and_nan_when_empty():
    gaps = list(range(1, 101))
    p = sb.percentiles(gaps)
    assert p == {"p50": pytest.approx(50.5), "p99": pytest.approx(99.01)}
    assert all(math.isnan(v) for v in sb.percentiles([]).values())


def test_a_record_without_usage_counts_its_chunks_and_a_short_output_is_counted():
    r = record(0.0, [0.1, 0.2, 0.3], None, max_tokens=8)
    assert r.tokens == 3
    s = sb.summarize([r])
    assert s["no_usage"] == 1 and s["short_outputs"] == 1
    assert math.isnan(sb.summarize([sb.RequestRecord(0, 1, 1, 0.0, error="x")])["duration_s"])


def test_the_sweep_doubles_then_bisects_to_the_highest_rate_within_the_bound():
    p99 = lambda rate: 10 * rate  # ms

    def run_at(rate):
        return {"completed": 4, "failed": 0, "tpot_ms": {"p99": p99(rate)}}

    best, runs = sb.sweep_rates(run_at, 35, start=1, max_rate=64, steps=3)
    assert [r for r, _ in runs] == [1, 2, 4, 3, 3.5, 3.75]
    assert best == 3.5
    best, runs = sb.sweep_rates(run_at, 15, start=4, steps=2)  # the start is beyond: halve, then bisect
    assert [r for r, _ in runs] == [4, 2, 1, 1.5, 1.75] and best == 1.5
    best, runs = sb.sweep_rates(run_at, 7, start=4, steps=2)  # nothing within: None after `steps` halvings
    assert [r for r, _ in runs] == [4, 2, 1] and best is None
    best, runs = sb.sweep_rates(run_at, 1000, start=1, max_rate=8)
    assert [r for r, _ in runs] == [1, 2, 4, 8] and best == 8
    best, _ = sb.sweep_rates(lambda r: {"completed": 4, "failed": 1, "tpot_ms": {"p99": 1}}, 7, steps=2)
    assert best is None  # a failed request is never within the bound


def test_request_fields_that_keep_the_output_length():
    spec = sb.RequestSpec(0, [1, 2], 2, 17)
    assert sb.request_body(spec, "ignore") == {"ignore_eos": True}
    assert json.loads(sb.request_body(spec, "hf")["generation_config"]) == {"eos_token_id": -1, "min_new_tokens": 17}
    assert sb.request_body(spec, "keep") == {}


class FakeStream:
    def __init__(self, chunks):
        self.chunks = chunks

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for chunk in self.chunks:
            await asyncio.sleep(0)
            yield chunk


class FakeClient:
    """completions.create as the openai client's: a stream of chunks, text then a finish then usage."""

    def __init__(self, fail_on=()):
        self.calls, self.fail_on = [], set(fail_on)
        self.completions = SimpleNamespace(create=self.create)

    async def create(self, **kwargs):
        self.calls.append(kwargs)
        if len(self.calls) - 1 in self.fail_on:
            raise RuntimeError("refused")
        n, choice = kwargs["max_tokens"], lambda text, finish=None: SimpleNamespace(text=text, finish_reason=finish)
        chunks = [SimpleNamespace(choices=[choice(f" t{i}")], usage=None) for i in range(n)]
        chunks.append(SimpleNamespace(choices=[choice("", "length")], usage=None))
        chunks.append(SimpleNamespace(choices=[], usage=SimpleNamespace(completion_tokens=n,
                                                                       prompt_tokens=len(kwargs["prompt"]))))
        return FakeStream(chunks)


def test_the_driver_records_each_text_chunk_and_the_usage_under_both_loads():
    specs, gaps = sb.make_requests(sb.Workload(num_requests=6, prompt_len=8, output_len=4, output_max=9, seed=0))
    client = FakeClient(fail_on={2})
    records = asyncio.run(sb.run_load(client, "m", specs, "ignore", concurrency=2))
    assert [r.index for r in records] == list(range(6))
    assert all(c["stream"] and c["stream_options"] == {"include_usage": True} and c["temperature"] == 0
               and c["extra_body"] == {"ignore_eos": True} and c["model"] == "m" for c in client.calls)
    assert sorted(c["max_tokens"] for c in client.calls) == sorted(s.output_len for s in specs)
    ok = [r for r in records if r.ok]
    assert len(ok) == 5 and sum(r.error == "RuntimeError: refused" for r in records) == 1
    for r in ok:
        assert len(r.chunks) == r.output_tokens == specs[r.index].output_len  # the finish chunk carries no text
        assert r.prompt_tokens == len(specs[r.index].prompt)
        assert r.send <= r.chunks[0] <= r.chunks[-1] <= r.end
    records = asyncio.run(sb.run_load(FakeClient(), "m", specs, "keep", sb.arrival_times(gaps, math.inf)))
    assert len(records) == 6 and all(r.ok for r in records)
    assert sb.summarize(records)["output_tokens"] == sum(s.output_len for s in specs)


def test_the_table_has_a_row_per_run():
    a = record(0.0, [0.1 + 0.01 * i for i in range(11)], 11)
    runs = [sb.run_entry("ours", 2.0, None, [a], False), sb.run_entry("theirs", None, 16, [a], True),
            sb.run_entry("ours", math.inf, None, [a], False)]
    assert "requests" in runs[1] and "requests" not in runs[0]
    table = sb.markdown_table(json.loads(json.dumps(runs)))  # as read back from --out
    lines = table.splitlines()
    assert len(lines) == 5 and lines[2].startswith("| ours | rate 2/s | 1 / 1 |")
    assert "| theirs | concurrency 16 |" in lines[3] and "| all at once |" in lines[4]
    assert "| 10.00 / 10.00 |" in lines[2]  # TPOT p50 / p99
