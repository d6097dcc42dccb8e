"""Evolutionary search over a schedule space, guided by a cost model (ask/tell).

``propose(n)`` returns up to ``n`` points never measured before; ``observe(points, results)`` feeds
their measurements back and refits the model. Until the first successful measurement the proposals
are random samples; after that each round evolves a population (the best measured points plus random
samples) by mutation and crossover for a few generations, keeps the children the model ranks highest,
and proposes the best of them plus a share of random points (epsilon-greedy exploration).
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np
import tvm_ffi

from autosched.search_spaces import InvalidPoint, Point, point_key

if TYPE_CHECKING:
    from tvm import IRModule

    from autosched.cost_model import CostModel
    from autosched.records import MeasureResult
    from autosched.search_spaces import Space

# Seconds of Space.apply from which the builder gets the search's module instead of applying the point
# again. Below it, sending costs as much: writing and reading TVM's JSON of a small scheduled module
# takes about as long as applying its point.
SEND_MODULE_AFTER = 0.003


@dataclass(frozen=True)
class SearchConfig:
    """Knobs of the evolutionary search.

    Args:
        population: points kept after each generation.
        generations: rounds of mutation and selection per proposal.
        parents: best measured points seeded into the population.
        epsilon: share of each batch drawn at random instead of by the model.
        crossover: probability that a child comes from crossover rather than mutation.
        min_train: measurements needed before the model guides the search.
    """

    population: int = 64
    generations: int = 3
    parents: int = 16
    epsilon: float = 0.15
    crossover: float = 0.2
    min_train: int = 8


class EvolutionarySearch:
    """Args:
        space: the schedule space of the task.
        cost_model: ranks candidates (see :mod:`autosched.cost_model`).
        featurize: maps scheduled modules to feature rows.
        seed: makes proposals reproducible for the same measurements.
        config: search parameters.
    """

    def __init__(self, space: Space, cost_model: CostModel, featurize: Callable, seed: int = 0,
                 config: SearchConfig | None = None):
        self.space = space
        self.model = cost_model
        self.featurize = featurize
        self.config = config or SearchConfig()
        self.rng = np.random.default_rng(seed)
        self.measured: dict[str, tuple[Point, float]] = {}  # key -> (point, median seconds or inf)
        self.rejected: dict[str, str] = {}  # key -> why the space could not apply the point
        # Points whose scheduled module is structurally equal to an earlier point's: the same kernel, which
        # is measured once. This catches what a space's canonical() rules do not.
        self.duplicates: dict[str, str] = {}  # key -> key of the earlier point
        self._kernels: dict[int, str] = {}  # structural hash of a scheduled module -> its first point's key
        self._features: dict[str, np.ndarray] = {}
        # Scheduled modules of points not measured yet that were slow to apply, for the builder to compile
        # instead of applying the point again. A module takes tens to hundreds of kB: those of about one
        # round's applications are kept: a point proposed is mostly measured within the round it was applied in.
        self._modules: collections.OrderedDict[str, IRModule] = collections.OrderedDict()
        self._modules_kept = self.config.population * (self.config.generations + 1)
        self._fitted = False
        self._first: list[Point] = []  # proposed before anything else (e.g. transferred points)

    # ---- tell ------------------------------------------------------------------------------------
    def observe(self, points: list[Point], results: list[MeasureResult]) -> None:
        for point, result in zip(points, results):
            key = point_key(point)
            self.measured[key] = (point, result.median)
            self._modules.pop(key, None)
        self._refit()

    def observe_known(self, points: list[Point], latencies: list[float]) -> None:
        """Seed the search with points measured earlier (e.g. records in the database)."""
        for point, latency in zip(points, latencies):
            point = self.space.complete(point)
            if self.space.validate(point) is None:
                self.measured[point_key(point)] = (point, latency)
        self._refit()

    def propose_first(self, points: list[Point]) -> None:
        """Points to propose before any sampling (e.g. decisions transferred from similar shapes)."""
        self._first.extend(p for p in points if point_key(p) not in self.measured)

    def best(self) -> tuple[Point, float] | None:
        ok = [v for v in self.measured.values() if math.isfinite(v[1])]
        return min(ok, key=lambda v: v[1]) if ok else None

    def _refit(self) -> None:
        items = list(self.measured.items())
        if len(items) < self.config.min_train or not any(math.isfinite(lat) for _, (_, lat) in items):
            return
        keys = [k for k, _ in items]
        feats = self._features_of([p for _, (p, _) in items], keys)
        usable = [i for i, k in enumerate(keys) if k in self._features]
        if len(usable) < 2:
            return
        self.model.fit(feats[usable], np.array([items[i][1][1] for i in usable]))
        self._fitted = True

    # ---- ask -------------------------------------------------------------------------------------
    def propose(self, n: int) -> list[Point]:
        """Up to ``n`` new valid points (fewer only when the space seems exhausted)."""
        if n <= 0:
            return []
        first: dict[str, Point] = {}
        while self._first and len(first) < n:
            point = self._first.pop(0)
            key = point_key(point)
            if key not in self.measured and key not in first and self._applies(point, key):
                first[key] = point
        if first:
            return list(first.values()) + self._random_new(n - len(first), exclude=set(first))
        if not self._fitted:
            return self._random_new(n)
        scored = self._evolve()
        n_random = int(round(self.config.epsilon * n))
        chosen: dict[str, Point] = {}
        for key, point in scored:
            if len(chosen) >= n - n_random:
                break
            chosen[key] = point
        for point in self._random_new(n - len(chosen), exclude=set(chosen)):
            chosen[point_key(point)] = point
        return list(chosen.values())

    def modules(self, points: list[Point]) -> list[IRModule | None]:
        """The scheduled module of each proposed point, None where the search kept none (a point quick to apply,
        a space with its own features, a module dropped for room): the builder applies those points itself."""
        return [self._modules.get(point_key(p)) for p in points]

    def _random_new(self, n: int, exclude: set[str] | None = None, tries_per_point: int = 20) -> list[Point]:
        out: dict[str, Point] = {}
        exclude = exclude or set()
        for _ in range(n * tries_per_point):
            if len(out) >= n:
                break
            try:
                point = self.space.sample(self.rng)
            except InvalidPoint:
                break
            key = point_key(point)
            if key in self.measured or key in out or key in exclude or key in self.rejected or key in self.duplicates:
                continue
            if self._applies(point, key):
                out[key] = point
        return list(out.values())

    def _evolve(self) -> list[tuple[str, Point]]:
        """Unmeasured points of the final population, best predicted first."""
        cfg = self.config
        ranked = sorted(self.measured.values(), key=lambda v: v[1])
        population = {point_key(p): p for p, lat in ranked[: cfg.parents] if math.isfinite(lat)}
        for point in self._random_new(max(0, cfg.population - len(population))):
            population[point_key(point)] = point
        for _ in range(cfg.generations):
            parents = list(population.values())
            children: dict[str, Point] = {}
            for _ in range(cfg.population):
                a = parents[int(self.rng.integers(len(parents)))]
                if self.rng.random() < cfg.crossover and len(parents) > 1:
                    child = self.space.crossover(a, parents[int(self.rng.integers(len(parents)))], self.rng)
                else:
                    child = self.space.mutate(a, self.rng)
                if child is None:
                    continue
                key = point_key(child)
                if key not in population and key not in self.rejected and self._applies(child, key):
                    children[key] = child
            merged = {**population, **children}
            keys = list(merged)
            scores = self.model.predict(self._features_of(list(merged.values()), keys))
            order = np.argsort(-scores, kind="stable")
            population = {keys[i]: merged[keys[i]] for i in order[: cfg.population]}
        keys = list(population)
        scores = self.model.predict(self._features_of(list(population.values()), keys))
        order = np.argsort(-scores, kind="stable")
        return [(keys[i], population[keys[i]]) for i in order if keys[i] not in self.measured]

    # ---- features --------------------------------------------------------------------------------
    def _applies(self, point: Point, key: str) -> bool:
        """Featurise ``point`` (cached); False, with the reason kept, if the space cannot apply it or an earlier
        point gave the same kernel."""
        if key in self._features:
            return True
        if key in self.duplicates or key in self.rejected:
            return False
        reason = self.space.validate(point)
        analytic = self.space.point_features(point) if reason is None else None
        if analytic is not None:
            self._features[key] = np.asarray(analytic, dtype=np.float64)
            return True
        start = time.perf_counter()
        try:
            mod = self.space.apply(point)
        except InvalidPoint as exc:
            self.rejected[key] = str(exc)
            return False
        apply_seconds = time.perf_counter() - start
        first = self._kernels.setdefault(tvm_ffi.structural_hash(mod), key)
        if first != key:
            self.duplicates[key] = first
            return False
        self._features[key] = self.featurize([mod])[0]
        if key not in self.measured and apply_seconds >= SEND_MODULE_AFTER:
            self._modules[key] = mod
            while len(self._modules) > self._modules_kept:
                self._modules.popitem(last=False)
        return True

    def _features_of(self, points: list[Point], keys: list[str]) -> np.ndarray:
        for point, key in zip(points, keys):
            if key not in self._features and key not in self.rejected:
                self._applies(point, key)
        width = next(iter(self._features.values())).shape[0] if self._features else 1
        return np.stack([self._features.get(k, np.zeros(width)) for k in keys])
