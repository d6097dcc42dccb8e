"""One artifact for any length and batch: bucket sizes, padding that is checked to be exact, and the
runtime that pads, dispatches and cuts back."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from autosched.errors import UsageError
from autosched.pipeline import (
    BucketedModel,
    bucket_grid,
    bucket_key,
    build_buckets,
    check_padding_is_exact,
    export_bucketed,
    extract_tasks,
    load_model,
    merge_bucket_tasks,
    models_at,
    parse_batches,
    parse_lengths,
    prepare,
)
from autosched.runmodel import run_artifact
from autosched.tuner import TuneOptions, tune_tasks

from .helpers import InstantMeasurer


def test_bucket_lengths():
    assert parse_lengths(None) is None
    assert parse_lengths("dynamic", 100) == [16, 32, 64, 100]
    assert parse_lengths("dynamic", 64) == [16, 32, 64]
    assert parse_lengths("300, 77,1000") == [77, 300, 1000]
    assert parse_lengths("dynamic", 1024, 1.5) == [16, 32, 48, 64, 80, 128, 192, 256, 288, 432, 512, 656, 992, 1024]
    for bad in ("0", "a,b", ""):
        with pytest.raises(UsageError, match="--tokens"):
            parse_lengths(bad)


def test_bucket_batches_and_grids():
    assert parse_batches(None) is None
    assert parse_batches("dynamic", 16) == [1, 2, 4, 8, 16]
    assert parse_batches("dynamic", 12) == [1, 2, 4, 8, 12]
    assert parse_batches("dynamic", 1) == [1]
    assert parse_batches("4,1") == [1, 4]
    for bad in ("0", "x", ""):
        with pytest.raises(UsageError, match="--batch"):
            parse_batches(bad)
    assert bucket_grid(None, [64]) == [] and bucket_grid([4], None) == []
    assert bucket_grid([1, 2], [1]) == [(1, None), (2, None)]
    assert bucket_grid(None, [8, 16]) == [(None, 8), (None, 16)]
    assert bucket_grid([1, 2], [8, 16]) == [(1, 8), (1, 16), (2, 8), (2, 16)]
    assert [bucket_key(b) for b in ((None, 128), (4, None), (4, 128))] == ["128", "b4", "b4-t128"]


class _Bidirectional(nn.Module):
    """Attention over every position: appending tokens changes the earlier outputs."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 16).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(x.shape)


def bidirectional(batch: int = 1, tokens: int = 16, dtype=torch.float32):
    torch.manual_seed(0)
    return _Bidirectional().to(dtype), (torch.randn(batch, tokens, 32, generator=torch.Generator().manual_seed(1)),)


@pytest.mark.slow  # tunes or builds several lengths (10-25 s)
def test_each_bucket_gets_its_share_of_the_trials(cpu_target):
    """tune-model at several lengths: the short bucket's kernels are not starved by the long one's,
    whose absolute times are larger (weighted by calls alone, they took nearly every trial)."""
    import dataclasses

    per_bucket = [extract_tasks(prepare(load_model("tiny-llama", tokens=n), cpu_target)[0]) for n in (16, 256)]
    merged = merge_bucket_tasks(per_bucket)
    assert sum(t.weight for t in merged) == sum(t.weight for tasks in per_bucket for t in tasks)  # calls add up
    short, long = ({t.key for t in tasks} - {t.key for t in other}
                   for tasks, other in ((per_bucket[0], per_bucket[1]), (per_bucket[1], per_bucket[0])))
    assert short and long
    assert all(t.share == 1.0 for t in merged if t.key in long)
    assert all(t.share > 4 for t in merged if t.key in short)

    def trials_of(tasks):
        options = TuneOptions(trials=60, batch_size=4, seed=0, cost_model="random")
        # Each kernel 'runs' in a time proportional to its work, at half the rate of the heaviest kernel,
        # which stands for the device's floor: each other kernel has room in proportion to its work.
        work = {t.spec.key: (t.flops + t.min_bytes) * 2e-12 for t in tasks}
        heaviest = max(tasks, key=lambda t: t.flops + t.min_bytes).spec.key
        work[heaviest] /= 2
        results = tune_tasks(tasks, cpu_target, None, options, measurer=InstantMeasurer(lambda spec: work[spec.key]))
        per = {t.key: r.trials for t, r in zip(tasks, results)}
        return sum(per[k] for k in short), sum(per[k] for k in long)

    fair_short, fair_long = trials_of(merged)
    starved_short, starved_long = trials_of([dataclasses.replace(t, share=1.0) for t in merged])
    assert fair_short >= 0.5 * fair_long, (fair_short, fair_long)
    assert starved_short < 0.5 * starved_long, (starved_short, starved_long)  # what the shares change


@pytest.mark.slow  # tunes or builds several lengths (10-25 s)
def test_a_fused_kernel_at_an_untuned_length_starts_from_the_tuned_lengths(cpu_target, tmp_path):
    """Kernels with no operator of ours (the CPU's matmuls, fused elementwise chains) also transfer: the
    same function at another length is found by its sizeless form, nearest length first."""
    from autosched.database.store import Database
    from autosched.measure import Measurer
    from autosched.tuner import tune
    from autosched.warm_start import nearest_workloads, transfer_points

    tasks = {tokens: extract_tasks(prepare(load_model("tiny-llama", tokens=tokens), cpu_target)[0]) for tokens in (16, 24, 64)}

    def matmuls(tokens):
        return sorted((t for t in tasks[tokens] if t.workload is None and t.name.startswith("matmul")), key=lambda t: t.name)

    # One measurer for the four runs: each would otherwise start its own builder pool and runner (seconds each).
    with Database(tmp_path / "t.db") as db, Measurer(cpu_target) as measurer:
        for tokens in (16, 64):
            for task in matmuls(tokens)[:2]:
                tune(task, cpu_target, db, TuneOptions(trials=2, batch_size=2, cost_model="random", transfer=False),
                     measurer=measurer)
        new = matmuls(24)[0]
        near = nearest_workloads(db, new, cpu_target, k=4)
        assert len(near) == 4  # both tuned lengths' two matmuls: the same function with other sizes
        nearest_key = near[0][1]
        assert nearest_key == matmuls(16)[0].key  # 24 tokens is nearer 16 than 64, and the same weight
        space = new.space(cpu_target)
        points = transfer_points(db, new, cpu_target, space)
        assert points and all(space.validate(p) is None for p, _, _ in points)
        # A function of another computation is never matched: the database holds only matmuls.
        others = [t for t in tasks[24] if t.workload is None and not t.name.startswith("matmul")]
        assert others and all(nearest_workloads(db, t, cpu_target) == [] for t in others)



def test_build_makes_finer_buckets_than_tune_model_tunes():
    """By default ``build --tokens dynamic`` pads by at most a quarter (300 tokens run as 304), while
    ``tune-model`` tunes the powers of two, which the build's buckets include; both take --bucket-growth."""
    from autosched.cli import build_parser
    from autosched.cli.model import _sizes

    def buckets(*argv):
        return _sizes(build_parser().parse_args([*argv, "tiny-llama", "--tokens", "dynamic", "--max-tokens", "1024"]))[1]

    tuned, built = buckets("tune-model"), buckets("build", "-o", "out")
    assert tuned == [16, 32, 64, 128, 256, 512, 1024]
    assert set(tuned) <= set(built) and 304 in built and len(built) == 19
    assert buckets("build", "-o", "out", "--bucket-growth", "2") == tuned

def test_a_model_that_is_not_causal_is_refused():
    with pytest.raises(UsageError, match="not a causal model"):
        check_padding_is_exact("tests.test_lengths:bidirectional", {})


@pytest.mark.slow
def test_one_artifact_runs_lengths_between_its_buckets_exactly(cpu_target, tmp_path):
    """Buckets 8 and 16 of tiny-llama: 5 tokens run padded to 8, 11 padded to 16, and both match the
    model run at exactly that length; the rotary tables that differ by length are stored per bucket,
    the weights once."""
    kwargs = {"batch": 1, "tokens": None, "dtype": None}
    axes = check_padding_is_exact("tiny-llama", kwargs)
    assert axes.inputs == [1] and axes.outputs == [1]
    buckets = [(None, 8), (None, 16)]
    models = models_at("tiny-llama", kwargs, buckets)
    built = []
    executables, params, reports = build_buckets(models, buckets, cpu_target, None,
                                                 progress=lambda bucket, report: built.append((bucket, report.seconds)))
    # Progress as each bucket is built, with the seconds of its steps.
    assert [b for b, _ in built] == buckets and all(set(s) == {"import", "database", "compile"} for _, s in built)
    assert all(s["compile"] > 0 for _, s in built)
    short, long = params[(None, 8)], params[(None, 16)]
    assert sum(a is b for a, b in zip(short, long)) >= len(short) - 4  # the weights are shared
    out = export_bucketed(tmp_path / "dyn", executables, params, models[0], cpu_target, reports, {"tokens": axes}, None)
    model = BucketedModel(out)
    for tokens, bucket in ((5, 8), (11, 16)):
        assert model.bucket(tokens) == (None, bucket)
        reference = load_model("tiny-llama", tokens=tokens)
        got = model(reference.inputs[0].numpy())[0]
        with torch.no_grad():
            expected = reference.module(*reference.inputs).numpy()
        assert got.shape == expected.shape and np.allclose(got, expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(UsageError, match="more than this build's maximum of 16"):
        model.bucket(17)
    result = run_artifact(str(out), repeat=2, tokens=11)
    assert result["bucket"] == 16 and result["matches_torch"] is True, result


class _MixesTheBatch(nn.Module):
    """Each sequence minus the batch's mean: adding sequences changes the first one's output."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, x):
        y = self.proj(x)
        return y - y.mean(0, keepdim=True)


def mixes_the_batch(batch: int = 1, tokens: int = 16, dtype=torch.float32):
    torch.manual_seed(0)
    return _MixesTheBatch().to(dtype), (torch.randn(batch, tokens, 32, generator=torch.Generator().manual_seed(1)),)


def test_a_model_whose_sequences_see_each_other_gets_no_dynamic_batch():
    with pytest.raises(UsageError, match="sequences are not independent"):
        check_padding_is_exact("tests.test_lengths:mixes_the_batch", {}, "batch")
    assert check_padding_is_exact("tests.test_lengths:bidirectional", {}, "batch").inputs == [0]


@pytest.mark.slow  # tunes or builds several lengths (10-25 s)
def test_one_artifact_runs_batches_and_lengths_between_its_buckets_exactly(cpu_target, tmp_path):
    """Batches 1 and 2 by lengths 8 and 16 of tiny-llama: 2 sequences of 5 tokens run in the (2, 8)
    bucket, 1 of 11 in (1, 16), each matching the model run at exactly that shape."""
    kwargs = {"batch": None, "tokens": None, "dtype": None}
    axes = {axis: check_padding_is_exact("tiny-llama", kwargs, axis) for axis in ("batch", "tokens")}
    assert axes["batch"].inputs == [0] and axes["batch"].outputs == [0]
    buckets = bucket_grid([1, 2], [8, 16])
    models = models_at("tiny-llama", kwargs, buckets)
    executables, params, reports = build_buckets(models, buckets, cpu_target, None)
    out = export_bucketed(tmp_path / "grid", executables, params, models[0], cpu_target, reports, axes, None)
    model = BucketedModel(out)
    assert sorted(p.name for p in out.glob("*.so")) == ["model-b1-t16.so", "model-b1-t8.so", "model-b2-t16.so",
                                                         "model-b2-t8.so"]
    for batch, tokens, bucket in ((2, 5, (2, 8)), (1, 11, (1, 16))):
        assert model.bucket(tokens=tokens, batch=batch) == bucket
        reference = load_model("tiny-llama", batch=batch, tokens=tokens)
        got = model(reference.inputs[0].numpy())[0]
        with torch.no_grad():
            expected = reference.module(*reference.inputs).numpy()
        assert got.shape == expected.shape and np.allclose(got, expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(UsageError, match="rebuild with --max-batch 3"):
        model.bucket(tokens=8, batch=3)
    result = run_artifact(str(out), repeat=2, tokens=11, batch=2)
    assert (result["batch_bucket"], result["bucket"]) == (2, 16) and result["matches_torch"] is True, result


@pytest.mark.slow
def test_a_decode_step_for_any_batch_from_the_command_line(tmp_path):
    """``build --tokens 1 --batch dynamic``: one decode-step artifact for 1 to 4 sequences."""
    import json

    from .helpers import cli

    # In-process: a new interpreter costs seconds of importing TVM, and test_readme.py runs build and run as processes.
    out = tmp_path / "decode"
    proc = cli("build", "tiny-llama", "--tokens", "1", "--batch", "dynamic", "--max-batch", "4",
               "-o", str(out), "--db", str(tmp_path / "none.db"))
    assert "one artifact for 1 to 4 sequences" in proc.stderr, proc.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["buckets"] == [[1, None], [2, None], [4, None]] and "token_axes" not in manifest
    result = json.loads(cli("run", str(out), "--batch", "3", "--format", "json").stdout)
    assert (result["batch"], result["batch_bucket"], result["matches_torch"]) == (3, 4, True), result
