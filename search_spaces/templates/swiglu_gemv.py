"""A decode step's SwiGLU, gate and up projections with SiLU(gate)·up in one streaming GEMV (``swiglu_gemm`` with
at most eight rows, fp16/bf16) as a TIRx kernel for sm_90. Not yet run on a GPU.

Unfused, a decode step ran the gate and up projections as one GEMV over W[2n, k] (``gpu_gemv``), then a kernel of
its own for SiLU(y[:n]) · y[n:], every layer. ``hopper_gemm``'s fused kernel takes prefill chunks; this template
is gemv8's streaming kernel (:mod:`.gemv8`) for 16-bit weights and two weight rows per output column:

* each warp owns ``cols_per_warp`` output columns j; for each it reads gate row j and up row n + j, its 32 lanes
  taking consecutive 16-byte chunks (8 weights each) of both, through the non-coherent path with no L1
  allocation (the weights are read once);
* a chunk becomes 8 fp32 weights (``cuda/swiglu_gemv.cuh``, common.cuh's conversions); the products and sums are
  fp32, a gate and an up accumulator per activation row (``m`` rows, at most 8, read from L1/L2);
* the lanes' partial sums meet by int4_gemv's warp shuffles, and lane 0 stores SiLU(gate) · up, SiLU in fp32 as
  the workload's reference has it, g / (1 + exp(-g)), cast to the output dtype once.

Knobs: gemv8's warps per block, columns per warp (two weight rows each) and ``unroll`` (a lane's loop unrolled in
equal parts of at most 16 loads, then a last step for the lanes of a row's remaining chunks; loads unconditional,
a warp past the last column reading it again and storing nothing).
"""

from __future__ import annotations

import math

from autosched.target import device_facts

from .._knobs import Knob, Point
from ._hopper import CUDA_SCALAR, HOPPER_ARCHS, HopperTemplate, cuda_file, epilogue_source
from .gemv8 import StreamingSteps, streamed_sums, unroll_factor
from .hopper_gemm import _gemm_shape
from .int4_gemv import MAX_M

# Deferred imports: tvm (imported where used: `autosched --help` stays fast).

CHUNK = 8  # weights per lane per load: 16 bytes of fp16/bf16
_DTYPES = ("float16", "bfloat16")


def _dot_source(dtype: str, m: int) -> tuple[str, str]:
    """(name, source) of the helper that adds one chunk's products of a gate row and an up row with each of m rows
    to that row's gate and up accumulators (``cuda/swiglu_gemv.cuh``)."""
    scalar = CUDA_SCALAR[dtype]
    name = f"autosched_swiglu_chunk_{dtype}_m{m}"
    accs = ", ".join([f"float& g{i}" for i in range(m)] + [f"float& u{i}" for i in range(m)])
    rows = " ".join(f"autosched_swiglu_row<{scalar}>(g{i}, u{i}, wg, wu, xp, {i}, row_bytes);" for i in range(m))
    return name, cuda_file("swiglu_gemv.cuh") + (
        f"__device__ __forceinline__ void {name}({accs}, const void* gp, const void* up, const void* xp, "
        f"int row_bytes) {{ float wg[8], wu[8]; autosched_swiglu_unpack<{scalar}>(gp, wg); "
        f"autosched_swiglu_unpack<{scalar}>(up, wu); {rows} }}\n")


def swiglu_gemv_kernel(m: int, n: int, k: int, dtype: str, p: Point):
    """The TIRx kernel of point ``p`` for C[m, n] = SiLU(A[m, k] · W[:n]ᵀ) ⊙ (A · W[n:]ᵀ), W[2n, k].

    Accumulators: column r's gate sums of the m rows, then its up sums (``2 m`` per column). A lane's loop runs
    over the steps in which every lane has a chunk, ``unrolled`` at a time, then a last step for the lanes of a
    row's remaining chunks."""
    from tvm.script import tirx as T

    warps, cols_pw = p["warps"], p["cols_per_warp"]
    threads, cols_pb = 32 * warps, warps * cols_pw
    grid = math.ceil(n / cols_pb)
    chunks = k // CHUNK  # per weight row
    full, tail = divmod(chunks, 32)  # steps in which every lane has a chunk; the lanes of the last one
    unrolled = unroll_factor(full, 2 * cols_pw) if p["unroll"] else 1
    dot, dot_source = _dot_source(dtype, m)
    _, store1, epi_source = epilogue_source(dtype, "none")

    def read_col(col):  # the column a warp reads: past the last one (n that no block divides), the last
        return T.min(col, n - 1) if n % cols_pb else col

    def add_chunk(acc, A, W, r, col, chunk):
        return T.cuda.func_call(dot, *[acc[r * 2 * m + i] for i in range(2 * m)],
                                W.access_ptr("r", offset=read_col(col) * k + chunk * CHUNK),
                                W.access_ptr("r", offset=(n + read_col(col)) * k + chunk * CHUNK),
                                A.access_ptr("r", offset=chunk * CHUNK), k * 2, source_code=dot_source)

    def swiglu(acc, r, i):  # SiLU(gate) · up in fp32
        gate, up = acc[r * 2 * m + i], acc[r * 2 * m + m + i]
        return gate / (T.float32(1) + T.exp(-gate)) * up

    stream = streamed_sums(cols_pw * 2 * m, cols_pw, full, unrolled, tail, add_chunk)

    # fmt: off
    @T.prim_func
    def main(A: T.Buffer((m, k), dtype, align=16), W: T.Buffer((2 * n, k), dtype, align=16),
             C: T.Buffer((m, n), dtype, align=16)):
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        T.device_entry()
        bx = T.cta_id([grid])
        tx = T.thread_id([threads])
        acc = T.alloc_local((cols_pw * 2 * m,), "float32")
        lane = T.meta_var(tx % 32)
        first = T.meta_var(bx * cols_pb + (tx // 32) * cols_pw)  # the warp's first column
        stream(acc, A, W, first, lane)
        if lane == 0:
            for r in T.unroll(cols_pw):
                if first + r < n:
                    for i in T.unroll(m):
                        T.cuda.func_call(store1, C.access_ptr("w", offset=i * n + first + r), swiglu(acc, r, i),
                                         source_code=epi_source)
    # fmt: on
    return main


class SwigluGemvSpace(StreamingSteps, HopperTemplate):
    """``swiglu_gemm`` with at most eight rows of fp16/bf16 on sm_90 (a decode step's gate and up projections and
    SiLU·up): the streaming kernel above."""

    chunk = CHUNK
    name = "swiglu_gemv"
    version = 1
    families = ("swiglu_gemm",)

    @classmethod
    def matches(cls, func) -> bool:
        return _gemm_shape(func, gated=True) is not None

    @classmethod
    def suits(cls, func, target, hints) -> bool:
        if target.arch not in HOPPER_ARCHS or (hints or {}).get("op") != "swiglu_gemm":
            return False
        shape = _gemm_shape(func, gated=True)
        return shape is not None and cls.serves(shape[0], shape[2], shape[3])

    @classmethod
    def serves(cls, m: int, k: int, dtype: str) -> bool:
        """Whether the kernel takes ``m`` rows over ``k`` in ``dtype`` (on sm_90): at most eight rows, fp16 or
        bf16, rows of whole 16-byte chunks."""
        return 1 <= m <= MAX_M and k % CHUNK == 0 and dtype in _DTYPES

    def __init__(self, func, target, hints=None):
        super().__init__(func, target, hints)
        self.m, self.n, self.k, self.dtype = self.taken(_gemm_shape(func, gated=True),
                                                        "C[m, n] = SiLU(A · W[:n]ᵀ) ⊙ (A · W[n:]ᵀ), W[2n, k]")
        self.sms = device_facts(target).sms
        self.knobs = [
            Knob("warps", (1, 2, 4, 8)),
            Knob("cols_per_warp", (1, 2, 4)),
            Knob("unroll", (False, True), ordered=False),
        ]

    def loads_per_step(self, p: Point) -> int:
        return 2 * p["cols_per_warp"]  # a gate row and an up row per column

    def check(self, p: Point) -> str | None:
        if 2 * p["cols_per_warp"] * self.m > 32:
            return f"{2 * p['cols_per_warp'] * self.m} accumulators per thread (at most 32)"
        if p["cols_per_warp"] * p["warps"] > 2 * self.n:
            return "more columns per block than the output has"
        return None

    def default(self) -> Point:
        for point in ({"warps": 4, "cols_per_warp": 1, "unroll": True}, {"warps": 1, "cols_per_warp": 1, "unroll": True}):
            point = self.canonical(point)
            if self.check(point) is None:
                return point
        return super().default()

    def kernel(self, p: Point):
        return swiglu_gemv_kernel(self.m, self.n, self.k, self.dtype, p)

    def point_features(self, p: Point) -> list[float]:
        """Knobs, the bytes each thread has in flight, and how the blocks fill the machine."""
        cols_pb = p["warps"] * p["cols_per_warp"]
        in_flight = 2 * 16 * p["cols_per_warp"] * self.unrolled(p)
        blocks = math.ceil(self.n / cols_pb)
        return [p["warps"], p["cols_per_warp"], float(p["unroll"]), cols_pb, math.log2(blocks), blocks / self.sms,
                in_flight, in_flight * 32 * p["warps"], self.steps(), self.m]
