"""Lowering: the Relax passes shared by task extraction and by applying the database, so the
kernels' keys match."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .importer import import_model

if TYPE_CHECKING:
    from tvm import IRModule

    from autosched.target import TargetSpec

    from .load import Model

# Deferred imports: tvm, numpy (imported where used: `autosched --help` stays fast).


def prepare(model: Model, target: TargetSpec) -> tuple[IRModule, list]:
    """Import and lower ``model`` for ``target``; weight-only computations (e.g. the transposes that put
    each Linear's weight in the layout its GEMM reads) move to ``main_transform_params``, run once at
    build time."""
    from tvm import relax

    from autosched.search_spaces.templates.hopper_gemm import HOPPER_ARCHS

    mod, params = import_model(model, linear_as_gemm=target.is_gpu,
                               hopper=target.is_gpu and target.arch in HOPPER_ARCHS)
    return lower(relax.transform.LiftTransformParams()(mod)), params


def transform_params(lowered: IRModule, params: list) -> list:
    """Run ``main_transform_params`` once (on the CPU) and return the parameters ``main`` expects."""
    import tvm
    from tvm import relax

    if "main_transform_params" not in [gv.name_hint for gv in lowered.functions]:
        return params
    # Only the kernels main_transform_params calls: DeadCodeElimination keeps every TIR function, and
    # LLVM would otherwise compile each of the model's GPU kernels as CPU code too, which nothing calls.
    entry = lowered["main_transform_params"]
    called = {gv.name_hint for gv in relax.analysis.all_global_vars(entry)} | {"main_transform_params"}
    only = tvm.IRModule({gv: f for gv, f in lowered.functions.items() if gv.name_hint in called}, attrs=lowered.attrs)
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
