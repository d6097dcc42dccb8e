"""Shapes nobody tuned: reuse the decisions of the nearest tuned shapes of the same operator.

A new sequence length or batch size usually wants nearly the same schedule as its neighbours. The
nearest tuned workloads (same operator, dtype, attributes and target; distance = sum over shape keys of
|log2(a/b)|) give their best points; each is adapted to the new shape's space (a value the new space
does not offer snaps to its nearest choice) and kept only if the space accepts it. Transferred points
are measured and checked like any candidate before use: as a fallback schedule and as the first
population of a new search.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autosched.database.store import Database
    from autosched.search_spaces import Point, Space
    from autosched.target import TargetSpec
    from autosched.task import Task


def shape_distance(a: dict[str, int], b: dict[str, int]) -> float:
    return sum(abs(math.log2(a[k] / b[k])) for k in a if k in b)


def nearest_workloads(db: Database, task: Task, target: TargetSpec, k: int = 3) -> list[tuple[float, str]]:
    """(distance, workload key) of the ``k`` nearest tuned workloads, excluding the task's own."""
    from autosched.database.queries import workloads_of_op

    wl = task.workload
    if wl is None:
        return []
    found = []
    for shape, key in workloads_of_op(db, wl.op, wl.dtype, wl.attrs_dict, target.match_key):
        if key != task.key:
            found.append((shape_distance(wl.shape_dict, shape), key))
    return sorted(found)[:k]


def _nearest_choice(choices: tuple, value: Any) -> Any:
    def log(x):
        return math.log2(x) if isinstance(x, (int, float)) and x > 0 else 0.0

    if isinstance(value, (list, tuple)):
        value = tuple(value)
        same_len = [c for c in choices if isinstance(c, tuple) and len(c) == len(value)]
        if not same_len:
            return choices[0]
        return min(same_len, key=lambda c: sum(abs(log(x) - log(y)) for x, y in zip(c, value)))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value if value in choices else choices[0]
    numeric = [c for c in choices if isinstance(c, (int, float)) and not isinstance(c, bool)]
    return min(numeric, key=lambda c: abs(log(c) - log(value))) if numeric else choices[0]


def adapt_point(space: Space, point: Point) -> Point | None:
    """``point`` made valid for ``space`` (values snapped to the nearest choices), or None."""
    adapted = {}
    for knob in space.knobs:
        value = point.get(knob.name)
        if value is None:
            return None
        value = tuple(value) if isinstance(value, list) else value
        adapted[knob.name] = value if value in knob.choices else _nearest_choice(knob.choices, value)
    adapted = space.canonical(adapted)
    return adapted if space.validate(adapted) is None else None


def transfer_points(db: Database, task: Task, target: TargetSpec, space: Space, workloads: int = 3,
                    per_workload: int = 4) -> list[tuple[Point, str, float]]:
    """(point, source workload key, distance) for the new task, nearest sources first, no duplicates."""
    from autosched.search_spaces import point_key

    out, seen = [], set()
    for distance, key in nearest_workloads(db, task, target, workloads):
        for record in db.records_for(key, target, space=space.id, only_ok=True, limit=per_workload):
            point = adapt_point(space, record.point)
            if point is not None and point_key(point) not in seen:
                seen.add(point_key(point))
                out.append((point, key, distance))
    return out
