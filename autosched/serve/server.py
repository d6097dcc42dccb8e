"""uvicorn's server for :mod:`.app`, draining on SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
import threading

import uvicorn


def listen(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A socket bound to ``host:port`` and listening (an OSError where that address cannot be had), made before
    the model loads and before uvicorn starts, whose own failure to bind is a log line and an exit."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose first SIGTERM or SIGINT drains: new requests get 503 and the running ones
    have ``drain_timeout`` seconds to finish; then it exits. A second signal exits at once."""

    def __init__(self, app, host: str, port: int, engine, drain_timeout: float, name: str, log):
        super().__init__(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                        timeout_graceful_shutdown=5, lifespan="off"))
        self.engine, self.drain_timeout, self.name, self.log = engine, drain_timeout, name, log
        self._loop = None
        self._draining = False

    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn's own re-raises the signal after shutting down (the process then dies of it): a drained
        # server exits 0 instead.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig, frame) -> None:
        if self._draining or self._loop is None:
            self.should_exit = self.force_exit = True
            return
        self._draining = True
        self.engine.draining = True
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        now = self.engine.stats()
        self.log.log(f"draining: {now.running} running and {now.waiting} waiting requests get up to "
                     f"{self.drain_timeout:g} s to finish; new requests get 503")
        if not await self.engine.drain(self.drain_timeout):
            self.log.log("drain timeout reached: the requests still running end with an error")
            await asyncio.get_running_loop().run_in_executor(None, self.engine.stop)
        self.should_exit = True

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        host, port = self.servers[0].sockets[0].getsockname()[:2]
        self.log.log(f"serving {self.name} at http://{host}:{port}/v1 (OpenAI API; Ctrl-C or SIGTERM drains and exits)")
        sys.stderr.flush()
