"""Records measured under another TVM version are rebuilt and re-checked before they are applied.

A schedule that was right with one compiler can fail to build, or compute a different answer, with
another; the database therefore trusts a record only under the TVM version that measured it, or under
a version for which a validation (rebuilt, checked against the reference, timed) succeeded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from autosched.database.store import Database
    from autosched.measure import Measurer
    from autosched.records import TuningRecord
    from autosched.target import TargetSpec
    from autosched.task import Task


def trusted_best(db: Database, task: Task, target: TargetSpec, space_id: str,
                 measurer: Callable[[], Measurer] | None = None, candidates: int = 5) -> TuningRecord | None:
    """The fastest record of ``task`` that is valid under this TVM: measured with it, or validated.

    Records from other TVM versions are validated on demand with ``measurer()`` (a factory, so that no
    worker processes start when nothing needs validating); without one they are skipped.
    """
    for record in db.records_for(task.key, target, space=space_id, only_ok=True, limit=candidates):
        if record.meta.get("tvm_version") == target.tvm_version:
            return record
        known = db.validation(record.record_id, target.tvm_version)
        if known is None and measurer is not None:
            (result,) = measurer().measure(task.spec, [record.point])
            if db.readonly:  # a database one may only read: this build trusts the result, nobody stores it
                if result.ok:
                    return record
                continue
            db.add_validation(record.record_id, target.tvm_version, result)
            known = db.validation(record.record_id, target.tvm_version)
        if known is not None and known.ok:
            return record
    return None
