"""``/metrics`` in Prometheus' text format (``prometheus-client``): requests by endpoint and status, time to
first token and time per output token as histograms, tokens, and the engine's state read at each scrape
(requests running and waiting, KV pages in use, the prefix cache's hit rate). Each server has a registry of
its own, so that several servers in one process (tests) keep apart."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Seconds: from a few milliseconds (a small model, a GPU) to minutes (a long queue on a CPU).
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0)
TPOT_BUCKETS = (0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


# The generator's counts (scheduler.StepStats) exported as counters: which calls the steps made, and their time.
GENERATOR_COUNTS = {
    "prefill_calls": "Prefill calls", "static_prefill_calls": "Prefill calls of a static chunk (tuned kernels)",
    "prefill_tokens": "Tokens prefilled", "prefill_s": "Seconds in prefill calls",
    "decode_steps": "Decode steps", "static_decode_steps": "Decode steps of a static batch (tuned kernels)",
    "padded_decode_steps": "Decode steps with padding rows", "decode_tokens": "Rows decoded",
    "decode_s": "Seconds in decode steps", "host_sample_calls": "Steps whose logits were read to the host",
}


class ServerMetrics:
    """The server's metrics; ``engine`` is read at each scrape (its :meth:`~.engine.Engine.stats`)."""

    def __init__(self, engine=None):
        self.registry = CollectorRegistry()
        self.requests = Counter("autosched_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.ttft = Histogram("autosched_time_to_first_token_seconds", "Time from a request's arrival to its "
                              "first token", buckets=TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("autosched_time_per_output_token_seconds", "A request's time per output token "
                              "after its first", buckets=TPOT_BUCKETS, registry=self.registry)
        self.generated = Counter("autosched_generation_tokens", "Tokens generated", registry=self.registry)
        self.engine = engine
        self.registry.register(_EngineCollector(self))

    def finished(self, ttft: float, tpot: float | None, tokens: int) -> None:
        """A request finished (called by the engine's thread)."""
        self.ttft.observe(ttft)
        if tpot is not None:
            self.tpot.observe(tpot)
        self.generated.inc(tokens)

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self):
        engine = self.metrics.engine
        if engine is None:
            return
        s = engine.stats()
        for name, what, value in (("autosched_num_requests_running", "Requests whose sequences are in the batch",
                                   s.running),
                                  ("autosched_num_requests_waiting", "Requests waiting for a row of the batch",
                                   s.waiting),
                                  ("autosched_kv_cache_pages_used", "Pages of the KV cache in use (running "
                                   "sequences and kept prefixes)", s.kv_pages_used),
                                  ("autosched_kv_cache_pages", "Pages of the KV cache in all", s.kv_pages),
                                  ("autosched_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache, "
                                   "of all prompt tokens", s.prefix_hit_tokens / s.prefix_queried_tokens
                                   if s.prefix_queried_tokens else 0.0)):
            yield GaugeMetricFamily(name, what, value=value)
        yield CounterMetricFamily("autosched_prefix_cache_queried_tokens", "Prompt tokens looked up in the "
                                  "prefix cache", value=s.prefix_queried_tokens)
        yield CounterMetricFamily("autosched_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache",
                                  value=s.prefix_hit_tokens)
        yield CounterMetricFamily("autosched_engine_generator_seconds", "Seconds in the generator's calls (the "
                                  "model's steps, waited for)", value=s.generator_seconds)
        yield CounterMetricFamily("autosched_engine_host_seconds", "Seconds of the engine's own work between the "
                                  "generator's calls (outputs, admission) while requests ran", value=s.host_seconds)
        for key in GENERATOR_COUNTS:
            if key in s.generator:
                yield CounterMetricFamily(f"autosched_generator_{key}", GENERATOR_COUNTS[key],
                                          value=s.generator[key])
