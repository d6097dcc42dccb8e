"""Runs chosen points of our spaces on the GPU, each checked against the float64 reference and then
launched a few more times, for Nsight Compute to read their hardware counters:

    ncu --clock-control none -k regex:main_kernel --launch-skip 2 --launch-count 1 --section SpeedOfLight \
        python3 benchmarks/profile_kernels.py int4-decode

(``benchmarks/hopper_next_gpu.sh profile`` runs it under ncu for every case.) The points are the best ones
the search found in the 2026-12-02 runs (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CASES = {
    "int4-decode": ("dequant_gemm", "m=1,n=11008,k=4096", "float16", "bits=4,group=128",
                    {"warps": 1, "rows_per_warp": 4, "unroll": True, "half_products": True, "mma": False}),
    "int4-decode-b8": ("dequant_gemm", "m=8,n=11008,k=4096", "float16", "bits=4,group=128",
                       {"warps": 1, "rows_per_warp": 4, "unroll": True, "half_products": True, "mma": False}),
    "paged-gqa8": ("paged_decode_attention", "b=16,h=32,hkv=4,d=128,ctx=4096,page=16", "float16", "",
                   {"warps": 8, "unroll": 1, "split": 2, "mma": True, "prefetch": 1, "ctas_per_sm": 1, "tma_stages": 0}),
    "paged-gqa4": ("paged_decode_attention", "b=16,h=32,hkv=8,d=128,ctx=4096,page=16", "float16", "",
                   {"warps": 4, "unroll": 1, "split": 2, "mma": True, "prefetch": 0, "ctas_per_sm": 3, "tma_stages": 0}),
    "attention-noncausal": ("attention", "b=1,h=32,s=2048,d=128", "float16", "causal=0",
                            {"consumers": 2, "block_kv": 160, "stages": 2, "overlap": False, "pingpong": True}),
    "gemm-awkward": ("gemm", "m=1000,n=4000,k=3000", "float16", "",
                     {"consumers": 2, "wg_rows": 64, "block_n": 256, "stages": 3, "group_m": 1, "persistent": False,
                      "split_k": 1, "swap_ab": False, "pingpong": False, "multicast": "none"}),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="+", choices=list(CASES))
    parser.add_argument("--launches", type=int, default=4, help="launches after the checked one")
    parser.add_argument("--points", help="a JSON list of points to run instead of the case's best one")
    parser.add_argument("--time", action="store_true",
                        help="also time each point: median of 50 runs, CUDA events, L2 flushed (as the benchmark)")
    args = parser.parse_args()

    import torch
    from gpu_benchmark import run_tvm_module

    from autosched.measure._worker import time_cuda
    from autosched.target import parse_target
    from autosched.task import Task
    from autosched.workloads import make_workload

    target = parse_target("cuda")
    chosen = json.loads(args.points) if args.points else None
    for name, point in ((n, p) for n in args.cases for p in (chosen if chosen is not None else [CASES[n][4]])):
        op, shape, dtype, attrs, _ = CASES[name]
        task = Task.from_workload(make_workload(op, shape, dtype, attrs))
        space = task.space(target)
        problem = space.validate(point)
        if problem:
            print(f"{name}: {point} is not a point of {space.id}: {problem}", flush=True)
            continue
        checker = task.spec.checker(task.func)
        inputs = checker.make_inputs(torch.Generator().manual_seed(0), "cuda")
        fn, err = run_tvm_module(space.apply(point), target, checker, inputs, checker.reference(inputs),
                                 space.build_config(point), space.codegen)
        if err > checker.tolerance:
            print(f"{name}: {point}: relative error {err:.2e} above {checker.tolerance:.0e}: not run", flush=True)
            continue
        for _ in range(args.launches):
            fn()
        torch.cuda.synchronize()
        timed = f", median {statistics.median(time_cuda(fn, 50, 256 << 20)) * 1e6:.2f} us" if args.time else ""
        print(f"{name}: {space.id} {point}: relative error {err:.1e}, {args.launches + 1} launches{timed}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
