"""The XGBoost ranker and the features it learns from."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import spearmanr

from autosched.cost_model import FEATURE_LENGTH, FeatureExtractor, NotFittedError, XGBCostModel, create_cost_model
from autosched.errors import UsageError
from autosched.task import Task
from autosched.workloads import make_workload


def test_predict_before_fit_raises():
    with pytest.raises(NotFittedError):
        XGBCostModel().predict(np.zeros((2, FEATURE_LENGTH)))


def test_ranks_a_known_order():
    """On synthetic data where latency is a monotone function of two features, the ranking learnt on
    one half orders the other half almost perfectly (Spearman > 0.9)."""
    rng = np.random.default_rng(0)
    x = rng.random((200, 10))
    latency = np.exp(3 * x[:, 0] - 2 * x[:, 1])
    model = XGBCostModel(seed=0).fit(x[:100], latency[:100])
    rho = spearmanr(model.predict(x[100:]), -latency[100:]).statistic
    assert rho > 0.9


def test_failures_rank_last():
    rng = np.random.default_rng(1)
    x = rng.random((60, 4))
    latency = 1 + x[:, 0]
    latency[x[:, 1] > 0.7] = np.inf  # "failed" candidates share a visible feature
    model = XGBCostModel(seed=0).fit(x, latency)
    scores = model.predict(x)
    assert scores[np.isinf(latency)].mean() < scores[np.isfinite(latency)].mean()


def test_save_load_round_trip(tmp_path):
    rng = np.random.default_rng(2)
    x = rng.random((40, FEATURE_LENGTH))
    model = XGBCostModel(n_estimators=20).fit(x, rng.random(40))
    model.save(tmp_path / "model.json")
    again = XGBCostModel.load(tmp_path / "model.json")
    np.testing.assert_allclose(again.predict(x), model.predict(x))
    (tmp_path / "bad.json").write_text('{"header": {"format": "other"}}')
    with pytest.raises(ValueError, match="not an autosched cost model"):
        XGBCostModel.load(tmp_path / "bad.json")


def test_unknown_model_name():
    with pytest.raises(UsageError, match="unknown cost model"):
        create_cost_model("lstm")


def test_features_of_real_schedules_differ(cpu_target):
    """Different schedules of one GEMM give different per-store feature vectors of the right length."""
    task = Task.from_workload(make_workload("gemm", "m=128,n=128,k=128"))
    space = task.space(cpu_target)
    rng = np.random.default_rng(0)
    mods = [space.apply(space.sample(rng)) for _ in range(6)]
    feats = FeatureExtractor(cpu_target)(mods)
    assert feats.shape == (6, FEATURE_LENGTH)
    assert np.isfinite(feats).all()
    assert len({tuple(np.round(f, 6)) for f in feats}) > 1
