"""GPU benchmark: autosched against torch and TVM's default dlight schedules, on the same inputs.

Usage: python benchmarks/gpu_benchmark.py [--cases NAME ...] [--trials N] [--time-budget S] [--out DIR]
       python benchmarks/gpu_benchmark.py --hand-points gemm --shape 1000,4000,3000 --points all --out DIR
       python benchmarks/gpu_benchmark.py --hand-points gemm --shape 16,4096,11008 --points decode --out DIR
       python benchmarks/gpu_benchmark.py --hand-points fp8 --shape 8192,11008,4096 --points all --out DIR
       python benchmarks/gpu_benchmark.py --hand-points attention --case 1,32,32,2048,128,full --out DIR
       python benchmarks/gpu_benchmark.py --hand-points space --workload dequant_gemm --attrs bits=4,group=128 \
           --shape m=1,n=11008,k=4096 --points first --out DIR      (any workload's space: its first points)

For each case, in one run on the GPU: autosched tunes the workload (the database is written to --out),
then the best kernel, the dlight-scheduled kernel and the torch equivalent are each checked against
the float64 reference and timed the same way: CUDA events around single runs, the L2 cache flushed
(256 MB read) before each, median of the repeats. Prints one table with times, TFLOP/s or GB/s and
the ratios, and writes results.json and results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

# name: (op, shape, dtype, attrs, bound) - bound says whether to report TFLOP/s or GB/s.
CASES = {
    "gemm-fp16-4096": ("gemm", "m=4096,n=4096,k=4096", "float16", "", "compute"),
    "gemm-bf16-4096": ("gemm", "m=4096,n=4096,k=4096", "bfloat16", "", "compute"),
    "mlp-up-fp16": ("gemm", "m=2048,n=11008,k=4096", "float16", "", "compute"),
    "mlp-up-bf16": ("gemm", "m=2048,n=11008,k=4096", "bfloat16", "", "compute"),
    # The Llama-2-7B prefill GEMMs of a 512-token prompt, and a shape no tile divides.
    "prefill512-qkv": ("gemm", "m=512,n=12288,k=4096", "float16", "", "compute"),
    "prefill512-o": ("gemm", "m=512,n=4096,k=4096", "float16", "", "compute"),
    "prefill512-up": ("gemm", "m=512,n=11008,k=4096", "float16", "", "compute"),
    "prefill512-down": ("gemm", "m=512,n=4096,k=11008", "float16", "", "compute"),
    "gemm-awkward": ("gemm", "m=1000,n=4000,k=3000", "float16", "", "compute"),
    # FP8 (fp8_gemm: E4M3 activations and weights, per-token and per-channel scales) at the fp16 cases' shapes, and a
    # batch of 16 prompts of 512 tokens; FP8_TWINS pairs each with its fp16 case for the ratio under the table.
    "prefill512-o-fp8": ("fp8_gemm", "m=512,n=4096,k=4096", "float16", "", "compute"),
    "prefill512-up-fp8": ("fp8_gemm", "m=512,n=11008,k=4096", "float16", "", "compute"),
    "prefill16x512-up": ("gemm", "m=8192,n=11008,k=4096", "float16", "", "compute"),
    "prefill16x512-up-fp8": ("fp8_gemm", "m=8192,n=11008,k=4096", "float16", "", "compute"),
    # ... and the per-token quantisation of its activations that a W8A8 prefill chunk adds before each GEMM
    "prefill16x512-quant-fp8": ("fp8_quant_rows", "m=8192,k=4096", "float16", "", "memory"),
    "batch16-gemm-fp16": ("gemm", "m=16,n=4096,k=4096", "float16", "", "memory"),
    "gemv-4096": ("gemm", "m=1,n=4096,k=4096", "float16", "", "memory"),
    "gemv-11008": ("gemm", "m=1,n=11008,k=4096", "float16", "", "memory"),
    "dequant-int4-decode": ("dequant_gemm", "m=1,n=11008,k=4096", "float16", "bits=4,group=128", "memory"),
    "dequant-int4-decode-b8": ("dequant_gemm", "m=8,n=11008,k=4096", "float16", "bits=4,group=128", "memory"),
    "dequant-int4-prefill": ("dequant_gemm", "m=2048,n=11008,k=4096", "float16", "bits=4,group=128", "compute"),
    # A decode step's SwiGLU (Llama-2-7B's gate and up projections, SiLU·up) in one kernel (swiglu_gemv), against torch's
    # GEMM over the stacked weight and its SiLU and product after it
    "swiglu-decode": ("swiglu_gemm", "m=1,n=11008,k=4096", "float16", "", "memory"),
    "swiglu-decode-b8": ("swiglu_gemm", "m=8,n=11008,k=4096", "bfloat16", "", "memory"),
    "rmsnorm-4096": ("rmsnorm", "m=4096,n=4096", "float16", "", "memory"),
    "softmax-4096": ("softmax", "m=4096,n=4096", "float16", "", "memory"),
    "rope-llama": ("rope", "b=1,s=2048,h=32,d=128", "float16", "", "memory"),
    "attention-prefill": ("attention", "b=1,h=32,s=2048,d=128", "float16", "causal=1", "compute"),
    "paged-decode": ("paged_decode_attention", "b=16,h=32,d=128,ctx=4096,page=16", "float16", "", "memory"),
    # One long sequence (few (sequence, head) pairs: the split case), and GQA 8:1 and Llama-3's 4:1 (K/V read
    # once per group).
    "paged-decode-b1-32k": ("paged_decode_attention", "b=1,h=32,d=128,ctx=32768,page=16", "float16", "", "memory"),
    "paged-decode-gqa8": ("paged_decode_attention", "b=16,h=32,hkv=4,d=128,ctx=4096,page=16", "float16", "", "memory"),
    "paged-decode-gqa4-llama3": ("paged_decode_attention", "b=16,h=32,hkv=8,d=128,ctx=4096,page=16", "float16", "",
                                 "memory"),
    # Mixture-of-experts prefill (512 tokens x 2 experts: Mixtral's gate/up and down; Qwen3-MoE's 4096 routed rows over
    # 128 experts): the grouped GEMM on the rows sorted by expert (moe_grouped_gemm) against torch's per-expert
    # matmuls and against the GEMV per routed row that served prefill before (moe_gemm, same shape, rows unsorted).
    "moe-prefill-mixtral-up": ("moe_grouped_gemm", "m=1024,e=8,n=28672,k=4096", "float16", "", "compute"),
    "moe-prefill-mixtral-down": ("moe_grouped_gemm", "m=1024,e=8,n=4096,k=14336", "float16", "", "compute"),
    "moe-prefill-qwen3-up": ("moe_grouped_gemm", "m=4096,e=128,n=1536,k=2048", "bfloat16", "", "compute"),
    "moe-prefill-mixtral-up-gemv": ("moe_gemm", "m=1024,e=8,n=28672,k=4096", "float16", "", "compute"),
}
FP8_TWINS = {"prefill512-o-fp8": "prefill512-o", "prefill512-up-fp8": "prefill512-up",
             "prefill16x512-up-fp8": "prefill16x512-up"}


def torch_fn(op: str, wl, ins):
    """The torch way to compute the workload (what a user would run without autosched)."""
    a = wl.attrs_dict
    if op == "gemm":
        bias = ins[2] if a.get("bias") else None
        return lambda: F.linear(ins[0], ins[1], bias)
    if op == "swiglu_gemm":  # one GEMM over the stacked weight, then SiLU(gate) · up
        n = wl.shape_dict["n"]

        def swiglu():
            y = F.linear(ins[0], ins[1])
            return F.silu(y[:, :n]) * y[:, n:]

        return swiglu
    if op == "batch_matmul":
        return lambda: torch.bmm(ins[0], ins[1])
    if op == "fp8_gemm":  # cuBLAS's FP8 GEMM with row-wise scales (torch may take only bf16 output for those)
        a8, w8 = ins[0].view(torch.float8_e4m3fn), ins[1].view(torch.float8_e4m3fn)
        bias = ins[4] if a.get("bias") else None
        out_dtype = getattr(torch, wl.dtype)
        return lambda: torch._scaled_mm(a8, w8.t(), scale_a=ins[2].view(-1, 1), scale_b=ins[3].view(1, -1), bias=bias,
                                        out_dtype=out_dtype)
    if op == "dequant_gemm":
        from autosched.workloads import get_operator

        deq = get_operator(op)

        def run():  # dequantise, then matmul: two kernels, as torch does without a fused int4 kernel
            w = deq.dequantize(wl, ins[1], ins[2]).to(ins[0].dtype)
            return F.linear(ins[0], w)

        return run
    if op == "moe_grouped_gemm":  # one matmul per expert over its contiguous rows
        x, indptr, w = ins
        bounds = indptr.tolist()

        def run():
            out = torch.empty(x.shape[0], w.shape[1], dtype=x.dtype, device=x.device)
            for j in range(w.shape[0]):
                if bounds[j + 1] > bounds[j]:
                    torch.mm(x[bounds[j]:bounds[j + 1]], w[j].t(), out=out[bounds[j]:bounds[j + 1]])
            return out

        return run
    if op == "moe_gemm":  # each expert's rows gathered, one matmul per expert, scattered back
        x, expert, w = ins
        rows = [torch.nonzero(expert == j).flatten() for j in range(w.shape[0])]

        def run():
            out = torch.empty(x.shape[0], w.shape[1], dtype=x.dtype, device=x.device)
            for j, idx in enumerate(rows):
                if len(idx):
                    out[idx] = x[idx] @ w[j].t()
            return out

        return run
    if op == "rmsnorm":
        return lambda: F.rms_norm(ins[0], (ins[0].shape[-1],), ins[1], a["eps"])
    if op == "softmax":
        return lambda: torch.softmax(ins[0], -1)
    if op == "rope":
        x, cos, sin = ins
        half = x.shape[-1] // 2
        c, s_ = cos[None, :, None, :].to(x.dtype), sin[None, :, None, :].to(x.dtype)
        return lambda: x * c + torch.cat([-x[..., half:], x[..., :half]], -1) * s_
    if op == "attention":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        q, k, v = ins

        def run():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=a["causal"], enable_gqa=q.shape[1] != k.shape[1])

        return run
    if op == "paged_decode_attention":
        q, kc, vc, table, lens = ins
        s = wl.shape_dict

        def run():  # gather each sequence's pages, then one SDPA call with a length mask
            k = kc[table.long()].reshape(s["b"], -1, s["hkv"], s["d"])[:, : s["ctx"]].transpose(1, 2)
            v = vc[table.long()].reshape(s["b"], -1, s["hkv"], s["d"])[:, : s["ctx"]].transpose(1, 2)
            mask = torch.arange(s["ctx"], device=q.device)[None, :] < lens[:, None]
            return F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=mask[:, None, None, :],
                                                  enable_gqa=s["h"] != s["hkv"])[:, :, 0]

        return run
    raise KeyError(op)


def copy_bandwidth(time_cuda) -> float:
    """GB/s of a 1 GiB device-to-device copy, counting bytes read and written: the memory ceiling."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = statistics.median(time_cuda(lambda: dst.copy_(src), 20, 0))
    return 2 * src.numel() / seconds / 1e9


def dlight_module(func, target):
    import tvm
    from tvm.s_tir import dlight as dl

    with target.tvm_target():
        return dl.ApplyDefaultSchedule(dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.LowBatchGEMV(), dl.gpu.Reduction(),
                                       dl.gpu.GeneralReduction(), dl.gpu.RMSNorm(), dl.gpu.Fallback())(
            tvm.IRModule({"main": func}))


def run_tvm_module(mod, target, checker, inputs, refs, config=None, codegen=None):
    """Compile, check against the reference, return a zero-argument function that runs the kernel."""
    import tvm

    from autosched.target import compile_module
    from autosched.workloads import torch_dtype

    lib = compile_module(mod, target, config, codegen)
    outs = [torch.empty(s, dtype=torch_dtype(d), device="cuda") for s, d in checker.output_specs()]
    for out in outs:  # poisoned as the runner poisons them (uint8 codes: 0xFF, a NaN code)
        out.fill_(float("nan") if out.is_floating_point() else -1)
    args = [tvm.runtime.from_dlpack(t) for t in checker.arrange(inputs, outs)]
    fn = lib["main"]
    fn(*args)
    torch.cuda.synchronize()
    err = max(checker.errors(inputs, outs, refs))
    return (lambda: fn(*args)), err


def seconds_to_90_percent(db, workload_key: str, run_id) -> float | None:
    """Seconds from the run's first record to the first one within 90% of the run's best speed."""
    from datetime import datetime

    from autosched.database.queries import history

    rows = [r for r in history(db, workload_key) if r["workload"] == workload_key and r["run_id"] == run_id]
    times = [(datetime.fromisoformat(str(r["created_at"])), r["latency_us"]) for r in rows if r["latency_us"]]
    if not times:
        return None
    best = min(lat for _, lat in times)
    first = min(t for t, _ in times)
    reached = min(t for t, lat in times if lat <= best / 0.9)
    return (reached - first).total_seconds()


def check_torch(fn, refs):
    from autosched.correctness import relative_error

    out = fn()
    torch.cuda.synchronize()
    return relative_error(out.reshape(refs[0].shape), refs[0])


# Hand-picked points of the Hopper templates, each in a process of its own (a point that deadlocks costs its
# timeout, not the run), beside torch (cuBLAS; SDPA's flash and cuDNN backends) in the same process.

GEMM_BASE = {"consumers": 2, "wg_rows": 64, "block_n": 256, "stages": 4, "group_m": 8, "persistent": False}


def gemm_probe_points() -> list[dict]:
    pts = [dict(GEMM_BASE)]
    for change in ({"stages": 3}, {"stages": 5}, {"block_n": 128}, {"block_n": 192}, {"wg_rows": 128, "block_n": 128},
                   {"consumers": 1, "wg_rows": 128, "block_n": 256}, {"persistent": True}, {"group_m": 1},
                   {"group_m": 16}, {"persistent": True, "stages": 5}, {"consumers": 1, "block_n": 256},
                   {"persistent": True, "pingpong": True}, {"persistent": True, "pingpong": True, "stages": 5},
                   {"persistent": True, "pingpong": True, "wg_rows": 128, "block_n": 128}):
        pts.append({**GEMM_BASE, **change})
    return pts


def gemm_small_m_points() -> list[dict]:
    """Points for a decode GEMM (m of 2-64): one consumer of 64 rows, narrow tiles, split-K across a cluster."""
    base = {"consumers": 1, "wg_rows": 64, "group_m": 1, "persistent": False}
    plain = [{**base, "block_n": bn, "stages": stages, "split_k": split, "swap_ab": False}
             for bn in (64, 128) for stages in (4, 7) for split in (1, 2)]
    # Swapped: the tokens on wgmma's N side (16 or 32), the weights in 64- or 128-row tiles.
    swapped = [{**base, "wg_rows": rows, "block_n": bn, "stages": stages, "split_k": split, "swap_ab": True}
               for rows in (64, 128) for bn in (16, 32) for stages in (7, 12) for split in (1, 2)
               if stages * (rows + bn) * 64 * 2 + 1024 <= 227 * 1024]
    return plain + swapped


def gemm_decode_points(m: int, n: int, k: int, dtype: str) -> list[dict]:
    """A decode GEMM's (m of 2-16) wgmma default beside the streaming mma.sync kernel's valid points."""
    from autosched.search_spaces.templates import mma_gemv
    from autosched.target import parse_target
    from autosched.task import Task
    from autosched.workloads import make_workload

    space = Task.from_workload(make_workload("gemm", f"m={m},n={n},k={k}", dtype)).space(
        parse_target("cuda:sm_90", require_device=False))
    # One step in flight (two never led: BENCHMARKS.md), 2 to 8 warps, 1 or 2 tiles a block.
    streams = [{"stream": True, "stream_warps": w, "stream_tiles": t, "stream_unroll": 1}
               for w in (2, 4, 8) for t in (1, 2)]
    return [space.wgmma_default()] + [p for p in streams if mma_gemv.check(m, n, k, False, p) is None]


def _gemm_point(m, n, k, dtype, bias, act, point, queue):
    try:
        import torch
        import tvm

        from autosched.measure.timing import time_cuda
        from autosched.search_spaces.templates.hopper_gemm import hopper_gemm_kernel
        from autosched.search_spaces.templates.mma_gemv import mma_gemv_kernel

        point = {**point, "sms": torch.cuda.get_device_properties(0).multi_processor_count}
        t0 = time.perf_counter()
        kernel = mma_gemv_kernel if point.get("stream") else hopper_gemm_kernel
        func = kernel(m, n, k, dtype, bias, act, point)
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
        read_gb = (m * k + n * k) * a.element_size() / 1e9  # what a decode GEMM's time is: its operands' bytes
        queue.put({"point": point, "rel_err": err, "build_s": round(build_s, 2), "ms": mine * 1e3,
                   "tflops": tf / mine, "cublas_tflops": tf / cublas, "ratio": cublas / mine,
                   "read_gbs": read_gb / mine, "cublas_read_gbs": read_gb / cublas})
    except Exception as exc:  # noqa: BLE001 - a failing point is reported, not fatal
        queue.put({"point": point, "error": f"{type(exc).__name__}: {str(exc)[-600:]}"})


def _space_point(op, shape, dtype, attrs, point, repeat, queue):
    """Any workload's space at one point (``--hand-points space``): built as the search builds it, checked against the
    float64 reference, timed with the L2 flushed; GB/s of the workload's least bytes."""
    try:
        from autosched.measure.timing import time_cuda
        from autosched.target import parse_target
        from autosched.task import Task
        from autosched.workloads import make_workload

        target = parse_target("cuda")
        task = Task.from_workload(make_workload(op, shape, dtype, attrs))
        space = task.space(target)
        checker = task.spec.checker(task.func)
        inputs = checker.make_inputs(torch.Generator().manual_seed(0), "cuda")
        t0 = time.perf_counter()
        fn, err = run_tvm_module(space.apply(point), target, checker, inputs, checker.reference(inputs),
                                 space.build_config(point), space.codegen)
        build_s = time.perf_counter() - t0
        seconds = statistics.median(time_cuda(fn, repeat, 256 << 20))
        queue.put({"point": space.complete(point), "space": space.name, "rel_err": err, "ok": err <= checker.tolerance,
                   "build_s": round(build_s, 2), "us": seconds * 1e6, "gbs": task.min_bytes / seconds / 1e9})
    except Exception as exc:  # noqa: BLE001 - a failing point is reported, not fatal
        queue.put({"point": point, "error": f"{type(exc).__name__}: {str(exc)[-600:]}"})


def space_points(op: str, shape: str, dtype: str, attrs: str, which: str) -> list[dict]:
    """``first``: the space's first points (its default, then what the search measures right after it); ``all``: those
    and every valid point of the space's knobs, canonical, each once (small spaces only); else a JSON list."""
    from autosched.target import parse_target
    from autosched.task import Task
    from autosched.workloads import make_workload

    if which not in ("first", "all"):
        return json.loads(which)
    space = Task.from_workload(make_workload(op, shape, dtype, attrs)).space(parse_target("cuda:sm_90",
                                                                                           require_device=False))
    points = space.first_points()
    if which == "all":
        import itertools

        for values in itertools.product(*(knob.choices for knob in space.knobs)):
            point = space.canonical(dict(zip((knob.name for knob in space.knobs), values)))
            if space.validate(point) is None:
                points.append(point)
    return [p for i, p in enumerate(points) if p not in points[:i]]


FP8_BASE = {"consumers": 2, "wg_rows": 64, "block_n": 192, "stages": 4, "group_m": 8, "persistent": False,
            "promote": True}


def fp8_probe_points() -> list[dict]:
    """hopper_fp8_gemm points: promoted sums (each 128-code stage added in fp32) or the tensor cores' own
    accumulation, tile widths, ring depths, persistence, ping-pong and multicast."""
    pts = [dict(FP8_BASE)]
    for change in ({"promote": False}, {"promote": False, "block_n": 256}, {"block_n": 128}, {"block_n": 128, "stages": 6},
                   {"stages": 5}, {"persistent": True}, {"persistent": True, "pingpong": True},
                   {"persistent": True, "pingpong": True, "promote": False, "block_n": 256},
                   {"persistent": True, "multicast": "b", "block_n": 128}, {"consumers": 1, "wg_rows": 128, "block_n": 64},
                   {"group_m": 1}, {"group_m": 16}):
        pts.append({**FP8_BASE, **change})
    return pts


def _fp8_point(m, n, k, dtype, bias, act, point, queue):
    """One hopper_fp8_gemm point against the float64 reference, timed beside cuBLAS's FP8 GEMM (torch._scaled_mm,
    row-wise scales) and cuBLAS's fp16/bf16 GEMM of the same shape."""
    try:
        import torch
        import tvm

        from autosched.measure.timing import time_cuda
        from autosched.search_spaces.templates.hopper_gemm import hopper_gemm_kernel
        from autosched.workloads.fp8 import quantize_e4m3

        point = {**point, "sms": torch.cuda.get_device_properties(0).multi_processor_count}
        t0 = time.perf_counter()
        func = hopper_gemm_kernel(m, n, k, dtype, bias, act, point, fp8=True)
        ex = tvm.compile(tvm.IRModule({"main": func}), target=tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}),
                         tir_pipeline="tirx")
        build_s = time.perf_counter() - t0
        tdt = getattr(torch, dtype)
        a, sa = quantize_e4m3(torch.randn(m, k, device="cuda"))
        w, sw = quantize_e4m3(torch.randn(n, k, device="cuda") / k ** 0.5)
        bias_t = torch.randn(n, device="cuda", dtype=tdt) if bias else None
        c = torch.full((m, n), float("nan"), device="cuda", dtype=tdt)
        targs = [tvm.runtime.from_dlpack(t) for t in [a, w, sa, sw] + ([bias_t] if bias else []) + [c]]
        ex(*targs)
        torch.cuda.synchronize()
        a8, w8 = a.view(torch.float8_e4m3fn), w.view(torch.float8_e4m3fn)
        ref = (a8.double() @ w8.double().T) * sa.double()[:, None] * sw.double()[None, :]
        if bias:
            ref = ref + bias_t.double()
        if act == "silu":
            ref = torch.nn.functional.silu(ref)
        err = float((c.double() - ref).norm() / ref.norm()) if torch.isfinite(c).all() else float("inf")
        flush = 256 << 20
        mine = statistics.median(time_cuda(lambda: ex(*targs), 30, flush))
        tf = 2 * m * n * k / 1e12
        row = {"point": point, "rel_err": err, "build_s": round(build_s, 2), "ms": mine * 1e3, "tflops": tf / mine}
        try:
            def scaled_mm():
                return torch._scaled_mm(a8, w8.t(), scale_a=sa.view(-1, 1), scale_b=sw.view(1, -1), out_dtype=tdt)
            cublas8 = statistics.median(time_cuda(scaled_mm, 30, flush))
            row.update(cublas_fp8_tflops=tf / cublas8, ratio_cublas_fp8=cublas8 / mine)
        except Exception as exc:  # noqa: BLE001 - torch may not take this output dtype with row-wise scales
            row["cublas_fp8_error"] = str(exc)[:200]
        a16, b16 = torch.randn(m, k, device="cuda", dtype=tdt), torch.randn(n, k, device="cuda", dtype=tdt)
        cublas16 = statistics.median(time_cuda(lambda: torch.matmul(a16, b16.T), 30, flush))
        row.update(cublas_16bit_tflops=tf / cublas16, ratio_cublas_16bit=cublas16 / mine)
        queue.put(row)
    except Exception as exc:  # noqa: BLE001 - a failing point is reported, not fatal
        queue.put({"point": point, "error": f"{type(exc).__name__}: {str(exc)[-600:]}"})


ATTENTION_POINTS = [{"consumers": c, "block_kv": kv, "stages": st, "overlap": ov, "pingpong": False}
          for c in (2, 1) for kv in (128, 64) for st in (2, 3) for ov in (False, True)]
ATTENTION_POINTS += [{"consumers": 2, "block_kv": kv, "stages": st, "overlap": False, "pingpong": True}
           for kv in (128, 64) for st in (2, 3)]


def _attention_point(case, dtype, point, queue):
    try:
        import torch
        import torch.nn.functional as F
        import tvm
        from torch.nn.attention import SDPBackend, sdpa_kernel

        from autosched.measure.timing import time_cuda
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


def hand_points(args) -> int:
    """`--hand-points gemm|fp8|attention|space`: the points of --points (a preset or a JSON list), no search."""
    from _isolated import run_isolated

    rows = []
    if args.hand_points in ("gemm", "fp8"):
        presets = {"base": lambda: [GEMM_BASE], "all": gemm_probe_points, "small": gemm_small_m_points}
        if args.hand_points == "fp8":
            presets = {"base": lambda: [FP8_BASE], "all": fp8_probe_points}
        decode = args.points == "decode"  # per shape: gemm_decode_points
        points = [] if decode else presets[args.points]() if args.points in presets else json.loads(args.points)
        for shape in args.shape or ["4096,4096,4096"]:
            m, n, k = (int(x) for x in shape.split(","))
            for point in gemm_decode_points(m, n, k, args.dtype) if decode else points:
                row = run_isolated(_fp8_point if args.hand_points == "fp8" else _gemm_point,
                                   (m, n, k, args.dtype, args.bias, args.act, point), args.timeout, {"point": point})
                rows.append({**row, "shape": [m, n, k]})
                print(json.dumps(rows[-1]), flush=True)
    elif args.hand_points == "space":
        for shape in args.shape:
            for point in space_points(args.workload, shape, args.dtype, args.attrs, args.points):
                row = run_isolated(_space_point, (args.workload, shape, args.dtype, args.attrs, point, 30), args.timeout,
                                   {"point": point})
                rows.append({**row, "workload": args.workload, "shape": shape, "attrs": args.attrs})
                print(json.dumps(rows[-1]), flush=True)
    else:
        points = ATTENTION_POINTS if args.points in ("all", "base") else json.loads(args.points)
        for text in args.case or ["1,32,32,2048,128,causal"]:
            *nums, mode = text.split(",")
            case = (*(int(x) for x in nums), mode == "causal")
            for point in points:
                rows.append(run_isolated(_attention_point, (case, args.dtype, point), args.timeout,
                                         {"case": case, "point": point}))
                print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.hand_points}_points.json").write_text(json.dumps(rows, indent=1))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--trials", type=int, default=128)
    parser.add_argument("--time-budget", type=float, default=35.0, help="tuning seconds per case")
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/gpu"))
    hand = parser.add_argument_group("hand-picked template points (no search)")
    hand.add_argument("--hand-points", choices=("gemm", "fp8", "attention", "space"),
                      help="time chosen points of hopper_gemm, hopper_fp8_gemm (fp8_gemm) or hopper_attention beside "
                      "torch instead of the cases")
    hand.add_argument("--shape", action="append", default=[], help="gemm: m,n,k; space: m=1,n=11008,k=4096 (repeatable)")
    hand.add_argument("--case", action="append", default=[], help="attention: b,h,hkv,s,d,causal|full (repeatable)")
    hand.add_argument("--points", default="all",
                      help="gemm: base | all | small | decode (m of 2-16: the wgmma default and the streaming kernel's "
                           "points); fp8: base | all; attention: all; space: first | all; or a JSON list")
    hand.add_argument("--dtype", default="float16")
    hand.add_argument("--workload", default="dequant_gemm", help="space: the operator")
    hand.add_argument("--attrs", default="", help="space: the workload's attributes (bits=4,group=128)")
    hand.add_argument("--bias", action="store_true")
    hand.add_argument("--act", default="none")
    hand.add_argument("--timeout", type=float, default=120, help="seconds per point")
    args = parser.parse_args()
    if args.hand_points:
        return hand_points(args)

    import tvm

    from autosched.database.store import Database
    from autosched.measure import MeasureConfig, Measurer
    from autosched.measure.timing import time_cuda
    from autosched.target import parse_target
    from autosched.task import Task
    from autosched.tuner import TuneOptions, tune
    from autosched.workloads import make_workload

    target = parse_target("cuda")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    db = Database(out_dir / "gpu_tuning.db")
    machine = {"gpu": target.device_name, "arch": target.arch, "sms": target.num_cores, "driver": target.driver_version,
               "tvm": tvm.__version__, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    print(f"machine: {machine}", flush=True)
    machine["copy_bandwidth_gbps"] = copy_bandwidth(time_cuda)
    machine["l2_flush"] = args.flush
    print(f"device-to-device copy: {machine['copy_bandwidth_gbps']:.0f} GB/s", flush=True)
    rows = []
    measurer = Measurer(target, MeasureConfig.for_target(target, repeat=10))
    try:
        for name in args.cases:
            op, shape, dtype, attrs, bound = CASES[name]
            wl = make_workload(op, shape, dtype, attrs)
            task = Task.from_workload(wl)
            checker = task.spec.checker(task.func)
            inputs = checker.make_inputs(torch.Generator().manual_seed(0), "cuda")
            refs = checker.reference(inputs)
            row = {"case": name, "workload": wl.key, "bound": bound, "flops": task.flops, "bytes": task.min_bytes}

            def timed(fn):
                return statistics.median(time_cuda(fn, args.repeat, 256 << 20))

            try:
                start = time.perf_counter()
                result = tune(task, target, db, TuneOptions(trials=args.trials, batch_size=32, seed=0,
                                                            time_budget=args.time_budget), measurer=measurer)
                row["tuning_s"], row["trials"] = time.perf_counter() - start, result.trials
                row["space"] = result.space
                if result.best_point is not None:
                    space = task.space(target)
                    fn, err = run_tvm_module(space.apply(result.best_point), target, checker, inputs, refs,
                                             space.build_config(result.best_point), space.codegen)
                    row["autosched_err"] = err
                    row["autosched_s"] = timed(fn) if err <= checker.tolerance else None
                    row["best_point"] = result.best_point
                row["failures"] = result.failures
                row["to_90pct_s"] = seconds_to_90_percent(db, wl.key, result.run_id)
            except Exception:  # noqa: BLE001 - report and go on to the next case
                row["autosched_error"] = traceback.format_exc(limit=3)
            try:
                fn, err = run_tvm_module(dlight_module(task.func, target), target, checker, inputs, refs)
                row["dlight_err"] = err
                row["dlight_s"] = timed(fn) if err <= checker.tolerance else None
            except Exception:  # noqa: BLE001
                row["dlight_error"] = traceback.format_exc(limit=3)
            try:
                fn = torch_fn(op, wl, inputs)
                row["torch_err"] = check_torch(fn, refs)
                row["torch_s"] = timed(fn)
            except Exception:  # noqa: BLE001
                row["torch_error"] = traceback.format_exc(limit=3)
            rows.append(row)
            print(json.dumps(row, default=str), flush=True)
            (out_dir / "results.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=2, default=str))
    finally:
        measurer.close()
        db.close()
    table = markdown(machine, rows)
    (out_dir / "results.md").write_text(table)
    print(table)
    return 0


def _rate(row, key):
    t = row.get(key)
    if not t:
        return "-"
    if row["bound"] == "compute":
        return f"{row['flops'] / t / 1e12:.1f} TFLOP/s"
    return f"{row['bytes'] / t / 1e9:.0f} GB/s"


def markdown(machine, rows) -> str:
    lines = [f"GPU: {machine['gpu']} ({machine['arch']}, {machine['sms']} SMs, driver {machine['driver']}); "
             f"TVM {machine['tvm']}, torch {machine['torch']}; {machine['date']}. "
             f"Device-to-device copy: {machine['copy_bandwidth_gbps']:.0f} GB/s. L2 flushed by {machine['l2_flush']}.",
             "",
             "| case | space | autosched | rate | dlight | rate | torch | rate | vs dlight | vs torch | trials "
             "| tuning (s) | to 90% (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def us(t):
        return f"{t * 1e6:.1f} us" if t else "failed"

    for r in rows:
        a, d, t = r.get("autosched_s"), r.get("dlight_s"), r.get("torch_s")
        vs_d = f"{d / a:.2f}x" if a and d else "-"
        vs_t = f"{t / a:.2f}x" if a and t else "-"
        to90 = r.get("to_90pct_s")
        lines.append(f"| {r['case']} | {r.get('space', '-')} | {us(a)} | {_rate(r, 'autosched_s')} | {us(d)} | "
                     f"{_rate(r, 'dlight_s')} | {us(t)} | {_rate(r, 'torch_s')} | {vs_d} | {vs_t} | "
                     f"{r.get('trials', '-')} | {r.get('tuning_s', 0):.0f} | {'-' if to90 is None else f'{to90:.0f}'} |")
    lines += ["", "Ratios are speed-ups of autosched (above 1: autosched faster). Memory-bound rates count each "
              "input read once and each output written once."]
    by_case = {r["case"]: r for r in rows}
    for fp8, fp16 in FP8_TWINS.items():
        a, b = by_case.get(fp8, {}).get("autosched_s"), by_case.get(fp16, {}).get("autosched_s")
        if a and b:
            lines.append(f"FP8 `{fp8}`: {b / a:.2f}x the speed of our fp16 `{fp16}` ({us(a)} vs {us(b)}).")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
