"""A quick correctness check of single kernels on the GPU, without the measurer's process pools: each
(workload, point) is compiled, run once on seeded inputs and compared with the float64 reference. For a
first look at new kernels when device time is short; the GPU tests remain the check that counts.

    python benchmarks/quick_check_gpu.py   (on the GPU machine, after the TVM stage call)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CASES = [
    ("dequant_gemm", "m=1000,n=1032,k=576", "float16", "bits=4,group=128", None),
    ("gemm", "m=1000,n=1576,k=328", "float16", "bias=1,act=gelu",
     {"consumers": 2, "wg_rows": 64, "block_n": 64, "stages": 4, "group_m": 4, "persistent": True, "split_k": 1,
      "swap_ab": False, "pingpong": True, "multicast": "none"}),
    ("attention", "b=1,h=4,hkv=2,s=1000,d=128", "float16", "causal=1",
     {"consumers": 2, "block_kv": 128, "stages": 2, "overlap": False, "pingpong": True}),
    ("paged_decode_attention", "b=3,h=16,hkv=2,d=128,ctx=520,page=16", "float16", "",
     {"warps": 4, "unroll": 4, "split": 2, "mma": True, "prefetch": 0, "ctas_per_sm": 1, "tma_stages": 0}),
]


def main() -> int:
    import torch
    import tvm

    from autosched.measure._worker import relative_error
    from autosched.target import parse_target
    from autosched.task import Task
    from autosched.workloads import make_workload

    target = parse_target("cuda", require_device=True)
    hopper = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    for op, shape, dtype, attrs, point in CASES:
        start = time.perf_counter()
        row = {"op": op, "shape": shape, "dtype": dtype, "attrs": attrs}
        try:
            task = Task.from_workload(make_workload(op, shape, dtype, attrs))
            space = task.space(target)
            point = point or space.default()
            row.update(space=space.id, point=point)
            ex = tvm.compile(space.apply(point), target=hopper, **{k: v for k, v in space.codegen.items() if k != "arch"})
            checker = task.spec.checker(task.func)
            inputs, refs = checker.inputs_and_reference(torch.Generator().manual_seed(0), "cuda")
            outs = [torch.full(r.shape, float("nan"), dtype=inputs[0].dtype, device="cuda") for r in refs]
            ex["main"](*[tvm.runtime.from_dlpack(t) for t in checker.arrange(inputs, outs)])
            torch.cuda.synchronize()
            row["rel_error"] = max(relative_error(o, r) for o, r in zip(outs, refs))
            row["ok"] = row["rel_error"] <= checker.tolerance
        except Exception as exc:  # noqa: BLE001 - report and go on to the next kernel
            row["error"] = f"{type(exc).__name__}: {str(exc)[-400:]}"
        row["seconds"] = round(time.perf_counter() - start, 1)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
