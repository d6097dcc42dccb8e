"""Functions that run inside builder and runner processes.

Workers stay alive across batches, so TVM (and torch) are imported once per worker, not once per
candidate; per-task state (the function, its space, inputs and reference outputs) is cached by the
task spec's key. Every function returns a result object rather than raising, so that a failing
candidate is recorded with its reason.
"""

from __future__ import annotations

import math
import os
import time
import traceback
from typing import Any

from autosched.errors import TemplateBugError
from autosched.measure.timing import time_cuda
from autosched.records import REFERENCE_FAILED, BuildResult, MeasureResult
from autosched.target import compile_module
from autosched.workloads import torch_dtype

# Deferred imports: tvm, torch, numpy (imported where used: `autosched --help` stays fast).

_CACHE: dict[str, Any] = {}


def init_worker() -> None:
    """Import what every job needs, once, when the worker starts."""
    os.environ.setdefault("TVM_BACKTRACE", "0")
    import tvm  # noqa: F401

    import autosched.search_spaces  # noqa: F401


def _short(exc: BaseException) -> str:
    from autosched.search_spaces._knobs import _first_line

    return f"{type(exc).__name__}: {_first_line(exc)}"


# ---- builder --------------------------------------------------------------------------------------
def _space(spec, target):
    key = ("space", spec.key, target.match_key)
    if key not in _CACHE:
        from autosched.search_spaces import create_space

        _CACHE[key] = create_space(spec.func(), target, spec.family, spec.hints)
    return _CACHE[key]


def build_candidate(spec, target, point: dict, path: str, scheduled: str | None = None) -> BuildResult:
    """Compile ``point``'s scheduled module for ``target`` and export it to ``path``. The module is
    ``scheduled`` (``tvm.ir.save_json`` of the one the search made) or, without it, made here by applying
    ``point`` to the task's function."""
    import tvm

    from autosched.search_spaces import InvalidPoint

    start = time.perf_counter()
    space = None
    try:
        space = _space(spec, target)  # its build options and code generation, even for a scheduled module
        mod = space.apply(point) if scheduled is None else tvm.ir.load_json(scheduled)
    except InvalidPoint as exc:
        return BuildResult(None, time.perf_counter() - start, "space", str(exc))
    except Exception as exc:  # noqa: BLE001 - a generated space's failure is the candidate's
        if getattr(space, "template", False):
            # A template writes its kernel in Python: past its own check, an exception is a bug in the
            # generator, the same for every point that reaches it. The traceback crosses the process boundary
            # as text.
            raise TemplateBugError(f"template space '{space.name}' raised generating point {point}: "
                                   f"{_short(exc)}\n{traceback.format_exc()}") from None
        return BuildResult(None, time.perf_counter() - start, "space", _short(exc))
    try:
        compile_module(mod, target, space.build_config(point), space.codegen).export_library(path)
    except Exception as exc:  # noqa: BLE001
        return BuildResult(None, time.perf_counter() - start, "build", _short(exc))
    return BuildResult(path, time.perf_counter() - start)


def build_reference(spec, target) -> None:
    """Compile a raw function's reference into the reference cache ahead of the runner, which would
    otherwise compile one task's reference after another between candidates."""
    spec.checker(spec.func(), target).export_reference("cuda" if target.is_gpu else "cpu")


# ---- runner ---------------------------------------------------------------------------------------
def _task_state(spec, target) -> dict[str, Any]:
    """Inputs on the device, poisoned output buffers and float64 reference outputs of one task."""
    key = ("run", spec.key, target.match_key)
    if key not in _CACHE:
        import torch

        func = spec.func()
        checker = spec.checker(func, target)
        gen = torch.Generator().manual_seed(spec.seed)
        device = target.torch_device
        inputs, refs = checker.inputs_and_reference(gen, device)
        outs = [torch.empty(shape, dtype=torch_dtype(dtype), device=device) for shape, dtype in checker.output_specs()]
        for old in [k for k in _CACHE if k[0] == "run"]:
            del _CACHE[old]  # one task at a time: free the previous task's device memory
        _CACHE[key] = {"checker": checker, "inputs": inputs, "outs": outs, "refs": refs}
    return _CACHE[key]


def prepare_task(spec, target) -> str | None:
    """Build the task's inputs and reference outputs ahead of the candidates (outside their timeout:
    a reference can take long, e.g. TVM's default GPU schedules import their tensor intrinsics).
    Returns None, or why the reference could not be computed."""
    try:
        _task_state(spec, target)
    except Exception as exc:  # noqa: BLE001
        return _short(exc)
    return None


# The first call of a freshly loaded CPU kernel (the check) can take milliseconds more than a warm one
# (lazy binding, the thread pool waking), many times a short kernel's own time on a small VM. Below
# this, a slow check is no evidence of a slow kernel, so the cutoff waits for a warm run.
COLD_CALL_SLACK = 0.02


def run_candidate(spec, target, path: str, config: dict) -> MeasureResult:
    """Load ``path``, check its output against the reference, then time it.

    ``config``: repeat, number, min_repeat_ms, flush_bytes (see :class:`autosched.measure.MeasureConfig`).
    """
    import tvm

    start = time.perf_counter()
    try:
        state = _task_state(spec, target)
    except Exception as exc:  # noqa: BLE001 - the reference itself failed: report, do not time
        return MeasureResult.failed("run", f"{REFERENCE_FAILED}: {_short(exc)}")
    dev = target.device()
    try:
        lib = tvm.runtime.load_module(path)
        func = lib["main"]
        # Step 1. Poison the outputs, run once, compare: unwritten elements show up as NaN.
        for out in state["outs"]:
            out.fill_(float("nan") if out.is_floating_point() else -1)
        args = [tvm.runtime.from_dlpack(t) for t in state["checker"].arrange(state["inputs"], state["outs"])]
        check_start = time.perf_counter()
        func(*args)
        dev.sync()
        check_seconds = time.perf_counter() - check_start
    except Exception as exc:  # noqa: BLE001
        return MeasureResult.failed("run", _short(exc), run_seconds=time.perf_counter() - start)
    errors = state["checker"].errors(state["inputs"], state["outs"], state["refs"])
    worst = max(errors) if errors else 0.0
    tol = state["checker"].tolerance
    if not worst <= tol:
        why = "output has NaN/inf (unwritten or overflowed elements)" if math.isinf(worst) else \
            f"relative error {worst:.3g} exceeds tolerance {tol:.1g}"
        return MeasureResult.failed("wrong_result", why, run_seconds=time.perf_counter() - start,
                                    rel_error=None if math.isinf(worst) else worst)
    if target.is_gpu:
        try:
            latencies = time_cuda(lambda: func(*args), config["repeat"], config["flush_bytes"], config.get("cutoff"))
        except Exception as exc:  # noqa: BLE001
            return MeasureResult.failed("run", _short(exc), run_seconds=time.perf_counter() - start)
        return MeasureResult(tuple(latencies), None, None, 0.0, time.perf_counter() - start, worst)
    # Step 2. Time: a warm-up run is discarded by the evaluator; each repeat is the mean of `number` runs.
    # A candidate whose single timed run is already far slower than the best known is not timed further:
    # its rank is settled, and slow candidates would otherwise dominate the tuning time.
    try:
        if config.get("cutoff") is not None and check_seconds > max(2 * config["cutoff"], COLD_CALL_SLACK):
            # Even the cold first run says enough: twice the cutoff, and too slow for a cold start to explain.
            return MeasureResult((check_seconds,), None, None, 0.0, time.perf_counter() - start, worst)
        if config.get("cutoff") is not None:
            # Up to three repeats as the full timing makes them, judged by the fastest: on a small VM one
            # run of a short kernel can stall for many times its length (the thread pool).
            probe = lib.time_evaluator("main", dev, number=config["number"], repeat=min(3, config["repeat"]),
                                       min_repeat_ms=config["min_repeat_ms"], cache_flush_bytes=config["flush_bytes"])
            timed = [float(x) for x in probe(*args).results]
            if min(timed) > config["cutoff"]:
                return MeasureResult(tuple(timed), None, None, 0.0, time.perf_counter() - start, worst)
        else:
            timed = []
        if config["repeat"] > len(timed):  # the probe's repeats are the first ones
            timer = lib.time_evaluator("main", dev, number=config["number"], repeat=config["repeat"] - len(timed),
                                       min_repeat_ms=config["min_repeat_ms"], cache_flush_bytes=config["flush_bytes"])
            timed += [float(x) for x in timer(*args).results]
        latencies = tuple(timed)
    except Exception as exc:  # noqa: BLE001
        return MeasureResult.failed("run", _short(exc), run_seconds=time.perf_counter() - start)
    return MeasureResult(latencies, None, None, 0.0, time.perf_counter() - start, worst)
