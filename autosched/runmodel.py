"""``autosched run``: load a built model with TVM's runtime, run it on random inputs, compare the output
with the PyTorch model it came from, and time it."""

from __future__ import annotations

import statistics
from typing import Any

# ||tvm - torch|| / ||torch|| accepted for a whole model, by dtype: many kernels' rounding adds up.
MODEL_TOLERANCE = {"float32": 1e-3, "float16": 2e-2, "bfloat16": 6e-2}


def run_artifact(path: str, repeat: int = 20, check: bool = True) -> dict[str, Any]:
    import torch
    import tvm

    from autosched.measure._worker import relative_error

    from .pipeline import load_artifact, load_model
    from .target import KIND_FACTS

    vm, params, manifest = load_artifact(path)
    torch_device = KIND_FACTS[manifest["target"]["kind"]].device
    device = tvm.device(torch_device, 0)
    gen = torch.Generator().manual_seed(0)
    inputs = [random_input(spec, gen).to(torch_device) for spec in manifest["inputs"]]
    args = [tvm.runtime.from_dlpack(t) for t in inputs] + params
    out = vm["main"](*args)
    out = out[0] if not hasattr(out, "numpy") else out
    result: dict[str, Any] = {"model": manifest["model"], "target": f"{manifest['target']['kind']}:{manifest['target']['arch']}",
                              "tuned_kernels": len(manifest["tuned_kernels"]),
                              "default_kernels": len(manifest["default_kernels"])}
    timer = vm.time_evaluator("main", device, number=1, repeat=repeat, min_repeat_ms=0)
    times = list(timer(*args).results)
    result["latency_ms"] = statistics.median(times) * 1e3
    result["latency_min_ms"] = min(times) * 1e3
    if check:
        kwargs = dict(manifest.get("model_kwargs", {}))
        if "dtype" in kwargs:
            kwargs["dtype"] = getattr(torch, kwargs["dtype"])
        for key in ("batch", "tokens"):
            if key in kwargs:
                kwargs[key] = int(kwargs[key])
        model = load_model(manifest["model"], **kwargs)
        if not _same_weights(model, manifest, params):
            result["matches_torch"] = None
            result["note"] = "the model factory gave other weights than the artifact's; no comparison"
            return result
        with torch.no_grad():
            ref = model.module.to(torch_device)(*inputs)
        got = torch.from_dlpack(out)
        err = relative_error(got.to(ref.device), ref.double())
        dtype = str(ref.dtype).replace("torch.", "")
        result["rel_error_vs_torch"] = err
        result["matches_torch"] = err <= MODEL_TOLERANCE.get(dtype, 1e-3)
    return result


def _same_weights(model, manifest: dict[str, Any], params: list) -> bool:
    """Whether the factory gave the weights the artifact was built from: by the manifest's digest, or
    for an older manifest without one, by the first parameter where its size agrees."""
    import torch

    if "weights_sha256" in manifest:
        return model.weights_digest() == manifest["weights_sha256"]
    weights = list(model.module.parameters())
    first = torch.from_dlpack(params[0]).cpu() if params else None
    if first is None or not weights or weights[0].numel() != first.numel():
        return first is None or not weights
    return torch.equal(weights[0].detach().cpu().reshape(first.shape), first)


def random_input(spec: dict[str, Any], gen):
    """A random tensor that fits an input of the manifest: normal values for a floating-point input,
    integers drawn uniformly from its ``range`` [low, high) for an integer one (token ids within the
    vocabulary; [0, 2) when an older manifest gives no range)."""
    import torch

    dtype = getattr(torch, spec["dtype"])
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(spec["shape"], generator=gen).to(dtype)
    low, high = spec.get("range") or (0, 2)
    if dtype == torch.bool:
        return torch.randint(0, 2, spec["shape"], generator=gen).bool()
    return torch.randint(int(low), int(high), spec["shape"], generator=gen, dtype=dtype)
