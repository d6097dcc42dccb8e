"""Shapes nobody tuned: reuse the decisions of the nearest tuned shapes of the same operator.

A new sequence length or batch size usually wants nearly the same schedule as its neighbours. The
nearest tuned workloads (same operator, dtype, attributes and target; distance = sum over shape keys of
|log2(a/b)|; for a raw function with no operator of ours, the functions that differ from it only in
their sizes, by the same distance over their buffers' dimensions) give their best points; each is
adapted to the new shape's space (a value the new space does not offer snaps to its nearest choice)
and kept only if the space accepts it. Transferred points are measured and checked like any candidate
before use: as a fallback schedule and as the first population of a new search.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autosched.database.store import Database
    from autosched.search_spaces import Point, Space
    from autosched.target import TargetSpec
    from autosched.task import Task

# Deferred imports: tvm, numpy, sqlalchemy (imported where used: `autosched --help` stays fast).


def shape_distance(a: dict[str, int], b: dict[str, int]) -> float:
    return sum(abs(math.log2(a[k] / b[k])) for k in a if k in b)


def nearest_workloads(db: Database, task: Task, target: TargetSpec, k: int = 3) -> list[tuple[float, str]]:
    """(distance, workload key) of the ``k`` nearest tuned workloads, excluding the task's own."""
    from autosched.database.queries import workloads_of_op

    wl = task.workload
    if wl is None:
        return _nearest_functions(db, task, target, k)
    found = []
    for shape, key in workloads_of_op(db, wl.op, wl.dtype, wl.attrs_dict, target.match_key):
        if key != task.key:
            found.append((shape_distance(wl.shape_dict, shape), key))
    return sorted(found)[:k]


_SIZELESS: dict[str, tuple[str, list[int]]] = {}  # workload key -> its function without sizes


def sizeless(func) -> tuple[str, list[int]]:
    """The function with its sizes taken out: its script with every number erased (the same fused
    kernel at another length or batch prints the same) and its buffers' dimensions, in order."""
    import tvm

    text = re.sub(r"def \w+\(", "def f(", func.without_attr("global_symbol").script(show_meta=False))
    # Parameters by position (a kernel shared by two layers is named after either), then every number
    # that is not part of a name or a dtype (float16): sizes and constants.
    names = sorted((str(p.name) for p in func.params if getattr(p, "name", "")), key=len, reverse=True)
    position = {name: f"arg{i}" for i, name in enumerate(str(p.name) for p in func.params)}
    for name in names:
        text = re.sub(rf"\b{re.escape(name)}(?![0-9])", position[name], text)
    text = re.sub(r"(?<![A-Za-z_0-9])\d+", "#", text)
    dims = [int(d) for p in func.params for d in getattr(p, "shape", None) or () if isinstance(d, tvm.tirx.IntImm)]
    return text, dims


def _nearest_functions(db: Database, task: Task, target: TargetSpec, k: int) -> list[tuple[float, str]]:
    """A raw function's nearest tuned workloads: functions that differ from it only in their sizes (e.g.
    the fused RMSNorm of another bucket length), by the log-distance of their buffers' dimensions.
    A match is only a candidate: its points must still suit the space and pass the check where used."""
    import tvm

    from autosched.database.queries import tuned_functions

    text, dims = sizeless(task.func)
    found = []
    for key, func_json in tuned_functions(db, target.match_key):
        if key == task.key:
            continue
        if key not in _SIZELESS:
            _SIZELESS[key] = sizeless(tvm.ir.load_json(func_json))
        other_text, other_dims = _SIZELESS[key]
        if other_text == text and len(other_dims) == len(dims) and all(d > 0 for d in dims + other_dims):
            found.append((sum(abs(math.log2(a / b)) for a, b in zip(dims, other_dims)), key))
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


def _fits(tile: tuple, extent: int) -> bool:
    """A tile whose product pads ``extent`` by at most a quarter (a tile of 16 over 24 rows pads to 32)."""
    size = math.prod(tile)
    return -(-extent // size) * size <= 1.25 * extent


def adapt_point(space: Space, point: Point) -> Point | None:
    """``point`` made valid for ``space`` (values snapped to the nearest choices), or None."""
    from autosched.search_spaces._knobs import TileKnob

    adapted = {}
    point = space.complete(point)
    for knob in space.knobs:
        value = point.get(knob.name)
        if value is None:
            return None
        value = tuple(value) if isinstance(value, list) else value
        adapted[knob.name] = value if value in knob.choices else _nearest_choice(knob.choices, value)
        if isinstance(knob, TileKnob) and not _fits(adapted[knob.name], knob.extent):
            # A tile that fit the tuned shape but pads this one by much (16 rows of a 24-row loop): the
            # nearest tile that fits, so that the point is kept rather than refused.
            fitting = tuple(c for c in knob.choices if _fits(c, knob.extent))
            if fitting:
                adapted[knob.name] = _nearest_choice(fitting, value)
    adapted = space.canonical(adapted)
    if space.validate(adapted) is None:
        return adapted
    # Knobs that were valid together may not be here (a tile of 8 rows in what became a block of 10):
    # the nearest point with one knob changed that the space accepts.
    repairs = []
    for knob in space.knobs:
        for choice in knob.choices:
            if choice != adapted[knob.name]:
                repaired = space.canonical({**adapted, knob.name: choice})
                if space.validate(repaired) is None:
                    repairs.append((_choice_distance(choice, adapted[knob.name]), len(repairs), repaired))
    return min(repairs)[2] if repairs else None


def _choice_distance(a: Any, b: Any) -> float:
    """How far apart two values of a knob are: log2 ratio of numbers, summed over a tile's levels."""
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
        return sum(_choice_distance(x, y) for x, y in zip(a, b))
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in (a, b))
    return abs(math.log2(a / b)) if numbers else 1.0


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
