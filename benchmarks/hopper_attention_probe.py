"""Probe of the Hopper attention template on one GPU: each point built, checked against a float64
reference and timed (CUDA events, L2 flushed, median) next to torch's scaled_dot_product_attention with
its flash and cuDNN backends, in the same run. Each point runs in its own process with a timeout.

    python benchmarks/hopper_attention_probe.py --case 1,32,32,2048,128,causal --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _isolated import run_isolated  # noqa: E402

POINTS = [{"consumers": c, "block_kv": kv, "stages": st, "overlap": ov, "pingpong": False}
          for c in (2, 1) for kv in (128, 64) for st in (2, 3) for ov in (False, True)]
POINTS += [{"consumers": 2, "block_kv": kv, "stages": st, "overlap": False, "pingpong": True}
           for kv in (128, 64) for st in (2, 3)]


def _one(case, dtype, point, queue):
    try:
        import torch
        import torch.nn.functional as F
        import tvm
        from torch.nn.attention import SDPBackend, sdpa_kernel

        from autosched.measure._worker import time_cuda
        from autosched.search_spaces.templates.hopper_attention import hopper_attention_kernel

        b, h, hkv, s, d, causal = case
        t0 = time.perf_counter()
        func = hopper_attention_kernel(b, h, hkv, s, d, dtype, causal, point)
        ex = tvm.compile(tvm.IRModule({"main": func}), target=tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}),
                         tir_pipeline="tirx")
        build_s = time.perf_counter() - t0
        tdt = getattr(torch, dtype)
        q = torch.randn(b, h, s, d, device="cuda", dtype=tdt)
        k = torch.randn(b, hkv, s, d, device="cuda", dtype=tdt)
        v = torch.randn(b, hkv, s, d, device="cuda", dtype=tdt)
        o = torch.full((b, h, s, d), float("nan"), device="cuda", dtype=tdt)
        args = [tvm.runtime.from_dlpack(t) for t in (q, k, v, o)]
        ex(*args)
        torch.cuda.synchronize()
        g = h // hkv
        scores = q.double() @ k.double().repeat_interleave(g, 1).transpose(-1, -2) / d ** 0.5
        if causal:
            scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
        ref = scores.softmax(-1) @ v.double().repeat_interleave(g, 1)
        err = float((o.double() - ref).norm() / ref.norm()) if torch.isfinite(o).all() else float("inf")
        flush = 256 << 20
        flops = 4 * b * h * s * s * d / (2 if causal else 1)
        row = {"case": case, "dtype": dtype, "point": point, "rel_err": err, "build_s": round(build_s, 2),
               "tflops": flops / statistics.median(time_cuda(lambda: ex(*args), 30, flush)) / 1e12}
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                def sdpa(backend=backend):
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=g > 1)
                row[f"{name}_tflops"] = flops / statistics.median(time_cuda(sdpa, 30, flush)) / 1e12
            except Exception as exc:  # noqa: BLE001 - a backend may not take the case
                row[f"{name}_error"] = str(exc)[:120]
        queue.put(row)
    except Exception as exc:  # noqa: BLE001
        queue.put({"case": case, "point": point, "error": f"{type(exc).__name__}: {str(exc)[-600:]}"})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", action="append", default=[], help="b,h,hkv,s,d,causal|full")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--points", default="all")
    ap.add_argument("--timeout", type=float, default=60)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    points = POINTS if args.points == "all" else json.loads(args.points)
    rows = []
    for text in args.case or ["1,32,32,2048,128,causal"]:
        *nums, mode = text.split(",")
        case = (*(int(x) for x in nums), mode == "causal")
        for point in points:
            row = run_isolated(_one, (case, args.dtype, point), args.timeout, {"case": case, "point": point})
            rows.append(row)
            print(json.dumps(row), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "hopper_attention_probe.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
