"""``autosched tune-model``, ``build`` and ``run``: a whole model, at one shape or in buckets."""

from __future__ import annotations

import json
import math

from ..errors import UsageError
from ..output import console, emit
from .common import TUNE_MODEL_TRIALS, open_build_db, open_db, searched_cell, tune_kernels, tuning_budget

BUILD_BUCKET_GROWTH = 1.25  # `build --tokens dynamic`: finer than the tuned buckets (tune-model: 2)



def cmd_tune_model(args) -> int:
    from ..tuner import check_seed

    check_seed(args.seed, "--seed")
    _quantize_needs_generate(args)
    if args.generate:
        from .generate import cmd_tune_generate

        return cmd_tune_generate(args)
    from ..pipeline import extract_tasks, merge_bucket_tasks, prepare, split_tunable
    from ..target import parse_target
    trials = tuning_budget(args, TUNE_MODEL_TRIALS)
    target = parse_target(args.target, require_device=args.runner == "local")
    models, buckets = _models(args)
    tasks, untunable = split_tunable(merge_bucket_tasks([extract_tasks(prepare(m, target)[0]) for m in models]), target)
    log = console(stderr=True)
    at = f" at {_describe_buckets(buckets)}" if buckets else ""
    log.log(f"{args.model}{at}: {len(tasks) + len(untunable)} distinct kernels, "
            f"{sum(t.weight for t in tasks + untunable):.0f} calls per forward pass; {len(tasks)} tunable"
            + (f" ({len(untunable)} without a space keep the default schedule)" if untunable else ""))
    results = tune_kernels(args, tasks, target, trials, log)
    rows = [{"kernel": t.name, "weight": t.weight, "space": r.space, "trials": r.trials,
             "searched": searched_cell(r),
             "latency_us": r.best_latency * 1e6 if math.isfinite(r.best_latency) else None,
             "weighted_us": t.weight * r.best_latency * 1e6 if math.isfinite(r.best_latency) else None,
             "failures": sum(r.failures.values())} for t, r in zip(tasks, results)]
    estimate = model_estimate(tasks, results, untunable)
    if len(models) > 1:
        estimate = estimate.replace("per forward pass", f"for one forward pass in each of the {len(models)} buckets")
    elif args.runner == "local":
        # The sum over kernels leaves out what the build runs besides them (copies, allocations, the VM
        # between calls, kernels without a space) and times each kernel with warm caches: build the model
        # with the kernels just tuned and time it, as `autosched run` would.
        log.log(f"{args.model}: building it with the best kernels to time one forward pass")
        estimate = f"{_measured_forward(models[0], target, args.db) * 1e3:.4g} ms per forward pass, measured on " \
                   f"a build with the best kernels ({estimate.replace('estimated ', 'kernels alone: ')})"
    emit(rows, args.format, [("kernel", "kernel"), ("weight", "calls"), ("space", "space"), ("trials", "trials"),
                             ("searched", "searched"), ("latency_us", "best (us)"), ("weighted_us", "x calls (us)"),
                             ("failures", "failed")],
         title=f"{args.model}: {estimate}")
    log.log(f"{args.model}: {estimate}")
    return 0


def _measured_forward(model, target, db_path: str) -> float:
    """Seconds of one forward pass of ``model`` built with the database's best kernels (see :func:`cmd_build`)."""
    from ..pipeline import build_model
    from ..runmodel import time_forward

    with open_db(db_path, readonly=True) as db:
        executable, params, _ = build_model(model, target, db)
    return time_forward(executable, params, model.input_specs(), target)


def model_estimate(tasks, results, untunable=()) -> str:
    """The model's estimated latency: the sum over kernels of calls x best latency, and what it leaves out."""
    measured = [(t, r) for t, r in zip(tasks, results) if math.isfinite(r.best_latency)]
    total = sum(t.weight * r.best_latency for t, r in measured)
    text = f"estimated {total * 1e3:.4g} ms per forward pass (sum over kernels of calls x best latency)"
    missing = len(tasks) - len(measured)
    if missing:
        text += f"; {missing} of {len(tasks)} tunable kernels have no successful measurement and are left out"
    if untunable:
        text += f"; {len(untunable)} kernels without a space are not measured"
    return text


def _quantize_needs_generate(args) -> None:
    quantize = getattr(args, "quantize", None)
    if quantize is None:
        return
    from ..generation.quantize import scheme

    scheme(quantize)  # an unknown or empty name (--quantize "") is refused, not built unquantised
    if not args.generate:
        raise UsageError(f"--quantize {args.quantize} applies to text generation builds: add --generate")
    if getattr(args, "tokenizer", None) and not args.generate:
        raise UsageError("--tokenizer applies to text generation builds (for autosched serve): add --generate")


def cmd_build(args) -> int:
    from ..output import check_output_folder
    from ..target import cpu_build_opt_level

    check_output_folder(args.output, "the artifact", build=True)  # before minutes of building
    _quantize_needs_generate(args)
    cpu_build_opt_level()  # a bad $AUTOSCHED_CPU_OPT_LEVEL said before the build, not after it
    if args.generate:
        from .generate import cmd_build_generate

        return cmd_build_generate(args)
    from ..pipeline import build_buckets, build_model, build_summary, check_padding_is_exact, export_artifact, export_bucketed
    from ..pipeline.lengths import bucket_key
    from ..target import parse_target

    target = parse_target(args.target, require_device=False)
    models, buckets = _models(args)
    # Several buckets: first check that padding to one is exact for this model (before minutes of building).
    axes = {axis: check_padding_is_exact(args.model, _model_kwargs(args), axis)
            for axis, index in (("batch", 0), ("tokens", 1)) if any(b[index] is not None for b in buckets)}
    db = open_build_db(args.db)
    db_path = str(db.path) if db else None
    log = console(stderr=True)
    try:
        if not buckets:
            executable, params, report = build_model(models[0], target, db)
            out = export_artifact(args.output, executable, params, models[0], target, report, db_path)
            summary = build_summary(report)
        else:
            def built(bucket, report):
                log.log(f"bucket {bucket_key(bucket)} ({buckets.index(bucket) + 1}/{len(buckets)}): {build_summary(report)}")

            executables, params, reports = build_buckets(models, buckets, target, db, progress=built)
            out = export_bucketed(args.output, executables, params, models[0], target, reports, axes, db_path)
            upto = " and ".join(f"1 to {max(b[i] for b in buckets)} {what}" for i, what in ((0, "sequences"), (1, "tokens"))
                                if buckets[0][i] is not None)
            summary = f"one artifact for {upto}, inputs padded to the smallest of {_describe_buckets(buckets)}"
    finally:
        if db is not None:
            db.close()
    print(str(out))
    log.log(f"{summary}; load it with TVM alone (see README)")
    return 0


def cmd_run(args) -> int:
    from ..runmodel import run_artifact

    result = run_artifact(args.artifact, repeat=args.repeat, check=not args.no_check, tokens=args.tokens,
                          batch=args.batch, profile=args.profile)
    if args.format == "json":
        print(json.dumps(result, indent=2))
    else:
        kernels = result.pop("kernels", None)
        emit([{"field": k, "value": v} for k, v in result.items()], "table", [("field", "field"), ("value", "value")])
        if kernels:
            print()
            emit([dict(k, kernel=k["kernel"][:72], ms=round(k["ms"], 4), share=f"{k['share']:.1%}") for k in kernels],
                 "table",
                 [("kernel", "kernel"), ("calls", "calls"), ("ms", "ms per run"), ("share", "share"),
                  ("schedule", "schedule")])
    return 0 if result.get("matches_torch", True) else 1


def _model_kwargs(args) -> dict:
    """The factory's arguments that all buckets share (a --batch or --tokens with several sizes: None)."""
    import torch

    dtype = None
    if args.dtype:
        from ..workloads import normalize_dtype

        dtype = getattr(torch, normalize_dtype(args.dtype))
    batches, lengths = _sizes(args)
    return {"batch": batches[0] if batches and len(batches) == 1 else None,
            "tokens": lengths[0] if lengths and len(lengths) == 1 else None, "dtype": dtype}


def _sizes(args) -> tuple[list[int] | None, list[int] | None]:
    """--batch and --tokens: None (the model's default), or the sizes to tune or build (several: a
    bucketed build)."""
    from ..pipeline import parse_batches, parse_lengths

    return parse_batches(args.batch, args.max_batch), parse_lengths(args.tokens, args.max_tokens, args.bucket_growth)


def _models(args) -> tuple[list, list]:
    """The model at each bucket --batch and --tokens name, and the buckets ((batch, tokens) pairs; [] for
    one model at one shape)."""
    from ..pipeline import bucket_grid, load_model, models_at

    buckets, kwargs = bucket_grid(*_sizes(args)), _model_kwargs(args)
    if not buckets:
        return [load_model(args.model, **kwargs)], []
    return models_at(args.model, kwargs, buckets), buckets


def _describe_buckets(buckets: list) -> str:
    batches = sorted({b for b, _ in buckets if b is not None})
    lengths = sorted({t for _, t in buckets if t is not None})
    parts = ([f"batch {', '.join(map(str, batches))}"] if batches else []) \
        + ([f"{', '.join(map(str, lengths))} tokens"] if lengths else [])
    return f"{len(buckets)} buckets ({'; '.join(parts)})"
