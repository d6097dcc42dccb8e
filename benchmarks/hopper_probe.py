"""Probe of the Hopper GEMM template on one GPU: each point built, checked against torch in float64 and
timed (CUDA events, L2 flushed, median) next to torch's matmul (cuBLAS) in the same run.

Each point runs in its own process with a timeout, so a point that deadlocks (a wrong mbarrier phase)
costs its timeout and not the run. Usage:

    python benchmarks/hopper_probe.py --shape 4096,4096,4096 --dtype float16 --points all --out DIR
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

BASE = {"consumers": 2, "wg_rows": 64, "block_n": 256, "stages": 4, "group_m": 8, "persistent": False}


def probe_points() -> list[dict]:
    pts = [dict(BASE)]
    for change in ({"stages": 3}, {"stages": 5}, {"block_n": 128}, {"block_n": 192}, {"wg_rows": 128, "block_n": 128},
                   {"consumers": 1, "wg_rows": 128, "block_n": 256}, {"persistent": True}, {"group_m": 1},
                   {"group_m": 16}, {"persistent": True, "stages": 5}, {"consumers": 1, "block_n": 256},
                   {"persistent": True, "pingpong": True}, {"persistent": True, "pingpong": True, "stages": 5},
                   {"persistent": True, "pingpong": True, "wg_rows": 128, "block_n": 128}):
        pts.append({**BASE, **change})
    return pts


def small_m_points() -> list[dict]:
    """Points for a decode GEMM (m of 2-64): one consumer of 64 rows, narrow tiles, split-K across a cluster."""
    base = {"consumers": 1, "wg_rows": 64, "group_m": 1, "persistent": False}
    plain = [{**base, "block_n": bn, "stages": stages, "split_k": split, "swap_ab": False}
             for bn in (64, 128) for stages in (4, 7) for split in (1, 2)]
    # Swapped: the tokens on wgmma's N side (16 or 32), the weights in 64- or 128-row tiles.
    swapped = [{**base, "wg_rows": rows, "block_n": bn, "stages": stages, "split_k": split, "swap_ab": True}
               for rows in (64, 128) for bn in (16, 32) for stages in (7, 12) for split in (1, 2)
               if stages * (rows + bn) * 64 * 2 + 1024 <= 227 * 1024]
    return plain + swapped


def _one(m, n, k, dtype, bias, act, point, queue):
    try:
        import torch
        import tvm

        from autosched.measure._worker import time_cuda
        from autosched.search_spaces.templates.hopper_gemm import hopper_gemm_kernel

        point = {**point, "sms": torch.cuda.get_device_properties(0).multi_processor_count}
        t0 = time.perf_counter()
        func = hopper_gemm_kernel(m, n, k, dtype, bias, act, point)
        ex = tvm.compile(tvm.IRModule({"main": func}), target=tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}),
                         tir_pipeline="tirx")
        build_s = time.perf_counter() - t0
        tdt = getattr(torch, dtype)
        a = torch.randn(m, k, device="cuda", dtype=tdt)
        b = torch.randn(n, k, device="cuda", dtype=tdt) / k ** 0.5
        bias_t = torch.randn(n, device="cuda", dtype=tdt) if bias else None
        c = torch.full((m, n), float("nan"), device="cuda", dtype=tdt)
        args = [a, b] + ([bias_t] if bias else []) + [c]
        targs = [tvm.runtime.from_dlpack(t) for t in args]
        ex(*targs)
        torch.cuda.synchronize()
        ref = a.double() @ b.double().T
        if bias:
            ref = ref + bias_t.double()
        if act == "silu":
            ref = torch.nn.functional.silu(ref)
        err = float((c.double() - ref).norm() / ref.norm()) if torch.isfinite(c).all() else float("inf")
        flush = 256 << 20
        mine = statistics.median(time_cuda(lambda: ex(*targs), 30, flush))
        cublas = statistics.median(time_cuda(lambda: torch.matmul(a, b.T), 30, flush))
        tf = 2 * m * n * k / 1e12
        queue.put({"point": point, "rel_err": err, "build_s": round(build_s, 2), "ms": mine * 1e3,
                   "tflops": tf / mine, "cublas_tflops": tf / cublas, "ratio": cublas / mine})
    except Exception as exc:  # noqa: BLE001 - a failing point is reported, not fatal
        queue.put({"point": point, "error": f"{type(exc).__name__}: {str(exc)[-600:]}"})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", action="append", default=[])
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--bias", action="store_true")
    ap.add_argument("--act", default="none")
    ap.add_argument("--points", default="base", help="base | all | small (decode GEMMs) | JSON list of points")
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    presets = {"base": lambda: [BASE], "all": probe_points, "small": small_m_points}
    points = presets[args.points]() if args.points in presets else json.loads(args.points)
    rows = []
    for shape in args.shape or ["4096,4096,4096"]:
        m, n, k = (int(x) for x in shape.split(","))
        for point in points:
            row = run_isolated(_one, (m, n, k, args.dtype, args.bias, args.act, point), args.timeout, {"point": point})
            row["shape"] = [m, n, k]
            rows.append(row)
            print(json.dumps(row), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "hopper_probe.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
