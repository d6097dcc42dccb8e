"""Building a model: each kernel gets its best record (or a default schedule), then the whole module
is compiled."""

from __future__ import annotations

import hashlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autosched.errors import SpaceError, UsageError
from autosched.measure import Measurer, MeasureRequest
from autosched.target import compile_module, default_gpu_schedule
from autosched.validate import trusted_best
from autosched.warm_start import transfer_points

from . import launch
from .launch import with_programmatic_launch
from .lowering import prepare, transform_params
from .tasks import kernel_calls, task_of

if TYPE_CHECKING:
    from tvm import IRModule

    from autosched.database.store import Database
    from autosched.target import TargetSpec

    from .load import Model

# Deferred imports: tvm, numpy (imported where used: `autosched --help` stays fast).


@dataclass
class ApplyReport:
    """How each kernel of a model was scheduled. ``tuned`` and ``default`` hold the kernels ``main`` calls
    (each exactly once: together, every kernel of the forward pass); ``build_time`` those only
    ``main_transform_params`` calls (run once, when the weights are prepared)."""

    tuned: dict[str, dict[str, Any]] = field(default_factory=dict)  # kernel -> record info
    # Kernels of a shape nobody tuned, on the best point of the nearest tuned shape: kernel -> its source.
    transferred: dict[str, str] = field(default_factory=dict)
    default: list[str] = field(default_factory=list)  # kernels on a default schedule
    # Of those, the kernels whose record (or transferred point) ran slower than TVM's default schedule
    # when both were measured at build time (GPU kernels of a generic space only; see apply_database).
    slower_than_default: list[str] = field(default_factory=list)
    build_time: list[str] = field(default_factory=list)  # kernels of main_transform_params only, default schedule
    # Kernels compiled on their own and called from the model as packed functions, so that each keeps its
    # own pass options (e.g. loop partitioning, no storage rewrite) and code generation (TIRx kernels take
    # another lowering pipeline): name -> (kernel, pass options, codegen).
    separate: dict[str, tuple[Any, dict, dict]] = field(default_factory=dict)
    # Seconds of each step of the build (import, database, compile): where a slow build spent its time.
    seconds: dict[str, float] = field(default_factory=dict)


def build_summary(report: ApplyReport) -> str:
    """One line on how the model's kernels were scheduled, e.g. "14 kernels per forward pass: 14 from the
    database, 0 on default schedules (4 more run once at build time)"."""
    total = len(report.tuned) + len(report.transferred) + len(report.default)
    text = f"{total} kernels per forward pass: {len(report.tuned)} from the database"
    if report.transferred:
        text += f", {len(report.transferred)} from the nearest tuned shape"
    text += f", {len(report.default)} on default schedules"
    if report.slower_than_default:
        text += f" ({len(report.slower_than_default)} of them had a record slower than the default, not used)"
    if report.build_time:
        text += f" ({len(report.build_time)} more run once, at build time, on default schedules)"
    if report.seconds:
        text += "; " + ", ".join(f"{step} {s:.1f} s" for step, s in report.seconds.items())
    return text


class LazyMeasurer:
    """A :class:`~autosched.measure.Measurer` started on first use and shared by every kernel of a build,
    all its buckets included: its builder pool and runner process (seconds to start, with TVM imported in
    each and a CUDA context) start once per build, not once per bucket. Call it for the measurer."""

    def __init__(self, target: TargetSpec):
        self.target = target
        self._measurer = None

    def __call__(self):
        if self._measurer is None:
            self._measurer = Measurer(self.target)
        return self._measurer

    def close(self) -> None:
        if self._measurer is not None:
            self._measurer.close()
            self._measurer = None

    def __enter__(self) -> LazyMeasurer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def apply_database(mod: IRModule, db: Database | None, target: TargetSpec,
                   measurer: LazyMeasurer | None = None, calls=None) -> tuple[IRModule, ApplyReport]:
    """Schedule every kernel of the lowered ``mod``: the best record for it on ``target`` if the
    database has one, else a default (dlight on the GPU, the space's default point on the CPU).
    ``measurer``: the build's shared one (records from another TVM version and transferred points need one);
    without it, one is started if needed and closed on return. ``calls``: the kernels that run per pass
    (global name -> calls; default: those ``main`` calls), the others run once and keep default schedules."""
    import tvm
    from tvm import tirx

    from autosched.search_spaces import InvalidPoint

    if measurer is None:
        with LazyMeasurer(target) as own:
            return apply_database(mod, db, target, own, calls)
    report = ApplyReport()
    out = tvm.IRModule(mod.functions, attrs=mod.attrs)
    pending = []
    can_measure = not target.is_gpu or bool(target.device_name)
    per_pass = kernel_calls(mod) if calls is None else calls
    # First every kernel's choice, then every measurement those choices need, in one batch (the builds of
    # a dynamic model's hundreds of kernels compile side by side), then each kernel's schedule.
    # (global var, task, space, best record, transferred candidates, index of its measurement, runs per pass)
    kernels = []
    requests = []
    for gv, func in mod.functions.items():
        if not isinstance(func, tirx.PrimFunc):
            continue
        task = task_of(gv.name_hint, func)
        # Kernels run only once, at build time, get a default schedule and are not counted among the model's.
        runs_per_pass = gv.name_hint in per_pass
        space = best = None
        nearest, measured = [], None
        try:
            space = task.space(target)
            if db is not None and runs_per_pass:
                best = trusted_best(db, task, target, space.id, measurer if can_measure else None)
                if best is None and can_measure:
                    # A shape nobody tuned (e.g. a bucket length of a --tokens dynamic build): the best
                    # points of the two nearest tuned shapes (often the buckets below and above) against
                    # the default, measured here; the fastest that checks out.
                    nearest = transfer_points(db, task, target, space, workloads=2, per_workload=1)
                    if nearest:
                        measured = len(requests)
                        requests.append(_against_default(task, space, [p for p, _, _ in nearest], target))
                elif best is not None and can_measure and target.is_gpu and not space.template:
                    # The tuner starts a generic GPU space from the space's default point, never from
                    # dlight's schedule, so a short search can leave a record slower than what an untuned
                    # build runs (seen on a 16-row fused RMSNorm): the record against it.
                    measured = len(requests)
                    requests.append(_against_default(task, space, [best.point], target))
        except (SpaceError, InvalidPoint):
            space, best, nearest, measured = None, None, [], None
        kernels.append((gv, task, space, best, nearest, measured, runs_per_pass))
    results = measurer().measure_batch(requests) if requests else []
    target_id = db.ensure_target(target) if db is not None and requests else None

    for gv, task, space, best, nearest, measured, runs_per_pass in kernels:
        default = report.default if runs_per_pass else report.build_time
        scheduled = transferred = None
        if measured is not None:
            winner = _fastest(results[measured])
            if nearest:
                # Measurements of this shape like any other: the next build (or tune-model) starts from them.
                # The default point too, so that the best record is the same choice as this build's, unless
                # what ran in its place was dlight's schedule, which is not a point of the space.
                request = requests[measured]
                kept = len(request.points) if request.modules[-1] is None else len(nearest)
                db.add_records(db.ensure_workload(task), target_id, None, space.id,
                               request.points[:kept], results[measured][:kept])
            if nearest and winner is not None:
                transferred, source = nearest[winner][:2]
            elif best is not None and winner is None:
                report.slower_than_default.append(gv.name_hint)
                best = None
        try:
            point = _chosen_point(space, best, transferred, target)
            if point is not None:
                scheduled = space.apply(point)["main"]
        except (SpaceError, InvalidPoint):
            scheduled = None
        if scheduled is not None and best is not None:
            from autosched.search_spaces import point_key

            # Whether the search found it, or the record is the space's default point measured first.
            searched = point_key(space.complete(best.point)) != point_key(space.default())
            report.tuned[gv.name_hint] = {"key": task.key, "record_id": best.record_id,
                                          "latency_us": best.median * 1e6, "space": best.space, "searched": searched}
        elif scheduled is not None and transferred is not None:
            report.transferred[gv.name_hint] = source
        else:
            default.append(gv.name_hint)
        if scheduled is None:
            # dlight schedules it below on the GPU; the CPU builds it as written.
            pending.append(gv)
            continue
        if space.codegen or space.build_config(point):
            report.separate[gv.name_hint] = (scheduled.with_attr("tirx.is_scheduled", True),
                                             space.build_config(point), space.codegen)
            continue
        attrs = {"global_symbol": gv.name_hint, "tirx.is_scheduled": True}
        for key, value in attrs.items():
            scheduled = scheduled.with_attr(key, value)
        out[gv] = scheduled
    if report.separate:
        out = _call_separately(out, set(report.separate))
    if target.is_gpu and pending:
        out = default_gpu_schedule(out, target)
    return out, report


def _chosen_point(space, best, transferred, target: TargetSpec):
    """The point a kernel is built with: its best record's, a transferred one, or the space's default (on the
    CPU, or a template's); None where TVM's own default schedule (dlight) is better on the GPU."""
    if space is None:
        return None
    if best is not None:
        return best.point
    if transferred is not None:
        return transferred
    if not target.is_gpu or space.template:
        # A template's default point is a hand-built kernel, better than dlight's generic one.
        return space.default()
    return None


def _against_default(task, space, points: list, target: TargetSpec):
    """A measurement of ``points`` followed by the schedule an untuned build gives the kernel (the space's
    default point; dlight's schedule for a generic space on the GPU), for :func:`_fastest`."""
    import tvm

    dlight = None
    if target.is_gpu and not space.template:
        dlight = default_gpu_schedule(tvm.IRModule({"main": task.func}), target)
    return MeasureRequest(task.spec, [*points, space.default()], modules=[None] * len(points) + [dlight])


def _fastest(results: list) -> int | None:
    """The index of the fastest point of an :func:`_against_default` measurement that checks out; None if
    the default (measured last) is faster or no point checks out."""
    ok = sorted((r.median, i) for i, r in enumerate(results) if r.ok)
    return ok[0][1] if ok and ok[0][1] < len(results) - 1 else None


def _call_separately(mod: IRModule, names: set[str]) -> IRModule:
    """``mod`` with every ``call_tir`` of a kernel in ``names`` turned into a call of the packed function of
    that name (the kernel is compiled on its own and linked in), and those kernels removed."""
    import tvm
    from tvm import relax

    call_tir = tvm.ir.Op.get("relax.call_tir")

    @relax.expr_functor.mutator
    class ToPacked(relax.PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            if call.op == call_tir and isinstance(call.args[0], tvm.ir.GlobalVar) and call.args[0].name_hint in names:
                out = call.ty_args[0]
                out = list(out.fields) if isinstance(out, relax.TupleType) else [out]
                return relax.call_dps_packed(relax.ExternFunc(call.args[0].name_hint), call.args[1], out)
            return call

    out = tvm.IRModule({gv: f for gv, f in mod.functions.items() if gv.name_hint not in names}, attrs=mod.attrs)
    for gv, func in list(out.functions.items()):
        if isinstance(func, relax.Function):
            out[gv] = ToPacked(out).visit_expr(func)
    return out


def compile_separate(executable, report: ApplyReport, target: TargetSpec, programmatic_launch: bool = False,
                     launch_only=None, prefetch=None):
    """Compile the kernels that ``apply_database`` set apart and link them into the model's executable.
    They compile side by side in threads: TVM's compiler (and NVRTC) release the GIL, and a GPU model
    sets apart one kernel per tuned TIRx GEMM and attention, each a second or so to compile.
    ``programmatic_launch``, ``launch_only``, ``prefetch``: as :func:`build_pipeline` gives the others
    (:mod:`.launch`)."""
    import tvm

    def compile_one(item):
        name, (kernel, config, codegen) = item
        if programmatic_launch and (launch_only is None or name in launch_only):
            kernel = with_programmatic_launch(kernel, (prefetch or {}).get(name))
        return compile_module(tvm.IRModule({name: kernel.with_attr("global_symbol", name)}), target, config, codegen)

    if not report.separate:
        return executable
    with ThreadPoolExecutor(max_workers=min(len(report.separate), os.cpu_count() or 1)) as pool:
        libraries = list(pool.map(compile_one, report.separate.items()))
    for lib in libraries:
        executable.mod.import_module(lib.mod)
    return executable


def defer_parameter_reads():
    """A Relax pass (run last, on the VM-ready functions): each read of a packed parameter (``v =
    packed_params[i]``, one VM instruction) moves to just before the first instruction that uses ``v``.

    Lowered as written, a generation step's function reads all of its parameters (a few for each layer) before
    its first kernel (the embedding lookup), so the GPU waits for the host to read them all each step, idle; read
    where used, the reads of
    later layers run on the host while the GPU works on earlier ones. A read the function does not use
    within its block stays where it was."""
    import tvm
    from tvm import relax

    def reorder(block, params: set) -> relax.BindingBlock:
        deferred: dict = {}  # var -> its read, not yet placed
        out = []
        for binding in block.bindings:
            value = binding.value
            if (isinstance(binding, relax.VarBinding) and isinstance(value, relax.TupleGetItem)
                    and isinstance(value.tuple_value, relax.Var) and value.tuple_value in params):
                deferred[binding.var] = binding
                continue
            for var in relax.analysis.free_vars(value):
                if var in deferred:
                    out.append(deferred.pop(var))
            out.append(binding)
        out += deferred.values()  # unused in this block: at its end, in their order
        return relax.BindingBlock(out)

    @tvm.transform.module_pass(opt_level=0, name="DeferParameterReads")
    def defer(mod, _ctx):
        for gv, func in list(mod.functions.items()):
            if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
                continue
            params = {p for p in func.params if isinstance(p.ty, tvm.ir.TupleType)}
            if not params or any(isinstance(b, relax.DataflowBlock) for b in func.body.blocks):
                continue
            body = relax.SeqExpr([reorder(b, params) for b in func.body.blocks], func.body.body)
            mod[gv] = relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs, func.span)
        return mod

    return defer


def build_pipeline(target: TargetSpec, programmatic_launch: bool = False, launch_only=None, prefetch=None):
    """The Relax passes that compile a module :func:`apply_database` scheduled: TVM's default for the
    target without its fusion, then :func:`defer_parameter_reads`; with ``programmatic_launch`` (Hopper), the
    kernels TVM's TIR pipeline compiles (those named in ``launch_only``, where given) launch while the kernel
    before them finishes (:mod:`autosched.pipeline.launch`), those in ``prefetch`` ({name: WeightPrefetch})
    asking L2 for their weights first.

    On CUDA, ``tvm.compile``'s default pipeline legalises, re-annotates and fuses again (``FuseOps`` and
    ``FuseTIR``) before dlight. Our lowering has fused already, and a second fusion over scheduled kernels
    merges them with their neighbours: a kernel scheduled from a record has lost the opaque pattern it was
    imported with, so e.g. a tuned GEMM was fused with the residual add after it. FuseTIR then failed on
    the scheduled GEMM's buffers ("Inconsistent buffers epilogue and lv58 mapped to the same relax var"),
    and where it did not fail, the merged kernel was no longer the schedule the database chose. The CPU's
    default pipeline does not fuse."""
    import tvm

    from autosched.search_spaces.templates._hopper import HOPPER_ARCHS

    if programmatic_launch and not (target.is_gpu and target.arch in HOPPER_ARCHS):
        raise UsageError(f"programmatic dependent launch needs a Hopper GPU (cuda:sm_90); the target is {target.label}")
    if not target.is_gpu:
        return tvm.transform.Sequential([tvm.relax.pipeline.get_default_pipeline(target.tvm_target()),
                                         defer_parameter_reads()])
    from tvm.relax.backend.cuda import pipeline as cuda

    tvm_target = target.tvm_target()
    refusion = {"AnnotateTIROpPattern", "FoldConstant", "FuseOps", "FuseTIR"}
    legalize = [p for p in cuda.legalize_passes(tvm_target) if p.info.name not in refusion]

    @tvm.transform.module_pass(opt_level=0, name="AutoschedBuild")
    def passes(mod, _ctx):
        # LegalizeOps and dlight stay: anything still unlowered gets TVM's default kernel; dlight leaves
        # scheduled kernels as they are.
        with tvm_target:
            overlap = [launch.programmatic_launch(launch_only, prefetch)] if programmatic_launch else []
            return tvm.transform.Sequential(cuda.library_dispatch_passes(tvm_target) + legalize
                                            + cuda.dataflow_lower_passes(tvm_target) + overlap
                                            + cuda.finalize_passes(tvm_target) + [defer_parameter_reads()])(mod)

    return passes


def schedule_model(model: Model, target: TargetSpec, db: Database | None, measurer: LazyMeasurer | None = None):
    """Import, lower and apply the database: (the scheduled module, the transformed parameters ``main``
    takes, report). ``measurer``: a build's shared one (see :func:`apply_database`)."""
    began = time.perf_counter()
    lowered, params = prepare(model, target)
    imported = time.perf_counter()
    scheduled, report = apply_database(lowered, db, target, measurer)
    report.seconds = {"import": imported - began, "database": time.perf_counter() - imported}
    return scheduled, transform_params(lowered, params), report


def compile_scheduled(scheduled: IRModule, report: ApplyReport, target: TargetSpec):
    """The executable of :func:`schedule_model`'s module, with the kernels it set apart linked in."""
    began = time.perf_counter()
    executable = compile_module(scheduled, target, relax_pipeline=build_pipeline(target))
    executable = compile_separate(executable, report, target)
    report.seconds["compile"] = time.perf_counter() - began
    return executable


def build_model(model: Model, target: TargetSpec, db: Database | None, measurer: LazyMeasurer | None = None):
    """Import, lower, apply the database and compile; returns (executable, the transformed parameters
    ``main`` takes, report)."""
    scheduled, params, report = schedule_model(model, target, db, measurer)
    return compile_scheduled(scheduled, report, target), params, report


def build_buckets(models: list[Model], buckets: list, target: TargetSpec, db: Database | None, progress=None):
    """:func:`build_model` for each bucket (``models[i]`` is the model at ``buckets[i]``, a (batch, tokens)
    pair, all with the same weights): returns ({bucket: executable}, {bucket: the parameters its ``main``
    takes}, {bucket: report}). ``progress(bucket, report)`` is called as each bucket is built, in order.

    One measurer serves every bucket, and each bucket compiles in a thread while the next one is imported
    and measured (TVM's compiler releases the GIL).

    The parameters are mostly the same weights in every bucket, but not all: tables computed from
    constants alone (rotary embeddings' cos/sin) are folded into them at each length. A tensor equal to
    one of an earlier bucket is that same object, so that the artifact stores it once."""
    executables, params, reports, seen = {}, {}, {}, {}
    compiling = []  # (bucket, future of its executable), in bucket order

    def finish_compiled(wait: bool) -> None:
        while compiling and (wait or compiling[0][1].done()):
            bucket, future = compiling.pop(0)
            executables[bucket] = future.result()  # a compile error stops the build here
            if progress is not None:
                progress(bucket, reports[bucket])

    with LazyMeasurer(target) as measurer, ThreadPoolExecutor(max_workers=1) as compiler:
        for model, bucket in zip(models, buckets):
            scheduled, transformed, reports[bucket] = schedule_model(model, target, db, measurer)
            compiling.append((bucket, compiler.submit(compile_scheduled, scheduled, reports[bucket], target)))
            params[bucket] = []
            for tensor in transformed:
                data = tensor.numpy()
                digest = hashlib.sha256(f"{data.dtype}{data.shape}".encode() + data.tobytes()).hexdigest()
                params[bucket].append(seen.setdefault(digest, tensor))
            finish_compiled(wait=False)
        finish_compiled(wait=True)
    return executables, params, reports
