"""The deployable artifacts, both kinds: a model build (``autosched build``: ``model.so``, or a library per
bucket) and a generation build (``autosched build --generate``: ``generate.so``), each beside ``params.bin`` and
``manifest.json``. One writer (:func:`write_artifact`) and one manifest reader (:func:`read_manifest`, by
kind) for both, loadable with TVM's runtime alone: nothing here imports a build module."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from autosched.errors import UsageError

if TYPE_CHECKING:
    from autosched.pipeline.build import ApplyReport
    from autosched.pipeline.load import Model
    from autosched.target import TargetSpec


MANIFEST = "manifest.json"
LIBRARY = "model.so"
PARAMS = "params.bin"
MANIFEST_VERSION = 1  # what export_artifact, export_bucketed and the generation build write
MODEL_FORMAT = "autosched-model"  # the format of `build`'s manifest
GENERATION_FORMAT = "autosched-generator"  # the format of `build --generate`'s manifest
GENERATION_LIBRARY = "generate.so"


def write_artifact(out_dir: str | Path, libraries: dict, params: dict, manifest: dict) -> Path:
    """Write an artifact of either kind: ``params`` ({name: TVM tensor}) to ``params.bin``, each executable of
    ``libraries`` ({file name: executable}) and then ``manifest.json`` (last: a folder with a manifest is
    whole). The folder is created."""
    import tvm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / PARAMS).write_bytes(tvm.runtime.save_param_dict(params))
    for name, executable in libraries.items():
        executable.export_library(str(out / name))
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return out


def export_artifact(out_dir: str | Path, executable, params: list, model: Model, target: TargetSpec,
                    report: ApplyReport, db_path: str | None) -> Path:
    """Write ``model.so``, ``params.bin`` and ``manifest.json`` to ``out_dir``."""
    manifest = _manifest(model, target, db_path)
    tensors = _named(params)
    manifest.update(param_order=list(tensors), library=LIBRARY, **kernel_sources(report))
    return write_artifact(out_dir, {LIBRARY: executable}, tensors, manifest)


def export_bucketed(out_dir: str | Path, executables: dict, params: dict, model: Model, target: TargetSpec,
                    reports: dict, axes: dict, db_path: str | None) -> Path:
    """A build of several buckets, (batch, tokens) pairs: one library per bucket (``model-t128.so``,
    ``model-b4.so``, ``model-b4-t128.so``), one parameter file holding each distinct tensor once
    (``param_order`` per bucket), and a manifest saying which axis of each input and output is the
    batch and the sequence. ``axes``: {"batch" and/or "tokens": PaddedAxes}, the axes that vary."""
    from autosched.buckets import bucket_key

    manifest = _manifest(model, target, db_path)
    buckets = sorted(executables, key=lambda b: (b[0] or 0, b[1] or 0))
    # Each tensor once: build_buckets made a tensor shared by several buckets one object.
    distinct = list({id(t): t for bucket in params.values() for t in bucket}.values())
    tensors = _named(distinct)
    names = dict(zip(map(id, distinct), tensors))
    manifest["param_order"] = {bucket_key(b): [names[id(t)] for t in params[b]] for b in buckets}
    for axis, found in axes.items():
        for spec, index in zip(manifest["inputs"], found.inputs):
            if index is not None:
                spec["shape"][index] = axis
        manifest["model_kwargs"].pop(axis, None)
        manifest[f"{'token' if axis == 'tokens' else axis}_axes"] = {"inputs": found.inputs, "outputs": found.outputs}
    # Lengths alone: the buckets as lengths, as such builds have always written them.
    listed = [b[1] for b in buckets] if "batch" not in axes else [list(b) for b in buckets]
    manifest.update(buckets=listed, libraries={bucket_key(b): _library(b) for b in buckets},
                    kernels_per_bucket={bucket_key(b): kernel_sources(reports[b]) for b in buckets})
    return write_artifact(out_dir, {_library(b): executables[b] for b in buckets}, tensors, manifest)


def _library(bucket) -> str:
    from autosched.buckets import bucket_key

    key = bucket_key(bucket)
    return f"model-{key if key.startswith('b') else 't' + key}.so"


def kernel_sources(report: ApplyReport) -> dict:
    """The manifest's record of where each kernel's schedule came from: tuned, transferred or default."""
    return {"tuned_kernels": report.tuned, "transferred_kernels": report.transferred,
            "default_kernels": report.default, "build_time_kernels": report.build_time,
            "records_slower_than_default": report.slower_than_default}


def _named(tensors: list) -> dict:
    """``tensors`` named as ``params.bin`` holds them: ``p0``, ``p1``, ..."""
    return {f"p{i}": t for i, t in enumerate(tensors)}


def _manifest(model: Model, target: TargetSpec, db_path: str | None) -> dict:
    """The manifest's fields every model build has."""
    import tvm

    from autosched import __version__

    return {
        "format": MODEL_FORMAT, "version": MANIFEST_VERSION, "model": model.spec, "model_kwargs": dict(model.kwargs),
        "autosched_version": __version__,
        "tvm_version": tvm.__version__, "target": target.to_json(), "created_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "params": PARAMS, "inputs": model.input_specs(), "weights_sha256": model.weights_digest(), "database": db_path,
    }


def read_manifest(out_dir: str | Path, kind: str = "model") -> dict:
    """The manifest of an artifact of ``kind`` (``model``: ``autosched build``; ``generation``: ``autosched build
    --generate``), checked: it parses, is of that kind and a version this autosched reads, has the fields a
    load needs, and the files it names are there (a damaged artifact is named in one line, not met later as
    a TVM or KeyError)."""
    generation = kind == "generation"
    build = "`autosched build MODEL --generate`" if generation else "`autosched build`"
    rebuild = f"rebuild it with {build}"
    manifest_path = Path(out_dir) / MANIFEST
    if Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise UsageError(f"{out_dir} is a file, not an artifact: give the folder {build[:-1]} -o DIR` wrote")
    if not Path(out_dir).is_dir():
        raise UsageError(f"no folder {out_dir} (so no {MANIFEST}): give the folder {build[:-1]} -o DIR` wrote")
    if not manifest_path.exists():
        raise UsageError(f"{out_dir} is not an autosched build (no {MANIFEST}): run {build[:-1]} -o {out_dir}` first")
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as exc:
        raise UsageError(f"{manifest_path} is not valid JSON ({exc.msg}, line {exc.lineno}): {rebuild}") from None
    except (UnicodeDecodeError, OSError) as exc:
        raise UsageError(f"{manifest_path} cannot be read ({exc}): {rebuild}") from None
    if not isinstance(manifest, dict):
        raise UsageError(f"{manifest_path} is not an autosched manifest (not a JSON object): {rebuild}")
    if generation and manifest.get("format") != GENERATION_FORMAT:
        raise UsageError(f"{out_dir} was built without --generate: rebuild it with {build}")
    if not generation and manifest.get("format") == GENERATION_FORMAT:
        raise UsageError(f"{out_dir} is a generation artifact (built with --generate): generate from it with "
                         f"`autosched generate {out_dir} --prompt-ids 1,2,3` or autosched.Generator")
    check_manifest_version(manifest, manifest_path)
    if generation:
        need = ["target", "decoder", "library", "params", "param_order", "max_seq_len", "max_batch", "page_size"]
    else:
        need = ["model", "target", "inputs", "params", "param_order"] + (
            ["libraries", "kernels_per_bucket"] if "buckets" in manifest else ["library", "tuned_kernels", "default_kernels"])
    missing = [key for key in need if key not in manifest]
    if missing:
        raise UsageError(f"{manifest_path} lacks {', '.join(missing)}: {rebuild}")
    libraries = list(manifest["libraries"].values()) if "buckets" in manifest else [manifest["library"]]
    for name in [*libraries, manifest["params"]]:
        if not (Path(out_dir) / name).is_file():
            raise UsageError(f"{Path(out_dir) / name} is missing (named by {manifest_path}): {rebuild}")
    return manifest


def check_manifest_version(manifest: dict, manifest_path: Path) -> None:
    """A manifest of a version this autosched does not read is refused in one line (an older manifest has no
    version: 1)."""
    version = manifest.get("version", MANIFEST_VERSION)
    if version != MANIFEST_VERSION:
        by = f" (autosched {manifest['autosched_version']} wrote it)" if manifest.get("autosched_version") else ""
        raise UsageError(f"{manifest_path} is of manifest version {version!r}{by} and this autosched reads version "
                         f"{MANIFEST_VERSION}: rebuild the artifact with this autosched, or use the one that built it")


def load_library(path: Path, rebuild: str = "rebuild it with `autosched build`"):
    """A compiled library of an artifact; one that TVM cannot load (empty, damaged) is a UsageError naming it
    and the reason."""
    import tvm

    try:
        return tvm.runtime.load_module(str(path))
    except Exception as exc:  # noqa: BLE001 - TVM raises its own error types for a damaged file
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
        raise UsageError(f"{path} cannot be loaded ({reason}): {rebuild}") from None



def load_params(path: Path, rebuild: str = "rebuild it with `autosched build`") -> dict:
    """Every tensor of a parameter file, by name (on the host); a damaged file is a UsageError naming it."""
    import tvm

    try:
        return tvm.runtime.load_param_dict(path.read_bytes())
    except Exception as exc:  # noqa: BLE001 - TVM's error for a damaged parameter file
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
        raise UsageError(f"{path} cannot be read as parameters ({reason}): {rebuild}") from None


def _saved_params(out: Path, manifest: dict, device) -> dict:
    """Every tensor of ``params.bin``, by name, on ``device``."""
    saved = load_params(out / manifest["params"])
    return {name: t.copyto(device) for name, t in saved.items()}


def artifact_device(manifest: dict, path: str | Path):
    """The device an artifact's kernels run on; a DeviceError in one line where this machine has none (a
    build for ``cuda:sm_90`` made on a machine without a GPU, say)."""
    import tvm

    from autosched.errors import DeviceError
    from autosched.target import KIND_FACTS, use_all_cpu_threads

    target = manifest["target"]
    if target["kind"] == "llvm":
        use_all_cpu_threads()  # as the kernels were tuned and timed
    device = tvm.device(KIND_FACTS[target["kind"]].device, 0)
    if not device.exist:
        raise DeviceError(f"{path} was built for {target['kind']}:{target['arch']} and this machine has no such "
                          f"device: run it on a machine with one, or build it again with --target llvm")
    return device


def load_generation_artifact(out_dir: str | Path):
    """(executable, params on the device in ``param_order``, manifest, device) of a ``build --generate``
    artifact, using TVM's runtime only."""
    out, manifest = Path(out_dir), read_manifest(out_dir, "generation")
    rebuild = "rebuild the artifact with `autosched build MODEL --generate`"
    device = artifact_device(manifest, out)
    executable = load_library(out / manifest["library"], rebuild)
    saved = load_params(out / manifest["params"], rebuild)
    missing = [name for name in manifest["param_order"] if name not in saved]
    if missing:
        raise UsageError(f"{out / manifest['params']} lacks {len(missing)} of the {len(manifest['param_order'])} "
                         f"parameters {MANIFEST} names (a truncated file?): {rebuild}")
    return executable, [saved[name].copyto(device) for name in manifest["param_order"]], manifest, device


def load_artifact(out_dir: str | Path):
    """(VirtualMachine, params, manifest) of an exported artifact, using TVM's runtime only. A
    ``--tokens dynamic`` build is loaded by :class:`BucketedModel` instead."""
    from tvm import relax

    out, manifest = Path(out_dir), read_manifest(out_dir)
    if "buckets" in manifest:
        raise UsageError(f"{out} is a --tokens dynamic build: load it with autosched.pipeline.BucketedModel")
    device = artifact_device(manifest, out)
    vm = relax.VirtualMachine(load_library(out / manifest["library"]), device)
    saved = _saved_params(out, manifest, device)
    return vm, [saved[name] for name in manifest["param_order"]], manifest


class BucketedModel:
    """A ``--tokens dynamic`` and/or ``--batch dynamic`` build, with TVM's runtime and numpy only:
    ``model(*inputs)`` pads each input along its sequence and batch axes to the smallest bucket that
    holds it (token ids with the lowest id of their range, other inputs with zeros), runs that bucket's
    module and cuts the outputs back. Exact for the models the build accepts (causal, and sequences of
    a batch independent)."""

    def __init__(self, out_dir: str | Path):
        self.path, self.manifest = Path(out_dir), read_manifest(out_dir)
        if "buckets" not in self.manifest:
            raise UsageError(f"{out_dir} was built for one shape: load it with autosched.pipeline.load_artifact")
        listed = self.manifest["buckets"]
        # (batch, tokens) pairs; a build of lengths alone lists lengths
        self.buckets: list[tuple] = [tuple(b) if isinstance(b, list) else (None, b) for b in listed]
        self.axes = {axis: self.manifest[key] for axis, key in (("batch", "batch_axes"), ("tokens", "token_axes"))
                     if key in self.manifest}
        self.device = artifact_device(self.manifest, self.path)
        self._tensors = _saved_params(self.path, self.manifest, self.device)  # once, however many buckets take each
        self._vms: dict[tuple, object] = {}

    def key(self, bucket: tuple) -> str:
        """The bucket's name in the manifest."""
        from autosched.buckets import bucket_key

        return bucket_key(bucket)

    def params(self, bucket: tuple) -> list:
        """The parameters the bucket's ``main`` takes after its inputs."""
        return [self._tensors[name] for name in self.manifest["param_order"][self.key(bucket)]]

    def bucket(self, tokens: int | None = None, batch: int | None = None) -> tuple:
        """The bucket, a (batch, tokens) pair, for inputs of ``tokens`` tokens and ``batch`` sequences
        (None: the largest bucket along that axis)."""
        from .buckets import bucket_for

        chosen = []
        for index, (axis, size) in enumerate((("batch", batch), ("tokens", tokens))):
            sizes = sorted({b[index] for b in self.buckets if b[index] is not None})
            if not sizes:
                chosen.append(None)
            else:
                chosen.append(sizes[-1] if size is None else bucket_for(sizes, size, axis))
        return tuple(chosen)

    def vm(self, bucket: tuple):
        """The virtual machine of one bucket, loaded on first use."""
        from tvm import relax

        if bucket not in self._vms:
            library = self.path / self.manifest["libraries"][self.key(bucket)]
            self._vms[bucket] = relax.VirtualMachine(load_library(library), self.device)
        return self._vms[bucket]

    def sizes_of(self, inputs) -> tuple:
        """(batch, tokens) of ``inputs``, None along an axis the build does not vary."""
        def size(axis):
            if axis not in self.axes:
                return None
            return next(x.shape[a] for x, a in zip(inputs, self.axes[axis]["inputs"]) if a is not None)

        return size("batch"), size("tokens")

    def padded(self, inputs, bucket: tuple) -> list:
        """The inputs (numpy arrays) padded to ``bucket``, as TVM tensors on the model's device."""
        import numpy as np
        import tvm

        out = []
        for i, (x, spec) in enumerate(zip(inputs, self.manifest["inputs"])):
            x = np.asarray(x)
            widths = [(0, 0)] * x.ndim
            for axis, target in zip(("batch", "tokens"), bucket):
                index = self.axes[axis]["inputs"][i] if axis in self.axes else None
                if index is not None and x.shape[index] < target:
                    widths[index] = (0, target - x.shape[index])
            if any(w != (0, 0) for w in widths):
                x = np.pad(x, widths, constant_values=(spec.get("range") or [0])[0])
            out.append(tvm.runtime.tensor(np.ascontiguousarray(x), self.device))
        return out

    def cut(self, outputs, sizes: tuple) -> list:
        """The outputs cut back to ``sizes``, (batch, tokens), along their axes (numpy arrays)."""
        cut = []
        for i, o in enumerate(outputs):
            o = o.numpy()
            for axis, size in zip(("batch", "tokens"), sizes):
                index = self.axes[axis]["outputs"][i] if axis in self.axes else None
                if index is not None:
                    o = o.take(range(size), axis=index)
            cut.append(o)
        return cut

    def __call__(self, *inputs) -> list:
        sizes = self.sizes_of(inputs)
        bucket = self.bucket(tokens=sizes[1], batch=sizes[0])
        out = self.vm(bucket)["main"](*self.padded(inputs, bucket), *self.params(bucket))
        outputs = [out] if hasattr(out, "numpy") else [out[i] for i in range(len(out))]
        return self.cut(outputs, sizes)
