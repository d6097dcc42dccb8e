"""A mixture-of-experts prefill's expert products as one grouped GEMM on tensor cores, for sm_90: the space of the
``moe_grouped_gemm`` workload (X's routed rows sorted by expert, the experts' row offsets ``indptr`` [e + 1],
W [e, n, k], Y [m, n]).

Why a workload of its own rather than a template for ``moe_gemm``: ``moe_gemm`` takes the rows in any order
with an expert index per row, so a tile of its rows may need as many weight tiles as it has rows, and only a
GEMV per row (``gpu_moe_matmul``) is fair to every order. With the rows sorted by expert and the offsets given,
a tile of rows of one expert shares each weight tile, which is a GEMM's reuse: the weights are read once per
row tile instead of once per row, and the products run on tensor cores. Sorting is the caller's (the decoder
sorts a prefill chunk's routed rows, gathers X into that order and scatters Y back:
``autosched/generation/linear.py``'s :func:`~autosched.generation.linear.grouped_moe`); decode's few rows keep
``moe_gemm``, whose GEMV wastes nothing on them. As MLC-LLM's ``group_gemm`` and vLLM's fused MoE kernel do,
each CTA owns an (expert, row tile, column tile); here the row tiles are counted on the device from ``indptr``
(no per-tile table to build), the launch holding ``m / block_m + e`` slots per column tile, the spare ones
returning at once.

The body is ``cuda/moe_grouped_gemm.cuh``: mma.sync m16n8k16 (fp16 or bf16 in, fp32 accumulation), four or
eight warps (2 or 4 along the rows x 2 along the columns), ldmatrix from XOR-swizzled shared memory fed by a ring
of cp.async stages of 64 k. Knobs: the row tile (``block_m``: 32 suits Qwen3-MoE's ~32 rows per expert, 128
Mixtral's ~128), the column tile (``block_n``), the ring's depth (``stages``) and the warps (``warps``: eight
halve each warp's accumulators). The CPU serves the workload with ``moe_matmul``.
"""

from __future__ import annotations

import math

from autosched.target import device_facts

from .._knobs import Knob, Point
from ._hopper import CUDA_SCALAR, HOPPER_ARCHS, SMEM_LIMIT, HopperTemplate, device_function

# Deferred imports: tvm (imported where used: `autosched --help` stays fast).

BK = 64  # k per stage
WARPS_N = 2  # warps along the columns; the rest (warps / 2) along the rows
MAX_ACCUMULATORS = 128  # fp32 accumulators per thread: (block_m / (warps / 2) / 16) x (block_n / 16) x 4


def smem_elements(block_m: int, block_n: int, stages: int) -> int:
    """Shared memory of the body, in elements: each stage's X and W tiles."""
    return stages * (block_m + block_n) * BK


def slots(m: int, e: int, block_m: int) -> int:
    """Row-tile slots per column tile: as many as any split of m rows among e experts can need."""
    return math.ceil(m / block_m) + e


def unsupported(n: int, k: int, dtype: str) -> str | None:
    """Why the kernel cannot serve these sizes, or None."""
    if dtype not in CUDA_SCALAR:
        return f"dtype {dtype} (fp16 and bf16 only)"
    if k % 8:
        return f"k = {k} (rows of whole 16-byte chunks: a multiple of 8)"
    if n % 2:
        return f"n = {n} (columns stored in pairs: even)"
    return None


def kernel_name(m: int, e: int, n: int, k: int, dtype: str, p: Point) -> str:
    return (f"autosched_moe_grouped_gemm_m{m}_e{e}_n{n}_k{k}_bm{p['block_m']}_bn{p['block_n']}_s{p['stages']}"
            f"_w{p['warps']}_{dtype}")


def body_source(name: str, m: int, e: int, n: int, k: int, dtype: str, p: Point) -> str:
    config = {"M": m, "E": e, "N": n, "K": k, "BM": p["block_m"], "BN": p["block_n"], "STAGES": p["stages"],
              "WARPS": p["warps"]}
    return device_function("moe_grouped_gemm.cuh", "AUTOSCHED_MOE_GROUPED_GEMM", name, dtype, config)


def moe_grouped_gemm_kernel(m: int, e: int, n: int, k: int, dtype: str, p: Point):
    """The TIRx launch of point ``p`` with the ``moe_grouped_gemm`` workload's signature (X, indptr, W, Y)."""
    from tvm.script import tirx as T

    reason = unsupported(n, k, dtype)
    if reason:
        raise ValueError(f"moe_grouped_gemm cannot serve {reason}")
    name = kernel_name(m, e, n, k, dtype, p)
    source = body_source(name, m, e, n, k, dtype, p)
    grid = slots(m, e, p["block_m"]) * math.ceil(n / p["block_n"])
    elements = smem_elements(p["block_m"], p["block_n"], p["stages"])
    threads = 32 * p["warps"]

    # fmt: off
    @T.prim_func
    def main(X: T.Buffer((m, k), dtype, align=16), indptr: T.Buffer((e + 1,), "int32"),
             W: T.Buffer((e, n, k), dtype, align=16), Y: T.Buffer((m, n), dtype, align=16)):
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        T.device_entry()
        cta = T.cta_id([grid])
        tx = T.thread_id([threads])  # noqa: F841 (declares the block's threads)
        smem = T.alloc_buffer((elements,), dtype, scope="shared.dyn", align=128)
        T.cuda.func_call(name, X.access_ptr("r"), indptr.access_ptr("r"), W.access_ptr("r"), Y.access_ptr("w"),
                         smem.access_ptr("rw"), cta, source_code=source)
    # fmt: on
    return main


def _shape(func) -> dict | None:
    """The workload's sizes from X[m, k], indptr[e + 1] int32, W[e, n, k], Y[m, n]."""
    params = list(func.params)
    if len(params) != 4:
        return None
    try:
        (m, k), (e1,), (e, n, k2), (m2, n2) = ([int(x) for x in p.shape] for p in params)
    except (AttributeError, TypeError, ValueError):
        return None
    if str(params[1].dtype) != "int32" or e1 != e + 1 or k != k2 or m != m2 or n != n2:
        return None
    return {"m": m, "e": e, "n": n, "k": k, "dtype": str(params[0].dtype)}


class MoeGroupedGemmSpace(HopperTemplate):
    """``moe_grouped_gemm`` on sm_90: the grouped GEMM above."""

    name = "moe_grouped_gemm"
    version = 1
    families = ("moe_grouped",)

    @classmethod
    def matches(cls, func) -> bool:
        return _shape(func) is not None

    @classmethod
    def suits(cls, func, target, hints) -> bool:
        if target.arch not in HOPPER_ARCHS or (hints or {}).get("op") != "moe_grouped_gemm":
            return False
        s = _shape(func)
        return s is not None and unsupported(s["n"], s["k"], s["dtype"]) is None

    def __init__(self, func, target, hints=None):
        super().__init__(func, target, hints)
        self.shape = self.taken(_shape(func), "the moe_grouped_gemm workload's")
        self.sms = device_facts(target).sms
        self.knobs = [
            Knob("block_m", (32, 64, 128)),
            Knob("block_n", (32, 64, 128)),
            Knob("stages", (2, 3, 4)),
            Knob("warps", (4, 8)),
        ]

    def check(self, p: Point) -> str | None:
        bm, bn, stages, warps = p["block_m"], p["block_n"], p["stages"], p["warps"]
        warp_rows = bm // (warps // WARPS_N)
        if warp_rows < 16:
            return f"{warps} warps over {bm} rows leave a warp {warp_rows} (an mma tile is 16)"
        accumulators = warp_rows // 16 * (bn // 16) * 4
        if accumulators > MAX_ACCUMULATORS:
            return f"{accumulators} fp32 accumulators per thread for a {bm} x {bn} tile (at most {MAX_ACCUMULATORS})"
        smem = 2 * smem_elements(bm, bn, stages)
        if smem > SMEM_LIMIT:
            return f"{smem} bytes of shared memory (limit {SMEM_LIMIT})"
        if stages > 2 and math.ceil(self.shape["k"] / BK) < stages:
            return f"{stages} stages for {math.ceil(self.shape['k'] / BK)} steps of k"
        return None

    def default(self) -> Point:
        # The smallest row tile that holds an expert's average rows (fewer rows masked off at each expert's
        # end), columns of 128 (64 where n is small), three stages.
        rows = self.shape["m"] / self.shape["e"]
        bm = next((b for b in (32, 64) if rows <= b), 128)
        bn = 128 if self.shape["n"] >= 1024 else 64
        for stages in (3, 2):
            point = {"block_m": bm, "block_n": bn, "stages": stages, "warps": 4}
            if self.check(point) is None:
                return point
        return super().default()

    def kernel(self, p: Point):
        s = self.shape
        return moe_grouped_gemm_kernel(s["m"], s["e"], s["n"], s["k"], s["dtype"], p)

    def point_features(self, p: Point) -> list[float]:
        """Knobs, the CTAs against the SMs, and how full an expert's row tiles are on average."""
        s = self.shape
        bm, bn = p["block_m"], p["block_n"]
        rows = s["m"] / s["e"]
        tiles = s["e"] * max(1, math.ceil(rows / bm)) * math.ceil(s["n"] / bn)
        return [bm, bn, p["stages"], p["warps"], tiles / self.sms, math.log2(tiles),
                rows / (max(1, math.ceil(rows / bm)) * bm), s["k"] / BK]
