"""autosched: schedule search for the operators of large language models, on Apache TVM.

Heavy dependencies (TVM, torch, xgboost) are imported lazily, so ``autosched --help`` is instant.
"""

from __future__ import annotations

from . import _checkout, tvm_adapter

__version__ = "0.1.0"

__all__ = ["Generator", "Sampling", "__version__"]


def __getattr__(name: str):
    # autosched.Generator without importing TVM at `import autosched`.
    if name in ("Generator", "Sampling", "Completion", "GenerationError"):
        from . import generation

        return getattr(generation, name)
    raise AttributeError(f"module 'autosched' has no attribute {name!r}")

# search_spaces/, database/ and examples/ sit at the top of the repository and are installed as
# autosched.search_spaces, autosched.database and autosched.examples (setup.py's package-dir). From
# a plain checkout on PYTHONPATH, with nothing installed, the same three names come from _checkout.
_checkout.install()

# TVMScript parsing inside an import (TVM's tensor intrinsics, which dlight imports; our WMMA intrinsics)
# took seconds per hundred functions in lookups that find nothing: answered once, here, for the process.
tvm_adapter.cache_frozen_frame_lookups()
