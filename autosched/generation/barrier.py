"""The step barrier: where a decode step, once its call has begun, waits for the step before it.

A decode function of a build calls :data:`STEP_BARRIER` just before it first reads the KV cache (on the first
layer's q/k/v, after its projection, or on the embeddings where positions are read first). TVM's cache copies
a step's page tables to the device when the step first reads the cache, on a stream of its own that does not
wait for the steps before: they must be done by then, for they read the same buffers. The host can
therefore launch step t + 1 before it has read step t's tokens (the ids fed are step t's tokens on the
device) and let the barrier, inside the call, wait for step t: the host's turn between two steps (its
bookkeeping, the call's start, the first kernels' launch) no longer leaves the GPU idle. Without a wait
queued (:meth:`StepBarrier.queue`) the barrier only copies its input.
"""

from __future__ import annotations

from collections.abc import Callable

from autosched.tvm_adapter import nn_tensor, relax_expr

# Deferred imports: tvm, tvm_ffi (imported where used: `autosched --help` stays fast).

STEP_BARRIER = "autosched.generation.step_barrier"


class StepBarrier:
    """What the next barrier does before the step reads the cache (at most one thing, run once)."""

    def __init__(self):
        self._queued = None

    def queue(self, wait: Callable[[], None]) -> None:
        """Have the next barrier call ``wait`` (which returns once the step before is done)."""
        self._queued = wait

    def __call__(self, x, ids, out) -> None:
        wait, self._queued = self._queued, None
        if wait is not None:
            wait()
        x.copyto(out)


BARRIER = StepBarrier()


def register() -> None:
    """Make :data:`STEP_BARRIER` callable from a module's VM (before one that calls it is loaded)."""
    import tvm_ffi

    tvm_ffi.register_global_func(STEP_BARRIER, BARRIER, override=True)


def step_barrier(x, input_ids):
    """``x`` (an ``nn.Tensor``) passed through the barrier, a copy of it that the model reads on. The call
    also takes the function's ``input_ids``: an input of the call, whose address changes from call to call,
    keeps TVM's CUDA-graph rewrite from capturing the barrier into a graph (where a replay would skip it)."""
    from tvm import relax

    expr = relax_expr(x)
    call = relax.call_dps_packed(relax.ExternFunc(STEP_BARRIER), relax.Tuple([expr, relax_expr(input_ids)]), expr.ty)
    return nn_tensor(call, "after_barrier")
