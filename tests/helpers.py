"""Test helpers: build and check one point of a space in-process (no worker pools)."""

from __future__ import annotations

import torch


def check_point(task, space, point, target, seed: int = 0) -> float:
    """Apply ``point``, compile for ``target``, run on fresh random inputs and return the relative error
    against the task's reference (float64 torch, or the unscheduled function)."""
    import tvm

    from autosched.measure._worker import relative_error
    from autosched.workloads import torch_dtype

    mod = space.apply(point)
    executable = tvm.compile(mod, target=target.tvm_target())
    checker = task.spec.checker(task.func)
    inputs, refs = checker.inputs_and_reference(torch.Generator().manual_seed(seed), target.torch_device)
    outs = [torch.full(s, float("nan"), dtype=torch_dtype(d), device=target.torch_device) for s, d in checker.output_specs()]
    executable(*[tvm.runtime.from_dlpack(t) for t in checker.arrange(inputs, outs)])
    return max(relative_error(o, r) for o, r in zip(outs, refs))
