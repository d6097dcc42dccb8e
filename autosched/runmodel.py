"""``autosched run``: load a built model with TVM's runtime, run it on random inputs, compare the output
with the PyTorch model it came from, and time it."""

from __future__ import annotations

import statistics
import time
from typing import Any

from .correctness import relative_error
from .errors import UsageError
from .pipeline import BucketedModel, load_artifact, load_model, read_manifest
from .target import KIND_FACTS
from .tvm_adapter import gpu_sleep

# Deferred imports: tvm, torch (imported where used: `autosched --help` stays fast).

# ||tvm - torch|| / ||torch|| accepted for a whole model, by dtype: many kernels' rounding adds up.
MODEL_TOLERANCE = {"float32": 1e-3, "float16": 2e-2, "bfloat16": 6e-2}


def run_artifact(path: str, repeat: int = 20, check: bool = True, tokens: int | None = None,
                 batch: int | None = None, profile: bool = False) -> dict[str, Any]:
    """Run, time and check an artifact; ``tokens`` and ``batch`` pick the shape for a ``--tokens dynamic``
    or ``--batch dynamic`` build (default: its largest bucket); ``profile`` adds each kernel's time
    (:func:`kernel_times`) under ``kernels``."""
    if repeat < 1:
        raise UsageError(f"--repeat must be at least 1 (got {repeat})")
    for option, size in (("--tokens", tokens), ("--batch", batch)):
        if size is not None and size < 1:
            raise UsageError(f"{option} must be at least 1 (got {size})")
    manifest = read_manifest(path)  # before TVM and torch are imported: a wrong path is said at once
    import torch
    import tvm

    torch_device = KIND_FACTS[manifest["target"]["kind"]].device
    device = tvm.device(torch_device, 0)
    gen = torch.Generator().manual_seed(0)
    result: dict[str, Any] = {"model": manifest["model"],
                              "target": f"{manifest['target']['kind']}:{manifest['target']['arch']}"}
    if "buckets" in manifest:
        model = BucketedModel(path)
        for axis, size in (("tokens", tokens), ("batch", batch)):
            if size is not None and axis not in model.axes:
                raise UsageError(f"{path} was built for one {'length' if axis == 'tokens' else 'batch'}; "
                                 f"--{axis} picks one of a --{axis} dynamic build")
        bucket = model.bucket(tokens=tokens, batch=batch)
        sizes = (batch or bucket[0], tokens or bucket[1])
        shape = {"batch": sizes[0], "tokens": sizes[1]}
        specs = [{**spec, "shape": [shape.get(d, d) for d in spec["shape"]]} for spec in manifest["inputs"]]
        inputs = [random_input(spec, gen) for spec in specs]
        vm, params = model.vm(bucket), model.params(bucket)
        args = model.padded([t.numpy() for t in inputs], bucket) + params
        kernels = manifest["kernels_per_bucket"][model.key(bucket)]
        if "tokens" in model.axes:
            result.update(tokens=sizes[1], bucket=bucket[1])
        if "batch" in model.axes:
            result.update(batch=sizes[0], batch_bucket=bucket[0])
        tokens = sizes[1] if "tokens" in model.axes else None
        batch = sizes[0] if "batch" in model.axes else None
    else:
        if tokens is not None or batch is not None:
            raise UsageError(f"{path} was built for one shape; --tokens and --batch pick one of a --tokens dynamic "
                             f"or --batch dynamic build")
        vm, params, _ = load_artifact(path)
        inputs = [random_input(spec, gen).to(torch_device) for spec in manifest["inputs"]]
        args = [tvm.runtime.from_dlpack(t) for t in inputs] + params
        kernels = manifest
    out = vm["main"](*args)
    out = out[0] if not hasattr(out, "numpy") else out
    if "buckets" in manifest:
        out = tvm.runtime.tensor(model.cut([out], (batch, tokens))[0])
    result.update(kernel_counts(kernels))
    timer = vm.time_evaluator("main", device, number=1, repeat=repeat, min_repeat_ms=0)
    times = list(timer(*args).results)
    result["latency_ms"] = statistics.median(times) * 1e3
    result["latency_min_ms"] = min(times) * 1e3
    if manifest["target"]["kind"] == "llvm":
        result["threads"] = tvm.get_global_func("runtime.NumThreads")()
    if profile:
        result["kernels"] = [dict(entry, schedule=schedule_of(entry["kernel"], kernels))
                             for entry in kernel_times(vm, args, device)]
    if check:
        result.update(_against_torch(manifest, params, [t.to(torch_device) for t in inputs], out,
                                     {"tokens": tokens, "batch": batch}))
        if result.get("rel_error_vs_torch") == float("inf"):  # the output holds a NaN or infinity
            result["first_nonfinite_kernel"] = first_nonfinite_kernel(vm, args, device)
    return result


def time_forward(executable, params: list, input_specs: list[dict[str, Any]], target, repeat: int = 20) -> float:
    """Median seconds of one forward pass of a compiled model (``executable``, the parameters its ``main``
    takes) on random inputs, timed as ``autosched run`` times an artifact: what tune-model reports as the
    model's latency, with every kernel the build runs (tuned, default, copies) and the VM between them."""
    import torch
    import tvm
    from tvm import relax

    device = tvm.device(target.torch_device, 0)
    gen = torch.Generator().manual_seed(0)
    inputs = [random_input(spec, gen).to(target.torch_device) for spec in input_specs]
    vm = relax.VirtualMachine(executable, device)
    args = [tvm.runtime.from_dlpack(t) for t in inputs] + list(params)
    vm["main"](*args)  # warm-up
    timer = vm.time_evaluator("main", device, number=1, repeat=repeat, min_repeat_ms=0)
    return statistics.median(timer(*args).results)


def kernel_times(vm, args: list, device, repeat: int = 5) -> list[dict[str, Any]]:
    """Where one run of ``main(*args)`` spends its time, kernel by kernel, slowest first: each kernel's
    calls, its milliseconds per run (median of ``repeat`` runs) and its share of the kernels' sum.

    On the CPU each call is timed on the host (TVM's CPU kernels return when done). On a GPU, CUDA events
    are recorded around each call on the stream the kernels run on, and a sleep kernel first keeps the
    GPU busy while the host queues the run, so that each pair of events brackets its kernel alone, not
    the host's launch overhead (the kernels' sum is then close to the run's GPU time)."""
    gpu = device.dlpack_device_type() != 1  # kDLCPU
    if gpu:
        import torch

    def stamp():
        if not gpu:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def elapsed_ms(start, end) -> float:
        return start.elapsed_time(end) if gpu else (end - start) * 1e3

    pairs: list[tuple[str, Any, Any]] = []
    opened: list[Any] = []

    def instrument(func, symbol, before, ret, *call_args):
        if symbol.startswith("vm.builtin."):
            return 0
        if before:
            opened.append(stamp())
        else:
            pairs.append((symbol, opened.pop(), stamp()))
        return 0

    vm["main"](*args)  # warm-up: memory pools filled, modules loaded
    device.sync()
    runs: list[dict[str, list[float]]] = []
    vm.set_instrument(instrument)
    try:
        for _ in range(repeat):
            pairs.clear()
            if gpu:
                gpu_sleep(50_000_000)  # long enough for the host to queue the whole run behind it
            vm["main"](*args)
            device.sync()
            if gpu:
                torch.cuda.synchronize()
            per_kernel: dict[str, list[float]] = {}
            for symbol, start, end in pairs:
                per_kernel.setdefault(symbol, []).append(elapsed_ms(start, end))
            runs.append(per_kernel)
    finally:
        vm.set_instrument(None)
    totals = {name: statistics.median(sum(run[name]) for run in runs) for name in runs[0]}
    whole = sum(totals.values()) or 1.0
    return [{"kernel": name, "calls": len(runs[0][name]), "ms": ms, "share": ms / whole}
            for name, ms in sorted(totals.items(), key=lambda item: -item[1])]


def kernel_counts(kernels: dict[str, Any]) -> dict[str, int]:
    """How many of the manifest's kernels have each origin, counted as ``--profile`` labels them
    (:func:`schedule_of`): a record found by search (tuned), a record of the space's default point (measured,
    never searched), the nearest tuned shape's (transferred), no record (default)."""
    tuned = kernels.get("tuned_kernels", {})
    default_point = sum(1 for info in tuned.values() if isinstance(info, dict) and info.get("searched") is False)
    return {"tuned_kernels": len(tuned) - default_point, "default_point_kernels": default_point,
            "transferred_kernels": len(kernels.get("transferred_kernels", {})),
            "default_kernels": len(kernels.get("default_kernels", []))}


def schedule_of(kernel: str, kernels: dict[str, Any]) -> str:
    """Where a kernel's schedule came from, by the artifact's manifest: its record's space, the nearest
    tuned shape, or the default (a template's default point or TVM's dlight rules)."""
    if kernel in kernels.get("tuned_kernels", {}):
        info = kernels["tuned_kernels"][kernel]
        if info.get("searched") is False:  # its record is the space's default point: measured, never searched
            return f"default point, measured ({info.get('space', '?')})"
        return f"tuned ({info.get('space', '?')})"
    if kernel in kernels.get("transferred_kernels", {}):
        return "transferred"
    if kernel in kernels.get("default_kernels", []):
        return "default"
    return "-"


def first_nonfinite_kernel(vm, args: list, device) -> str | None:
    """The first call of ``main(*args)`` whose inputs are finite and whose output is not, as
    "name (call N)": where a NaN or infinity in the model's output came from. Every call is synchronised
    and checked, so this runs once, after a failed check. A call's output is its return value, or its
    last tensor argument for a kernel writing into its arguments (allocations are not calls here); None
    if no call matches."""
    import torch
    import tvm

    calls, found = [0], []

    def finite(tensor) -> bool:
        value = torch.from_dlpack(tensor)
        return not value.is_floating_point() or bool(torch.isfinite(value).all())

    def instrument(func, symbol, before, ret, *call_args):
        if before or found or symbol.startswith("vm.builtin.alloc"):  # new storage holds anything
            return 0
        device.sync()
        calls[0] += 1
        tensors = [a for a in call_args if isinstance(a, tvm.runtime.Tensor)]
        output = ret if isinstance(ret, tvm.runtime.Tensor) else (tensors.pop() if tensors else None)
        if output is not None and not finite(output) and all(finite(t) for t in tensors):
            found.append(f"{symbol} (call {calls[0]})")
        return 0

    vm.set_instrument(instrument)
    try:
        vm["main"](*args)
        device.sync()
    finally:
        vm.set_instrument(None)
    return found[0] if found else None


def _against_torch(manifest: dict[str, Any], params: list, inputs: list, out, sizes: dict) -> dict[str, Any]:
    """The relative error of ``out`` against the PyTorch model the artifact came from, on ``inputs``
    (``sizes``: the batch and tokens a bucketed build ran at, where they vary)."""
    import torch

    kwargs = dict(manifest.get("model_kwargs", {}))
    if "dtype" in kwargs:
        kwargs["dtype"] = getattr(torch, kwargs["dtype"])
    for key in ("batch", "tokens"):
        if key in kwargs:
            kwargs[key] = int(kwargs[key])
    kwargs.update({k: v for k, v in sizes.items() if v is not None})
    model = load_model(manifest["model"], **kwargs)
    if not _same_weights(model, manifest, params):
        return {"matches_torch": None, "note": "the model factory gave other weights than the artifact's; no comparison"}
    with torch.no_grad():
        ref = model.module.to(inputs[0].device if inputs else "cpu")(*inputs)
    got = torch.from_dlpack(out)
    err = relative_error(got.to(ref.device), ref.double())
    dtype = str(ref.dtype).replace("torch.", "")
    return {"rel_error_vs_torch": err, "matches_torch": err <= MODEL_TOLERANCE.get(dtype, 1e-3)}


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
