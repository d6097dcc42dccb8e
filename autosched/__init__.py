"""autosched: schedule search for the operators of large language models, on Apache TVM.

Heavy dependencies (TVM, torch, xgboost) are imported lazily, so ``autosched --help`` is instant.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
