"""CUDA code without a GPU: the source TVM generates for a scheduled module (``autosched show``; the compile
tests give it to nvcc, ``tests/nvcc.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from autosched.target import compile_module

if TYPE_CHECKING:
    from tvm import IRModule

    from autosched.target import TargetSpec


def cuda_source(mod: IRModule, target: TargetSpec, config: dict | None = None, codegen: dict | None = None) -> str:
    """The CUDA C++ that TVM generates for ``mod`` (no GPU or driver needed)."""
    executable = compile_module(mod, target, config, codegen)
    for imported in executable.mod.imports:
        if imported.kind == "cuda":
            return imported.inspect_source()
    raise RuntimeError("the compiled module has no CUDA part")
