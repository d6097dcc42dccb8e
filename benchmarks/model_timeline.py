"""Where a whole model's GPU time goes between kernels: the tuned build and torch.compile, traced by
CUPTI (torch.profiler), run after run.

``model_benchmark.py --profile`` sums each kernel's time with the host queued ahead of the GPU; the run's
latency can be larger than that sum. This script traces plain runs, back to back as the benchmark times
them, and splits each run's span into kernel time and idle gaps (naming the kernels around the largest
gaps), with memory copies and sets counted apart. It also times the tuned build with and without a sleep
kernel queued ahead of it, which tells host-bound gaps from GPU-side ones.

    python benchmarks/model_timeline.py --db model_cuda.db --config 16:512   (a database of tuned records)
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

import torch


def trace(fn, runs: int) -> list[dict]:
    """``runs`` calls of ``fn``, each traced on its own: its span, kernel time, gaps and copies (ms)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    summary = []
    for _ in range(runs):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        evs = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
        span = (evs[-1].time_range.end - evs[0].time_range.start) / 1e3
        kernels = [e for e in evs if "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
        copies = [e for e in evs if e not in kernels]
        busy = sum((e.time_range.end - e.time_range.start) for e in evs) / 1e3
        gaps = []
        for a, b in zip(evs, evs[1:]):
            gap = (b.time_range.start - a.time_range.end) / 1e3
            if gap > 0.002:
                gaps.append((gap, a.name[:50], b.name[:50]))
        gaps.sort(reverse=True)
        by_name: dict[str, float] = {}
        for e in evs:
            by_name[e.name[:60]] = by_name.get(e.name[:60], 0.0) + (e.time_range.end - e.time_range.start) / 1e3
        top = sorted(by_name.items(), key=lambda kv: -kv[1])[:16]
        summary.append({"span_ms": span, "busy_ms": busy, "idle_ms": span - busy, "events": len(evs),
                        "kernels": len(kernels), "top": [(k, round(v, 4)) for k, v in top],
                        "copies": [(c.name[:40], (c.time_range.end - c.time_range.start) / 1e3) for c in copies][:8],
                        "largest_gaps": [(round(g, 4), x, y) for g, x, y in gaps[:6]]})
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", required=True)
    parser.add_argument("--config", default="16:512")
    parser.add_argument("--model", default="llama-7b-layers")
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import tvm
    from tvm import relax

    from autosched.database.store import Database
    from autosched.pipeline import build_model, load_model
    from autosched.target import parse_target

    target = parse_target("cuda")
    batch, tokens = (int(x) for x in args.config.split(":"))
    model = load_model(args.model, batch=batch, tokens=tokens, dtype=torch.float16)
    module = copy.deepcopy(model.module).to("cuda")
    inputs = tuple(t.to("cuda") for t in model.inputs)
    db = Database(Path(args.db))
    executable, params, _ = build_model(model, target, db)
    dev = tvm.cuda(0)
    vm = relax.VirtualMachine(executable, dev)
    vm_args = [tvm.runtime.from_dlpack(t) for t in inputs] + [p.copyto(dev) for p in params]
    compiled = torch.compile(module)
    with torch.no_grad():
        compiled(*inputs)

    result = {"config": args.config}

    def tuned():
        vm["main"](*vm_args)

    # host time to queue one run while the GPU is kept busy ahead of it
    import time

    host = []
    for _ in range(5):
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)
        start = time.perf_counter()
        vm["main"](*vm_args)
        host.append((time.perf_counter() - start) * 1e3)
        torch.cuda.synchronize()
    result["tuned_host_queue_ms"] = statistics.median(host)

    def events_ms(fn, sleep: bool) -> float:
        times = []
        for _ in range(7):
            torch.cuda.synchronize()
            if sleep:
                torch.cuda._sleep(50_000_000)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)

    with torch.no_grad():
        result["tuned_ms"] = events_ms(tuned, False)
        result["tuned_after_sleep_ms"] = events_ms(tuned, True)
        result["compile_ms"] = events_ms(lambda: compiled(*inputs), False)
        result["compile_after_sleep_ms"] = events_ms(lambda: compiled(*inputs), True)
        result["tuned_trace"] = trace(tuned, args.runs)
        result["compile_trace"] = trace(lambda: compiled(*inputs), args.runs)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
