"""The warp-specialised pipeline that the Hopper templates share (``hopper_gemm``, ``hopper_dequant``,
``hopper_attention``): a producer warpgroup fills a ring of shared-memory stages with TMA, each stage
with a *full* mbarrier the copy engine completes and an *empty* one its consumers release, and consumer
warpgroups accumulate with wgmma in registers.

TVMScript macros cannot allocate a buffer for their caller, so the kernel's buffers come from a Python
function called inside the kernel (``pipeline_buffers``); the rest are macros."""

from __future__ import annotations

from tvm.script import tirx as T

from ._hopper import cuda_file

# The helpers of cuda/hopper.cuh, by name; each carries the whole file (TVM emits a helper's source once
# per name, and the include guard keeps one copy). TIRx's own noop_barrier, which the accumulator fence
# replaces, fails in 0.27's code generator.
HOPPER_HELPERS = cuda_file("hopper.cuh")
FENCE_NAME = "autosched_acc_fence"
FENCE_SOURCE = HOPPER_HELPERS
# Ping-pong turns between two consumer warpgroups (named barriers 1 and 2).
TURN_SYNC, TURN_HANDOVER = "autosched_turn_sync", "autosched_turn_handover"
TURN_SYNC_SOURCE = TURN_HANDOVER_SOURCE = HOPPER_HELPERS
# A named barrier over the consumer warpgroups alone (the producer is elsewhere in its loop).
CONSUMERS_SYNC = "autosched_consumers_sync"
CONSUMERS_SYNC_SOURCE = HOPPER_HELPERS


def pipeline_buffers(smem_elems: int, dtype: str, stages: int, acc_len: int):
    """(smem, full, empty, acc), allocated in the kernel that calls this while it is parsed: the ring's
    dynamic shared memory (1024-byte aligned for 128-byte swizzled TMA boxes), a full and an empty
    mbarrier per stage, and each consumer thread's fp32 accumulators."""
    smem = T.alloc_buffer((smem_elems,), dtype, scope="shared.dyn", align=1024)
    full = T.alloc_shared((stages,), "uint64", align=8)
    empty = T.alloc_shared((stages,), "uint64", align=8)
    acc = T.alloc_local((acc_len,), "float32")
    return smem, full, empty, acc


def tile_walk_scalars():
    """(desc_a, desc_b, it, tile, tm, tn), mutable scalars of the kernel that calls this while it is parsed:
    the two wgmma shared-memory descriptors, the count of stages used so far (its ring position and
    barrier phase), the tile being worked on and its row and column tile."""
    return tuple(T.local_scalar(dtype=d) for d in ("uint64", "uint64", "int32", "int32", "int32", "int32"))


@T.macro
def init_stage_barriers(full, empty, stages, releases):
    """By one thread: each stage's full barrier awaits its producer's one arrival (with the TMA bytes),
    its empty barrier ``releases`` arrivals of consumer threads; then the initialisation is made visible
    to the copy engine (the caller syncs the CTA before any thread waits)."""
    for s in T.unroll(stages):
        T.ptx.mbarrier.init.shared.b64(T.address_of(full[s]), T.uint32(1))
        T.ptx.mbarrier.init.shared.b64(T.address_of(empty[s]), T.uint32(releases))
    T.ptx.fence.proxy.async_.shared__cta()


@T.macro
def zero_accumulators(acc, acc_len):
    """Zero the accumulators before a tile, each behind a compiler fence so that nvcc cannot move the
    zeroing past the next ``wgmma.fence`` (wgmma writes the registers behind the compiler's back)."""
    for i in T.unroll(acc_len):
        acc[i] = T.float32(0)
        T.cuda.func_call(FENCE_NAME, acc[i], source_code=FENCE_SOURCE)


@T.macro
def fence_accumulators(acc, acc_len):
    """After ``wgmma.wait_group 0``: a compiler fence on every accumulator, so that the epilogue reads the
    registers wgmma wrote, not values nvcc kept from before."""
    for i in T.unroll(acc_len):
        T.cuda.func_call(FENCE_NAME, acc[i], source_code=FENCE_SOURCE)
