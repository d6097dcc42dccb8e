"""What a correct result is: a kernel's output against its float64 reference. The workloads' checkers, the
runner and ``autosched run`` compare by it; it sits below all of them (ARCHITECTURE.md's layers)."""

from __future__ import annotations

import math

# Deferred imports: torch (imported where used: `autosched --help` stays fast).



def relative_error(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64; infinity if out has a NaN or infinity (e.g. unwritten)."""
    import torch

    out = out.double()
    if not bool(torch.isfinite(out).all()):
        return math.inf
    denom = float(ref.norm())
    return float((out - ref).norm()) / (denom if denom > 0 else 1.0)
