"""Loading a model: an example by name, or a factory named by module or file."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from autosched.errors import UsageError

if TYPE_CHECKING:
    import torch

# Deferred imports: torch (imported where used: `autosched --help` stays fast).


@dataclass
class Model:
    """A PyTorch model and example inputs; ``spec`` is how the user named it."""

    spec: str
    module: torch.nn.Module
    inputs: tuple[torch.Tensor, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)  # what the factory was given (JSON-able)
    # Per input: [low, high) of the values it takes (token ids within the vocabulary), or None (any float).
    input_ranges: list[list[int] | None] = field(default_factory=list)

    def weights_digest(self) -> str:
        """SHA-256 of the model's parameters and buffers (names, dtypes, shapes and bytes): whether a
        factory called again gave the weights an artifact was built from."""
        import torch

        digest = hashlib.sha256()
        for name, t in self.module.state_dict(keep_vars=False).items():
            t = t.detach().cpu().contiguous()
            digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
            digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return digest.hexdigest()

    def input_specs(self) -> list[dict[str, Any]]:
        """Shape, dtype and, for integer inputs, the range of values of each input (for the manifest)."""
        specs = []
        for i, t in enumerate(self.inputs):
            spec: dict[str, Any] = {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
            if i < len(self.input_ranges) and self.input_ranges[i] is not None:
                spec["range"] = list(self.input_ranges[i])
            specs.append(spec)
        return specs


def _input_ranges(module, inputs, declared) -> list[list[int] | None]:
    """[low, high) for each integer input: as the factory declared it, else the model's vocabulary size
    (``module.config.vocab_size`` or ``module.vocab_size``), else [min(example), max(example) + 1)."""
    import torch

    vocab = getattr(getattr(module, "config", None), "vocab_size", None) or getattr(module, "vocab_size", None)
    ranges: list[list[int] | None] = []
    for i, t in enumerate(inputs):
        if declared is not None and i < len(declared) and declared[i] is not None:
            ranges.append([int(declared[i][0]), int(declared[i][1])])
        elif t.is_floating_point() or t.is_complex():
            ranges.append(None)
        elif t.dtype == torch.bool:
            ranges.append([0, 2])
        elif vocab:
            ranges.append([0, int(vocab)])
        else:
            low = min(int(t.min()), 0) if t.numel() else 0
            ranges.append([low, (int(t.max()) if t.numel() else 0) + 1])
    return ranges


def _example_models() -> dict[str, Callable]:
    from autosched.examples import MODELS

    return MODELS


def load_model(spec: str, **kwargs: Any) -> Model:
    """A model named in ``examples/`` (e.g. ``tiny-llama``) or given as ``module:factory`` or
    ``path/to/file.py:factory``; the factory returns ``(model, example_inputs)``, or
    ``(model, example_inputs, {"input_ranges": [[low, high) or None per input]})`` to declare the values
    integer inputs take (e.g. token ids below the vocabulary size; see :func:`_input_ranges`)."""
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
    made = factory(**given)
    _check_made(spec, made)
    module, inputs = made[0], tuple(made[1])
    declared = made[2].get("input_ranges") if len(made) > 2 and made[2] else None
    return Model(spec, module.eval(), inputs, {k: str(v).replace("torch.", "") for k, v in given.items()},
                 _input_ranges(module, inputs, declared))


def _check_made(spec: str, made) -> None:
    """What a factory returned is (model, example_inputs[, options]): a UsageError in one line naming what it
    returned instead (``os:getcwd`` is a callable too)."""
    import torch

    expected = ("a factory returns (model, example_inputs): a torch.nn.Module and a tuple of example input tensors "
                "(see examples/)")
    if not isinstance(made, (tuple, list)) or len(made) not in (2, 3):
        what = f"a {type(made).__name__}" + (f" of {len(made)}" if isinstance(made, (tuple, list)) else "")
        raise UsageError(f"model factory '{spec}' returned {what}: {expected}")
    if not isinstance(made[0], torch.nn.Module):
        raise UsageError(f"model factory '{spec}' returned a {type(made[0]).__name__} as its model: {expected}")
    inputs = made[1]
    if not isinstance(inputs, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise UsageError(f"model factory '{spec}' returned {type(inputs).__name__} as its example inputs: {expected}")
    if len(made) == 3 and made[2] is not None and not isinstance(made[2], dict):
        raise UsageError(f"model factory '{spec}' returned a {type(made[2]).__name__} as its options: give a dict, "
                         "e.g. {'input_ranges': [[0, vocab]]}")
