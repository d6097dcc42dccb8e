"""The step barrier: where a decode step, once its call has begun, waits for the step before it.

A decode function of a build calls :data:`STEP_BARRIER` on its token embeddings, before anything reads the KV
cache. TVM's cache copies a step's page tables to the device when the step first reads the cache, on a stream
of its own that does not wait for the steps before: they must be done by then, for they read the same
buffers. The host can therefore launch step t + 1 before it has read step t's tokens (the ids fed are step
t's tokens on the device) and let the barrier, inside the call, wait for step t and read its tokens: the
host's turn between two steps (its bookkeeping, the call's start, the embedding's launch) no longer leaves
the GPU idle. Without a read queued (:meth:`StepBarrier.queue`) the barrier only copies its input.
"""

from __future__ import annotations

STEP_BARRIER = "autosched.generation.step_barrier"


class StepBarrier:
    """The tensor that the next barrier reads back to the host (at most one), and what it read."""

    def __init__(self):
        self._queued = None
        self.read = None

    def queue(self, tensor) -> None:
        """Have the next barrier wait for the work queued before it and read ``tensor`` (a device tensor)."""
        self._queued, self.read = tensor, None

    def take(self):
        """What the last barrier read (numpy), once; None if nothing was queued."""
        read, self.read = self.read, None
        return read

    def __call__(self, embeddings, ids, out) -> None:
        queued, self._queued = self._queued, None
        if queued is not None:
            self.read = queued.numpy()  # waits for everything queued on the device's stream: the step before
        embeddings.copyto(out)


BARRIER = StepBarrier()


def register() -> None:
    """Make :data:`STEP_BARRIER` callable from a module's VM (before one that calls it is loaded)."""
    import tvm_ffi

    tvm_ffi.register_global_func(STEP_BARRIER, BARRIER, override=True)


def step_barrier(x, input_ids):
    """``x`` (an ``nn.Tensor``: the step's embeddings) passed through the barrier, a copy of it that the model
    reads on. The call also takes the function's ``input_ids``: an input of the call, whose address changes
    from call to call, keeps TVM's CUDA-graph rewrite from capturing the barrier into a graph (where a
    replay would skip it)."""
    from tvm import relax

    from autosched.tvm_adapter import nn_tensor, relax_expr

    expr = relax_expr(x)
    call = relax.call_dps_packed(relax.ExternFunc(STEP_BARRIER), relax.Tuple([expr, relax_expr(input_ids)]), expr.ty)
    return nn_tensor(call, "after_barrier")
