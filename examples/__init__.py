"""Example models for ``autosched tune-model`` and ``build``, by name (``autosched.examples.MODELS``).

Installed with autosched as ``autosched.examples``; a model of your own is named by
``path/to/file.py:factory`` or ``module:factory`` instead.
"""

from __future__ import annotations

from .hf import MODELS as HF_MODELS
from .llama import MODELS as LLAMA_MODELS

MODELS = {**LLAMA_MODELS, **HF_MODELS}

__all__ = ["MODELS"]
