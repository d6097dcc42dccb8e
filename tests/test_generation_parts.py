"""The parts of the generation runtime on their own, without TVM or an artifact: the step scheduler (chunks,
padding, room in the cache, timing with an injected clock), request state, host sampling, and the artifact
reader's checks for both kinds of artifact. The loaded model and the Generator façade are tested over a
built artifact in test_generation.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from autosched.errors import UsageError
from autosched.generation import scheduler
from autosched.generation.request import Completion, GenerationError, Sampling, SequenceState, token_ids


def _seq(seq_id, pending, length=0, new=8, stops=(), prefilled=False):
    return SequenceState(seq_id, list(pending), length, new, frozenset(stops), Sampling(), prefilled=prefilled)


def test_prefill_packs_prompts_into_static_chunks_then_whole_prompts():
    limits = scheduler.Limits(max_seq_len=16, page_size=4, prefill_chunks=(8,))
    a, b = _seq(0, range(6)), _seq(1, range(5))
    parts, chunk = scheduler.next_prefill([a, b], limits)
    assert chunk == 8 and [(s.seq_id, n) for s, n in parts] == [(0, 6), (1, 2)]  # b spans two chunks
    a.feed(6, keep_cached=False)
    b.feed(2, keep_cached=False)
    assert a.prefilled and not b.prefilled and b.pending == [2, 3, 4]
    parts, chunk = scheduler.next_prefill([b], limits)  # 3 tokens wait: fewer than a chunk, a dynamic call
    assert chunk is None and [(s.seq_id, n) for s, n in parts] == [(1, 3)]
    # Without chunks, whole prompts up to max_seq_len a call: a prompt that does not fit waits for the next.
    c, d = _seq(2, range(10)), _seq(3, range(10))
    parts, _ = scheduler.next_prefill([c, d], scheduler.Limits(max_seq_len=16, page_size=4))
    assert [(s.seq_id, n) for s, n in parts] == [(2, 10)]
    # In a window: up to a window of a new sequence's tokens, then one a call.
    windowed = scheduler.Limits(max_seq_len=16, page_size=4, window=4)
    e = _seq(4, range(7))
    assert scheduler.next_prefill([e], windowed)[0][0][1] == 4
    e.feed(4, keep_cached=False)
    assert scheduler.next_prefill([e], windowed)[0][0][1] == 1


def test_admit_ends_what_the_cache_cannot_hold_and_the_rest_go_on():
    limits = scheduler.Limits(max_seq_len=12, page_size=4)
    full, big, small = _seq(0, [1], length=12), _seq(1, range(9)), _seq(2, range(3))
    kept, free = scheduler.admit([(full, 1), (big, 9), (small, 3)], free_pages=2, limits=limits, kv_pages=6)
    assert [s.seq_id for s, _ in kept] == [2] and free == 1
    assert full.completion.finish_reason == "max_seq_len"
    assert big.completion.finish_reason == "error" and "out of pages (6 in all)" in big.completion.error
    assert scheduler.pages_needed(length=4, tokens=1, page_size=4) == 1
    assert scheduler.pages_needed(length=5, tokens=3, page_size=4) == 0


def test_a_decode_step_is_padded_to_the_smallest_static_batch_with_pages_to_spare():
    batches = frozenset({2, 4})
    assert scheduler.padding_rows(3, batches, free_pages=5) == 1
    assert scheduler.padding_rows(1, batches, free_pages=5) == 1
    assert scheduler.padding_rows(4, batches, free_pages=5) == 0
    assert scheduler.padding_rows(5, batches, free_pages=5) == 0  # no static batch holds 5: dynamic
    assert scheduler.padding_rows(1, frozenset({4}), free_pages=2) == 0  # 3 pads need 3 free pages
    assert scheduler.decode_function(4, batches) == "decode_b4" and scheduler.decode_function(3, batches) == "batch_decode"
    assert scheduler.prefill_function(8, 8) == "prefill_t8" and scheduler.prefill_function(7, 8) == "batch_prefill"
    assert scheduler.prefill_function(8, None) == "batch_prefill"


def test_a_longrope_sequence_is_reread_when_it_crosses_the_original_context():
    crossing = _seq(0, [5], length=8, prefilled=True)
    before = _seq(1, [5], length=6, prefilled=True)
    assert scheduler.longrope_rereads([crossing, before], switch=8) == [crossing]


def test_step_stats_time_calls_with_the_injected_clock():
    now = iter([1.0, 1.5, 2.0, 2.25, 3.0, 3.25])
    stats = scheduler.StepStats(clock=lambda: next(now))
    stats.record(True, stats.clock(), 10, "prefill_t8")  # 1.0 -> 1.5
    stats.record(False, stats.clock(), 2, "decode_b2", padded=True)  # 2.0 -> 2.25
    stats.record(False, stats.clock(), 3, "batch_decode")  # 3.0 -> 3.25
    c = stats.counts
    assert (c["prefill_calls"], c["prefill_tokens"], c["static_prefill_calls"]) == (1, 10, 1)
    assert (c["decode_steps"], c["static_decode_steps"], c["padded_decode_steps"], c["decode_tokens"]) == (2, 1, 1, 5)
    assert stats.timing() == {"prefill_ms": 500.0, "prefill_tokens": 10, "ms_per_step": 250.0, "decode_steps": 2,
                              "tokens_per_s": 10.0}
    stats.reset()
    assert stats.timing()["decode_steps"] == 0 and stats.timing()["tokens_per_s"] == 0.0


def test_a_sequence_records_its_tokens_and_why_it_ended():
    seq = _seq(0, [1, 2], new=3, stops=(9,))
    seq.feed(2, keep_cached=True)
    assert seq.prefilled and seq.cached == [1, 2] and seq.length == 2 and not seq.decoding
    seq.accept(4)
    assert seq.decoding and seq.pending == [4] and not seq.completion.finished
    seq.accept(9)
    assert seq.completion == Completion([4, 9], "stop") and not seq.decoding
    other = _seq(1, [1], new=1)
    other.accept(5)
    assert other.completion.finish_reason == "length"
    failed = Completion()
    failed.fail("broken")
    assert (failed.finish_reason, failed.error) == ("error", "broken")


def test_requests_refuse_what_they_would_misread():
    assert token_ids((1, 2)) == [1, 2]
    for bad in ("12", 3, [1.5], ["3"]):
        with pytest.raises(GenerationError):
            token_ids(bad)
    with pytest.raises(UsageError, match="temperature 0 is greedy"):
        Sampling(top_k=3)
    with pytest.raises(UsageError, match="seed must be a whole number"):
        Sampling(temperature=1.0, seed=-1)
    assert Sampling().greedy and not Sampling(temperature=0.5).greedy


def test_host_sampling_is_reproducible_for_a_seed_and_keeps_to_top_k_and_top_p():
    import numpy as np

    from autosched.generation.sampler import sample_host

    logits = np.random.default_rng(0).standard_normal(50).astype("float32")
    sampling = Sampling(temperature=1.0, top_p=0.5, seed=3)

    def draws(seed):
        rng = np.random.default_rng(seed)
        return [sample_host(logits, sampling, rng) for _ in range(20)]

    assert draws(3) == draws(3) and draws(3) != draws(4)
    top = set(np.argsort(-logits)[:2].tolist())
    rng = np.random.default_rng(0)
    assert {sample_host(logits, Sampling(temperature=2.0, top_k=2), rng) for _ in range(50)} <= top
    assert sample_host(logits, Sampling(), rng) == int(np.argmax(logits))


def test_one_reader_names_either_kind_of_artifact_and_its_damage(tmp_path):
    from autosched.artifact import GENERATION_FORMAT, MANIFEST, MANIFEST_VERSION, MODEL_FORMAT, read_manifest

    def artifact(name, manifest):
        folder = tmp_path / name
        folder.mkdir()
        (folder / MANIFEST).write_text(json.dumps(manifest))
        return folder

    gen = artifact("gen", {"format": GENERATION_FORMAT, "version": MANIFEST_VERSION})
    model = artifact("model", {"format": MODEL_FORMAT, "version": MANIFEST_VERSION})
    with pytest.raises(UsageError, match="generation artifact.*`autosched generate"):
        read_manifest(gen)
    with pytest.raises(UsageError, match="built without --generate"):
        read_manifest(model, "generation")
    with pytest.raises(UsageError, match="lacks .*decoder"):
        read_manifest(gen, "generation")
    with pytest.raises(UsageError, match="no manifest.json"):
        read_manifest(tmp_path / "missing", "generation")
    future = artifact("future", {"format": GENERATION_FORMAT, "version": MANIFEST_VERSION + 1})
    with pytest.raises(UsageError, match=f"manifest version {MANIFEST_VERSION + 1}"):
        read_manifest(future, "generation")


def test_the_runtime_does_not_import_the_build_module():
    code = ("import sys, autosched.generation, autosched.generation.generator, autosched.generation.model, "
            "autosched.generation.sampler, autosched.generation.scheduler, autosched.artifact; "
            "bad = [m for m in sys.modules if m in ('autosched.generation.build', 'autosched.pipeline.build')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_generation_report_is_the_model_builds_report():
    """Transferred kernels and records slower than the default are reported as `build` reports them, and
    written to the manifest the same way."""
    from autosched.artifact import kernel_sources
    from autosched.generation.build import GenerationReport
    from autosched.pipeline.build import ApplyReport

    report = GenerationReport(tuned={"a": {}}, transferred={"b": "gemm[m=8]"}, default=["c", "d"],
                              slower_than_default=["c"], attention={"decode over cached pages": "autosched x"},
                              workloads={"a": {}}, seconds={"compile": 2.5})
    assert isinstance(report, ApplyReport)
    summary = report.summary()
    assert summary.startswith("4 kernels per forward pass: 1 from the database, 1 from the nearest tuned shape, "
                              "2 on default schedules (1 of them had a record slower than the default, not used)")
    assert "except ours for decode over cached pages" in summary and summary.endswith("compile 2.5 s")
    sources = kernel_sources(report)
    assert sources["transferred_kernels"] == {"b": "gemm[m=8]"} and sources["records_slower_than_default"] == ["c"]
