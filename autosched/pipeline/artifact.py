"""The deployable artifact: the compiled library, the parameters and a manifest, loadable with TVM's
runtime alone."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from autosched.errors import UsageError

if TYPE_CHECKING:
    from autosched.target import TargetSpec

    from .build import ApplyReport
    from .load import Model


MANIFEST = "manifest.json"
LIBRARY = "model.so"
PARAMS = "params.bin"


def export_artifact(out_dir: str | Path, executable, params: list, model: Model, target: TargetSpec,
                    report: ApplyReport, db_path: str | None) -> Path:
    """Write ``model.so``, ``params.bin`` and ``manifest.json`` to ``out_dir``."""
    out, manifest = _export_common(out_dir, model, target, db_path)
    manifest["param_order"] = _write_params(out, params)
    executable.export_library(str(out / LIBRARY))
    manifest.update(library=LIBRARY, **_kernels(report))
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return out


def export_bucketed(out_dir: str | Path, executables: dict, params: dict, model: Model, target: TargetSpec,
                    reports: dict, token_axes, db_path: str | None) -> Path:
    """A ``--tokens dynamic`` build: one library per bucket length (``model-t{n}.so``), one parameter
    file holding each distinct tensor once (``param_order`` per bucket), and a manifest saying which
    axis of each input and output is the sequence."""
    out, manifest = _export_common(out_dir, model, target, db_path)
    # Each tensor once: build_lengths made a tensor shared by several buckets one object.
    distinct = list({id(t): t for bucket in params.values() for t in bucket}.values())
    names = dict(zip(map(id, distinct), _write_params(out, distinct)))
    manifest["param_order"] = {str(n): [names[id(t)] for t in bucket] for n, bucket in sorted(params.items())}
    for length, executable in executables.items():
        executable.export_library(str(out / f"model-t{length}.so"))
    for spec, axis in zip(manifest["inputs"], token_axes.inputs):
        if axis is not None:
            spec["shape"][axis] = "tokens"
    manifest["model_kwargs"].pop("tokens", None)
    manifest.update(buckets=sorted(executables), libraries={str(n): f"model-t{n}.so" for n in sorted(executables)},
                    token_axes={"inputs": token_axes.inputs, "outputs": token_axes.outputs},
                    kernels_per_bucket={str(n): _kernels(r) for n, r in sorted(reports.items())})
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return out


def _kernels(report: ApplyReport) -> dict:
    return {"tuned_kernels": report.tuned, "transferred_kernels": report.transferred,
            "default_kernels": report.default, "build_time_kernels": report.build_time}


def _write_params(out: Path, tensors: list) -> list[str]:
    """Write ``tensors`` to ``params.bin`` as ``p0``, ``p1``, ...; returns the names."""
    import tvm

    names = [f"p{i}" for i in range(len(tensors))]
    (out / PARAMS).write_bytes(tvm.runtime.save_param_dict(dict(zip(names, tensors))))
    return names


def _export_common(out_dir: str | Path, model: Model, target: TargetSpec, db_path: str | None):
    """The output folder, created, and the manifest's fields every build has."""
    import tvm

    from autosched import __version__

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    manifest = {
        "format": "autosched-model", "version": 1, "model": model.spec, "model_kwargs": dict(model.kwargs),
        "autosched_version": __version__,
        "tvm_version": tvm.__version__, "target": target.to_json(), "created_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "params": PARAMS, "inputs": model.input_specs(), "weights_sha256": model.weights_digest(), "database": db_path,
    }
    return out, manifest


def read_manifest(out_dir: str | Path) -> dict:
    manifest_path = Path(out_dir) / MANIFEST
    if not manifest_path.exists():
        raise UsageError(f"{out_dir} is not an autosched build (no {MANIFEST}): run `autosched build` first")
    return json.loads(manifest_path.read_text())


def _saved_params(out: Path, manifest: dict, device) -> dict:
    """Every tensor of ``params.bin``, by name, on ``device``."""
    import tvm

    saved = tvm.runtime.load_param_dict((out / manifest["params"]).read_bytes())
    return {name: t.copyto(device) for name, t in saved.items()}


def _device(manifest: dict):
    import tvm

    from autosched.target import KIND_FACTS

    return tvm.device(KIND_FACTS[manifest["target"]["kind"]].device, 0)


def load_artifact(out_dir: str | Path):
    """(VirtualMachine, params, manifest) of an exported artifact, using TVM's runtime only. A
    ``--tokens dynamic`` build is loaded by :class:`BucketedModel` instead."""
    import tvm
    from tvm import relax

    out, manifest = Path(out_dir), read_manifest(out_dir)
    if "buckets" in manifest:
        raise UsageError(f"{out} is a --tokens dynamic build: load it with autosched.pipeline.BucketedModel")
    device = _device(manifest)
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(out / manifest["library"])), device)
    saved = _saved_params(out, manifest, device)
    return vm, [saved[name] for name in manifest["param_order"]], manifest


class BucketedModel:
    """A ``--tokens dynamic`` build, with TVM's runtime and numpy only: ``model(*inputs)`` pads each input
    along its sequence axis to the smallest bucket that holds it (token ids with the lowest id of their
    range, other inputs with zeros), runs that bucket's module and cuts the outputs back to the length
    given. Exact for the causal models the build accepts (no position sees the ones after it)."""

    def __init__(self, out_dir: str | Path):
        self.path, self.manifest = Path(out_dir), read_manifest(out_dir)
        if "buckets" not in self.manifest:
            raise UsageError(f"{out_dir} was built for one length: load it with autosched.pipeline.load_artifact")
        self.buckets: list[int] = self.manifest["buckets"]
        self.device = _device(self.manifest)
        self._tensors = _saved_params(self.path, self.manifest, self.device)  # once, however many buckets take each
        self._vms: dict[int, object] = {}

    def params(self, bucket: int) -> list:
        """The parameters the bucket's ``main`` takes after its inputs."""
        return [self._tensors[name] for name in self.manifest["param_order"][str(bucket)]]

    def bucket(self, tokens: int) -> int:
        from .lengths import bucket_for

        return bucket_for(self.buckets, tokens)

    def vm(self, bucket: int):
        """The virtual machine of one bucket, loaded on first use."""
        import tvm
        from tvm import relax

        if bucket not in self._vms:
            library = self.path / self.manifest["libraries"][str(bucket)]
            self._vms[bucket] = relax.VirtualMachine(tvm.runtime.load_module(str(library)), self.device)
        return self._vms[bucket]

    def tokens_of(self, inputs) -> int:
        axes = self.manifest["token_axes"]["inputs"]
        return next(x.shape[axis] for x, axis in zip(inputs, axes) if axis is not None)

    def padded(self, inputs, bucket: int) -> list:
        """The inputs (numpy arrays) padded to ``bucket`` tokens, as TVM tensors on the model's device."""
        import numpy as np
        import tvm

        out = []
        for x, axis, spec in zip(inputs, self.manifest["token_axes"]["inputs"], self.manifest["inputs"]):
            x = np.asarray(x)
            if axis is not None and x.shape[axis] < bucket:
                widths = [(0, 0)] * x.ndim
                widths[axis] = (0, bucket - x.shape[axis])
                x = np.pad(x, widths, constant_values=(spec.get("range") or [0])[0])
            out.append(tvm.runtime.tensor(np.ascontiguousarray(x), self.device))
        return out

    def cut(self, outputs, tokens: int) -> list:
        """The outputs cut back to ``tokens`` along their sequence axes (numpy arrays)."""
        return [o.numpy() if axis is None else o.numpy().take(range(tokens), axis=axis)
                for o, axis in zip(outputs, self.manifest["token_axes"]["outputs"])]

    def __call__(self, *inputs) -> list:
        tokens = self.tokens_of(inputs)
        bucket = self.bucket(tokens)
        out = self.vm(bucket)["main"](*self.padded(inputs, bucket), *self.params(bucket))
        outputs = [out] if hasattr(out, "numpy") else [out[i] for i in range(len(out))]
        return self.cut(outputs, tokens)
