"""How a GPU run is timed, shared by the runner and the benchmarks: single runs timed with CUDA events after the
L2 is flushed. (Whether a result is right, its relative error against the float64 reference, is
:mod:`autosched.correctness`'s.)"""

from __future__ import annotations

from typing import Any

# Deferred imports: torch (imported where used: `autosched --help` stays fast).

_FLUSH: dict[int, Any] = {}


def time_cuda(fn, repeat: int, flush_bytes: int, cutoff: float | None = None, warmup: int = 3) -> list[float]:
    """Times of ``repeat`` single runs of ``fn`` on the GPU, each after the L2 cache was flushed, with
    CUDA events. Stops after one run if that run is slower than ``cutoff`` seconds.

    The flush reads ``flush_bytes`` (a sum over a buffer several times the L2's size), so that memory-bound
    kernels are not timed out of the cache. Reading leaves the cache full of clean lines: the timed kernel
    finds none of its data there and has no other kernel's data to write back (a zeroing flush would leave
    dirty lines, whose write-back falls into the timed kernel). The flush also keeps the GPU busy while the
    host enqueues the timed launch, so launch latency does not enter the measurement.
    """
    import torch

    if flush_bytes and flush_bytes not in _FLUSH:
        _FLUSH[flush_bytes] = torch.ones(flush_bytes // 4, dtype=torch.int32, device="cuda")
    flush = _FLUSH.get(flush_bytes)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        if flush is not None:
            flush.sum()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1e-3)
        if cutoff is not None and times[-1] > cutoff:
            break
    return times
