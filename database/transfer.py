"""Moving records between databases: export to a portable JSON-lines file and import (merge) it.

The file starts with a header line (format, version, where and when it was exported); each following
line is one record with its workload, target and run inline, so a file is self-contained. Records keep
their ``uid``: importing the same file twice adds nothing the second time.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Iterator

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from autosched import __version__
from autosched.errors import DatabaseError, DatabaseUsageError

from .models import RecordRow, RunRow, TargetRow, WorkloadRow, utcnow
from .store import Database, head_revision

EXPORT_FORMAT = "autosched-records"
EXPORT_VERSION = 1


@dataclass
class RecordFilter:
    """Which records a command acts on. Empty fields match everything."""

    op: str | None = None
    workload: str | None = None  # substring of the workload key
    dtype: str | None = None
    shape: dict[str, int] | None = None  # every given key must have this value
    target_kind: str | None = None
    device: str | None = None  # substring of the device name
    run_id: int | None = None
    since: str | None = None  # ISO date or datetime
    until: str | None = None
    failed: bool | None = None  # True: only failures, False: only successes

    def apply(self, q):
        if self.op:
            q = q.where(WorkloadRow.op == self.op)
        if self.workload:
            q = q.where(WorkloadRow.key.contains(self.workload) | WorkloadRow.attrs_json.contains(self.workload))
        if self.dtype:
            q = q.where(WorkloadRow.dtype == self.dtype)
        for key, value in (self.shape or {}).items():
            q = q.where(func.json_extract(WorkloadRow.shape_json, f"$.{key}") == value)
        if self.target_kind:
            q = q.where(TargetRow.kind == self.target_kind)
        if self.device:
            q = q.where(TargetRow.device_name.contains(self.device))
        if self.run_id is not None:
            q = q.where(RecordRow.run_id == self.run_id)
        if self.since:
            q = q.where(RecordRow.created_at >= self.since)
        if self.until:
            q = q.where(RecordRow.created_at <= self.until)
        if self.failed is True:
            q = q.where(RecordRow.median_us.is_(None))
        elif self.failed is False:
            q = q.where(RecordRow.median_us.is_not(None))
        return q


def record_rows(session: Session, flt: RecordFilter | None = None, order_by_latency: bool = False):
    q = (select(RecordRow, WorkloadRow, TargetRow).join(WorkloadRow, RecordRow.workload_id == WorkloadRow.id)
         .join(TargetRow, RecordRow.target_id == TargetRow.id))
    q = (flt or RecordFilter()).apply(q)
    if order_by_latency:
        q = q.order_by(RecordRow.median_us.is_(None), RecordRow.median_us)
    else:
        q = q.order_by(RecordRow.id)
    return session.execute(q)


def _workload_json(w: WorkloadRow) -> dict[str, Any]:
    return {"key": w.key, "op": w.op, "shape": json.loads(w.shape_json), "dtype": w.dtype,
            "attrs": json.loads(w.attrs_json), "structural_hash": w.structural_hash, "func_json": w.func_json,
            "flops": w.flops, "min_bytes": w.min_bytes}


def _target_json(t: TargetRow) -> dict[str, Any]:
    return {"match_key": t.match_key, "kind": t.kind, "arch": t.arch, "device_name": t.device_name,
            "num_cores": t.num_cores, "max_shared_memory": t.max_shared_memory, "tvm_version": t.tvm_version,
            "driver_version": t.driver_version}


def record_json(r: RecordRow, w: WorkloadRow, t: TargetRow, run: RunRow | None) -> dict[str, Any]:
    return {
        "uid": r.uid, "workload": _workload_json(w), "target": _target_json(t),
        "run": None if run is None else {"host": run.host, "started_at": run.started_at, "command": run.command,
                                          "seed": run.seed, "autosched_version": run.autosched_version},
        "space": r.space, "point": json.loads(r.point_json), "latencies": json.loads(r.latencies_json),
        "median_us": r.median_us, "error_kind": r.error_kind, "error_msg": r.error_msg, "rel_error": r.rel_error,
        "build_seconds": r.build_seconds, "run_seconds": r.run_seconds, "created_at": r.created_at,
        "machine_load": r.machine_load,
    }


def export_records(db: Database, out: IO[str], flt: RecordFilter | None = None) -> int:
    """Write the header and the matching records to ``out``; returns the number of records."""
    with db.session() as s:
        rows = list(record_rows(s, flt))
        header = {"format": EXPORT_FORMAT, "version": EXPORT_VERSION, "schema": head_revision(),
                  "autosched_version": __version__, "exported_at": utcnow(), "host": socket.gethostname(),
                  "source": str(db.path), "count": len(rows)}
        out.write(json.dumps(header) + "\n")
        runs = {}
        for r, w, t in rows:
            if r.run_id is not None and r.run_id not in runs:
                runs[r.run_id] = s.get(RunRow, r.run_id)
            out.write(json.dumps(record_json(r, w, t, runs.get(r.run_id))) + "\n")
    return len(rows)


def read_export(path: str | Path) -> tuple[dict[str, Any], Iterator[dict[str, Any]], list[int]]:
    """The header, an iterator over the records of an export file, and the numbers of the lines the
    iterator skipped as not a JSON record (filled as it reads; a truncated file ends in one)."""
    path = Path(path)
    if not path.exists():
        raise DatabaseUsageError(f"no export file at {path}")
    if not path.is_file():
        raise DatabaseUsageError(f"{path} is not a file: give the file `autosched db export -o` wrote")
    handle = path.open(errors="replace")  # a binary file fails as "not JSON", not as a decoding error
    first = handle.readline()
    if not first.strip():
        handle.close()
        raise DatabaseUsageError(f"{path} is empty, not an autosched export: give the file `autosched db export -o` wrote")
    try:
        header = json.loads(first)
    except json.JSONDecodeError:
        handle.close()
        raise DatabaseUsageError(f"{path} is not an autosched export: its first line is not JSON") from None
    if not isinstance(header, dict) or header.get("format") != EXPORT_FORMAT:
        handle.close()
        found = header.get("format") if isinstance(header, dict) else header
        raise DatabaseUsageError(f"{path} is not an autosched export (header format {found!r})")
    if header.get("version", 0) > EXPORT_VERSION:
        handle.close()
        raise DatabaseError(f"{path} uses export version {header['version']}; this autosched reads up to "
                            f"{EXPORT_VERSION}: upgrade autosched")

    def records():
        with handle:
            for number, line in enumerate(handle, start=2):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    record = None
                if not isinstance(record, dict):
                    broken.append(number)
                    continue
                yield record

    broken: list[int] = []
    return header, records(), broken


@dataclass
class ImportStats:
    read: int = 0
    added: int = 0
    skipped: int = 0  # already present (same uid)
    broken: list[int] = field(default_factory=list)  # line numbers that are not a JSON record


def check_export(path: str | Path) -> int:
    """Read an export file through without a database: the number of complete records in it.

    Raises:
        DatabaseUsageError: no such file, not an export, or not one complete record in it (nothing would
            be imported), so that a failed import creates no database; bad input, exit code 2.
    """
    header, records, broken = read_export(path)
    complete = sum(1 for _ in records)
    if broken and not complete:
        raise DatabaseUsageError(f"{path}:{broken[0]} is not valid JSON (a truncated file?) and no complete record "
                            "comes before it: nothing was imported; export the records again")
    return complete


def import_records(db: Database, path: str | Path, batch: int = 500, stats: ImportStats | None = None) -> ImportStats:
    """Merge the records of an export file into ``db``. Importing the same file again adds nothing. Lines
    that are not a JSON record (the cut end of a truncated file) are skipped and listed in
    ``stats.broken``; ``stats`` (given) counts what was added even if a later batch fails."""
    header, records, broken = read_export(path)
    stats = stats if stats is not None else ImportStats()
    pending: list[dict[str, Any]] = []
    for rec in records:
        stats.read += 1
        pending.append(rec)
        if len(pending) >= batch:
            _merge(db, pending, header, stats)
            pending = []
    if pending:
        _merge(db, pending, header, stats)
    stats.broken = broken
    return stats


def _merge(db: Database, records: list[dict[str, Any]], header: dict[str, Any], stats: ImportStats) -> None:
    added, skipped = db.merge_records(records, header.get("exported_at"))
    stats.added += added
    stats.skipped += skipped
