"""Tuning tasks: one TensorIR function to tune, how to check it, and how workers rebuild it.

A task comes either from one of our operators (a :class:`Workload`, checked against torch in float64)
or from a function of unknown origin such as a Relax-fused kernel (checked against the same function
compiled unscheduled for the CPU). Builder and runner processes receive a small picklable
:class:`TaskSpec` and rebuild the function and its checker themselves, once per task.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .correctness import relative_error
from .target import parse_target
from .workloads import Workload, get_operator
from .workloads._base import randn, torch_dtype

if TYPE_CHECKING:
    import torch
    from tvm.tirx import PrimFunc

    from autosched.search_spaces import Space
    from autosched.target import TargetSpec

# Deferred imports: tvm, tvm_ffi, torch, numpy (imported where used: `autosched --help` stays fast).

# Tolerance on ||out - ref|| / ||ref|| for functions that are checked against their own default schedule,
# by the least precise floating-point dtype the function reads, keeps or accumulates in (not its output's:
# an fp16 product written as float32 carries fp16's error): both compute in that precision, so only the
# order of the sums differs.
SELF_CHECK_TOLERANCE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 3e-2}
# Unit roundoff of each dtype. A sequential sum of K random terms kept in it is off by about u·√K/2.4 of
# its value (each partial sum rounded), the candidate's and the reference's independently: u·√K bounds
# their difference with room to spare (tree-shaped sums, as GPU schedules make, drift far less).
UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}


@dataclass(frozen=True)
class TaskSpec:
    """What a worker process needs to rebuild a task (picklable and cheap to send)."""

    workload: str | None  # Workload JSON, or None for a raw function
    func_json: str | None  # tvm.ir.save_json of the function when there is no workload
    family: str | None
    seed: int = 0

    @property
    def key(self) -> str:
        text = f"{self.workload}|{self.family}|{self.seed}|{self.func_json}"
        return hashlib.sha1(text.encode()).hexdigest()

    def func(self) -> PrimFunc:
        import tvm

        if self.workload is not None:
            wl = Workload.from_json(self.workload)
            return normalize_func(get_operator(wl.op).build(wl))
        return tvm.ir.load_json(self.func_json)

    @property
    def hints(self) -> dict[str, Any]:
        """The workload's attributes, which template spaces need (e.g. ``causal``)."""
        return workload_hints(Workload.from_json(self.workload)) if self.workload is not None else {}

    def checker(self, func: PrimFunc, target: TargetSpec | None = None) -> Checker:
        """``target``: the GPU a raw function's reference is compiled for (default: the first GPU's)."""
        if self.workload is not None:
            return OperatorChecker(Workload.from_json(self.workload))
        return SelfChecker(func, target)


def workload_hints(wl: Workload) -> dict[str, Any]:
    """What template spaces read of a workload: its operator and attributes (e.g. ``causal``, ``bias``)."""
    return {"op": wl.op, **wl.attrs_dict}


@dataclass
class Task:
    """One function to tune, with what the tuner shows and stores about it."""

    name: str
    func: PrimFunc
    workload: Workload | None = None
    family: str | None = None
    weight: float = 1.0  # how many times the kernel runs per model invocation
    meta: dict[str, Any] = field(default_factory=dict)
    # How much one second of this kernel counts for the task scheduler, per call: above 1 for the kernels
    # of a dynamic build's short buckets, so that each bucket's latency counts relative to its own size.
    share: float = 1.0

    @classmethod
    def from_workload(cls, wl: Workload) -> Task:
        op = get_operator(wl.op)
        return cls(wl.key, normalize_func(op.build(wl)), wl, op.family)

    @classmethod
    def from_func(cls, name: str, func: PrimFunc, weight: float = 1.0) -> Task:
        return cls(name, normalize_func(func), None, None, weight)

    @cached_property
    def spec(self) -> TaskSpec:
        import tvm

        if self.workload is not None:
            return TaskSpec(json.dumps(self.workload.to_json()), None, self.family)
        return TaskSpec(None, tvm.ir.save_json(self.func), self.family)

    @cached_property
    def structural_hash(self) -> str:
        import tvm_ffi

        return f"{tvm_ffi.structural_hash(self.func) & (2**64 - 1):016x}"

    @property
    def key(self) -> str:
        """The database key: the workload's key, or ``func:<structural hash>`` for raw functions."""
        return self.workload.key if self.workload is not None else f"func:{self.structural_hash}"

    @cached_property
    def flops(self) -> float:
        if self.workload is not None:
            return get_operator(self.workload.op).flops(self.workload)
        import tvm
        from tvm import s_tir

        try:
            return float(s_tir.analysis.estimate_tir_flops(tvm.IRModule({"main": self.func})))
        except Exception:  # noqa: BLE001 - TVM cannot count some functions; the count is only shown
            return 0.0

    @cached_property
    def min_bytes(self) -> float:
        if self.workload is not None:
            return get_operator(self.workload.op).min_bytes(self.workload)
        return float(sum(_param_bytes(p) for p in self.func.params))

    @property
    def work(self) -> float:
        """How much the model asks of this kernel: its calls x (FLOPs + bytes it must move)."""
        return self.weight * (self.flops + self.min_bytes)

    def space(self, target: TargetSpec) -> Space:
        from autosched.search_spaces import create_space

        return create_space(self.func, target, self.family, workload_hints(self.workload) if self.workload else None)


def normalize_func(func: PrimFunc) -> PrimFunc:
    """The function under the name ``main`` with only the attributes that change its meaning, so that
    the same kernel hashes the same whatever it was called (TVM hashes the global symbol too)."""
    if func.attrs is not None and "tirx.is_scheduled" in func.attrs:
        func = func.without_attr("tirx.is_scheduled")
    return func.with_attr("global_symbol", "main").with_attr("tirx.noalias", True)


def _param_bytes(param) -> int:
    shape = getattr(param, "shape", None) or ()
    n = 1
    for dim in shape:
        n *= int(dim)
    bits = param.dtype.bits * param.dtype.lanes if hasattr(param.dtype, "bits") else 32
    return n * bits // 8


def output_indices(func: PrimFunc) -> list[int]:
    """Indices of the parameters that some block writes (the outputs)."""
    from tvm import s_tir

    from autosched.search_spaces._analysis import blocks_of

    sch = s_tir.Schedule(func)
    written = {w.source.name for b in blocks_of(sch) for w in sch.get(b).writes}
    return [i for i, p in enumerate(func.params) if p.name in written]


def precision_tolerance(func: PrimFunc) -> float:
    """The relative error two correct schedules of ``func`` may show against each other: the tolerance of the
    least precise float dtype among its parameters and buffers, widened for a reduction kept in a low-precision
    accumulator to the drift of its sums (u·√K, K the reduction's length)."""
    from tvm import s_tir, tirx

    from autosched.search_spaces._analysis import blocks_of, iter_kinds

    sch = s_tir.Schedule(func)
    dtypes = {str(p.dtype) for p in func.params if hasattr(p, "dtype")}
    drift = 0.0
    for block in blocks_of(sch):
        stmt = sch.get(block)
        dtypes |= {str(b.dtype) for b in stmt.alloc_buffers}
        kinds = iter_kinds(sch, block)
        if "R" not in kinds or not stmt.writes:
            continue
        length = 1
        for kind, iv in zip(kinds, stmt.iter_vars):
            if kind == "R" and isinstance(iv.dom.extent, tirx.IntImm):
                length *= int(iv.dom.extent)
        accumulator = str(stmt.writes[0].source.dtype)
        drift = max(drift, UNIT_ROUNDOFF.get(accumulator, 0.0) * length ** 0.5)
    floats = [d for d in dtypes if d in SELF_CHECK_TOLERANCE]
    base = max((SELF_CHECK_TOLERANCE[d] for d in floats), default=1e-4)
    return max(base, drift)


class Checker:
    """Inputs, output shapes and the reference of one task (lives in the runner process)."""

    tolerance: float

    def make_inputs(self, gen: torch.Generator, device: str) -> list[torch.Tensor]:
        raise NotImplementedError

    def output_specs(self) -> list[tuple[tuple[int, ...], str]]:
        raise NotImplementedError

    def reference(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        raise NotImplementedError

    def arrange(self, inputs: list, outputs: list) -> list:
        """Arguments in the function's parameter order."""
        return list(inputs) + list(outputs)

    def errors(self, inputs: list, outs: list, refs: list) -> list[float]:
        """Each output's error against its reference (compared with :attr:`tolerance`): relative L2 errors."""
        return [relative_error(o, r) for o, r in zip(outs, refs)]

    def inputs_and_reference(self, gen: torch.Generator, device: str) -> tuple[list, list]:
        """Seeded random inputs on ``device`` and the float64 reference outputs for them."""
        inputs = self.make_inputs(gen, device)
        return inputs, self.reference(inputs)


class OperatorChecker(Checker):
    def __init__(self, wl: Workload):
        self.wl, self.op = wl, get_operator(wl.op)
        self.tolerance = self.op.tolerance(wl)

    def make_inputs(self, gen, device):
        return self.op.make_inputs(self.wl, gen, device)

    def output_specs(self):
        return self.op.output_specs(self.wl)

    def reference(self, inputs):
        return self.op.reference(self.wl, inputs)

    def errors(self, inputs, outs, refs):
        return self.op.errors(self.wl, inputs, outs, refs)


class SelfChecker(Checker):
    """Checks a function of unknown origin against the same function under an independent schedule."""

    def __init__(self, func: PrimFunc, target: TargetSpec | None = None):
        self.func = func
        self.target = target if target is not None and target.is_gpu else None
        self.outputs = output_indices(func)
        self.inputs = [i for i in range(len(func.params)) if i not in self.outputs]
        self.tolerance = precision_tolerance(func)
        self._compiled: dict[str, Any] = {}  # reference executable per device type

    def _spec(self, index: int) -> tuple[tuple[int, ...], str]:
        p = self.func.params[index]
        return tuple(int(d) for d in p.shape), str(p.dtype)

    def make_inputs(self, gen, device, positive: bool = False):
        """Normal random floats (uniform in [0.5, 1.5) if ``positive``) and small non-negative integers."""
        import torch

        out = []
        for i in self.inputs:
            shape, dtype = self._spec(i)
            if dtype == "bool":
                out.append(torch.randint(0, 2, shape, generator=gen).bool().to(device))
            elif dtype.startswith(("int", "uint")):
                # Integer inputs are often indices: keep them small and non-negative.
                out.append(torch.randint(0, 2, shape, generator=gen, dtype=torch_dtype(dtype)).to(device))
            elif positive:
                data = 0.5 + torch.rand(shape, generator=gen, dtype=torch.float32)
                out.append(data.to(torch_dtype(dtype)).to(device))
            else:
                out.append(randn(shape, dtype, gen, device))
        return out

    def inputs_and_reference(self, gen, device):
        """As for any checker, except that a fused kernel's inputs may be intermediates whose domain
        is narrower than normal noise (RMSNorm's mean of squares meets an rsqrt): if the reference is
        not finite on normal inputs, positive inputs are drawn instead."""
        import torch

        for positive in (False, True):
            inputs = self.make_inputs(gen, device, positive)
            refs = self.reference(inputs)
            if all(bool(torch.isfinite(r).all()) for r in refs):
                return inputs, refs
        raise ValueError("the function's own output has NaN/inf on normal and on positive random inputs, "
                         "so its candidates cannot be checked")

    def output_specs(self):
        return [self._spec(i) for i in self.outputs]

    def arrange(self, inputs, outputs):
        args: list = [None] * len(self.func.params)
        for i, t in zip(self.inputs, inputs):
            args[i] = t
        for i, t in zip(self.outputs, outputs):
            args[i] = t
        return args

    def reference(self, inputs):
        """The function's outputs computed by an independent schedule: on a GPU, TVM's own default
        (dlight) schedule; on the CPU, the function as written. (A naive CPU build of a large GEMM of
        a model would take minutes per task on the GPU machine.)"""
        import torch

        device = inputs[0].device if inputs else torch.device("cpu")
        outs = [torch.empty(s, dtype=getattr(torch, d), device=device) for s, d in self.output_specs()]
        if device.type not in self._compiled:  # loaded once: a retry on other inputs reuses it
            self._compiled[device.type] = self._reference_function(device.type)
        self._compiled[device.type](*[_to_tvm(t) for t in self.arrange(inputs, outs)])
        return [o.double() for o in outs]

    def reference_path(self, device_type: str) -> Path:
        """Where the compiled reference is kept: named by everything that decides its code (the function by
        its structural hash, as the database keys a raw function's task)."""
        import tvm
        import tvm_ffi

        function = tvm_ffi.structural_hash(self.func) & (2**64 - 1)
        text = f"{REFERENCE_RECIPE}|{tvm.__version__}|{self._reference_target(device_type)}|{function:016x}"
        return reference_cache() / f"{hashlib.sha1(text.encode()).hexdigest()[:24]}.so"

    def export_reference(self, device_type: str) -> Path:
        """Compile the reference into the reference cache unless it is there already. A builder process
        does this ahead of the runner, which then loads it instead of compiling one task's reference after
        another between candidates."""
        path = self.reference_path(device_type)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.so")
            self._reference_module(device_type).export_library(str(partial))
            os.replace(partial, path)  # atomic: a process reading it never sees half a file
        return path

    def _reference_function(self, device_type: str):
        import tvm

        try:
            return tvm.runtime.load_module(str(self.export_reference(device_type))).main
        except OSError:  # the cache folder cannot be written: compile in memory only
            return self._reference_module(device_type).jit().main

    def _reference_target(self, device_type: str):
        import tvm

        if device_type == "cuda":
            return (self.target or parse_target("cuda")).tvm_target()
        return tvm.target.Target({"kind": "llvm"})

    def _reference_module(self, device_type: str):
        import tvm

        target = self._reference_target(device_type)
        if device_type == "cuda":
            from tvm.s_tir import dlight as dl

            with target:
                mod = dl.ApplyDefaultSchedule(dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(),
                                              dl.gpu.GeneralReduction(), dl.gpu.Fallback())(
                    tvm.IRModule({"main": self.func}))
            return tvm.compile(mod, target=target)
        return tvm.compile(self.func, target=target)


# Bump when what a reference is compiled with changes (the dlight rules above): the cache is then rebuilt.
REFERENCE_RECIPE = "dlight-v1"
CACHE_ENV = "AUTOSCHED_CACHE"


def reference_cache() -> Path:
    """The folder of compiled references, kept between runs: ``$AUTOSCHED_CACHE/references``, by default
    under ``~/.cache/autosched``."""
    root = os.environ.get(CACHE_ENV) or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "autosched"
    return Path(root) / "references"


def _to_tvm(tensor):
    import tvm

    return tvm.runtime.from_dlpack(tensor)
