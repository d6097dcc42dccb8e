"""``autosched db ...``: query, share and upgrade tuning databases."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from autosched.errors import DatabaseError, UsageError
from autosched.output import emit
from autosched.target import KINDS
from autosched.workloads import normalize_dtype, parse_shape

from .transfer import RecordFilter, export_records, import_records, record_json, record_rows

# Deferred imports: sqlalchemy (imported where used: `autosched --help` stays fast).

LIST_COLUMNS = [("id", "id"), ("workload", "workload"), ("target", "target"), ("space", "space"),
                ("latency_us", "latency (us)"), ("error", "error"), ("run_id", "run"), ("created_at", "when")]
BEST_COLUMNS = [("op", "op"), ("shape", "shape"), ("dtype", "dtype"), ("attrs", "attrs"), ("target", "target"),
                ("device", "device"), ("latency_us", "latency (us)"), ("gflops", "GFLOP/s"), ("gbps", "GB/s"),
                ("trials", "trials"), ("failures", "failed"), ("noise_pct", "noise (%)"), ("load_pct", "load (%)")]


def add_parser(sub, add_db_arg, add_format) -> None:
    db = sub.add_parser("db", help="query, export, import and upgrade the tuning database")
    dsub = db.add_subparsers(dest="db_command", metavar="DB_COMMAND")
    dsub.required = True

    def filters(p):
        p.add_argument("--op", help="only this operator")
        p.add_argument("--shape", help="only these shape values, e.g. m=2048 or m=2048,n=4096")
        p.add_argument("--dtype", help="only this dtype")
        p.add_argument("--workload", help="only workload keys (or kernel names) containing this text")
        p.add_argument("--target", dest="target_kind", choices=KINDS, help="only this target kind")
        p.add_argument("--device", help="only devices whose name contains this text")
        p.add_argument("--run", dest="run_id", type=int, help="only this run id")
        p.add_argument("--since", help="only records from this date on (YYYY-MM-DD)")
        p.add_argument("--until", help="only records up to this date (YYYY-MM-DD or full time)")

    p = dsub.add_parser("list", help="list records, newest last")
    add_db_arg(p)
    filters(p)
    p.add_argument("--failed", action="store_true", help="only failed candidates")
    p.add_argument("--ok", action="store_true", help="only successful candidates")
    p.add_argument("--limit", type=int, default=200, help="at most this many rows (default 200; 0: all)")
    add_format(p)

    p = dsub.add_parser("best", help="the best record of each workload and device")
    add_db_arg(p)
    p.add_argument("--op", help="only this operator")
    p.add_argument("--target", dest="target_kind", choices=KINDS, help="only this target kind")
    add_format(p)

    p = dsub.add_parser("show", help="one record in full: point, timings, error, provenance")
    p.add_argument("record_id", type=int, help="record id (from `db list` or `db best`)")
    add_db_arg(p)
    add_format(p)

    p = dsub.add_parser("history", help="best latency so far against trials, for workloads matching a key")
    p.add_argument("workload", help="text the workload key contains, e.g. 'gemm[m=1024'")
    add_db_arg(p)
    p.add_argument("--target", dest="target_kind", choices=KINDS, help="only this target kind")
    p.add_argument("--device", help="only devices whose name contains this text")
    p.add_argument("--improvements", action="store_true", help="only the trials that improved the best")
    add_format(p)

    p = dsub.add_parser("compare", help="best latencies of the same workloads on two devices or in two databases")
    add_db_arg(p)
    p.add_argument("--other", help="a second database (default: compare devices within --db)")
    p.add_argument("--device-a", help="device (name substring) of the first side")
    p.add_argument("--device-b", help="device (name substring) of the second side")
    p.add_argument("--op", help="only this operator")
    add_format(p)

    p = dsub.add_parser("stats", help="records, failures by reason, runs and tuning time spent")
    add_db_arg(p)
    filters(p)
    add_format(p)

    p = dsub.add_parser("export", help="write records to a portable JSON-lines file")
    add_db_arg(p)
    filters(p)
    p.add_argument("-o", "--output", required=True, help="file to write ('-' for stdout)")
    p.add_argument("--force", action="store_true", help="overwrite the -o file if it exists")

    p = dsub.add_parser("import", help="merge an export file into the database (idempotent)")
    p.add_argument("file", help="an export file written by `autosched db export`")
    add_db_arg(p)
    add_format(p, ("table", "json"))

    p = dsub.add_parser("upgrade", help="upgrade the database to this autosched's schema")
    add_db_arg(p)


def _filter(args) -> RecordFilter:
    failed = None
    if getattr(args, "failed", False) and getattr(args, "ok", False):
        raise UsageError("--failed and --ok exclude each other")
    if getattr(args, "failed", False):
        failed = True
    elif getattr(args, "ok", False):
        failed = False
    shape = getattr(args, "shape", None)
    dtype = getattr(args, "dtype", None)
    if shape:
        shape = parse_shape(shape)
    if dtype:
        dtype = normalize_dtype(dtype)
    return RecordFilter(op=getattr(args, "op", None), workload=getattr(args, "workload", None), dtype=dtype, shape=shape,
                        target_kind=getattr(args, "target_kind", None), device=getattr(args, "device", None),
                        run_id=getattr(args, "run_id", None), since=getattr(args, "since", None),
                        until=getattr(args, "until", None), failed=failed)


def run(args) -> int:

    from .store import Database

    cmd = args.db_command
    if cmd == "upgrade":
        old, new = Database.upgrade(args.db)
        print(f"{args.db}: schema {old or 'empty'} -> {new}" if old != new else f"{args.db}: already at schema {new}")
        return 0
    if cmd == "import":
        return _import(args)

    if cmd == "export" and args.output != "-":
        _check_export_file(args.output, args.force)  # before the database is opened
    with Database(args.db, readonly=True, create=False, busy_timeout=args.busy_timeout) as db:
        if cmd == "best":
            rows = db.summary(op=args.op, target_kind=args.target_kind)
            emit(rows, args.format, BEST_COLUMNS)
            return 0
        if cmd == "list":
            with db.session() as s:
                rows = []
                for r, w, t in record_rows(s, _filter(args)):
                    rows.append({"id": r.id, "workload": w.key, "target": f"{t.kind}:{t.arch}", "device": t.device_name,
                                 "space": r.space, "latency_us": r.median_us, "error": r.error_kind or "",
                                 "error_msg": r.error_msg, "run_id": r.run_id, "created_at": r.created_at,
                                 "point": json.loads(r.point_json)})
            if args.limit:
                rows = rows[-args.limit:]
            emit(rows, args.format, LIST_COLUMNS)
            return 0
        if cmd == "show":
            from .models import RecordRow, RunRow

            with db.session() as s:
                r = s.get(RecordRow, args.record_id)
                if r is None:
                    raise UsageError(f"no record {args.record_id} in {args.db}")
                data = record_json(r, r.workload, r.target, s.get(RunRow, r.run_id) if r.run_id else None)
                data["id"] = r.id
            if args.format == "json":
                print(json.dumps(data, indent=2))
            else:
                emit(_flatten(data), args.format, [("field", "field"), ("value", "value")], title=f"record {r.id}")
            return 0
        if cmd == "history":
            from .queries import history

            rows = history(db, args.workload, args.target_kind, args.device)
            if args.improvements:
                rows = [r for r in rows if r["improved"]]
            emit(rows, args.format, [("workload", "workload"), ("device", "device"), ("trial", "trial"),
                                     ("latency_us", "latency (us)"), ("best_us", "best so far (us)"),
                                     ("error", "error"), ("run_id", "run")])
            return 0
        if cmd == "compare":
            from .queries import compare

            other = Database(args.other, readonly=True, create=False) if args.other else None
            try:
                rows = compare(db, other, args.device_a, args.device_b, args.op)
            finally:
                if other is not None:
                    other.close()
            emit(rows, args.format, [("workload", "workload"), ("device_a", "device A"), ("latency_a_us", "A (us)"),
                                     ("device_b", "device B"), ("latency_b_us", "B (us)"),
                                     ("speedup_b_over_a", "B faster by")])
            return 0
        if cmd == "stats":
            from .queries import stats

            data = stats(db, _filter(args))
            if args.format == "json":
                print(json.dumps(data, indent=2))
            else:
                emit([{"field": k, "value": json.dumps(v) if isinstance(v, (dict, list)) else v} for k, v in data.items()],
                     args.format, [("field", "field"), ("value", "value")])
            return 0
        if cmd == "export":
            if args.output == "-":
                n = export_records(db, sys.stdout, _filter(args))
            else:
                try:
                    with open(args.output, "w") as out:
                        n = export_records(db, out, _filter(args))
                except OSError as exc:
                    raise DatabaseError(f"cannot write {args.output}: {exc.strerror}") from None
            print(f"exported {n} records to {args.output}", file=sys.stderr)
            return 0
    raise UsageError(f"unknown db command {cmd}")


def _check_export_file(path: str, force: bool) -> None:
    """``db export -o PATH``: a file to write, not a folder, and not a file that exists unless ``--force``."""
    if os.path.isdir(path):
        raise UsageError(f"-o {path} is a folder: give a file to export to, e.g. {os.path.join(path, 'records.jsonl')}")
    if os.path.exists(path) and not force:
        raise UsageError(f"-o {path} exists: give --force to overwrite it, or another file")


def _import(args) -> int:
    """``db import``: a file that is missing, not an export or without one complete record fails before
    the database is opened; a database this command created and added nothing to is removed again."""
    from .store import Database, is_url
    from .transfer import ImportStats, check_export

    check_export(args.file)
    created = not is_url(args.db) and not Path(args.db).exists()
    stats = ImportStats()
    try:
        with Database(args.db, busy_timeout=args.busy_timeout) as db:
            import_records(db, args.file, stats=stats)
    except BaseException:
        if created and stats.added == 0:
            for suffix in ("", "-wal", "-shm", "-journal"):
                Path(f"{args.db}{suffix}").unlink(missing_ok=True)
        raise
    data = {"read": stats.read, "added": stats.added, "already_present": stats.skipped,
            "broken_lines": len(stats.broken)}
    if args.format == "json":
        print(json.dumps(data))
    else:
        emit([{"field": k, "value": v} for k, v in data.items()], "table", [("field", "field"), ("value", "value")],
             title=f"imported {args.file}")
    if stats.broken:
        more = f" (and {len(stats.broken) - 1} more broken lines)" if len(stats.broken) > 1 else ""
        raise DatabaseError(f"{args.file}:{stats.broken[0]} is not valid JSON (a truncated file?){more}: imported the "
                            f"{stats.read} complete records ({stats.added} new, {stats.skipped} already present) "
                            "and skipped it; export again for what it held")
    return 0


def _flatten(data: dict[str, Any], prefix: str = "") -> list[dict[str, Any]]:
    rows = []
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and key in ("workload", "target", "run"):
            rows.extend(_flatten({k: v for k, v in value.items() if k != "func_json"}, name + "."))
        else:
            rows.append({"field": name, "value": json.dumps(value) if isinstance(value, (dict, list)) else value})
    return rows
