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
    import tvm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    executable.export_library(str(out / LIBRARY))
    names = [f"p{i}" for i in range(len(params))]
    (out / PARAMS).write_bytes(tvm.runtime.save_param_dict(dict(zip(names, params))))
    from autosched import __version__

    manifest = {
        "format": "autosched-model", "version": 1, "model": model.spec, "model_kwargs": model.kwargs,
        "autosched_version": __version__,
        "tvm_version": tvm.__version__, "target": target.to_json(), "created_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "library": LIBRARY, "params": PARAMS, "param_order": names,
        "inputs": model.input_specs(), "weights_sha256": model.weights_digest(),
        "database": db_path, "tuned_kernels": report.tuned, "default_kernels": report.default,
        "build_time_kernels": report.build_time,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return out


def load_artifact(out_dir: str | Path):
    """(VirtualMachine, params, manifest) of an exported artifact, using TVM's runtime only."""
    import tvm
    from tvm import relax

    from autosched.target import KIND_FACTS

    out = Path(out_dir)
    manifest_path = out / MANIFEST
    if not manifest_path.exists():
        raise UsageError(f"{out} is not an autosched build (no {MANIFEST}): run `autosched build` first")
    manifest = json.loads(manifest_path.read_text())
    device = tvm.device(KIND_FACTS[manifest["target"]["kind"]].device, 0)
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(out / manifest["library"])), device)
    saved = tvm.runtime.load_param_dict((out / manifest["params"]).read_bytes())
    params = [saved[name].copyto(device) for name in manifest["param_order"]]
    return vm, params, manifest
