"""Example models for ``autosched tune-model`` and ``build``, by name (``autosched.examples.MODELS``).

Installed with autosched as ``autosched.examples``; a model of your own is named by
``path/to/file.py:factory`` or ``module:factory`` instead.
"""

from __future__ import annotations

from .llama import MODELS

__all__ = ["MODELS"]
