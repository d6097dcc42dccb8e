"""How fast any kernel can read N bytes on this GPU, timed as the GPU benchmark times ours: a Triton kernel
that only streams its input (16-byte loads, one int32 sum per program), swept over block sizes and warps,
and a TIRx kernel in which each CTA asks the copy engine for one chunk of the input (``cp.async.bulk`` into
shared memory, one mbarrier), swept over chunk and copy sizes; each run after an L2 flush by reading, CUDA
events, median of 50. Beside them, torch's device-to-device copy of the same bytes.

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


BULK_READ = "autosched_bulk_read"


def bulk_read_module(n_bytes: int, chunk: int, piece: int):
    """A TIRx kernel that reads ``n_bytes`` (a multiple of 16) by bulk copies: CTA i asks for bytes
    [i * chunk, (i + 1) * chunk) in copies of ``piece`` bytes into its shared memory, waits on one mbarrier,
    and writes the chunk's first word to ``Out[i]`` (so nothing can be skipped)."""
    from tvm.script import tirx as T

    from autosched.search_spaces.templates._hopper import cuda_file

    grid = -(-n_bytes // chunk)
    source = cuda_file("common.cuh") + f"""
__device__ __forceinline__ void {BULK_READ}(const uint8_t* src, int* out, uint8_t* smem, int bx, int tx) {{
  constexpr long long N = {n_bytes}LL;
  constexpr int CHUNK = {chunk}, PIECE = {piece};
  const long long begin = (long long)bx * CHUNK;
  const int bytes = (int)(N - begin < CHUNK ? N - begin : CHUNK);
  const unsigned bar = static_cast<unsigned>(__cvta_generic_to_shared(smem + CHUNK));
  if (tx != 0) return;
  autosched_bulk_expect(bar, bytes);
  for (int off = 0; off < bytes; off += PIECE)
    autosched_bulk_copy(smem + off, src + begin + off, bytes - off < PIECE ? bytes - off : PIECE, bar);
  autosched_mbarrier_wait(bar, 0);
  out[bx] = *reinterpret_cast<const int*>(smem);
}}
"""

    # fmt: off
    @T.prim_func
    def main(X: T.Buffer((n_bytes,), "uint8", align=16), Out: T.Buffer((grid,), "int32")):
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        T.device_entry()
        bx = T.cta_id([grid])
        tx = T.thread_id([32])
        smem = T.alloc_buffer((chunk + 16,), "uint8", scope="shared.dyn", align=128)
        T.cuda.func_call(BULK_READ, X.access_ptr("r"), Out.access_ptr("w"), smem.access_ptr("rw"), bx, tx,
                         source_code=source)
    # fmt: on
    return main, grid


def compile_bulk_read(n_bytes: int, chunk: int, piece: int):
    """The compiled bulk-read kernel (TVM's TIRx pipeline, sm_90a) and its grid size."""
    import tvm
    from tvm.target import Target

    func, grid = bulk_read_module(n_bytes, chunk, piece)
    lib = tvm.compile(tvm.IRModule({"main": func}), target=Target({"kind": "cuda", "arch": "sm_90a"}),
                      tir_pipeline="tirx")
    return lib, grid


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, nargs="+", default=[23.28, 90.2], help="megabytes (1e6 bytes) to read")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch
    import triton
    import triton.language as tl
    import tvm

    from autosched.measure.timing import time_cuda

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
        size = n * 4 // 16 * 16
        raw = x.view(torch.uint8)[:size]
        bulk = None
        for chunk in (16 << 10, 32 << 10, 64 << 10, 128 << 10):
            for piece in sorted({p for p in (4 << 10, 16 << 10, chunk) if p <= chunk}):
                lib, grid = compile_bulk_read(size, chunk, piece)
                out = torch.zeros(grid, dtype=torch.int32, device="cuda")
                fn, fn_args = lib["main"], [tvm.runtime.from_dlpack(raw), tvm.runtime.from_dlpack(out)]
                fn(*fn_args)
                torch.cuda.synchronize()
                if not torch.equal(out, x[:: chunk // 4][:grid]):  # each chunk's first word, as read
                    raise SystemExit(f"bulk read chunk={chunk} piece={piece}: wrong first words")
                us = statistics.median(time_cuda(lambda fn=fn, a=fn_args: fn(*a), 50, 256 << 20)) * 1e6
                if bulk is None or us < bulk["us"]:
                    bulk = {"us": us, "chunk": chunk, "piece": piece, "grid": grid}
        y = torch.empty_like(x)
        half = x[: n // 2]
        copy_us = statistics.median(time_cuda(lambda: y[: n // 2].copy_(half), 50, 256 << 20)) * 1e6
        row = {"mb": mb, "read_us": best["us"], "read_gbps": mb * 1e3 / best["us"], "best": best,
               "bulk_read_us": bulk["us"], "bulk_read_gbps": size / 1e3 / bulk["us"], "bulk_best": bulk,
               "copy_same_bytes_us": copy_us, "copy_same_bytes_gbps": mb * 1e3 / copy_us}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
