"""How fast any kernel can read N bytes on this GPU, timed as the GPU benchmark times ours: a Triton kernel
that only streams its input (16-byte loads, one int32 sum per program), swept over block sizes and warps,
each run after an L2 flush by reading, CUDA events, median of 50. Beside it, torch's device-to-device
copy of the same bytes.

A memory-bound goal stated as a share of the large-copy bandwidth (4.2 TB/s on the H200) can lie below
what a kernel of that size can reach at all: launch, ramp-up and tail cost a few microseconds whatever the
kernel does. This script measures that floor for the sizes of our decode kernels.

    python benchmarks/read_floor.py --mb 23.28 90.2 --out benchmarks/results/read_floor.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, nargs="+", default=[23.28, 90.2], help="megabytes (1e6 bytes) to read")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch
    import triton
    import triton.language as tl

    from autosched.measure._worker import time_cuda

    @triton.jit
    def stream_read(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        pid = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for i in tl.static_range(ITERS):
            offs = (pid * ITERS + i) * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs, mask=offs < n, other=0, cache_modifier=".cg")
        tl.store(out_ptr + pid, tl.sum(acc))

    rows = []
    for mb in args.mb:
        n = int(mb * 1e6) // 4
        x = torch.randint(-1000, 1000, (n,), dtype=torch.int32, device="cuda")
        want = int(x.sum())
        best = None
        for block in (1024, 2048, 4096, 8192):
            for iters in (1, 2, 4, 8):
                for warps in (4, 8):
                    grid = triton.cdiv(n, block * iters)
                    out = torch.empty(grid, dtype=torch.int32, device="cuda")

                    def run(block=block, iters=iters, warps=warps, grid=grid, out=out):
                        stream_read[(grid,)](x, out, n, BLOCK=block, ITERS=iters, num_warps=warps)

                    run()
                    if int(out.sum()) != want:
                        raise SystemExit(f"stream_read block={block} iters={iters}: wrong sum")
                    us = statistics.median(time_cuda(run, 50, 256 << 20)) * 1e6
                    if best is None or us < best["us"]:
                        best = {"us": us, "block": block, "iters": iters, "warps": warps, "grid": grid}
        y = torch.empty_like(x)
        half = x[: n // 2]
        copy_us = statistics.median(time_cuda(lambda: y[: n // 2].copy_(half), 50, 256 << 20)) * 1e6
        row = {"mb": mb, "read_us": best["us"], "read_gbps": mb * 1e3 / best["us"], "best": best,
               "copy_same_bytes_us": copy_us, "copy_same_bytes_gbps": mb * 1e3 / copy_us}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
