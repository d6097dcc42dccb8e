"""Decode attention in TVM's paged-KV-cache convention on a GPU: our ``kv_cache_decode`` at its defaults and at
other (split, spread_split, warps, unroll, blocks, fill) points, against TVM's ``batch_decode_paged_kv``, on the batches and
contexts generation meets.

Each kernel reads a batch of sequences of ``--context`` tokens from shuffled pages in the runtime's layout
(``[pages, 2, hkv, 16, d]``, CSR page table); its output is checked against TVM's kernel (the convention
the cache's merge reads) before it is timed: CUDA events around single launches after the L2 is flushed,
median of ``--repeat``. GB/s counts the K/V bytes read, against a device-to-device copy in the same run.

    python benchmarks/decode_attention_benchmark.py --heads 32:32,32:8 --batches 1,16,64 --context 544 \\
        --out decode_attention.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

PAGE = 16
FLUSH_BYTES = 256 << 20
# (split, spread_split, warps, unroll, blocks, fill): None for the default, "fit" for default_blocks.
POINTS = [(split, spread, warps, None, blocks, False) for split in (2, 4, 8) for spread in (2, split) for warps in (4, 8)
          for blocks in (None, "fit")]
# Sixteen warps: twice the token rows in flight per CTA where batch 1 leaves most SMs with one or two CTAs; "fit"
# (without GQA: two CTAs an SM, 64 registers) keeps batch 1's split of 8 in one wave.
POINTS += [(split, 2, 16, None, blocks, False) for split in (4, 8) for blocks in (None, "fit")]
# Sixteen warps that, where the pairs spread and are many (batch 64 with GQA), take 2 or 4 pairs a CTA.
POINTS += [(8, 2, 16, None, None, True)]
# Batch 1 without GQA: a split's share of 544 tokens (68) in one round of loads rather than two.
POINTS += [(8, 2, warps, 8, None, False) for warps in (4, 8)]


def compile_kernel(func, codegen):
    import tvm

    from autosched.target import compile_module, parse_target

    name = str(func.attrs["global_symbol"])
    executable = compile_module(tvm.IRModule({name: func}), parse_target("cuda"), {}, codegen)
    return executable[name]


def make_inputs(batch: int, context: int, h: int, hkv: int, d: int, seed: int = 0):
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    per_seq = -(-context // PAGE)
    total = batch * per_seq
    pages = torch.randn((total, 2, hkv, PAGE, d), generator=gen, device="cuda").half()
    order = torch.randperm(total, generator=gen, device="cuda").int()
    indptr = torch.arange(0, total + 1, per_seq, dtype=torch.int32, device="cuda")
    last = torch.full((batch,), context - (per_seq - 1) * PAGE, dtype=torch.int32, device="cuda")
    q = torch.randn((batch, h, d), generator=gen, device="cuda").half()
    return q, pages, indptr, order, last


def runner(kernel, inputs, h: int, d: int):
    """A zero-argument launch of ``kernel`` on ``inputs``, and its (output, lse) tensors."""
    import torch
    import tvm

    q, pages, indptr, indices, last = inputs
    b = q.shape[0]
    out = torch.full((b, h, d), float("nan"), dtype=q.dtype, device="cuda")
    lse = torch.full((b, h), float("nan"), dtype=torch.float32, device="cuda")
    offsets = torch.zeros(b, dtype=torch.int32, device="cuda")
    args = [tvm.runtime.from_dlpack(t) for t in (q, pages, indptr, indices, last, offsets, offsets.clone(), out, lse)]
    return (lambda: kernel(*args, 0, 1.0, 10000.0, 1.0 / math.sqrt(d))), out, lse


def main() -> int:
    import torch
    from gpu_benchmark import copy_bandwidth

    from autosched.generation.attention import CODEGEN
    from autosched.measure.timing import time_cuda
    from autosched.search_spaces.templates import kv_cache_decode as kvd
    from autosched.target import parse_target

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", default="32:32,32:8", help="query:K/V heads, comma-separated")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--context", type=int, default=544, help="tokens per sequence (default 544)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--only-default", action="store_true",
                        help="the default kernel (and TVM's) only: for a profiler (ncu) to read")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from tvm.relax.frontend.nn.llm._decode_kernels import _attention_decode

    d = args.head_dim
    copy = copy_bandwidth(time_cuda)
    print(f"copy {copy:.0f} GB/s, context {args.context}, head dim {d}", flush=True)
    rows = []
    for spec in args.heads.split(","):
        h, hkv = map(int, spec.split(":"))
        g = h // hkv
        tvm_kernel = compile_kernel(_attention_decode(hkv, h, d, "float16", False, {}, parse_target("cuda").tvm_target()),
                                    None)
        batches = [int(b) for b in args.batches.split(",")]
        # The default kernel a build takes first, then the others.
        c = kvd.default_config(g, hkv, d)
        points = [(c["split"], c["spread_split"], c["warps"], c["unroll"], "fit" if c["blocks"] else None, c["fill"])]
        kernels = {}
        for split, spread_split, warps, unroll, blocks, fill in points + ([] if args.only_default else POINTS):
            w = warps or kvd.default_warps(g, d)
            u = unroll or kvd.default_unroll(g)
            fit = kvd.default_blocks(g, d, w, u) if blocks == "fit" else 0
            key = (split, min(spread_split, split), w, u, fit or None, fill)
            if (blocks == "fit" and fit is None) or key in kernels:
                continue
            try:
                kernels[key] = compile_kernel(kvd.kv_cache_decode_kernel(h, hkv, d, "float16", split=split, warps=w,
                                                                         unroll=u, blocks=fit,
                                                                         spread_split=spread_split, fill=fill), CODEGEN)
            except ValueError as exc:
                print(f"h{h}:{hkv} {key}: {exc}", flush=True)
        for batch in batches:
            inputs = make_inputs(batch, args.context, h, hkv, d)
            kv_bytes = batch * args.context * hkv * d * 2 * 2
            theirs, ref_out, ref_lse = runner(tvm_kernel, inputs, h, d)
            theirs()
            torch.cuda.synchronize()
            ref_out, ref_lse = ref_out.clone(), ref_lse.clone()
            named = [("tvm", theirs)] + [(key, runner(k, inputs, h, d)) for key, k in kernels.items()]
            for key, item in named:
                if key == "tvm":
                    run, err = item, 0.0
                else:
                    run, out, lse = item
                    run()
                    torch.cuda.synchronize()
                    err = float((out.float() - ref_out.float()).abs().max()) + float((lse - ref_lse).abs().max())
                seconds = statistics.median(time_cuda(run, args.repeat, FLUSH_BYTES))
                split, spread_split, warps, unroll, blocks, fill = key if key != "tvm" else (None,) * 6
                row = {"heads": h, "kv_heads": hkv, "batch": batch, "context": args.context,
                       "kernel": "tvm" if key == "tvm" else "ours", "split": split, "spread_split": spread_split,
                       "warps": warps, "unroll": unroll, "blocks": blocks, "fill": fill, "us": seconds * 1e6,
                       "gbs": kv_bytes / seconds / 1e9, "of_copy": kv_bytes / seconds / 1e9 / copy, "max_diff": err}
                rows.append(row)
                print(f"h{h}:{hkv} b{batch:<3} {row['kernel']:4} split {split} spread {spread_split} warps {warps} "
                      f"unroll {unroll} "
                      f"blocks {blocks} fill {fill}: {row['us']:7.2f} us {row['gbs']:6.0f} GB/s ({row['of_copy']:.0%} of copy) "
                      f"diff {err:.2g}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"copy_gbs": copy, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
