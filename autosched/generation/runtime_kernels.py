"""Kernels a generator compiles where it runs, at their first use (the grammar mask, the penalties and
log-probabilities): not part of the artifact, so that an artifact built before them can use them."""

from __future__ import annotations

import logging

from autosched.target import TargetSpec

# Deferred imports: tvm (imported where used: `autosched --help` stays fast).

_KERNELS: dict[tuple[str, str, int], object] = {}


def compiled_at_first_use(model, name: str, make):
    """``make(vocab, gpu)``'s PrimFunc compiled for ``model``'s device, once a process; None where it cannot be
    compiled (e.g. no CUDA compiler where the artifact runs: the host then does the work, warned once)."""
    import tvm

    spec = TargetSpec.from_json(model.manifest["target"])
    gpu = spec.kind == "cuda"
    key = (name, f"{spec.kind}:{spec.arch}", model.vocab)
    if key not in _KERNELS:
        try:
            target = spec.tvm_target() if gpu else tvm.target.Target("llvm")
            module = tvm.IRModule({"main": make(model.vocab, gpu).with_attr("global_symbol", "main")})
            _KERNELS[key] = tvm.compile(module, target=target)["main"]
        except Exception as exc:  # noqa: BLE001 - whatever stops the compiler, the host does the work
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            logging.getLogger(__name__).warning("%s stays on the host: its kernel did not compile (%s)", name, first)
            _KERNELS[key] = None
    return _KERNELS[key]
