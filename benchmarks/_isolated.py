"""Run one measurement in a process of its own, with a timeout: a kernel that deadlocks (a wrong mbarrier
phase, say) costs its timeout, not the whole run. The target puts one dict on the queue it is given."""

from __future__ import annotations

import multiprocessing as mp


def run_isolated(target, args: tuple, timeout: float, label: dict) -> dict:
    """``target(*args, queue)`` in a fresh process; its dict, or ``label`` with the reason it gave none."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        return {**label, "error": f"timed out after {timeout} s (deadlock?)"}
    return queue.get() if not queue.empty() else {**label, "error": f"exit code {proc.exitcode}"}
