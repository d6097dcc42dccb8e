"""``autosched show``: the kernel the search found (or the default one), as a user would read it."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from autosched.cuda_tools import cuda_source
from autosched.target import parse_target
from autosched.task import Task
from autosched.validate import trusted_best

if TYPE_CHECKING:
    from autosched.workloads import Workload

# Deferred imports: sqlalchemy (imported where used: `autosched --help` stays fast).


def render(wl: Workload, target_text: str, db_path: str | None) -> str:
    """CUDA source for a CUDA target, scheduled TensorIR for the CPU; from the best record in ``db_path``
    for this workload and target when there is one, else from the space's default point."""
    from autosched.database.store import Database, is_url

    target = parse_target(target_text, require_device=False)
    task = Task.from_workload(wl)
    space = task.space(target)
    point, origin = space.default(), "the space's default point (no record for this workload and target)"
    if db_path and (is_url(db_path) or os.path.exists(db_path)):
        with Database(db_path, readonly=True) as db:
            best = trusted_best(db, task, target, space.id)
        if best is not None:
            point = best.point
            origin = f"record {best.record_id} of {db_path}: {best.median * 1e6:.2f} us"
    mod = space.apply(point)
    header = f"// {wl.key} on {target.label}\n// schedule: {origin}\n// point: {point}\n"
    if target.is_gpu:
        return header + cuda_source(mod, target, space.build_config(point), space.codegen)
    return header.replace("//", "#") + mod.script()
