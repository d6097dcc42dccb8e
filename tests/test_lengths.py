"""One artifact for any length: bucket lengths, padding that is checked to be exact, and the runtime
that pads, dispatches and cuts back."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from autosched.errors import UsageError
from autosched.pipeline import (
    BucketedModel,
    build_lengths,
    check_padding_is_exact,
    export_bucketed,
    load_model,
    models_at,
    parse_lengths,
)
from autosched.runmodel import run_artifact


def test_bucket_lengths():
    assert parse_lengths(None) is None
    assert parse_lengths("dynamic", 100) == [16, 32, 64, 100]
    assert parse_lengths("dynamic", 64) == [16, 32, 64]
    assert parse_lengths("300, 77,1000") == [77, 300, 1000]
    assert parse_lengths("dynamic", 1024, 1.5) == [16, 32, 48, 80, 128, 192, 288, 432, 656, 992, 1024]
    for bad in ("0", "a,b", ""):
        with pytest.raises(UsageError, match="--tokens"):
            parse_lengths(bad)


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


def test_a_model_that_is_not_causal_is_refused():
    with pytest.raises(UsageError, match="not a causal model"):
        check_padding_is_exact("tests.test_lengths:bidirectional", {})


def test_one_artifact_runs_lengths_between_its_buckets_exactly(cpu_target, tmp_path):
    """Buckets 8 and 16 of tiny-llama: 5 tokens run padded to 8, 11 padded to 16, and both match the
    model run at exactly that length; the rotary tables that differ by length are stored per bucket,
    the weights once."""
    kwargs = {"batch": 1, "tokens": None, "dtype": None}
    axes = check_padding_is_exact("tiny-llama", kwargs)
    assert axes.inputs == [1] and axes.outputs == [1]
    models = models_at("tiny-llama", kwargs, [8, 16])
    executables, params, reports = build_lengths(models, cpu_target, None)
    assert sum(a is b for a, b in zip(params[8], params[16])) >= len(params[8]) - 4  # the weights are shared
    out = export_bucketed(tmp_path / "dyn", executables, params, models[0], cpu_target, reports, axes, None)
    model = BucketedModel(out)
    for tokens, bucket in ((5, 8), (11, 16)):
        assert model.bucket(tokens) == bucket
        reference = load_model("tiny-llama", tokens=tokens)
        got = model(reference.inputs[0].numpy())[0]
        with torch.no_grad():
            expected = reference.module(*reference.inputs).numpy()
        assert got.shape == expected.shape and np.allclose(got, expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(UsageError, match="more than this build's maximum of 16"):
        model.bucket(17)
    result = run_artifact(str(out), repeat=2, tokens=11)
    assert result["bucket"] == 16 and result["matches_torch"] is True, result
