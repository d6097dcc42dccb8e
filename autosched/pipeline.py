"""Whole models: PyTorch -> Relax -> fused TensorIR kernels -> tuned -> a deployable module.

1. **Import**: ``torch.export`` and TVM's ``from_exported_program``, weights kept as parameters, in
   torch's dtypes. Where our workloads beat what legalisation produces, they are substituted: each
   RMSNorm becomes our ``rmsnorm`` kernel, each scaled-dot-product attention our ``attention`` kernel
   (fused flash attention on the GPU) and, on the GPU, each Linear our ``gemm`` kernel on the weight as
   stored, a bias added in its epilogue (on the CPU, weights are transposed once, at build time, to the
   layout its space prefers).
2. **Lower** (:func:`lowering`): legalise operators to TensorIR, fold constants, fuse operators
   (``FuseOps``/``FuseTIR``: elementwise chains such as SwiGLU's, RoPE's or a residual add become one
   kernel), turn reshapes of contiguous tensors into views and drop dead code. Extraction and
   application of the database both run exactly this prefix, so the kernels' keys match.
3. **Extract**: every distinct kernel becomes a :class:`~autosched.task.Task`, deduplicated by structural
   hash and weighted by how often the model calls it.
4. **Tune**: one trial budget spread over the tasks by the task scheduler (:func:`~autosched.tuner.tune_tasks`).
5. **Apply**: each kernel gets the best record for its key and target; kernels without one get dlight's
   default schedule on the GPU, or their space's default point on the CPU, so an untuned model builds.
6. **Export**: ``export_library`` of the compiled module, the parameters, and a manifest; the artifact
   loads with TVM's runtime alone.
"""

from __future__ import annotations

import collections
import functools
import importlib
import importlib.util
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from .errors import UsageError
from .workloads import get_operator, make_workload

if TYPE_CHECKING:
    import torch
    from tvm import IRModule

    from autosched.database.store import Database
    from autosched.target import TargetSpec
    from autosched.task import Task

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"
MANIFEST = "manifest.json"
LIBRARY = "model.so"
PARAMS = "params.bin"


@dataclass
class Model:
    """A PyTorch model and example inputs; ``spec`` is how the user named it."""

    spec: str
    module: torch.nn.Module
    inputs: tuple[torch.Tensor, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)  # what the factory was given (JSON-able)
    # Per input: [low, high) of the values it takes (token ids within the vocabulary), or None (any float).
    input_ranges: list[list[int] | None] = field(default_factory=list)

    def input_specs(self) -> list[dict[str, Any]]:
        """Shape, dtype and, for integer inputs, the range of values of each input (for the manifest)."""
        specs = []
        for i, t in enumerate(self.inputs):
            spec: dict[str, Any] = {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
            if i < len(self.input_ranges) and self.input_ranges[i] is not None:
                spec["range"] = list(self.input_ranges[i])
            specs.append(spec)
        return specs


def _input_ranges(module, inputs, declared) -> list[list[int] | None]:
    """[low, high) for each integer input: as the factory declared it, else the model's vocabulary size
    (``module.config.vocab_size`` or ``module.vocab_size``), else [min(example), max(example) + 1)."""
    import torch

    vocab = getattr(getattr(module, "config", None), "vocab_size", None) or getattr(module, "vocab_size", None)
    ranges: list[list[int] | None] = []
    for i, t in enumerate(inputs):
        if declared is not None and i < len(declared) and declared[i] is not None:
            ranges.append([int(declared[i][0]), int(declared[i][1])])
        elif t.is_floating_point() or t.is_complex():
            ranges.append(None)
        elif t.dtype == torch.bool:
            ranges.append([0, 2])
        elif vocab:
            ranges.append([0, int(vocab)])
        else:
            low = min(int(t.min()), 0) if t.numel() else 0
            ranges.append([low, (int(t.max()) if t.numel() else 0) + 1])
    return ranges


def _example_models() -> dict[str, Callable]:
    path = EXAMPLES_DIR / "llama.py"
    if not path.exists():
        return {}
    loaded = importlib.util.spec_from_file_location("autosched_examples_llama", path)
    module = importlib.util.module_from_spec(loaded)
    sys.modules[loaded.name] = module
    loaded.loader.exec_module(module)
    return module.MODELS


def load_model(spec: str, **kwargs: Any) -> Model:
    """A model named in ``examples/`` (e.g. ``tiny-llama``) or given as ``module:factory`` or
    ``path/to/file.py:factory``; the factory returns ``(model, example_inputs)``, or
    ``(model, example_inputs, {"input_ranges": [[low, high) or None per input]})`` to declare the values
    integer inputs take (e.g. token ids below the vocabulary size; see :func:`_input_ranges`)."""
    examples = _example_models()
    if spec in examples:
        factory = examples[spec]
    elif ":" in spec:
        where, _, name = spec.rpartition(":")
        try:
            if where.endswith(".py"):
                loaded = importlib.util.spec_from_file_location(Path(where).stem, where)
                if loaded is None:
                    raise FileNotFoundError(where)
                module = importlib.util.module_from_spec(loaded)
                loaded.loader.exec_module(module)
            else:
                module = importlib.import_module(where)
            factory = getattr(module, name)
        except (ImportError, FileNotFoundError, AttributeError) as exc:
            raise UsageError(f"cannot load model factory '{spec}': {exc}") from None
    else:
        names = ", ".join(sorted(examples)) or "none found"
        raise UsageError(f"unknown model '{spec}': name an example ({names}) or give module:factory")
    given = {k: v for k, v in kwargs.items() if v is not None}
    made = factory(**given)
    module, inputs = made[0], tuple(made[1])
    declared = made[2].get("input_ranges") if len(made) > 2 and made[2] else None
    return Model(spec, module.eval(), inputs, {k: str(v).replace("torch.", "") for k, v in given.items()},
                 _input_ranges(module, inputs, declared))


def import_model(model: Model, *, linear_as_gemm: bool) -> tuple[IRModule, list]:
    """The Relax module (weights as parameters after the inputs) and the weights.

    With ``linear_as_gemm``, each Linear's ``x @ W.T`` becomes our ``gemm`` kernel on W[n,k] as stored
    (on the H200 its space ran the 7B layers' GEMMs at 176-317 TFLOP/s where the generic ``matmul``
    kernels reached 70-96); without it, the product stays a ``matmul`` on W transposed once at build
    time to [k,n], the layout the CPU space vectorises along (a 1 x 1376 x 512 product: 16 us against 56).

    Every operator is decomposed as usual except scaled-dot-product attention, which reaches Relax as
    one ``R.nn.attention`` call so that :func:`substitute_workloads` can hand it to our attention kernel,
    and RMSNorm, which becomes a call of our ``rmsnorm`` kernel as it is imported.
    """
    import warnings

    import torch
    from tvm.relax.frontend import detach_params
    from tvm.relax.frontend.torch import from_exported_program

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.export's own deprecations, not the user's
        exported = torch.export.export(model.module, model.inputs)
        table = torch.export.default_decompositions()
        for op in [op for op in table if "scaled_dot_product" in str(op) or "rms_norm" in str(op)]:
            del table[op]
        exported = exported.run_decompositions(table)
        matmul = functools.partial(_matmul_in_torch_dtype, linear_as_gemm=linear_as_gemm)
        converters = {name: matmul for name in ("mm.default", "matmul.default", "bmm.default")}
        converters["addmm.default"] = functools.partial(_addmm_in_torch_dtype, linear_as_gemm=linear_as_gemm)
        converters["rms_norm.default"] = _rms_norm_as_workload
        mod = from_exported_program(exported, keep_params_as_input=True, unwrap_unit_return_tuple=True,
                                    run_ep_decomposition=False, custom_convert_map=converters)
    mod, params = detach_params(mod)
    return substitute_workloads(mod), list(params["main"])


def _matmul_in_torch_dtype(node, importer, linear_as_gemm: bool):
    """``mm``/``matmul``/``bmm`` accumulated in float32 and returned in torch's dtype; with
    ``linear_as_gemm``, a Linear's ``x @ W.T`` becomes a call of our ``gemm`` workload's kernel.

    TVM 0.27's importer gives every such product a float32 result, so in a half-precision model all that
    follows (attention, the next GEMM's weights, the residual stream) silently ran in float32: twice the
    bytes and no tensor cores. The cast back fuses into the GEMM's kernel as its epilogue.
    """
    from tvm import relax

    lhs, rhs = importer.retrieve_args(node)
    dtype = str(node.meta["val"].dtype).replace("torch.", "")
    bb = importer.block_builder
    weight = _linear_weight(node, importer) if linear_as_gemm else None
    if weight is not None and len(lhs.ty.shape) == 2 and str(lhs.ty.dtype) == str(weight.ty.dtype) == dtype:
        (m, k), n = (int(d) for d in lhs.ty.shape), int(weight.ty.shape[0])
        wl = _supported_workload("gemm", {"m": m, "n": n, "k": k}, dtype)
        if wl is not None:
            gv = bb.add_func(_workload_func(wl), "autosched_gemm")
            return bb.emit(relax.call_tir(gv, [lhs, weight], relax.TensorType((m, n), dtype)))
    product = bb.emit(relax.op.matmul(lhs, rhs, out_dtype="float32"))
    if dtype in ("float16", "bfloat16"):
        return bb.emit(relax.op.astype(product, dtype))
    return product


def _addmm_in_torch_dtype(node, importer, linear_as_gemm: bool):
    """``addmm(bias, x, W.T)``, a Linear with a bias as torch.export decomposes it: accumulated in float32,
    the bias added, and returned in torch's dtype. With ``linear_as_gemm``, a call of our ``gemm``
    workload's kernel with ``bias=True``, whose epilogue adds the bias.

    TVM 0.27's importer adds the model's (half-precision) bias to its float32 product: an import failure
    ("Binary operators must have the same datatype") for every half-precision model with biased Linears.
    """
    from tvm import relax

    bias, lhs, rhs = importer.retrieve_args(node)[:3]
    beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
    dtype = str(node.meta["val"].dtype).replace("torch.", "")
    bb = importer.block_builder
    weight = _linear_weight(node, importer, factor=2) if linear_as_gemm else None
    if (weight is not None and beta == 1 and alpha == 1 and len(lhs.ty.shape) == 2 and len(bias.ty.shape) == 1
            and str(lhs.ty.dtype) == str(weight.ty.dtype) == str(bias.ty.dtype) == dtype
            and int(bias.ty.shape[0]) == int(weight.ty.shape[0])):
        (m, k), n = (int(d) for d in lhs.ty.shape), int(weight.ty.shape[0])
        wl = _supported_workload("gemm", {"m": m, "n": n, "k": k}, dtype, {"bias": True})
        if wl is not None:
            gv = bb.add_func(_workload_func(wl), "autosched_gemm")
            return bb.emit(relax.call_tir(gv, [lhs, weight, bias], relax.TensorType((m, n), dtype)))
    product = bb.emit(relax.op.matmul(lhs, rhs, out_dtype="float32"))
    if alpha != 1:
        product = bb.emit(relax.op.multiply(product, relax.const(alpha, "float32")))
    bias32 = bb.emit(relax.op.astype(bias, "float32"))
    if beta != 1:
        bias32 = bb.emit(relax.op.multiply(bias32, relax.const(beta, "float32")))
    out = bb.emit(relax.op.add(product, bias32))
    return bb.emit(relax.op.astype(out, dtype)) if dtype != "float32" else out


def _linear_weight(node, importer, factor: int = 1):
    """The Relax variable of W[n,k] if argument ``factor`` of ``node`` is ``permute(W, [1, 0])``."""
    factor = node.args[factor]
    if getattr(factor, "target", None) is None or "permute" not in str(factor.target):
        return None
    source, axes = factor.args[0], list(factor.args[1])
    weight = importer.env.get(source)
    if axes != [1, 0] or weight is None or len(weight.ty.shape) != 2:
        return None
    return weight


def _supported_workload(op: str, shape: dict, dtype: str, attrs: dict | None = None):
    """The workload, or None where the operator does not take this shape, dtype or attribute value."""
    try:
        return make_workload(op, shape, dtype, attrs)
    except UsageError:
        return None


def _workload_func(wl):
    """Our kernel of ``wl`` for a ``call_tir``: tagged with its workload (so that the task is the
    workload's), opaque to fusion, and without the ``main`` symbol it is built under."""
    func = get_operator(wl.op).build(wl).with_attr(WORKLOAD_ATTR, json.dumps(wl.to_json()))
    # Opaque, so that fusion keeps our kernel whole. Built as a module's "main"; kept, that symbol
    # clashes with Relax's main in the GPU build, where unscheduled kernels keep their attributes.
    return func.with_attr("op_pattern", 8).without_attr("global_symbol")


def _rms_norm_as_workload(node, importer):
    """``aten.rms_norm`` over the last axis: a call of our ``rmsnorm`` workload's kernel on the rows.

    Decomposed, it fused into three kernels (cast, square, and the rest) with float32 temporaries in
    between; one pass over the rows reads each element once. Other forms (no weight, several normalised
    axes, an eps the workload does not take) are decomposed here in Relax ops, computed in float32.
    """
    import math

    from tvm import relax

    args = list(importer.retrieve_args(node)) + [None, None]
    x, normalized, weight, eps = args[:4]
    dims, dtype = [int(d) for d in x.ty.shape], str(x.ty.dtype)
    rows, n = math.prod(dims[:-1]), dims[-1]
    bb = importer.block_builder
    wl = None
    if weight is not None and list(normalized) == [n] and str(weight.ty.dtype) == dtype:
        wl = _supported_workload("rmsnorm", {"m": rows, "n": n}, dtype, {"eps": eps})
    if wl is None:
        import torch

        axes = list(range(len(dims) - len(normalized), len(dims)))
        eps = eps if eps is not None else float(torch.finfo(node.meta["val"].dtype).eps)  # torch's default
        x32 = bb.emit(relax.op.astype(x, "float32"))
        mean_square = bb.emit(relax.op.mean(bb.emit(relax.op.multiply(x32, x32)), axis=axes, keepdims=True))
        y = bb.emit(relax.op.multiply(x32, bb.emit(relax.op.rsqrt(bb.emit(
            relax.op.add(mean_square, relax.const(eps, "float32")))))))
        if weight is not None:
            y = bb.emit(relax.op.multiply(y, bb.emit(relax.op.astype(weight, "float32"))))
        return bb.emit(relax.op.astype(y, dtype))
    gv = bb.add_func(_workload_func(wl), "autosched_rmsnorm")
    flat = bb.emit(relax.op.reshape(x, [rows, n]))
    out = bb.emit(relax.call_tir(gv, [flat, weight], relax.TensorType((rows, n), dtype)))
    return bb.emit(relax.op.reshape(out, dims))


WORKLOAD_ATTR = "autosched.workload"


def substitute_workloads(mod: IRModule) -> IRModule:
    """Replace each ``R.nn.attention`` (layout [batch, seq, heads, dim], no bias, causal or not) by a call
    of our ``attention`` workload's kernel on [batch, heads, seq, dim]. The kernel keeps the workload in
    an attribute, so it is tuned and stored under the same key as ``autosched tune attention`` and gets
    the attention space (the fused FlashAttention template on the GPU) instead of generic fusion."""
    import tvm
    from tvm import relax

    attention = tvm.ir.Op.get("relax.nn.attention")

    @relax.expr_functor.mutator
    class Substitute(relax.PyExprMutator):
        def visit_call_(self, call):
            call = self.visit_expr_post_order(call)
            if not (isinstance(call.op, tvm.ir.Op) and call.op.same_as(attention) and len(call.args) == 3):
                return call
            attrs = call.attrs
            causal = str(attrs.causal_mask or "")
            if attrs.scale is not None or attrs.window_size is not None or causal not in ("", "TopLeft"):
                return call
            q, k, v = call.args
            b, s, h, d = (int(x) for x in q.ty.shape)
            hkv, dtype = int(k.ty.shape[2]), str(q.ty.dtype)
            if int(k.ty.shape[1]) != s:
                return call  # cross attention: not our workload
            wl = make_workload("attention", {"b": b, "h": h, "s": s, "d": d, "hkv": hkv}, dtype,
                               {"causal": causal == "TopLeft"})
            gv = self.builder_.add_func(_workload_func(wl), "autosched_attention")
            qt, kt, vt = (self.builder_.emit(relax.op.permute_dims(x, [0, 2, 1, 3])) for x in (q, k, v))
            out = self.builder_.emit(relax.call_tir(gv, [qt, kt, vt], relax.TensorType((b, h, s, d), dtype)))
            return relax.op.permute_dims(out, [0, 2, 1, 3])

    mutator = Substitute(mod)
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function):
            mutator.builder_.update_func(gv, mutator.visit_expr(func))
    return mutator.builder_.get()


def task_of(name: str, func, weight: float = 1.0) -> Task:
    """The task of a lowered kernel: our workload's if it carries one (a substituted attention, RMSNorm
    or GEMM), else the function itself under its structural hash."""
    from autosched.workloads import Workload

    from .task import Task

    if func.attrs is not None and WORKLOAD_ATTR in func.attrs:
        task = Task.from_workload(Workload.from_json(str(func.attrs[WORKLOAD_ATTR])))
        task.name, task.weight = name, weight
        return task
    return Task.from_func(name, func, weight=weight)


def prepare(model: Model, target: TargetSpec) -> tuple[IRModule, list]:
    """Import and lower ``model`` for ``target``; weight-only computations (e.g. the transposes that put
    each Linear's weight in the layout its GEMM reads) move to ``main_transform_params``, run once at
    build time."""
    from tvm import relax

    mod, params = import_model(model, linear_as_gemm=target.is_gpu)
    return lower(relax.transform.LiftTransformParams()(mod)), params


def transform_params(lowered: IRModule, params: list) -> list:
    """Run ``main_transform_params`` once (on the CPU) and return the parameters ``main`` expects."""
    import tvm
    from tvm import relax

    if "main_transform_params" not in [gv.name_hint for gv in lowered.functions]:
        return params
    only = relax.transform.DeadCodeElimination(entry_functions=["main_transform_params"])(lowered)
    only = tvm.IRModule({gv: f for gv, f in only.functions.items() if gv.name_hint != "main"}, attrs=only.attrs)
    vm = relax.VirtualMachine(tvm.compile(only, target=tvm.target.Target({"kind": "llvm"})), tvm.cpu())
    out = vm["main_transform_params"]([p.copyto(tvm.cpu()) for p in params])
    return [out[i] for i in range(len(out))]


def lowering():
    """The shared lowering prefix of extraction and application (change both or neither)."""
    from tvm import relax, transform

    return transform.Sequential([
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        # A reshape of a contiguous tensor is a view: the build's own pipeline turns such kernels into
        # runtime reshapes, so they are no tasks of ours.
        relax.transform.RewriteDataflowReshape(),
        relax.transform.DeadCodeElimination(),
    ])


def lower(mod: IRModule) -> IRModule:
    return lowering()(mod)


def kernel_calls(mod: IRModule) -> collections.Counter[str]:
    """How many times the Relax functions call each TensorIR kernel (by global name)."""
    import tvm
    from tvm import relax

    call_tir = tvm.ir.Op.get("relax.call_tir")
    counts: collections.Counter[str] = collections.Counter()

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.same_as(call_tir):
            counts[expr.args[0].name_hint] += 1

    # Only `main` runs per forward pass; `main_transform_params` runs once, so its kernels need no tuning.
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function) and gv.name_hint == "main":
            relax.analysis.post_order_visit(func.body, visit)
    return counts


def extract_tasks(mod: IRModule) -> list[Task]:
    """Every distinct kernel of the lowered module as a task, weighted by its number of calls."""
    from tvm import tirx

    calls = kernel_calls(mod)
    by_key: dict[str, Task] = {}
    for gv, func in mod.functions.items():
        if not isinstance(func, tirx.PrimFunc) or calls.get(gv.name_hint, 0) == 0:
            continue
        task = task_of(gv.name_hint, func, calls[gv.name_hint])
        if task.key in by_key:
            by_key[task.key].weight += task.weight
            by_key[task.key].meta.setdefault("aliases", []).append(gv.name_hint)
        else:
            by_key[task.key] = task
    return list(by_key.values())


def split_tunable(tasks: list[Task], target: TargetSpec) -> tuple[list[Task], list[Task]]:
    """(tasks some space applies to, the rest): the rest keep their default schedule."""
    from autosched.errors import SpaceError

    tunable, rest = [], []
    for task in tasks:
        try:
            task.space(target)
            tunable.append(task)
        except SpaceError:
            rest.append(task)
    return tunable, rest


@dataclass
class ApplyReport:
    """How each kernel of a model was scheduled. ``tuned`` and ``default`` hold the kernels ``main`` calls
    (each exactly once: together, every kernel of the forward pass); ``build_time`` those only
    ``main_transform_params`` calls (run once, when the weights are prepared)."""

    tuned: dict[str, dict[str, Any]] = field(default_factory=dict)  # kernel -> record info
    default: list[str] = field(default_factory=list)  # kernels on a default schedule
    build_time: list[str] = field(default_factory=list)  # kernels of main_transform_params only, default schedule
    build_config: dict[str, Any] = field(default_factory=dict)  # pass options the schedules need
    # Kernels compiled on their own (TIRx: another lowering pipeline than the model's) and called from the
    # model as packed functions: name -> (kernel, pass options, codegen).
    separate: dict[str, tuple[Any, dict, dict]] = field(default_factory=dict)


def build_summary(report: ApplyReport) -> str:
    """One line on how the model's kernels were scheduled, e.g. "14 kernels per forward pass: 14 from the
    database, 0 on default schedules (4 more run once at build time)"."""
    text = (f"{len(report.tuned) + len(report.default)} kernels per forward pass: {len(report.tuned)} from the "
            f"database, {len(report.default)} on default schedules")
    if report.build_time:
        text += f" ({len(report.build_time)} more run once, at build time, on default schedules)"
    return text


def apply_database(mod: IRModule, db: Database | None, target: TargetSpec) -> tuple[IRModule, ApplyReport]:
    """Schedule every kernel of the lowered ``mod``: the best record for it on ``target`` if the
    database has one, else a default (dlight on the GPU, the space's default point on the CPU)."""
    import tvm
    from tvm import tirx

    from autosched.errors import SpaceError
    from autosched.search_spaces import InvalidPoint

    from .validate import trusted_best

    report = ApplyReport()
    out = tvm.IRModule(mod.functions, attrs=mod.attrs)
    pending = []
    measurers = []

    def measurer():
        # Only records from another TVM version need one; started on first use.
        if not measurers:
            from .measure import Measurer

            measurers.append(Measurer(target))
        return measurers[0]

    can_measure = not target.is_gpu or bool(target.device_name)
    per_pass = kernel_calls(mod)
    for gv, func in mod.functions.items():
        if not isinstance(func, tirx.PrimFunc):
            continue
        task = task_of(gv.name_hint, func)
        # Kernels run only once, at build time, get a default schedule and are not counted among the model's.
        runs_per_pass = gv.name_hint in per_pass
        default = report.default if runs_per_pass else report.build_time
        scheduled = best = None
        try:
            space = task.space(target)
            if db is not None and runs_per_pass:
                best = trusted_best(db, task, target, space.id, measurer if can_measure else None)
            if best is not None:
                point = best.point
            elif not target.is_gpu or space.template:
                # A template's default point is a hand-built kernel, better than dlight's generic one.
                point = space.default()
            else:
                point = None
            if point is not None:
                scheduled = space.apply(point)["main"]
        except (SpaceError, InvalidPoint):
            scheduled = None
        if scheduled is not None and best is not None:
            report.tuned[gv.name_hint] = {"key": task.key, "record_id": best.record_id,
                                          "latency_us": best.median * 1e6, "space": best.space}
        else:
            default.append(gv.name_hint)
        if scheduled is None:
            # dlight schedules it below on the GPU; the CPU builds it as written.
            pending.append(gv)
            continue
        if space.codegen:
            report.separate[gv.name_hint] = (scheduled, space.build_config(point), space.codegen)
            continue
        report.build_config.update(space.build_config(point))
        attrs = {"global_symbol": gv.name_hint, "tirx.is_scheduled": True}
        for key, value in attrs.items():
            scheduled = scheduled.with_attr(key, value)
        out[gv] = scheduled
    for m in measurers:
        m.close()
    if report.separate:
        out = _call_separately(out, set(report.separate))
    if target.is_gpu and pending:
        from tvm.s_tir import dlight as dl

        with target.tvm_target():
            out = dl.ApplyDefaultSchedule(dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.LowBatchGEMV(), dl.gpu.Reduction(),
                                          dl.gpu.GeneralReduction(), dl.gpu.RMSNorm(), dl.gpu.Fallback())(out)
    return out, report


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


def compile_separate(executable, report: ApplyReport, target: TargetSpec):
    """Compile the kernels that ``apply_database`` set apart and link them into the model's executable."""
    import tvm

    from .target import compile_module

    for name, (kernel, config, codegen) in report.separate.items():
        lib = compile_module(tvm.IRModule({name: kernel.with_attr("global_symbol", name)}), target, config, codegen)
        executable.mod.import_module(lib.mod)
    return executable


def build_pipeline(target: TargetSpec):
    """The Relax passes that compile a module :func:`apply_database` scheduled: TVM's default for the
    target without its fusion.

    On CUDA, ``tvm.compile``'s default pipeline legalises, re-annotates and fuses again (``FuseOps`` and
    ``FuseTIR``) before dlight. Our lowering has fused already, and a second fusion over scheduled kernels
    merges them with their neighbours: a kernel scheduled from a record has lost the opaque pattern it was
    imported with, so e.g. a tuned GEMM was fused with the residual add after it. FuseTIR then failed on
    the scheduled GEMM's buffers ("Inconsistent buffers epilogue and lv58 mapped to the same relax var"),
    and where it did not fail, the merged kernel was no longer the schedule the database chose. The CPU's
    default pipeline does not fuse."""
    if not target.is_gpu:
        return None
    import tvm
    from tvm.relax.backend.cuda import pipeline as cuda

    tvm_target = target.tvm_target()
    refusion = {"AnnotateTIROpPattern", "FoldConstant", "FuseOps", "FuseTIR"}
    legalize = [p for p in cuda.legalize_passes(tvm_target) if p.info.name not in refusion]

    @tvm.transform.module_pass(opt_level=0, name="AutoschedBuild")
    def passes(mod, _ctx):
        # LegalizeOps and dlight stay: anything still unlowered gets TVM's default kernel; dlight leaves
        # scheduled kernels as they are.
        with tvm_target:
            return tvm.transform.Sequential(cuda.library_dispatch_passes(tvm_target) + legalize
                                            + cuda.dataflow_lower_passes(tvm_target)
                                            + cuda.finalize_passes(tvm_target))(mod)

    return passes


def build_model(model: Model, target: TargetSpec, db: Database | None):
    """Import, lower, apply the database and compile; returns (executable, the transformed parameters
    ``main`` takes, report)."""
    from .target import compile_module

    lowered, params = prepare(model, target)
    scheduled, report = apply_database(lowered, db, target)
    executable = compile_module(scheduled, target, report.build_config, relax_pipeline=build_pipeline(target))
    executable = compile_separate(executable, report, target)
    return executable, transform_params(lowered, params), report


def export_artifact(out_dir: str | Path, executable, params: list, model: Model, target: TargetSpec,
                    report: ApplyReport, db_path: str | None) -> Path:
    """Write ``model.so``, ``params.bin`` and ``manifest.json`` to ``out_dir``."""
    import tvm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    executable.export_library(str(out / LIBRARY))
    names = [f"p{i}" for i in range(len(params))]
    (out / PARAMS).write_bytes(tvm.runtime.save_param_dict(dict(zip(names, params))))
    from autosched import __version__

    manifest = {
        "format": "autosched-model", "version": 1, "model": model.spec, "model_kwargs": model.kwargs,
        "autosched_version": __version__,
        "tvm_version": tvm.__version__, "target": target.to_json(), "created_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "library": LIBRARY, "params": PARAMS, "param_order": names,
        "inputs": model.input_specs(),
        "database": db_path, "tuned_kernels": report.tuned, "default_kernels": report.default,
        "build_time_kernels": report.build_time,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return out


def load_artifact(out_dir: str | Path):
    """(VirtualMachine, params, manifest) of an exported artifact, using TVM's runtime only."""
    import tvm
    from tvm import relax

    out = Path(out_dir)
    manifest_path = out / MANIFEST
    if not manifest_path.exists():
        raise UsageError(f"{out} is not an autosched build (no {MANIFEST}): run `autosched build` first")
    manifest = json.loads(manifest_path.read_text())
    device = tvm.cpu() if manifest["target"]["kind"] == "llvm" else tvm.cuda()
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(out / manifest["library"])), device)
    saved = tvm.runtime.load_param_dict((out / manifest["params"]).read_bytes())
    params = [saved[name].copyto(device) for name in manifest["param_order"]]
    return vm, params, manifest
