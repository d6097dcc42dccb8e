"""A model folder's safetensors weights, read one tensor at a time as the build maps them: a build holds its own
parameters and one checkpoint tensor beyond them, not a second copy of the model (transformers' loading holds the
whole model first). The tensors of the folder's ``model.safetensors``, or of the shards its
``model.safetensors.index.json`` lists (as ``save_pretrained`` writes a sharded model); other ``*.safetensors`` in
the folder (a repository's ``consolidated.safetensors`` of another format) are not read."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

# Deferred imports: torch, safetensors (imported where used: `autosched --help` stays fast).


class CheckpointTensors(Mapping):
    """The checkpoint's tensors by name, each read from its file when asked for; floating-point ones converted to
    ``dtype`` (a torch dtype; None: as stored)."""

    def __init__(self, files: dict[str, Path], dtype=None):
        self._files, self.dtype = files, dtype

    @classmethod
    def open(cls, folder: str | Path, dtype=None) -> CheckpointTensors | None:
        """The folder's checkpoint, or None where it has no safetensors checkpoint (a ``pytorch_model.bin``)."""
        from safetensors import safe_open

        folder = Path(folder)
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return cls({name: folder / file for name, file in weight_map.items()}, dtype)
        single = folder / "model.safetensors"
        if not single.is_file():
            return None
        with safe_open(str(single), "pt") as f:
            return cls(dict.fromkeys(f.keys(), single), dtype)

    def __getitem__(self, name: str):
        from safetensors import safe_open

        with safe_open(str(self._files[name]), "pt") as f:
            tensor = f.get_tensor(name)
        return tensor.to(self.dtype) if self.dtype is not None and tensor.is_floating_point() else tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)
