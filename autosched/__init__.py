"""autosched: schedule search for the operators of large language models, on Apache TVM.

Heavy dependencies (TVM, torch, xgboost) are imported lazily, so ``autosched --help`` is instant.
"""

from __future__ import annotations

from pathlib import Path

__version__ = "0.1.0"

__all__ = ["__version__"]

# The repository keeps search_spaces/ and database/ at its top level; an installation maps them to
# autosched.search_spaces and autosched.database (pyproject.toml). Run from a plain checkout
# (PYTHONPATH=<repo>, as on the GPU machine), the same mapping comes from this search path entry.
_checkout = Path(__file__).resolve().parent.parent
if (_checkout / "search_spaces" / "__init__.py").exists() and str(_checkout) not in __path__:
    __path__.append(str(_checkout))
