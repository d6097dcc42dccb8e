"""Building a model: each kernel gets its best record (or a default schedule), then the whole module
is compiled."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .lowering import prepare, transform_params
from .tasks import task_of

if TYPE_CHECKING:
    from tvm import IRModule

    from autosched.database.store import Database
    from autosched.target import TargetSpec

    from .load import Model

@dataclass
class ApplyReport:
    tuned: dict[str, dict[str, Any]] = field(default_factory=dict)  # kernel -> record info
    default: list[str] = field(default_factory=list)  # kernels on a default schedule
    build_config: dict[str, Any] = field(default_factory=dict)  # pass options the schedules need


def apply_database(mod: IRModule, db: Database | None, target: TargetSpec) -> tuple[IRModule, ApplyReport]:
    """Schedule every kernel of the lowered ``mod``: the best record for it on ``target`` if the
    database has one, else a default (dlight on the GPU, the space's default point on the CPU)."""
    import tvm
    from tvm import tirx

    from autosched.errors import SpaceError
    from autosched.search_spaces import InvalidPoint
    from autosched.validate import trusted_best

    report = ApplyReport()
    out = tvm.IRModule(mod.functions, attrs=mod.attrs)
    pending = []
    measurers = []

    def measurer():
        # Only records from another TVM version need one; started on first use.
        if not measurers:
            from autosched.measure import Measurer

            measurers.append(Measurer(target))
        return measurers[0]

    can_measure = not target.is_gpu or bool(target.device_name)
    for gv, func in mod.functions.items():
        if not isinstance(func, tirx.PrimFunc):
            continue
        task = task_of(gv.name_hint, func)
        scheduled = None
        try:
            space = task.space(target)
            best = trusted_best(db, task, target, space.id, measurer if can_measure else None) if db else None
            if best is not None:
                scheduled = space.apply(best.point)["main"]
                report.build_config.update(space.build_config(best.point))
                report.tuned[gv.name_hint] = {"key": task.key, "record_id": best.record_id,
                                              "latency_us": best.median * 1e6, "space": best.space}
            elif not target.is_gpu:
                scheduled = space.apply(space.default())["main"]
                report.build_config.update(space.build_config(space.default()))
                report.default.append(gv.name_hint)
        except (SpaceError, InvalidPoint):
            scheduled = None
        if scheduled is None:
            # dlight schedules it below on the GPU; the CPU builds it as written.
            report.default.append(gv.name_hint)
            pending.append(gv)
            continue
        attrs = {"global_symbol": gv.name_hint, "tirx.is_scheduled": True}
        for key, value in attrs.items():
            scheduled = scheduled.with_attr(key, value)
        out[gv] = scheduled
    for m in measurers:
        m.close()
    if target.is_gpu and pending:
        from tvm.s_tir import dlight as dl

        with target.tvm_target():
            out = dl.ApplyDefaultSchedule(dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.LowBatchGEMV(), dl.gpu.Reduction(),
                                          dl.gpu.GeneralReduction(), dl.gpu.RMSNorm(), dl.gpu.Fallback())(out)
    return out, report


def build_model(model: Model, target: TargetSpec, db: Database | None):
    """Import, lower, apply the database and compile; returns (executable, the transformed parameters
    ``main`` takes, report)."""
    from autosched.target import compile_module

    lowered, params = prepare(model, target)
    scheduled, report = apply_database(lowered, db, target)
    executable = compile_module(scheduled, target, report.build_config)
    return executable, transform_params(lowered, params), report
