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
    # In a window, a build from before windowed prefill calls were masked: up to a window of a new sequence's
    # tokens, then one a call.
    windowed = scheduler.Limits(max_seq_len=16, page_size=4, window=4)
    e = _seq(4, range(7))
    assert scheduler.next_prefill([e], windowed)[0][0][1] == 4
    e.feed(4, keep_cached=False)
    assert scheduler.next_prefill([e], windowed)[0][0][1] == 1


def test_a_prompt_past_the_window_prefills_in_chunks_of_up_to_a_window():
    """With the window masked in the cache's prefill kernel, a long prompt goes in calls of up to a window each
    (never more: a call's new tokens see each other unmasked), packed beside other prompts into a static chunk."""
    limits = scheduler.Limits(max_seq_len=64, page_size=4, prefill_chunks=(16,), window=6, window_chunk=6)
    long, short = _seq(0, range(20)), _seq(1, range(3))
    calls = []
    while long.pending or short.pending:
        parts, chunk = scheduler.next_prefill([s for s in (long, short) if s.pending], limits)
        calls.append(([(s.seq_id, n) for s, n in parts], chunk))
        for seq, n in parts:
            seq.feed(n, keep_cached=False)
    # 20 tokens: 6 + 6 + 6 + 2, the short prompt beside the first part; no call takes more than a window.
    assert [c for c, _ in calls] == [[(0, 6), (1, 3)], [(0, 6)], [(0, 6)], [(0, 2)]]
    # A call the window leaves short of the static chunk (9 of 16 tokens) runs the dynamic function.
    assert calls[0][1] == 16 and scheduler.prefill_function(9, calls[0][1]) == "batch_prefill"
    assert scheduler.Limits(max_seq_len=8, page_size=4).window_chunk == 1  # old manifests: one a call


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


def _cpu_paged_prefill(window: int, h_q: int, h_kv: int, d: int, page: int):
    """Our CPU kernel over cached pages (float32) compiled for the host: ``call(args, causal)`` runs it on
    the cache's arguments before its outputs and returns (output, lse), both filled with NaN before."""
    import numpy as np
    import tvm

    from autosched.generation.cpu_paged_prefill import cpu_paged_prefill_kernel

    kernel = cpu_paged_prefill_kernel(h_q, h_kv, d, page, "float32", window, "paged_prefill")
    run = tvm.compile(tvm.IRModule({"main": kernel}), target=tvm.target.Target({"kind": "llvm"}))

    def call(args, causal):
        rows = args[0].shape[0]
        out = tvm.runtime.tensor(np.full((rows, h_q, d), np.nan, "float32"))
        lse = tvm.runtime.tensor(np.full((rows, h_q), np.nan, "float32"))
        run(*[tvm.runtime.tensor(a) for a in args], out, lse, causal, 0, 1.0, 1e4, 1 / d**0.5)
        return out.numpy(), lse.numpy()

    return call


def _assert_attends(out, lse, q, keys, values):
    """``out`` and ``lse`` (base 2) are the attention of the query ``q`` over ``keys`` and ``values``."""
    import math

    import numpy as np

    scores = keys @ q / math.sqrt(len(q))
    weights = np.exp(scores - scores.max())
    np.testing.assert_allclose(out, weights @ values / weights.sum(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, (scores.max() + math.log(weights.sum())) / math.log(2), rtol=1e-5)


def test_the_cpu_paged_prefill_kernel_masks_cached_keys_to_the_window():
    """Our CPU kernel for a prefill call's queries over a windowed cache's pages, against numpy: two sequences
    (one whose window starts inside its first page, one with nothing cached), GQA, the query r tokens into the
    call seeing the last window - r - 1 cached keys (none from r = window - 1 on: zeros and a log-sum-exp of
    -5e4, which the merge with the call's own keys ignores); without ``causal``, every cached key."""
    import numpy as np

    from autosched.generation.cpu_paged_prefill import EMPTY_LSE

    h_q, h_kv, d, page, window = 4, 2, 8, 4, 6
    run = _cpu_paged_prefill(window, h_q, h_kv, d, page)
    rng = np.random.default_rng(0)
    pages = rng.standard_normal((8, 2, h_kv, page, d)).astype("float32")
    # Sequence 0: 6 keys in the window, its slots 3..8 of pages 5, 2, 7 (window offset 3); 7 new queries.
    # Sequence 1: no pages; 2 new queries.
    seq_pages, offset, cached, new = [5, 2, 7], 3, 6, [7, 2]
    q = rng.standard_normal((sum(new), h_q, d)).astype("float32")
    last_page_len = (offset + cached - 1) % page + 1
    args = [q, np.array([0, 7, 9], "int32"), pages, np.array([0, 3, 3], "int32"), np.array(seq_pages, "int32"),
            np.array([[last_page_len, 0], [offset, 0], [0, 0]], "int32"), np.zeros(2, "int32"),
            np.zeros(sum(new), "int32")]
    slots = [(seq_pages[(offset + c) // page], (offset + c) % page) for c in range(cached)]
    keys = np.stack([pages[p, 0, :, s] for p, s in slots])
    values = np.stack([pages[p, 1, :, s] for p, s in slots])
    for causal in (1, 0):
        out, lse = run(args, causal)
        for row in range(sum(new)):
            first = max(cached - max(window - row - 1, 0), 0) if causal else 0
            for h in range(h_q):
                if row >= new[0] or first == cached:  # nothing visible
                    assert not out[row, h].any() and lse[row, h] == EMPTY_LSE
                    continue
                _assert_attends(out[row, h], lse[row, h], q[row, h], keys[first:, h // 2], values[first:, h // 2])


def test_the_cpu_paged_prefill_kernel_without_a_window_sees_every_cached_key():
    """Our CPU kernel for a prefill call's queries over a cache's pages without a window (TVM's reads a
    one-element buffer past its end), against numpy: a sequence of 6 cached keys (pages 5 and 2, 2 keys in the
    last) and 3 new queries beside one with nothing cached; every cached key without ``causal``, and with it
    the keys before ``cached - new + r + 1`` (TVM's convention: the new tokens already in the pages)."""
    import numpy as np

    from autosched.generation.cpu_paged_prefill import EMPTY_LSE

    h_q, h_kv, d, page = 4, 2, 8, 4
    run = _cpu_paged_prefill(0, h_q, h_kv, d, page)
    rng = np.random.default_rng(1)
    pages = rng.standard_normal((8, 2, h_kv, page, d)).astype("float32")
    seq_pages, cached, new = [5, 2], 6, [3, 2]
    q = rng.standard_normal((sum(new), h_q, d)).astype("float32")
    args = [q, np.array([0, 3, 5], "int32"), pages, np.array([0, 2, 2], "int32"), np.array(seq_pages, "int32"),
            np.array([cached - page, 0], "int32"), np.zeros(2, "int32"), np.zeros(sum(new), "int32")]
    keys = np.stack([pages[seq_pages[c // page], 0, :, c % page] for c in range(cached)])
    values = np.stack([pages[seq_pages[c // page], 1, :, c % page] for c in range(cached)])
    for causal in (0, 1):
        out, lse = run(args, causal)
        for row in range(sum(new)):
            for h in range(h_q):
                if row >= new[0]:  # the sequence without pages: nothing visible
                    assert not out[row, h].any() and lse[row, h] == EMPTY_LSE
                    continue
                end = cached - new[0] + row + 1 if causal else cached
                _assert_attends(out[row, h], lse[row, h], q[row, h], keys[:end, h // 2], values[:end, h // 2])
