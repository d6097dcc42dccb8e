"""Plain data shared by every component: what was built, what was measured, what is stored.

A failed candidate is a result too: it carries an error kind and message instead of timings, ranks
last, and is stored so the search never proposes it again.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

# Why a candidate failed. "space": the point could not be applied to the workload; "build": TVM or the
# device compiler rejected the scheduled module; "run": the kernel crashed or the runtime raised;
# "wrong_result": it ran but its output differs from the reference; "*_timeout": it took too long.
ERROR_KINDS = ("space", "build", "build_timeout", "run", "run_timeout", "wrong_result")


@dataclass(frozen=True)
class BuildResult:
    """The outcome of compiling one candidate: a loadable artifact or an error."""

    artifact: str | None
    seconds: float = 0.0
    error_kind: str | None = None
    error_msg: str | None = None
    # With ``--builder rpc``: no artifact here; the point, for the server that measures it to build.
    remote_point: dict | None = None

    @property
    def ok(self) -> bool:
        return self.error_kind is None


REFERENCE_FAILED = "could not prepare inputs/reference"  # how a failed result names a task-level failure


@dataclass(frozen=True)
class MeasureResult:
    """The outcome of measuring one candidate.

    ``latencies`` are the raw per-repeat times in seconds (each the mean of one repeat's runs);
    ``rel_error`` is ||out - ref|| / ||ref|| of the correctness check; ``load`` is the share of the
    machine's CPU that other processes used while the candidate's batch was timed (None: not measured).
    """

    latencies: tuple[float, ...] = ()
    error_kind: str | None = None
    error_msg: str | None = None
    build_seconds: float = 0.0
    run_seconds: float = 0.0
    rel_error: float | None = None
    load: float | None = None

    @property
    def ok(self) -> bool:
        return self.error_kind is None and bool(self.latencies)

    @property
    def noise(self) -> float | None:
        """The spread of the repeats, (slowest - fastest) / median; None for a failure or a single repeat."""
        if not self.ok or len(self.latencies) < 2:
            return None
        return (max(self.latencies) - min(self.latencies)) / self.median

    @property
    def median(self) -> float:
        """Median latency in seconds; infinity for a failed candidate, so it ranks last."""
        return statistics.median(self.latencies) if self.ok else math.inf

    @property
    def reference_failed(self) -> bool:
        """Whether the task's inputs or reference, not the candidate, failed: no candidate can be checked."""
        return bool(self.error_msg) and self.error_msg.startswith(REFERENCE_FAILED)

    @classmethod
    def failed(cls, kind: str, msg: str, build_seconds: float = 0.0, run_seconds: float = 0.0,
               rel_error: float | None = None) -> MeasureResult:
        assert kind in ERROR_KINDS, kind
        return cls((), kind, msg, build_seconds, run_seconds, rel_error)


@dataclass(frozen=True)
class TuningRecord:
    """One stored measurement: a point of a space for a workload on a target, with its result."""

    workload_key: str
    target_key: str
    space: str  # "name@version"
    point: dict[str, Any]
    result: MeasureResult
    run_id: int | None = None
    created_at: str = ""
    record_id: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def median(self) -> float:
        return self.result.median
