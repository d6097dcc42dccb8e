"""Does the L2 flush before a timed run cost the timed kernel? On one GPU, with torch only.

autosched flushed the L2 by zeroing a 256 MB buffer, which leaves the cache full of dirty lines; a
memory-bound kernel timed next may pay for writing them back. This times, after each of the two
flushes of ``autosched.measure._worker.time_cuda`` (``write``: zeroing; ``read``: a sum over the buffer,
leaving clean lines), a read-only kernel (a sum) and a copy over 8 MB to 1 GB, and reports their
bandwidth. If the write flush costs the kernel, its rate falls at sizes near the L2's (50 MB on an
H200) and the gap reads as a fixed cost per launch:

    python benchmarks/l2_flush_probe.py --out DIR        (on the GPU machine; about half a minute)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES_MB = (8, 16, 23, 34, 50, 90, 256, 1024)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    import torch

    from autosched.measure._worker import time_cuda

    rows = []
    for mb in SIZES_MB:
        nbytes = mb << 20
        src = torch.ones(nbytes // 4, dtype=torch.int32, device="cuda")
        half_src, half_dst = src[: nbytes // 8], torch.empty(nbytes // 8, dtype=torch.int32, device="cuda")
        kernels = {"sum (reads the bytes)": lambda: src.sum(),
                   "copy (reads half, writes half)": lambda: half_dst.copy_(half_src)}
        for kernel, fn in kernels.items():
            row = {"mb": mb, "kernel": kernel}
            for flush_by in ("write", "read"):
                seconds = statistics.median(time_cuda(fn, args.repeat, 256 << 20, flush_by=flush_by))
                row[f"{flush_by}_us"] = round(seconds * 1e6, 2)
                row[f"{flush_by}_gbps"] = round(nbytes / seconds / 1e9)
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "l2_flush_probe.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
