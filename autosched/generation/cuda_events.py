"""The CUDA driver calls that decode steps launched ahead need, through ctypes over ``libcuda`` (TVM's Python
API has no events and no asynchronous copies): a mark after a step's tokens on TVM's stream (the legacy default
stream), which the host can wait for without waiting for the work queued after it, and the tokens' copy into
pinned host memory on a stream of its own, so that reading them does not wait for the next step either; and
host arrays queued for the device behind the work already queued (:class:`PinnedUploads`), where TVM's copy
would wait for that work first."""

from __future__ import annotations

import ctypes

# Deferred imports: numpy (imported where used: `autosched --help` stays fast).

CU_STREAM_NON_BLOCKING = 1
CU_EVENT_DISABLE_TIMING = 2
LEGACY_STREAM = None  # the driver's handle 0: the legacy default stream, where TVM launches and copies
SLOTS = 4  # marks in flight at once: a generator has at most two
SLOT_BYTES = 1 << 16  # tokens (int32) a mark can copy back


class CudaEventError(RuntimeError):
    pass


class _Driver:
    def __init__(self):
        self._cu = ctypes.CDLL("libcuda.so.1")

    @classmethod
    def open(cls):
        """One on this process's CUDA context; None where there is no CUDA driver."""
        try:
            return cls()
        except (OSError, CudaEventError):
            return None

    def _call(self, name: str, *args) -> None:
        status = getattr(self._cu, name)(*args)
        if status != 0:
            raise CudaEventError(f"{name} failed with CUDA driver error {status}")


class TokenMarks(_Driver):
    """Marks after decode steps' tokens: :meth:`mark` after a step's sampling kernel was launched,
    :meth:`wait` until that step is done, :meth:`read` its tokens (copied as soon as they were made)."""

    def __init__(self):
        super().__init__()
        self._stream = ctypes.c_void_p()
        self._call("cuStreamCreate", ctypes.byref(self._stream), CU_STREAM_NON_BLOCKING)
        self._done, self._copied, self._host = [], [], []
        for _ in range(SLOTS):
            for events in (self._done, self._copied):
                event = ctypes.c_void_p()
                self._call("cuEventCreate", ctypes.byref(event), CU_EVENT_DISABLE_TIMING)
                events.append(event)
            host = ctypes.c_void_p()
            self._call("cuMemAllocHost_v2", ctypes.byref(host), ctypes.c_size_t(SLOT_BYTES))
            self._host.append(host)
        self._next = 0

    def mark(self, tokens) -> tuple[int, int]:
        """Mark the work queued so far (through the step whose device tensor of int32 ``tokens`` was just
        launched) and queue the copy of ``tokens`` to the host behind it alone. Returns the mark."""
        count = int(tokens.numel())
        if 4 * count > SLOT_BYTES:
            raise CudaEventError(f"{count} tokens are more than a mark copies ({SLOT_BYTES // 4})")
        slot, self._next = self._next, (self._next + 1) % SLOTS
        self._call("cuEventRecord", self._done[slot], LEGACY_STREAM)
        self._call("cuStreamWaitEvent", self._stream, self._done[slot], 0)
        self._call("cuMemcpyDtoHAsync_v2", self._host[slot], ctypes.c_uint64(tokens.data_ptr()),
                   ctypes.c_size_t(4 * count), self._stream)
        self._call("cuEventRecord", self._copied[slot], self._stream)
        return slot, count

    def wait(self, mark: tuple[int, int]) -> None:
        """Until the work marked is done (not the work queued after the mark)."""
        self._call("cuEventSynchronize", self._done[mark[0]])

    def read(self, mark: tuple[int, int]):
        """The marked step's tokens (numpy int32), once copied."""
        import numpy as np

        slot, count = mark
        self._call("cuEventSynchronize", self._copied[slot])
        return np.ctypeslib.as_array(ctypes.cast(self._host[slot], ctypes.POINTER(ctypes.c_int32)), (count,)).copy()


class PinnedUploads(_Driver):
    """Host arrays copied into device tensors on TVM's stream behind the work queued there, without the host
    waiting for that work (TVM's ``copyfrom`` synchronizes the stream first: a grammar's mask copied while a
    decode step runs would hold the host until the step is done). Each array goes through pinned host memory of
    its own, one of ``SLOTS`` taken in turn; a slot is reused once its last copy is done."""

    def __init__(self):
        super().__init__()
        self._host = [ctypes.c_void_p() for _ in range(SLOTS)]
        self._sizes = [0] * SLOTS
        self._copied = []
        for _ in range(SLOTS):
            event = ctypes.c_void_p()
            self._call("cuEventCreate", ctypes.byref(event), CU_EVENT_DISABLE_TIMING)
            self._copied.append(event)
        self._used = [False] * SLOTS
        self._next = 0

    def upload(self, array, tensor) -> None:
        """Queue the copy of ``array`` (numpy, C-contiguous) into ``tensor`` (a device tensor of its bytes)."""
        slot, self._next = self._next, (self._next + 1) % SLOTS
        if self._used[slot]:
            self._call("cuEventSynchronize", self._copied[slot])  # its last copy: long done, as a rule
        size = array.nbytes
        if size > self._sizes[slot]:
            if self._sizes[slot]:
                self._call("cuMemFreeHost", self._host[slot])
            grown = max(size, 2 * self._sizes[slot], SLOT_BYTES)
            self._call("cuMemAllocHost_v2", ctypes.byref(self._host[slot]), ctypes.c_size_t(grown))
            self._sizes[slot] = grown
        ctypes.memmove(self._host[slot], array.ctypes.data, size)
        self._call("cuMemcpyHtoDAsync_v2", ctypes.c_uint64(tensor.data_ptr()), self._host[slot], ctypes.c_size_t(size),
                   LEGACY_STREAM)
        self._call("cuEventRecord", self._copied[slot], LEGACY_STREAM)
        self._used[slot] = True

