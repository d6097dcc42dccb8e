"""``autosched ops``, ``tune`` and ``show``: one operator at a time."""

from __future__ import annotations

import argparse
import json
import sys

from ..output import emit, plain
from .common import TUNE_TRIALS, ConsoleReporter, fixed, measurer_from_args, open_db, tuning_budget


# ---- commands ------------------------------------------------------------------------------------
def cmd_ops(args) -> int:
    from ..workloads import list_operators

    rows = []
    for op in list_operators():
        rows.append({"op": op.name, "shape_keys": ",".join(op.shape_keys), "dtypes": ",".join(op.dtypes),
                     "attrs": ", ".join(f"{a.name}={'|'.join(map(str, a.choices))}{'|...' if a.open else ''}" for a in op.attrs),
                     "presets": ", ".join(p.name for p in op.presets), "description": op.description})
    emit(rows, args.format, [("op", "operator"), ("shape_keys", "shape keys"), ("dtypes", "dtypes"),
                             ("attrs", "attributes"), ("presets", "presets"), ("description", "computes")])
    return 0


def _workload_from_args(args):
    from ..workloads import make_workload

    return make_workload(args.op, args.shape, args.dtype, args.attrs, args.preset)


def cmd_tune(args) -> int:
    from ..target import parse_target
    from ..task import Task
    from ..tuner import TuneOptions, check_seed, tune

    check_seed(args.seed, "--seed")
    trials = tuning_budget(args, TUNE_TRIALS)
    wl = _workload_from_args(args)
    target = parse_target(args.target, require_device=args.runner == "local")
    task = Task.from_workload(wl)
    measurer = measurer_from_args(args, target)  # before the database: a missing tracker creates no file
    try:
        db = open_db(args.db, busy_timeout=args.busy_timeout)
    except BaseException:
        if measurer is not None:
            measurer.close()
        raise
    reporter = ConsoleReporter(quiet=args.quiet)
    options = TuneOptions(trials=trials, batch_size=args.batch_size, seed=args.seed,
                          time_budget=args.time_budget, patience=args.patience, cost_model=args.cost_model,
                          transfer=not args.no_transfer)
    try:
        result = tune(task, target, db, options, reporter, measurer=measurer, command=" ".join(sys.argv))
    finally:
        reporter.close()
        if measurer is not None:
            measurer.close()
    best = db.best(task.key, target)
    summary = {
        "op": wl.op, "shape": wl.shape_dict, "dtype": wl.dtype, "attrs": wl.attrs_dict, "target": target.label,
        "space": result.space, "trials": result.trials, "rounds": result.rounds, "failures": result.failures,
        "seconds": round(result.seconds, 1), "stop_reason": result.stop_reason, "run_id": result.run_id,
        "latency_us": best.median * 1e6 if best else None,
        "gflops": task.flops / best.median / 1e9 if best and task.flops else None,
        "gbps": task.min_bytes / best.median / 1e9 if best and task.min_bytes else None,
        "best_point": best.point if best else None, "record_id": best.record_id if best else None,
        "db": str(db.path),
    }
    db.close()
    if args.format == "json":
        print(json.dumps(summary, indent=2, default=str))
    else:
        rows = [{"field": k, "value": _summary_cell(k, v)} for k, v in summary.items()]
        emit(rows, "table", [("field", "field"), ("value", "value")], title=f"autosched tune: {wl.key}")
    return 0 if best is not None else 1


def _summary_cell(key: str, value) -> str:
    """A value of ``tune``'s summary table: failures as their count (0, or e.g. "3 (build 2, run 1)")
    as ``db best`` shows them, numbers without scientific notation."""
    if key == "failures":
        total = sum(value.values())
        return f"{total} ({', '.join(f'{k} {n}' for k, n in value.items())})" if total else "0"
    if isinstance(value, float):
        return fixed(value)
    return plain(value)


def cmd_show(args) -> int:
    from ..show import render

    wl = _workload_from_args(args)
    print(render(wl, args.target, args.db))
    return 0


# ---- parser --------------------------------------------------------------------------------------
def add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("op", help="operator (see `autosched ops`)")
    p.add_argument("--shape", default="", help="shape, e.g. m=2048,n=4096,k=4096 (missing keys: preset or defaults)")
    p.add_argument("--preset", help="a real-model layer shape, e.g. llama2-7b-up (see `autosched ops`)")
    p.add_argument("--dtype", default="float32", help="float32, float16 or bfloat16 (default float32)")
    p.add_argument("--attrs", default="", help="operator attributes, e.g. bias=1,act=gelu")
