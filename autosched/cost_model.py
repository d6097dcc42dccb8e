"""The cost model: features of a scheduled kernel and an XGBoost ranker over them.

Features come from the lowered TensorIR of each candidate through TVM's per-store feature extractor
(164 numbers per buffer store: loop structure, arithmetic, memory access and reuse per buffer,
parallelism, vectorisation, GPU thread binding). A candidate's vector is the sum and the maximum of its
stores' features, plus the store count. The model ranks (objective ``rank:pairwise``): only the order
of candidates matters to the search, and ranks transfer between kernels of different sizes better than
absolute times.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from autosched.errors import UsageError
from autosched.tvm_adapter import feature_tune_context

if TYPE_CHECKING:
    from tvm import IRModule

    from autosched.target import TargetSpec

# Deferred imports: tvm, xgboost (imported where used: `autosched --help` stays fast).

N_STORE_FEATURES = 164
FEATURE_LENGTH = 2 * N_STORE_FEATURES + 1
MODEL_FORMAT = "autosched-xgb-cost-model"


class FeatureExtractor:
    """Per-candidate feature vectors from scheduled modules, for one target."""

    def __init__(self, target: TargetSpec):
        from tvm.s_tir import meta_schedule as ms

        self._ms = ms
        self._ctx = feature_tune_context(target.tvm_target())
        self._extractor = ms.feature_extractor.PerStoreFeature()

    def __call__(self, mods: list[IRModule]) -> np.ndarray:
        """One row of length ``FEATURE_LENGTH`` per module."""
        from tvm import s_tir

        if not mods:
            return np.zeros((0, FEATURE_LENGTH))
        candidates = [self._ms.MeasureCandidate(s_tir.Schedule(m), []) for m in mods]
        rows = []
        for feats in self._extractor.extract_from(self._ctx, candidates):
            per_store = feats.numpy()
            if per_store.size == 0:
                rows.append(np.zeros(FEATURE_LENGTH))
                continue
            rows.append(np.concatenate([per_store.sum(0), per_store.max(0), [np.log1p(per_store.shape[0])]]))
        return np.asarray(rows, dtype=np.float64)


class CostModel(Protocol):
    """Predicts which candidates are faster. Higher scores mean faster."""

    def fit(self, features: np.ndarray, latencies: np.ndarray) -> CostModel:
        """Learn from measured candidates; failed ones have latency ``inf``. Returns self."""

    def predict(self, features: np.ndarray) -> np.ndarray:
        """A score per row; only the order is meaningful."""


class NotFittedError(RuntimeError):
    """Raised by ``predict`` before ``fit``."""


def _relevance(latencies: np.ndarray, levels: int = 31) -> np.ndarray:
    """Integer relevance labels for ranking: 0 for failures, up to ``levels - 1`` for the fastest."""
    finite = np.isfinite(latencies)
    labels = np.zeros(len(latencies))
    if finite.any():
        throughput = np.where(finite, latencies[finite].min() / np.where(finite, latencies, 1.0), 0.0)
        labels = np.round(throughput * (levels - 1))
    return labels


class XGBCostModel:
    """XGBoost gradient-boosted trees with a pairwise ranking objective.

    Args:
        n_estimators: boosting rounds.
        max_depth: depth of each tree.
        learning_rate: shrinkage of each round.
        seed: random seed of the booster.
    """

    def __init__(self, n_estimators: int = 120, max_depth: int = 6, learning_rate: float = 0.1, seed: int = 0):
        self.n_estimators = n_estimators
        self.max_depth = max_depth
        self.learning_rate = learning_rate
        self.seed = seed

    def fit(self, features: np.ndarray, latencies: np.ndarray) -> XGBCostModel:
        import xgboost as xgb

        features = np.asarray(features, dtype=np.float64)
        latencies = np.asarray(latencies, dtype=np.float64)
        if len(features) != len(latencies):
            raise ValueError(f"{len(features)} feature rows but {len(latencies)} latencies")
        data = xgb.DMatrix(features, label=_relevance(latencies))
        data.set_group([len(features)])
        params = {"objective": "rank:pairwise", "max_depth": self.max_depth, "eta": self.learning_rate,
                  "seed": self.seed, "nthread": 1, "min_child_weight": 1, "verbosity": 0}
        self.booster_ = xgb.train(params, data, num_boost_round=self.n_estimators)
        self.n_samples_ = len(features)
        return self

    def predict(self, features: np.ndarray) -> np.ndarray:
        import xgboost as xgb

        if not hasattr(self, "booster_"):
            raise NotFittedError("XGBCostModel.predict called before fit")
        return self.booster_.predict(xgb.DMatrix(np.asarray(features, dtype=np.float64)))

    def save(self, path: str | Path) -> None:
        if not hasattr(self, "booster_"):
            raise NotFittedError("nothing to save: the model is not fitted")
        header = {"format": MODEL_FORMAT, "version": 1, "feature_length": FEATURE_LENGTH, "n_samples": self.n_samples_,
                  "params": {"n_estimators": self.n_estimators, "max_depth": self.max_depth,
                             "learning_rate": self.learning_rate, "seed": self.seed}}
        Path(path).write_text(json.dumps({"header": header, "booster": self.booster_.save_raw("json").decode()}))

    @classmethod
    def load(cls, path: str | Path) -> XGBCostModel:
        import xgboost as xgb

        data = json.loads(Path(path).read_text())
        header = data.get("header", {})
        if header.get("format") != MODEL_FORMAT or header.get("feature_length") != FEATURE_LENGTH:
            raise ValueError(f"{path} is not an autosched cost model of this version (header: {header})")
        model = cls(**header["params"])
        model.booster_ = xgb.Booster()
        model.booster_.load_model(bytearray(data["booster"].encode()))
        model.n_samples_ = header["n_samples"]
        return model


class RandomModel:
    """Scores at random: the search without a model, for ablations and tests."""

    def __init__(self, seed: int = 0):
        self.seed = seed

    def fit(self, features, latencies) -> RandomModel:
        self.rng_ = np.random.default_rng(self.seed)
        return self

    def predict(self, features) -> np.ndarray:
        rng = getattr(self, "rng_", None) or np.random.default_rng(self.seed)
        return rng.random(len(features))


def create_cost_model(name: str | CostModel, seed: int = 0) -> CostModel:
    """A cost model by name (``xgb`` or ``random``), or the instance given."""
    if not isinstance(name, str):
        return name
    models = {"xgb": lambda: XGBCostModel(seed=seed), "random": lambda: RandomModel(seed)}
    if name not in models:
        raise UsageError(f"unknown cost model '{name}'; choose one of {', '.join(models)}")
    return models[name]()
