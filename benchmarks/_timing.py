"""Timing shared by the benchmark scripts (run as ``python benchmarks/<script>.py``, which puts this
folder on the import path)."""

from __future__ import annotations

import statistics
from typing import Callable


def retime_interleaved(timers: dict[str, Callable[[], list[float]]], rounds: int = 7) -> dict[str, float]:
    """Median seconds of each timer's samples over ``rounds`` rounds that call every timer in turn.

    On a shared machine the memory bandwidth drifts by tens of percent over minutes; timing finished
    kernels or builds side by side, round after round, keeps that drift out of their ratios.
    """
    return {name: statistics.median(times) for name, times in interleaved_samples(timers, rounds).items()}


def interleaved_samples(timers: dict[str, Callable[[], list[float]]], rounds: int = 7) -> dict[str, list[float]]:
    """Every sample of each timer over ``rounds`` rounds that call every timer in turn."""
    samples: dict[str, list[float]] = {name: [] for name in timers}
    for _ in range(rounds):
        for name, timer in timers.items():
            samples[name] += timer()
    return samples
