"""Read-only questions users ask of a tuning database: a workload's history, two devices or two
databases side by side, and statistics of what tuning cost and why candidates failed."""

from __future__ import annotations

import collections
import json
import math
from datetime import datetime
from typing import Any

from sqlalchemy import func, select

from .models import RecordRow, RunRow, TargetRow, WorkloadRow
from .store import Database, run_status
from .transfer import RecordFilter, record_rows


def history(db: Database, workload: str, target_kind: str | None = None, device: str | None = None) -> list[dict]:
    """Best latency so far against the number of trials, per device, for workloads whose key contains
    ``workload`` (records in the order they were measured)."""
    flt = RecordFilter(workload=workload, target_kind=target_kind, device=device)
    best: dict[tuple[str, str], float] = {}
    trials: collections.Counter = collections.Counter()
    rows = []
    with db.session() as s:
        for r, w, t in record_rows(s, flt):
            key = (w.key, t.match_key)
            trials[key] += 1
            lat = r.median_us if r.median_us is not None else math.inf
            improved = lat < best.get(key, math.inf)
            best[key] = min(best.get(key, math.inf), lat)
            rows.append({"workload": w.key, "device": t.device_name, "target": f"{t.kind}:{t.arch}", "trial": trials[key],
                         "latency_us": r.median_us, "best_us": best[key] if math.isfinite(best[key]) else None,
                         "improved": improved, "record_id": r.id, "run_id": r.run_id, "created_at": r.created_at,
                         "error": r.error_kind})
    return rows


def compare(a: Database, b: Database | None = None, device_a: str | None = None, device_b: str | None = None,
            op: str | None = None) -> list[dict]:
    """The best latency of each workload on two devices (of one database, or of two databases)."""
    def bests(db: Database, device: str | None) -> dict[str, dict]:
        out = {}
        for row in db.summary(op=op):
            if device and device.lower() not in (row["device"] or "").lower() and device != row["target_key"]:
                continue
            if row["latency_us"] is None:
                continue
            current = out.get(row["workload"])
            if current is None or row["latency_us"] < current["latency_us"]:
                out[row["workload"]] = row
        return out

    left = bests(a, device_a)
    right = bests(b or a, device_b)
    rows = []
    for key in sorted(set(left) | set(right)):
        la, lb = left.get(key), right.get(key)
        rows.append({
            "workload": key, "device_a": la["device"] if la else None, "latency_a_us": la["latency_us"] if la else None,
            "device_b": lb["device"] if lb else None, "latency_b_us": lb["latency_us"] if lb else None,
            "speedup_b_over_a": (la["latency_us"] / lb["latency_us"]) if la and lb else None,
        })
    return rows


def stats(db: Database, flt: RecordFilter | None = None) -> dict[str, Any]:
    """Counts of workloads, targets, runs and records; failures by reason; time spent building and running."""
    out: dict[str, Any] = {}
    with db.session() as s:
        rows = list(record_rows(s, flt))
        out["records"] = len(rows)
        out["successful"] = sum(r.median_us is not None for r, _, _ in rows)
        out["failed"] = out["records"] - out["successful"]
        out["failures_by_reason"] = dict(collections.Counter(r.error_kind for r, _, _ in rows if r.error_kind))
        out["workloads"] = len({w.id for _, w, _ in rows})
        out["devices"] = sorted({t.device_name or t.match_key for _, _, t in rows})
        out["runs"] = 0  # counted below, with runs_by_status
        out["build_seconds"] = round(sum(r.build_seconds for r, _, _ in rows), 1)
        out["run_seconds"] = round(sum(r.run_seconds for r, _, _ in rows), 1)
        # Wall time of the tuning runs that recorded these candidates (search, builds, timing, overheads).
        run_ids = {r.run_id for r, _, _ in rows if r.run_id is not None}
        spans = s.execute(select(RunRow.started_at, RunRow.finished_at).where(RunRow.id.in_(run_ids),
                                                                            RunRow.status != "imported")).all()
        out["tuning_seconds"] = round(sum(_seconds_between(a, b) for a, b in spans if a and b), 1)
        # The runs counted are the runs that recorded these candidates; without a filter, every run (one
        # killed before its first batch was stored has none), so that `runs` is the sum of `runs_by_status`.
        q = select(RunRow)
        if flt is not None and flt != RecordFilter():
            q = q.where(RunRow.id.in_(run_ids))
        runs = list(s.scalars(q))
        out["runs"] = len(runs)
        out["runs_by_status"] = dict(collections.Counter(run_status(run) for run in runs))
        out["tvm_versions"] = sorted({v for (v,) in s.execute(select(TargetRow.tvm_version).distinct())})
        first_last = s.execute(select(func.min(RecordRow.created_at), func.max(RecordRow.created_at))).one()
        out["first_record"], out["last_record"] = first_last
    return out


def _seconds_between(start: str, end: str) -> float:
    return max(0.0, (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds())


def tuned_functions(db: Database, match_key: str) -> list[tuple[str, str]]:
    """(workload key, function JSON) of every raw function (a kernel with no operator of ours) with at
    least one successful record on targets of ``match_key``."""
    with db.session() as s:
        q = (select(WorkloadRow.key, WorkloadRow.func_json).join(RecordRow).join(TargetRow)
             .where(WorkloadRow.op == "func", WorkloadRow.func_json.is_not(None), TargetRow.match_key == match_key,
                    RecordRow.median_us.is_not(None)).distinct())
        return [(key, text) for key, text in s.execute(q)]


def workloads_of_op(db: Database, op: str, dtype: str, attrs: dict, match_key: str) -> list[tuple[dict, str]]:
    """(shape, workload key) of every workload of one operator, dtype and attribute set with at least one
    successful record on targets of ``match_key``."""
    with db.session() as s:
        q = (select(WorkloadRow.shape_json, WorkloadRow.key, WorkloadRow.attrs_json).join(RecordRow)
             .join(TargetRow).where(WorkloadRow.op == op, WorkloadRow.dtype == dtype,
                                    TargetRow.match_key == match_key, RecordRow.median_us.is_not(None)).distinct())
        return [(json.loads(shape), key) for shape, key, a in s.execute(q) if json.loads(a) == attrs]
