"""Task extraction: every distinct kernel of a lowered model as a tuning task, weighted by its calls."""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

from .substitute import WORKLOAD_ATTR

if TYPE_CHECKING:
    from tvm import IRModule

    from autosched.target import TargetSpec
    from autosched.task import Task


def task_of(name: str, func, weight: float = 1.0) -> Task:
    """The task of a lowered kernel: our workload's if it carries one (a substituted attention, RMSNorm
    or GEMM), else the function itself under its structural hash."""
    from autosched.task import Task
    from autosched.workloads import Workload

    if func.attrs is not None and WORKLOAD_ATTR in func.attrs:
        task = Task.from_workload(Workload.from_json(str(func.attrs[WORKLOAD_ATTR])))
        task.name, task.weight = name, weight
        return task
    return Task.from_func(name, func, weight=weight)


def kernel_calls(mod: IRModule) -> collections.Counter[str]:
    """How many times the Relax functions call each TensorIR kernel (by global name)."""
    import tvm
    from tvm import relax

    call_tir = tvm.ir.Op.get("relax.call_tir")
    counts: collections.Counter[str] = collections.Counter()

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.same_as(call_tir):
            counts[expr.args[0].name_hint] += 1

    # Only `main` runs per forward pass; `main_transform_params` runs once, so its kernels need no tuning.
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function) and gv.name_hint == "main":
            relax.analysis.post_order_visit(func.body, visit)
    return counts


def extract_tasks(mod: IRModule) -> list[Task]:
    """Every distinct kernel of the lowered module as a task, weighted by its number of calls."""
    from tvm import tirx

    calls = kernel_calls(mod)
    by_key: dict[str, Task] = {}
    for gv, func in mod.functions.items():
        if not isinstance(func, tirx.PrimFunc) or calls.get(gv.name_hint, 0) == 0:
            continue
        task = task_of(gv.name_hint, func, calls[gv.name_hint])
        if task.key in by_key:
            by_key[task.key].weight += task.weight
            by_key[task.key].meta.setdefault("aliases", []).append(gv.name_hint)
        else:
            by_key[task.key] = task
    return list(by_key.values())


def split_tunable(tasks: list[Task], target: TargetSpec) -> tuple[list[Task], list[Task]]:
    """(tasks some space applies to, the rest): the rest keep their default schedule."""
    from autosched.errors import SpaceError

    tunable, rest = [], []
    for task in tasks:
        try:
            task.space(target)
            tunable.append(task)
        except SpaceError:
            rest.append(task)
    return tunable, rest
