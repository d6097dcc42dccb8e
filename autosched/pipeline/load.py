"""Loading a model: an example by name, or a factory named by module or file."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from autosched.errors import UsageError

if TYPE_CHECKING:
    import torch


@dataclass
class Model:
    """A PyTorch model and example inputs; ``spec`` is how the user named it."""

    spec: str
    module: torch.nn.Module
    inputs: tuple[torch.Tensor, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)  # what the factory was given (JSON-able)


def _example_models() -> dict[str, Callable]:
    from autosched.examples import MODELS

    return MODELS


def load_model(spec: str, **kwargs: Any) -> Model:
    """A model named in ``examples/`` (e.g. ``tiny-llama``) or given as ``module:factory`` or
    ``path/to/file.py:factory``; the factory returns ``(model, example_inputs)``."""
    examples = _example_models()
    if spec in examples:
        factory = examples[spec]
    elif ":" in spec:
        where, _, name = spec.rpartition(":")
        try:
            if where.endswith(".py"):
                loaded = importlib.util.spec_from_file_location(Path(where).stem, where)
                if loaded is None:
                    raise FileNotFoundError(where)
                module = importlib.util.module_from_spec(loaded)
                loaded.loader.exec_module(module)
            else:
                module = importlib.import_module(where)
            factory = getattr(module, name)
        except (ImportError, FileNotFoundError, AttributeError) as exc:
            raise UsageError(f"cannot load model factory '{spec}': {exc}") from None
    else:
        names = ", ".join(sorted(examples)) or "none found"
        raise UsageError(f"unknown model '{spec}': name an example ({names}) or give module:factory")
    given = {k: v for k, v in kwargs.items() if v is not None}
    module, inputs = factory(**given)
    return Model(spec, module.eval(), tuple(inputs), {k: str(v).replace("torch.", "") for k, v in given.items()})
