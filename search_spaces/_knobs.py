"""Knobs and the space base class.

A point in a space is a plain dict ``{knob name: value}`` of JSON values (ints, bools, strings and
lists of ints). Applying a point to a fresh copy of the workload is deterministic, so a stored point
replays exactly. Sampling and mutation only return points that pass :meth:`Space.check`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

if TYPE_CHECKING:
    from tvm import IRModule, s_tir
    from tvm.tirx import PrimFunc

    from autosched.target import TargetSpec

# Deferred imports: tvm (imported where used: `autosched --help` stays fast).

Point = dict[str, Any]


class InvalidPoint(Exception):
    """A point that the space cannot apply; ``str(exc)`` is the reason, which is recorded."""


# Errors that mean the space's Python is wrong, not that the point is: :meth:`Space.apply` lets them
# through. TVM reports a rejected schedule as a RuntimeError (ScheduleError) or ValueError.
SPACE_BUGS: tuple[type[BaseException], ...] = (KeyError, TypeError, IndexError, AssertionError, NameError, AttributeError)


@dataclass(frozen=True)
class Knob:
    """One decision with its allowed values. ``ordered`` knobs mutate to a neighbouring value."""

    name: str
    choices: tuple[Any, ...]
    ordered: bool = True

    def sample(self, rng: np.random.Generator) -> Any:
        return self.choices[int(rng.integers(len(self.choices)))]

    def mutate(self, value: Any, rng: np.random.Generator) -> Any:
        if len(self.choices) < 2:
            return value
        try:
            at = self.choices.index(value)
        except ValueError:
            return self.sample(rng)
        if self.ordered and rng.random() < 0.7:
            step = int(rng.choice([-1, 1]))
            return self.choices[min(max(at + step, 0), len(self.choices) - 1)]
        others = [c for c in self.choices if c != value]
        return others[int(rng.integers(len(others)))]


@dataclass(frozen=True)
class TileKnob(Knob):
    """Inner factors of one loop split into ``levels`` loops; the outermost factor is derived.

    A value is a tuple of ``levels - 1`` factors, innermost last. Their product may exceed or not
    divide the extent: spaces pad the loop (``pad_einsum``) or let TVM guard the tail.
    """

    extent: int = 1
    levels: int = 2
    factors: tuple[int, ...] = field(default=())  # the factor set each level draws from
    max_inner: int = 0  # bound on the product of the inner factors (0: the extent rounded up to 2^k)
    min_last: int = 1  # smallest innermost factor (e.g. the vector width)

    @classmethod
    def make(cls, name: str, extent: int, levels: int, max_inner: int = 0, min_last: int = 1,
             cap: int = 64, last_choices: tuple[int, ...] | None = None) -> TileKnob:
        factors = candidate_factors(extent, cap)
        bound = max_inner or next_pow2(extent)
        lasts = last_choices or tuple(f for f in factors if f >= min(min_last, bound))
        choices = [c for c in _tile_choices(factors, levels - 1, bound, lasts)]
        return cls(name, tuple(choices), ordered=False, extent=extent, levels=levels, factors=factors,
                   max_inner=bound, min_last=min_last)

    def mutate(self, value: Any, rng: np.random.Generator) -> Any:
        # Move a factor of two between two levels: a small step in the space, which the evolutionary
        # search needs more often than a jump.
        value = tuple(value)
        if len(value) >= 2 and rng.random() < 0.6:
            a, b = rng.choice(len(value), size=2, replace=False)
            moved = list(value)
            if moved[a] % 2 == 0:
                moved[a] //= 2
                moved[b] *= 2
                if tuple(moved) in self.choices:
                    return tuple(moved)
        return super().mutate(value, rng) if rng.random() < 0.5 else self._neighbour(value, rng)

    def _neighbour(self, value: tuple[int, ...], rng: np.random.Generator) -> tuple[int, ...]:
        level = int(rng.integers(len(value)))
        options = [c for c in self.choices if c[:level] + c[level + 1:] == value[:level] + value[level + 1:] and c != value]
        return options[int(rng.integers(len(options)))] if options else value


def _tile_choices(factors, n, bound, lasts):
    """All n-tuples of factors (innermost from ``lasts``) whose product is at most ``bound``."""
    if n == 0:
        yield ()
        return

    def rec(prefix, remaining, prod):
        if remaining == 1:
            for f in lasts:
                if prod * f <= bound:
                    yield tuple(prefix) + (f,)
            return
        for f in factors:
            if prod * f <= bound:
                yield from rec(prefix + [f], remaining - 1, prod * f)

    yield from rec([], n, 1)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def candidate_factors(extent: int, cap: int = 64) -> tuple[int, ...]:
    """Powers of two and divisors of ``extent``, up to ``cap`` and to the extent rounded up to 2^k."""
    limit = min(cap, next_pow2(extent))
    out = {1 << i for i in range(limit.bit_length()) if (1 << i) <= limit}
    out |= {d for d in range(1, limit + 1) if extent % d == 0}
    return tuple(sorted(out))


def point_key(point: Point) -> str:
    """Canonical string of a point: the identity used to deduplicate candidates."""
    return json.dumps(point, sort_keys=True, separators=(",", ":"), default=_jsonable)


def _jsonable(value: Any) -> Any:
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"not JSON serialisable: {value!r}")


def point_from_json(data: dict[str, Any] | str) -> Point:
    if isinstance(data, str):
        data = json.loads(data)
    return {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}


def padded(extent: int, tile: int) -> int:
    return math.ceil(extent / tile) * tile


class Space:
    """Base class of the schedule spaces: the knobs of one workload on one target, and how to apply them.

    Subclasses set ``name`` and ``version`` (bump the version when the meaning of a point changes, so
    stored points are not replayed onto a different schedule; a knob added later, at a value that gives the
    stored points' kernels, goes in ``self.added`` instead), build ``self.knobs`` in ``__init__``
    after calling ``super().__init__``, and implement :meth:`schedule`. :meth:`check` holds the cheap
    constraints that sampling and mutation respect.
    """

    name: ClassVar[str] = ""
    version: ClassVar[int] = 1
    targets: ClassVar[tuple[str, ...]] = ("llvm", "cuda")
    families: ClassVar[tuple[str, ...]] = ()  # operator families this space serves (Operator.family)
    template: ClassVar[bool] = False  # builds its own kernel for a family rather than scheduling func
    # How the space's modules are compiled: {"tir_pipeline": "tirx", "arch": "sm_90a"} for TIRx kernels.
    codegen: ClassVar[dict[str, str]] = {}

    @classmethod
    def suits(cls, func: PrimFunc, target: TargetSpec, hints: dict | None) -> bool:
        """Whether the space can serve ``func`` on ``target`` at all (e.g. an architecture's instructions)."""
        return True

    @classmethod
    def matches(cls, func: PrimFunc) -> bool:
        """Whether this space applies to a function of unknown origin (e.g. a Relax-fused kernel)."""
        return False

    def __init__(self, func: PrimFunc, target: TargetSpec, hints: dict | None = None):
        self.func = func
        self.target = target
        self.hints = hints or {}
        self.knobs: list[Knob] = []
        # Knobs added to the space after points of its version were stored, with the values that give those
        # points' kernels: a stored point without them means these (see complete).
        self.added: dict[str, Any] = {}

    def taken(self, shape, takes: str):
        """``shape``, a template's reading of the function it was given; where it found nothing, a ValueError
        naming the functions the space ``takes`` (``matches`` keeps the others away from it)."""
        if shape is None:
            raise ValueError(f"{self.name} takes {takes} functions only")
        return shape

    @property
    def id(self) -> str:
        return f"{self.name}@{self.version}"

    # ---- to implement ---------------------------------------------------------------------------
    def initial(self, point: Point) -> PrimFunc:
        """The function the schedule starts from: the workload's own, or a template's kernel."""
        return self.func

    def schedule(self, sch: s_tir.Schedule, point: Point) -> None:
        raise NotImplementedError

    def check(self, point: Point) -> str | None:
        """The reason ``point`` is invalid, or None."""
        return None

    def first_points(self) -> list[Point]:
        """Points the search measures before it samples: the default first, so that a tuned kernel is never
        slower than the untuned build's (which uses that point on the CPU)."""
        return [self.default()]

    def canonical(self, point: Point) -> Point:
        """The representative of the points that give the same schedule (e.g. knobs a mode ignores set to
        fixed values), so the search does not measure one kernel twice. Identity by default."""
        return point

    def build_config(self, point: Point) -> dict[str, Any]:
        """TVM pass-context options the scheduled module of ``point`` must be compiled with."""
        return {}

    def point_features(self, point: Point) -> list[float] | None:
        """Features of ``point`` for the cost model, for spaces whose kernels TVM's per-store features cannot
        read (TIRx templates); None means: featurise the scheduled module."""
        return None

    def default(self) -> Point:
        """A reasonable point without search; subclasses give a better one."""
        return self._draw(np.random.default_rng(0))

    # ---- provided -------------------------------------------------------------------------------
    def complete(self, point: Point) -> Point:
        """``point`` with the knobs it predates (``added``) at the values that keep its kernel."""
        missing = {name: value for name, value in self.added.items() if name not in point}
        return {**point, **missing} if missing else point

    def apply(self, point: Point) -> IRModule:
        """The scheduled module for ``point``.

        Raises:
            InvalidPoint: the space or a TVM schedule primitive rejects the point; the reason is recorded.
            KeyError, TypeError, IndexError, AssertionError, NameError, AttributeError: a bug in the
                space's own code (a misspelled knob, a wrong argument), raised as is so tests fail
                instead of the search recording every point as invalid.
        """
        from tvm import s_tir

        point = self.complete(point)
        reason = self.validate(point)
        if reason:
            raise InvalidPoint(reason)
        try:
            sch = s_tir.Schedule(self.initial(point))
            self.schedule(sch, point)
        except (InvalidPoint, *SPACE_BUGS):
            raise
        except (RuntimeError, ValueError) as exc:  # TVM's ScheduleError, InternalError, DiagnosticError, ...
            raise InvalidPoint(f"{type(exc).__name__}: {_first_line(exc)}") from exc
        return sch.mod

    def validate(self, point: Point) -> str | None:
        point = self.complete(point)
        names = {k.name for k in self.knobs}
        if set(point) != names:
            missing, extra = sorted(names - set(point)), sorted(set(point) - names)
            return f"point does not fit space {self.id}: missing {missing}, unexpected {extra}"
        for knob in self.knobs:
            if point[knob.name] not in knob.choices:
                return f"knob {knob.name}={point[knob.name]!r} is not one of its choices"
        return self.check(point)

    def _draw(self, rng: np.random.Generator, tries: int = 1000) -> Point:
        """Knobs drawn independently until the point is valid."""
        last = None
        for _ in range(tries):
            point = self.canonical({k.name: k.sample(rng) for k in self.knobs})
            last = self.check(point)
            if last is None:
                return point
        raise InvalidPoint(f"no valid point found in {tries} samples of {self.id}; last reason: {last}")

    def sample(self, rng: np.random.Generator, tries: int = 1000) -> Point:
        """A random valid point: knobs drawn independently until the point is valid, else (in spaces where
        few combinations are, e.g. hopper_gemm on a small GEMM, whose knobs constrain each other) a random walk of valid
        mutations from the default point. (The base default draws without this fallback, so the two never
        call each other in a loop.)"""
        try:
            return self._draw(rng, tries)
        except InvalidPoint as drawn:
            point = self.default()  # raises InvalidPoint itself where no valid point is known
            if self.check(point) is not None:
                raise drawn from None
        for _ in range(int(rng.integers(1, 9))):
            point = self.mutate(point, rng) or point
        return point

    def mutate(self, point: Point, rng: np.random.Generator, tries: int = 50) -> Point | None:
        """A valid neighbour of ``point`` (one or two knobs changed), or None if none was found."""
        mutable = [k for k in self.knobs if len(k.choices) > 1]
        if not mutable:
            return None
        point = self.complete(point)
        for _ in range(tries):
            child = dict(point)
            for _ in range(1 if rng.random() < 0.7 else 2):
                knob = mutable[int(rng.integers(len(mutable)))]
                child[knob.name] = knob.mutate(child[knob.name], rng)
            child = self.canonical(child)
            if child != point and self.check(child) is None:
                return child
        return None

    def crossover(self, a: Point, b: Point, rng: np.random.Generator) -> Point | None:
        a, b = self.complete(a), self.complete(b)
        child = self.canonical({k.name: (a if rng.random() < 0.5 else b)[k.name] for k in self.knobs})
        return child if self.check(child) is None else None

    def size(self) -> float:
        """Number of points before constraints (an upper bound, for reports)."""
        return float(np.prod([float(len(k.choices)) for k in self.knobs]))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    # A device compiler's log: its first error line says what went wrong.
    for ln in lines:
        if "error:" in ln:
            return ln.strip()[:300]
    # TVM errors put the useful sentence last, after a traceback.
    for ln in reversed(lines):
        if "Error" in ln or "error" in ln or "Check failed" in ln:
            return ln.strip()[:300]
    return (lines[-1] if lines else text)[:300]
