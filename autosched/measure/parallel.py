"""Measuring a batch on several devices at once: one slot per device (a GPU of this host, or an RPC
server), the batch's candidates handed to whichever slot is free.

A slot measures one candidate at a time, as the local :class:`~autosched.measure.Runner` does. A slot
whose device is lost mid-candidate (an RPC server that died or hung) reports :data:`LOST`; the candidate
goes back to the queue for another slot, and only a candidate lost ``max_attempts`` times (a kernel
that kills every session it runs in) is recorded as failed. Results come back in the batch's order; the
tuning process alone writes them to the database.
"""

from __future__ import annotations

import collections
import math
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Protocol

from autosched.errors import UsageError
from autosched.records import BuildResult, MeasureResult

from . import SLOW_CUTOFF, MeasureConfig, Runner

if TYPE_CHECKING:
    from autosched.target import TargetSpec
    from autosched.task import TaskSpec

__all__ = ["LOST", "DeviceRunner", "ParallelRunner", "Slot", "device_runner", "parse_devices"]


class _Lost:
    """A slot's answer when its device went away mid-candidate (the candidate is not at fault yet)."""

    def __init__(self, reason: str = ""):
        self.reason = reason


LOST = _Lost()


class Slot(Protocol):
    """One device that measures one candidate at a time."""

    name: str

    def open(self) -> bool:
        """Make the device ready if it is not (e.g. take an RPC session): called before every candidate,
        cheap when the device is ready. False: no device can be had through this slot for now."""
        ...

    def measure(self, spec: TaskSpec, build: BuildResult, cutoff: float | None) -> MeasureResult | _Lost:
        """Check and time one successful build; :data:`LOST` (or a :class:`_Lost`) if the device went away."""
        ...

    def close(self) -> None: ...


class ParallelRunner:
    """Runs a batch over slots in parallel; subclasses say which slots exist (:meth:`slots`)."""

    max_attempts = 2  # sessions a candidate may lose before it is recorded as failed
    measured_by: list[str | None] = []  # of the last batch: the slot that measured each candidate
    lost_total = 0  # candidates handed back after their device was lost, over the runner's life

    def slots(self) -> list[Slot]:
        raise NotImplementedError

    def no_slot_accepted(self, stalled: float) -> None:
        """Called when candidates are left and no slot could be opened for ``stalled`` seconds: wait a
        little and return to try again, or raise to stop the run."""
        raise NotImplementedError

    def run(self, spec: TaskSpec, builds: list[BuildResult], cutoff: float | None = None) -> list[MeasureResult]:
        results: list[MeasureResult | None] = [None] * len(builds)
        for i, build in enumerate(builds):
            if not build.ok:
                results[i] = MeasureResult.failed(build.error_kind, build.error_msg, build.seconds)
        pending = collections.deque(i for i, b in enumerate(builds) if b.ok)
        lost: collections.Counter[int] = collections.Counter()
        lock = threading.Lock()
        best = [math.inf]
        self.measured_by = [None] * len(builds)

        def drain(slot: Slot) -> None:
            while True:
                with lock:
                    if not pending:
                        return
                # Open before taking a candidate: a slot waiting for a session must not hold one that an
                # open slot could measure (seen: a slot retrying a hung server kept the batch's last
                # candidate from the healthy one, round after round, until the run gave up).
                if not slot.open():
                    return  # nothing to be had through this slot now; the others carry on
                with lock:
                    if not pending:
                        return
                    i = pending.popleft()
                    # As in the local runner: the cutoff tightens with the batch's best so far.
                    limit = min(cutoff if cutoff is not None else math.inf, SLOW_CUTOFF * best[0])
                res = slot.measure(spec, builds[i], None if math.isinf(limit) else limit)
                with lock:
                    if isinstance(res, _Lost):
                        lost[i] += 1
                        self.lost_total += 1
                        if lost[i] < self.max_attempts:
                            pending.append(i)
                        else:
                            results[i] = MeasureResult.failed(
                                "run", f"its measurement session was lost {lost[i]} times, on different devices "
                                f"(last: {res.reason}): the kernel crashes or hangs where it runs", builds[i].seconds)
                        continue
                    b = builds[i]
                    results[i] = MeasureResult(res.latencies, res.error_kind, res.error_msg,
                                               b.seconds or res.build_seconds, res.run_seconds, res.rel_error)
                    best[0] = min(best[0], results[i].median)
                    self.measured_by[i] = slot.name

        stalled_since = None
        while pending:
            progress = sum(r is not None for r in results) + sum(lost.values())
            threads = [threading.Thread(target=drain, args=(slot,), daemon=True) for slot in self.slots()]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if pending and sum(r is not None for r in results) + sum(lost.values()) == progress:
                stalled_since = stalled_since or time.monotonic()
                self.no_slot_accepted(time.monotonic() - stalled_since)  # raises, or returns to try again
            else:
                stalled_since = None
        return results  # type: ignore[return-value]

    def close(self) -> None:
        for slot in self.slots():
            slot.close()


# ---- several GPUs of one host ---------------------------------------------------------------------
def parse_devices(text: str) -> list[int]:
    """``"0,1,3"`` -> [0, 1, 3]: device ordinals, each once."""
    try:
        devices = [int(part) for part in text.split(",") if part.strip() != ""]
    except ValueError:
        raise UsageError(f"--devices takes GPU numbers separated by commas, e.g. 0,1 (got {text!r})") from None
    if not devices or any(d < 0 for d in devices) or len(set(devices)) != len(devices):
        raise UsageError(f"--devices takes distinct GPU numbers >= 0 separated by commas, e.g. 0,1 (got {text!r})")
    return devices


class _DeviceSlot:
    def __init__(self, device: int, target: TargetSpec, config: MeasureConfig, workdir: str):
        self.name = f"device {device}"
        self.device = device
        # The process starts seeing only its GPU, as cuda:0 (the CUDA driver starts as TVM imports).
        self.runner = Runner(target, config, workdir, env={"CUDA_VISIBLE_DEVICES": str(device)},
                             log_name=f"runner-device{device}.log")

    def open(self) -> bool:
        return True

    def measure(self, spec, build, cutoff):
        # The local runner already turns a crash or a hang into this candidate's failed result and
        # restarts its process: a local device is never lost.
        return self.runner.run(spec, [build], cutoff)[0]

    def close(self) -> None:
        self.runner.close()


class DeviceRunner(ParallelRunner):
    """One runner process per GPU of this host (``CUDA_VISIBLE_DEVICES`` set per process), measuring
    at once. Each process computes a task's inputs and reference once, on its own GPU.

    On a CPU target the processes would share the cores and disturb each other's timings; the command
    line refuses ``--devices`` there, but the class accepts it so that the layout can be tested.
    """

    def __init__(self, target: TargetSpec, config: MeasureConfig, devices: list[int], workdir: str | None = None):
        self.devices = list(devices)
        self.dir = workdir or tempfile.mkdtemp(prefix="autosched-run-")
        self._slots = [_DeviceSlot(d, target, config, self.dir) for d in self.devices]

    def slots(self) -> list[Slot]:
        return list(self._slots)

    def no_slot_accepted(self, stalled: float) -> None:  # pragma: no cover - a device slot always opens
        raise RuntimeError("no device runner accepted a candidate")


def device_runner(devices: list[int]):
    """A ``runner`` factory for :class:`~autosched.measure.Measurer`: one runner process per GPU in ``devices``."""
    return lambda target, config, workdir: DeviceRunner(target, config, devices, workdir)
