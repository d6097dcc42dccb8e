"""Measuring through TVM's RPC tracker: every server registered under a key checks and times candidates.

The pieces are TVM's own. A tracker (``python -m tvm.exec.rpc_tracker``) hands out servers by key;
each server is TVM's :class:`tvm.rpc.Server`, started by ``autosched rpc-server`` with an
initialization callback (``server_init_callback``, TVM's documented hook for bringing functions into
a server) that imports autosched and registers two global functions:

* ``autosched.measure.prepare(payload)``: build the task's inputs and float64 torch reference on the
  server's device (once per session and task);
* ``autosched.measure.run(payload)``: load an uploaded candidate, check its output against the
  reference and time it: the same :func:`autosched.measure._worker.run_candidate` that the local
  runner calls, so the correctness check runs where the kernel runs.

Payloads are cloudpickled (task spec, target, config) and results come back the same way. TVM's RPC
already executes whatever a client uploads, so run servers only on trusted networks (TVM's warning).

On the tuning host, one *slot* per server is a local process (TVM's ``PopenWorker``) holding one RPC
session from the tracker; candidates are uploaded (``remote.upload``) and measured one at a time per
session, every session at once. A session that dies (server killed, kernel that crashes it) or does not
answer within the candidate's timeout (hung server) loses only that candidate, which goes back to the
queue for another server (:class:`~autosched.measure.parallel.ParallelRunner`).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from typing import TYPE_CHECKING

from autosched.errors import DeviceError, UsageError
from autosched.records import REFERENCE_FAILED, BuildResult, MeasureResult
from autosched.tvm_adapter import popen_worker, rpc_server_process, worker_process

from . import _worker_log
from ._worker import build_candidate, init_worker, prepare_task, run_candidate
from .parallel import ParallelRunner, _Lost

if TYPE_CHECKING:
    from autosched.target import TargetSpec

    from . import MeasureConfig

# Deferred imports: tvm, tvm_ffi, torch, psutil, cloudpickle (imported where used: `autosched --help` stays fast).

__all__ = ["LocalCluster", "RPCRunner", "RemoteBuilder", "parse_tracker", "register_functions", "rpc_runner", "serve"]

PREPARE_FUNC = "autosched.measure.prepare"
RUN_FUNC = "autosched.measure.run"
BUILD_RUN_FUNC = "autosched.measure.build_and_run"
CONNECT_TIMEOUT = 30.0  # seconds a slot waits for the tracker to hand it a free server
TRANSFER_ALLOWANCE = 30.0  # seconds added to a candidate's run timeout for its upload and the round trip


def parse_tracker(text: str) -> tuple[str, int]:
    host, _, port = (text or "").rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"--tracker takes HOST:PORT, e.g. 127.0.0.1:9190 (got {text!r})")
    return host, int(port)


# ---- server side: runs inside the RPC server's session processes ----------------------------------
def _remote_prepare(payload: bytes) -> bytes:
    import cloudpickle

    spec, target = cloudpickle.loads(bytes(payload))
    return cloudpickle.dumps(prepare_task(spec, target))


def _run_in_workpath(spec, target, name: str, config: dict, build_point: dict | None = None) -> MeasureResult:
    """Check and time the library ``name`` in this session's work folder, building it there first from
    ``build_point`` if given (``--builder rpc``); the library is removed afterwards."""
    import tvm

    path = tvm.get_global_func("tvm.rpc.server.workpath")(name)
    try:
        if build_point is None:
            return run_candidate(spec, target, path, config)
        build = build_candidate(spec, target, build_point, path)
        if not build.ok:
            return MeasureResult.failed(build.error_kind, build.error_msg, build.seconds)
        return dataclasses.replace(run_candidate(spec, target, path, config), build_seconds=build.seconds)
    finally:
        if os.path.exists(path):
            os.remove(path)


def _remote_run(payload: bytes) -> bytes:
    import cloudpickle

    spec, target, name, config = cloudpickle.loads(bytes(payload))
    return cloudpickle.dumps(_run_in_workpath(spec, target, name, config))


def _remote_build_and_run(payload: bytes) -> bytes:
    """``--builder rpc``: build a point here, then check and time it as :func:`_remote_run` does."""
    import cloudpickle

    spec, target, point, config = cloudpickle.loads(bytes(payload))
    return cloudpickle.dumps(_run_in_workpath(spec, target, f"candidate-{uuid.uuid4().hex}.so", config, point))


def register_functions() -> None:
    """The server's initialization callback: import TVM, torch and autosched once (session processes
    are forked from the server and inherit them) and register the two functions."""
    import tvm_ffi

    init_worker()
    import torch  # noqa: F401 - the reference; imported before the fork, not in every session

    tvm_ffi.register_global_func(PREPARE_FUNC, _remote_prepare, override=True)
    tvm_ffi.register_global_func(RUN_FUNC, _remote_run, override=True)
    tvm_ffi.register_global_func(BUILD_RUN_FUNC, _remote_build_and_run, override=True)


def serve(tracker: str, key: str, host: str = "127.0.0.1", port: int = 9090, port_end: int | None = None,
          custom_addr: str | None = None) -> None:
    """Run one RPC server registered under ``key`` at ``tracker`` until killed (``autosched rpc-server``);
    it listens on the first free port in [port, port_end) (default: the next 100)."""
    from tvm import rpc

    if not key:
        raise UsageError("--key is required: the tracker hands servers out by key (e.g. --key h200)")
    tracker_addr = parse_tracker(tracker)
    port_end = port_end or port + 100
    if port_end <= port:
        raise UsageError(f"--port-end ({port_end}) must be above --port ({port})")
    server = rpc.Server(host, port, port_end, key=key, tracker_addr=tracker_addr, custom_addr=custom_addr,
                        server_init_callback=register_functions)
    print(f"autosched rpc-server: listening on {host}:{server.port}, registered as {key!r} at "
          f"{tracker_addr[0]}:{tracker_addr[1]}", flush=True)
    try:
        server.proc.join()
    finally:
        server.terminate()


# ---- client side: one slot process per server ------------------------------------------------------
_SESSION: dict = {}  # in a slot process: its RPC session


def _slot_connect(tracker: tuple[str, int], key: str) -> str | None:
    """Open a session on a server under ``key``; a string names our functions the server lacks (a stock
    ``python -m tvm.exec.rpc_server``, not ``autosched rpc-server``)."""
    from tvm import rpc

    _SESSION.clear()
    remote = rpc.connect_tracker(*tracker).request(key, priority=1, session_timeout=0, max_retry=1)
    missing = [name for name in (PREPARE_FUNC, RUN_FUNC) if not _has_function(remote, name)]
    if missing:
        return ", ".join(missing)
    _SESSION.update(remote=remote)
    return None


def _has_function(remote, name: str) -> bool:
    try:
        return remote.get_function(name) is not None
    except Exception:  # noqa: BLE001 - TVM raises its own error types for a function the server lacks
        return False


def _slot_prepare(spec, target) -> str | None:
    """Compute the task's inputs and reference on this slot's server; a string says why not."""
    import cloudpickle

    reason = cloudpickle.loads(bytes(_SESSION["remote"].get_function(PREPARE_FUNC)(cloudpickle.dumps((spec, target)))))
    return None if reason is None else f"{REFERENCE_FAILED} on the server: {reason}"


def _slot_measure(spec, target, path: str, config: dict) -> MeasureResult:
    """Upload one candidate to this slot's server, check and time it there."""
    import cloudpickle

    remote = _SESSION["remote"]
    name = os.path.basename(path)
    remote.upload(path, name)
    return cloudpickle.loads(bytes(remote.get_function(RUN_FUNC)(cloudpickle.dumps((spec, target, name, config)))))


def _slot_build_and_measure(spec, target, point: dict, config: dict) -> MeasureResult:
    """Have this slot's server build one point, then check and time it there."""
    import cloudpickle

    run = _SESSION["remote"].get_function(BUILD_RUN_FUNC)
    return cloudpickle.loads(bytes(run(cloudpickle.dumps((spec, target, point, config)))))


class RemoteBuilder:
    """``--builder rpc``: builds nothing here. Each point goes to the RPC server that measures it, which
    builds it on its own cores (and compiler) first: for a tuning host slower than its servers, or
    without the compiler the target needs."""

    def __init__(self, target: TargetSpec, config: MeasureConfig, workdir: str | None = None):
        self.target = target

    def build(self, spec, points: list, modules=None) -> list:
        return [BuildResult(None, remote_point=dict(point)) for point in points]

    def close(self) -> None:
        pass


class _RPCSlot:
    def __init__(self, number: int, runner: RPCRunner):
        self.name = f"rpc slot {number}"
        self.runner = runner
        self.prepared: str | None = None
        self.connected = False
        self.worker = popen_worker(init_worker, stdout=subprocess.DEVNULL, stderr=runner._log)

    def _call(self, fn, args: tuple, timeout: float):
        """``fn(*args)`` in the slot process, which is killed if it has not answered after ``timeout`` s.

        The timeout is kept here, not by the PopenWorker's own timer inside the slot process: that timer
        is a Python thread, and it never runs while the process's main thread waits inside TVM's RPC
        (C++, holding the GIL) on a server that does not answer. Raises TimeoutError or ChildProcessError.
        """
        self.worker.send(fn, args)
        fired = threading.Event()

        def hard_kill():
            fired.set()
            proc = worker_process(self.worker)  # kill by pid: closing the pipes would block on the reader's lock
            if proc is not None:
                proc.kill()

        watchdog = threading.Timer(timeout, hard_kill)
        watchdog.start()
        try:
            return self.worker.recv()
        except ChildProcessError:
            if fired.is_set():
                raise TimeoutError from None
            raise
        finally:
            watchdog.cancel()

    def open(self) -> bool:
        if self.connected:
            return True
        others = sum(s.connected for s in self.runner._slots if s is not self)
        if self.runner.server_count() <= others:
            return False  # every server left is held by another slot: do not queue at the tracker
        try:
            missing = self._call(_slot_connect, (self.runner.tracker, self.runner.key), self.runner.connect_timeout)
        except Exception:  # noqa: BLE001 - no free server within the timeout, or the tracker is gone
            self.worker.kill()
            return False
        if missing:
            # A server without our functions would fail every candidate as if the kernel crashed it.
            self.runner.foreign = missing
            self.worker.kill()
            return False
        self.prepared, self.connected = None, True
        return True

    def measure(self, spec, build, cutoff) -> MeasureResult | _Lost:
        cfg = self.runner.config
        config = {"repeat": cfg.repeat, "number": cfg.number, "min_repeat_ms": cfg.min_repeat_ms,
                  "flush_bytes": cfg.flush_bytes, "cutoff": cutoff}
        # Step 1. The task's reference, once per session, under its own (long) timeout.
        # Step 2. The candidate, under its run timeout plus the transfer allowance.
        target, allowance = self.runner.target, self.runner.transfer_allowance
        if build.remote_point is not None:  # --builder rpc: the server builds it first
            steps = [(_slot_build_and_measure, (spec, target, build.remote_point, config),
                      cfg.build_timeout + cfg.run_timeout + allowance)]
        else:
            steps = [(_slot_measure, (spec, target, build.artifact, config), cfg.run_timeout + allowance)]
        if self.prepared != spec.key:
            steps.insert(0, (_slot_prepare, (spec, target), cfg.prepare_timeout + allowance))
        for fn, args, timeout in steps:
            try:
                res = self._call(fn, args, timeout)
            except TimeoutError:
                self.worker.kill()  # and with it the session's socket; the server is left to its own devices
                self.connected = False
                return _Lost(f"no answer within {timeout:.0f} s (hung server or kernel)")
            except ChildProcessError:
                self.connected = False
                return _Lost("the local slot process died")
            except Exception as exc:  # noqa: BLE001 - an RPC error raised in the slot: the session is gone
                self.worker.kill()
                self.connected = False
                return _Lost(f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}")
            if fn is _slot_prepare:
                if res is not None:
                    return MeasureResult.failed("run", res)
                self.prepared = spec.key
        if target.is_gpu and res.error_kind in ("run", "run_timeout"):
            # As the local runner does: a faulting kernel can leave the session's CUDA context unusable,
            # so the next candidate gets a fresh session (a new process forked by the server).
            self.worker.kill()
            self.connected = False
        return res

    def close(self) -> None:
        self.worker.kill()
        self.connected = False


class RPCRunner(ParallelRunner):
    """Checks and times candidates on every RPC server registered under ``key`` at ``tracker``.

    Args:
        target: what the servers' devices are (the tuning host need not have one).
        config: timing settings and timeouts (``run_timeout`` per candidate, ``prepare_timeout`` per task).
        tracker: ``HOST:PORT`` of the tracker.
        key: the servers' key.
        wait_for_servers: seconds to wait for a server to come back when none is left mid-run.
        connect_timeout: seconds a slot waits for the tracker to hand it a free server.
        transfer_allowance: seconds added to a candidate's ``run_timeout`` for its upload and round trip.
    """

    def __init__(self, target: TargetSpec, config: MeasureConfig, tracker: str, key: str,
                 workdir: str | None = None, wait_for_servers: float = 60.0,
                 connect_timeout: float = CONNECT_TIMEOUT, transfer_allowance: float = TRANSFER_ALLOWANCE):
        if not key:
            raise UsageError("--runner rpc needs --key: the key its servers registered under")
        self.target, self.config, self.key = target, config, key
        self.tracker = parse_tracker(tracker)
        self.wait_for_servers = wait_for_servers
        self.connect_timeout, self.transfer_allowance = connect_timeout, transfer_allowance
        self.dir = workdir or tempfile.mkdtemp(prefix="autosched-rpc-")
        self._log = _worker_log(self.dir, "rpc-runner.log")
        self._slots: list[_RPCSlot] = []
        self._made = 0
        self.foreign: str | None = None  # the functions a server under the key lacked (a stock TVM server)
        if self.server_count() == 0:
            raise self._no_server_error()
        # One session now, before any tuning, given back at once: a stock TVM server under the key is named
        # before a database is touched, and every slot still finds its server free at the first batch.
        self.foreign = self._probe_server()
        if self.foreign:
            raise self.foreign_server_error()

    def server_count(self) -> int:
        """Servers registered under the key now (busy or free)."""
        summary = self._summary()
        return sum(1 for s in summary.get("server_info", []) if s.get("key") == f"server:{self.key}")

    def _probe_server(self) -> str | None:
        """Open one session in this process and give it back: the functions of ours that a server under the key
        lacks (a stock ``python -m tvm.exec.rpc_server``), or None. Then wait until the server is back in the
        tracker's pool (a moment after the session ends), so that the first batch finds every server free."""
        from tvm import rpc

        free = self._free_servers()
        try:
            remote = rpc.connect_tracker(*self.tracker).request(self.key, priority=1, session_timeout=60, max_retry=1)
        except Exception:  # noqa: BLE001 - no server free now: the slots will say so at the first batch
            return None
        missing = [name for name in (PREPARE_FUNC, RUN_FUNC) if not _has_function(remote, name)]
        del remote
        gc.collect()
        deadline = time.monotonic() + 15
        while self._free_servers() < free and time.monotonic() < deadline:
            time.sleep(0.2)
        return ", ".join(missing) or None

    def _free_servers(self) -> int:
        """Servers under the key that the tracker would hand out now."""
        return int(self._summary().get("queue_info", {}).get(self.key, {}).get("free", 0))

    def _summary(self) -> dict:
        from tvm import rpc

        host, port = self.tracker
        try:
            # A quick probe first: connect_tracker itself retries for a minute before it gives up.
            socket.create_connection((host, port), timeout=10).close()
            tracker = rpc.connect_tracker(host, port)
            summary = tracker.summary()
            tracker.close()
        except Exception as exc:  # noqa: BLE001
            raise DeviceError(f"cannot reach the RPC tracker at {host}:{port} ({type(exc).__name__}): start one "
                              f"(python -m tvm.exec.rpc_tracker --host {host} --port {port} --port-end {port + 1}) "
                              "or fix --tracker") from None
        return summary

    def _no_server_error(self) -> DeviceError:
        host, port = self.tracker
        return DeviceError(f"no RPC server is registered under key {self.key!r} at the tracker {host}:{port}: start "
                           f"one (autosched rpc-server --tracker {host}:{port} --key {self.key}) or fix --key")

    def slots(self):
        """One slot per registered server: new servers join at the next batch. When servers have gone,
        slots without a session leave; one still holding a session stays, since which slots' servers
        have gone is learnt only by using them (a lost session then fails to reopen and the slot rests)."""
        want = self.server_count()
        while len(self._slots) < want:
            self._made += 1
            self._slots.append(_RPCSlot(self._made, self))
        idle = [slot for slot in self._slots if not slot.connected]
        for slot in idle[:max(0, len(self._slots) - max(want, 1))]:
            slot.close()
            self._slots.remove(slot)
        return list(self._slots)

    def foreign_server_error(self) -> DeviceError:
        host, port = self.tracker
        return DeviceError(f"an RPC server under key {self.key!r} at {host}:{port} lacks autosched's functions "
                           f"({self.foreign}): it is a stock TVM server; start the servers with `autosched "
                           f"rpc-server --tracker {host}:{port} --key {self.key}` instead")

    def run(self, spec, builds, cutoff=None):
        results = super().run(spec, builds, cutoff)
        if self.foreign:  # a stock server beside ours: say so now, not after a run short of devices
            raise self.foreign_server_error()
        return results

    def no_slot_accepted(self, stalled: float) -> None:
        if self.foreign:
            raise self.foreign_server_error()
        if stalled < self.wait_for_servers:
            time.sleep(2.0)
            return
        if self.server_count() == 0:
            raise self._no_server_error()
        # One session now, before any tuning: a stock TVM server under the key is named at once.
        self.slots()[0].open()
        if self.foreign:
            self.close()
            raise self.foreign_server_error()
        host, port = self.tracker
        raise DeviceError(f"the RPC servers under key {self.key!r} at {host}:{port} accepted no session for "
                          f"{stalled:.0f} s (busy with another tuner, or hung): restart them or use another --key")

    def close(self) -> None:
        for slot in self._slots:
            slot.close()
        self._slots = []
        self._log.close()


def rpc_runner(tracker: str, key: str):
    """A ``runner`` factory for :class:`~autosched.measure.Measurer`: the servers under ``key`` at ``tracker``."""
    return lambda target, config, workdir: RPCRunner(target, config, tracker, key, workdir)



class LocalCluster:
    """A tracker and ``servers`` RPC servers on this host's loopback (TVM's :class:`tvm.rpc.tracker.Tracker`
    and :class:`tvm.rpc.Server` with our callback), for tests and benchmarks. ``kill(i)`` kills server
    ``i`` and its sessions outright, as a crash would; ``pause(i)`` freezes them, as a hung machine
    would; ``close()`` stops everything.
    """

    def __init__(self, servers: int, key: str = "autosched-test", host: str = "127.0.0.1", timeout: float = 120.0):
        from tvm import rpc
        from tvm.rpc.tracker import Tracker

        self.key = key
        self.tracker = Tracker(host, port=9190, port_end=10190, silent=True)
        self.address = f"{host}:{self.tracker.port}"
        self.servers = []
        try:
            for _ in range(servers):
                self.servers.append(rpc.Server(host, port=10200, port_end=11200, key=key,
                                               tracker_addr=(host, self.tracker.port), silent=True,
                                               server_init_callback=register_functions))
            self.wait_for(servers, timeout)
        except BaseException:
            self.close()
            raise

    def registered(self) -> int:
        from tvm import rpc

        tracker = rpc.connect_tracker(*parse_tracker(self.address))
        try:
            return sum(1 for s in tracker.summary()["server_info"] if s.get("key") == f"server:{self.key}")
        finally:
            tracker.close()

    def wait_for(self, count: int, timeout: float = 120.0) -> None:
        """Wait until ``count`` servers are registered with the tracker."""
        deadline = time.monotonic() + timeout
        while self.registered() != count:
            if time.monotonic() > deadline:
                raise DeviceError(f"{self.registered()} RPC servers registered with the tracker at {self.address} "
                                  f"after {timeout:.0f} s, expected {count}")
            time.sleep(0.5)

    def kill(self, index: int) -> None:
        self.servers[index].terminate()

    def pause(self, index: int) -> None:
        """Stop server ``index`` and its sessions (SIGSTOP), as a hung machine: registered, never answering."""
        import psutil

        root = psutil.Process(rpc_server_process(self.servers[index]).pid)
        for proc in [root, *root.children(recursive=True)]:
            proc.send_signal(signal.SIGSTOP)

    def close(self) -> None:
        for server in self.servers:
            server.terminate()
        self.servers = []
        if self.tracker is not None:
            self.tracker.terminate()
            self.tracker = None

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
