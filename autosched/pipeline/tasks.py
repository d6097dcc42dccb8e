"""Task extraction: every distinct kernel of a lowered model as a tuning task, weighted by its calls."""

from __future__ import annotations

import collections
import dataclasses
from typing import TYPE_CHECKING

from autosched.errors import SpaceError
from autosched.task import Task
from autosched.workloads import Workload

from .substitute import WORKLOAD_ATTR

if TYPE_CHECKING:
    from tvm import IRModule

    from autosched.target import TargetSpec

# Deferred imports: tvm (imported where used: `autosched --help` stays fast).


def task_of(name: str, func, weight: float = 1.0) -> Task:
    """The task of a lowered kernel: our workload's if it carries one (a substituted attention, RMSNorm
    or GEMM), else the function itself under its structural hash."""
    if func.attrs is not None and WORKLOAD_ATTR in func.attrs:
        task = Task.from_workload(Workload.from_json(str(func.attrs[WORKLOAD_ATTR])))
        task.name, task.weight = name, weight
        return task
    return Task.from_func(name, func, weight=weight)


def kernel_calls(mod: IRModule, entry=lambda name: name == "main", runs=lambda name: 1) -> collections.Counter[str]:
    """How many times the Relax functions whose names ``entry`` accepts (``main``: the others run once, or
    are ``main_transform_params``) call each TensorIR kernel (by global name), each function run ``runs(name)``
    times."""
    import tvm
    from tvm import relax

    call_tir = tvm.ir.Op.get("relax.call_tir")
    counts: collections.Counter[str] = collections.Counter()

    # Only `main` runs per forward pass; `main_transform_params` runs once, so its kernels need no tuning.
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function) and entry(gv.name_hint):
            times = runs(gv.name_hint)

            def visit(expr, times=times):
                if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.same_as(call_tir):
                    counts[expr.args[0].name_hint] += times

            relax.analysis.post_order_visit(func.body, visit)
    return counts


def weight_inputs(mod: IRModule, entry=lambda name: name == "main") -> dict[str, int]:
    """Kernel name -> the position of its largest input that is a model weight (an element of the packed
    parameters the Relax function takes) in every call from the functions ``entry`` accepts; kernels without
    one are left out."""
    import tvm
    from tvm import relax

    call_tir = tvm.ir.Op.get("relax.call_tir")
    found: dict[str, set[int]] = {}
    sizes: dict[str, dict[int, int]] = {}
    for gv, func in mod.functions.items():
        if not isinstance(func, relax.Function) or not entry(gv.name_hint):
            continue
        params = {p for p in func.params if isinstance(p.ty, relax.TupleType)}
        weights: set = set()

        def visit(expr, params=params, weights=weights):
            if isinstance(expr, relax.VarBinding) and isinstance(expr.value, relax.TupleGetItem) \
                    and expr.value.tuple_value in params:
                weights.add(expr.var)
            if not (isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.same_as(call_tir)):
                return
            args = list(expr.args[1].fields) if isinstance(expr.args[1], relax.Tuple) else [expr.args[1]]
            mine = {i for i, arg in enumerate(args) if arg in weights}
            name = expr.args[0].name_hint
            found[name] = found[name] & mine if name in found else mine
            for i in mine:
                shape = args[i].ty.shape
                count = 1
                for extent in (shape.values if shape is not None else []):
                    count *= int(extent) if isinstance(extent, tvm.tirx.IntImm) else 0
                sizes.setdefault(name, {})[i] = count

        for block in func.body.blocks:
            for binding in block.bindings:
                visit(binding)
                relax.analysis.post_order_visit(binding.value, visit)
    return {name: max(positions, key=lambda i: sizes[name][i]) for name, positions in found.items() if positions}


def extract_tasks(mod: IRModule, entry=lambda name: name == "main", runs=lambda name: 1) -> list[Task]:
    """Every distinct kernel of the lowered module as a task, weighted by its number of calls (from the
    functions ``entry`` accepts, each run ``runs(name)`` times, as :func:`kernel_calls`)."""
    from tvm import tirx

    calls = kernel_calls(mod, entry, runs)
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

def merge_bucket_tasks(per_model: list[list[Task]]) -> list[Task]:
    """The kernels of several buckets of one model: each distinct kernel once, its calls added up.

    Each bucket counts alike relative to its size: a kernel's ``share`` scales its time by the largest
    bucket's work over its own bucket's work (work: calls x (FLOPs + bytes)). Weighed by calls alone, the
    longest bucket's kernels took nearly every trial, and the shorter buckets ran well behind builds tuned
    for their own length with the same trials per length.
    """
    work = [sum(t.work for t in tasks) or 1.0 for tasks in per_model]
    largest = max(work)
    merged: dict[str, Task] = {}
    for tasks, bucket_work in zip(per_model, work):
        share = largest / bucket_work
        for task in tasks:
            if task.key in merged:
                old = merged[task.key]
                weight = old.weight + task.weight
                # The merged kernel's priority is the sum of its buckets' priorities (calls x share).
                merged[task.key] = dataclasses.replace(old, weight=weight,
                                                       share=(old.weight * old.share + task.weight * share) / weight)
            else:
                merged[task.key] = dataclasses.replace(task, share=share)
    return list(merged.values())


def split_tunable(tasks: list[Task], target: TargetSpec) -> tuple[list[Task], list[Task]]:
    """(tasks some space applies to, the rest): the rest keep their default schedule."""
    tunable, rest = [], []
    for task in tasks:
        try:
            task.space(target)
            tunable.append(task)
        except SpaceError:
            rest.append(task)
    return tunable, rest
