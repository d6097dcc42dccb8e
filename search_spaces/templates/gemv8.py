"""8-bit decode GEMV (``dequant_gemm`` with bits=8 and a few rows) as a TIRx kernel for sm_90: int8 codes
(``fmt=int``, w = s·q, q8f16) or the bits of float8 E4M3FN numbers (``fmt=e4m3``, w = s·e4m3(q), fp8), one scale
per output channel. Not yet run on a GPU.

The TensorIR GEMV space (``gpu_gemv``) serves these far from the copy rate. This template is int4_gemv's
streaming kernel (:mod:`.int4_gemv`) for bytes:

* each warp owns ``rows_per_warp`` output columns (weight rows); its 32 lanes take consecutive 16-byte chunks of a
  row (16 weights each), so a warp reads 512 contiguous bytes per load, through the non-coherent path with no L1
  allocation (the weights are read once);
* a chunk becomes 16 fp32 weights exactly (``cuda/gemv8.cuh``): an int8 code q ^ 0x80 in the low mantissa bits of
  2^23, minus 2^23 + 128, is q (a byte permute and an add per weight: a cvt from int8 would issue at a quarter of
  the rate the weights arrive at); an E4M3 code's sign, exponent and mantissa bits moved into a half's, which then
  reads the code's value over 256 for normal and subnormal codes alike, NaN for 0x7F and 0xFF;
* the products and sums are fp32; the channel's scale (times 256 for E4M3) is applied once, after the warp's sum,
  as the workload's scales are one per output channel (group = k);
* the activations (``m`` rows, at most 8) are read from L1/L2, where every warp of the block finds them;
* the lanes' partial sums meet by warp shuffles (int4_gemv's), and lane 0 applies bias and activation and stores.

Knobs: int4_gemv's warps per block, weight rows per warp and ``unroll``. Rows of 8-bit weights take twice the
chunks of int4 ones, so rather than unrolling a lane's whole loop (which int4_gemv refuses past 16 loads),
``unroll`` unrolls it in equal parts: the most steps that divide its full steps (those in which every lane has a
chunk) and issue at most 16 loads; a last step serves the lanes of a row's remaining chunks (a 4096 x 11008 down
projection: 21 full steps in parts of 7, then a step for half of the lanes). The loads are unconditional, so
that nvcc may issue a part's loads before its arithmetic: warps past the last weight row read it again and store
nothing. Kept apart from int4_gemv (whose generated code stays as it was), it shares that template's warp sum,
limits and epilogue.
"""

from __future__ import annotations

import math

from autosched.target import device_facts

from .._analysis import operand_shapes
from .._knobs import Knob, Point
from ._hopper import CUDA_SCALAR, HOPPER_ARCHS, HopperTemplate, cuda_file, epilogue_source
from .int4_gemv import _WARP_SUM, MAX_M, MAX_UNROLLED_STEPS

# Deferred imports: tvm (imported where used: `autosched --help` stays fast).

CHUNK = 16  # weights per lane per load: 16 bytes
_DTYPES = ("float16", "bfloat16")
_CODES = {"int": "int8", "e4m3": "uint8"}  # the weights' dtype of each fmt in the workload
E4M3_SCALE = 256.0  # cuda/gemv8.cuh's E4M3 weights are the codes' values over 2^8


def _dot_source(dtype: str, m: int, fmt: str) -> tuple[str, str]:
    """(name, source) of the helper that adds one chunk's product with each of m rows to that row's accumulator
    (``cuda/gemv8.cuh``), the codes read as int8 (``fmt`` "int") or E4M3 over 256 ("e4m3")."""
    name = f"autosched_{'q8' if fmt == 'int' else 'e4m3'}_chunk_{dtype}_m{m}"
    unpack = "autosched_q8_unpack" if fmt == "int" else "autosched_e4m3_unpack"
    accs = ", ".join(f"float& acc{i}" for i in range(m))
    rows = " ".join(f"autosched_q8_row<{CUDA_SCALAR[dtype]}>(acc{i}, w, xp, {i}, row_bytes);" for i in range(m))
    return name, cuda_file("gemv8.cuh") + (
        f"__device__ __forceinline__ void {name}({accs}, const void* wp, const void* xp, int row_bytes) "
        f"{{ float w[16]; {unpack}(wp, w); {rows} }}\n")


def unroll_factor(full_steps: int, rows_per_warp: int) -> int:
    """Steps of a lane's loop unrolled together: the most that divide its ``full_steps`` (the steps in which every
    lane has a chunk) and issue at most 16 loads."""
    most = max(1, MAX_UNROLLED_STEPS // rows_per_warp)
    return max(d for d in range(1, min(full_steps, most) + 1) if full_steps % d == 0) if full_steps else 1


def streamed_sums(accumulators: int, rows: int, full: int, unrolled: int, tail: int, add_chunk):
    """The TVMScript macro ``(acc, A, W, first, lane)`` of a streaming GEMV warp (gemv8, swiglu_gemv): its
    ``accumulators`` zeroed, ``add_chunk(acc, A, W, r, first + r, chunk)`` for each of its ``rows`` over the
    ``full`` steps in which every lane has a chunk (``unrolled`` at a time), then the last step's ``tail``
    lanes, and each accumulator summed over the warp."""
    from tvm.script import tirx as T

    @T.macro
    def loop(acc, A, W, first, lane):
        for i in T.unroll(accumulators):
            acc[i] = T.float32(0)
        for outer in T.serial(full // unrolled):
            for inner in T.unroll(unrolled):
                for r in T.unroll(rows):
                    add_chunk(acc, A, W, r, first + r, (outer * unrolled + inner) * 32 + lane)
        if tail > 0:
            if lane < tail:
                for r in T.unroll(rows):
                    add_chunk(acc, A, W, r, first + r, full * 32 + lane)
        for i in T.unroll(accumulators):
            T.cuda.func_call(_WARP_SUM, acc[i], source_code=cuda_file("int4_gemv.cuh"))

    return loop


def gemv8_kernel(m: int, n: int, k: int, dtype: str, fmt: str, bias: bool, act: str, p: Point):
    """The TIRx kernel of point ``p`` for C[m, n] = act(A[m, k] · (s[n] · w(Wq[n, k]))ᵀ + bias[n]).

    A lane's loop runs over the steps in which every lane has a chunk, ``unrolled`` at a time, then a last step for
    the lanes of a row's remaining chunks. Its loads are unconditional (a warp past the last weight row reads the last
    row again, and stores nothing), so that nvcc may issue an unrolled part's loads before its arithmetic."""
    from tvm.script import tirx as T

    warps, rows_pw = p["warps"], p["rows_per_warp"]
    threads, rows_pb = 32 * warps, warps * rows_pw
    grid = math.ceil(n / rows_pb)
    chunks = k // CHUNK  # per weight row
    full, tail = divmod(chunks, 32)  # steps in which every lane has a chunk; the lanes of the last one
    unrolled = unroll_factor(full, rows_pw) if p["unroll"] else 1
    dot, dot_source = _dot_source(dtype, m, fmt)
    _, store1, epi_source = epilogue_source(dtype, act)

    def scale(S, row):  # the channel's scale, with E4M3's 2^8
        s = T.Cast("float32", S[row, 0])
        return s * T.float32(E4M3_SCALE) if fmt == "e4m3" else s

    def stored(acc, S, Bias, i, row):
        value = acc[i] * scale(S, row)
        return value + T.Cast("float32", Bias[row]) if bias else value

    def read_row(row):  # the weight row a warp reads: past the last one (n that no block divides), the last
        return T.min(row, n - 1) if n % rows_pb else row

    def add_chunk(acc, A, Wq, r, row, chunk):
        return T.cuda.func_call(dot, *[acc[r * m + i] for i in range(m)],
                         Wq.access_ptr("r", offset=read_row(row) * k + chunk * CHUNK),
                         A.access_ptr("r", offset=chunk * CHUNK), k * 2, source_code=dot_source)

    stream = streamed_sums(rows_pw * m, rows_pw, full, unrolled, tail, add_chunk)

    # fmt: off
    @T.macro
    def body(A, Wq, S, Bias, C):
        T.device_entry()
        bx = T.cta_id([grid])
        tx = T.thread_id([threads])
        acc = T.alloc_local((rows_pw * m,), "float32")
        lane = T.meta_var(tx % 32)
        first = T.meta_var(bx * rows_pb + (tx // 32) * rows_pw)  # the warp's first weight row
        stream(acc, A, Wq, first, lane)
        if lane == 0:
            for r in T.unroll(rows_pw):
                if first + r < n:
                    for i in T.unroll(m):
                        T.cuda.func_call(store1, C.access_ptr("w", offset=i * n + first + r),
                                         stored(acc, S, Bias, r * m + i, first + r), source_code=epi_source)

    @T.prim_func
    def main(A: T.Buffer((m, k), dtype, align=16), Wq: T.Buffer((n, k), _CODES[fmt], align=16),
             S: T.Buffer((n, 1), dtype), Bias: T.Buffer((n,), dtype), C: T.Buffer((m, n), dtype, align=16)):
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        body(A, Wq, S, Bias if bias else None, C)
    # fmt: on
    if bias:
        return main
    # The body never names the bias it was given as None: the same function less that parameter.
    from tvm import tirx

    params = [param for i, param in enumerate(main.params) if i != 3]
    return tirx.PrimFunc(params, main.body, main.ret_type, main.attrs, main.span)


class StreamingSteps:
    """A streaming GEMV space's steps over K (a lane's 16-byte chunks of a weight row, 32 lanes a step) and
    their unrolling; ``chunk``: weights a lane loads at once; ``loads_per_step(p)``: the weight rows a lane
    loads a chunk of in each step."""

    chunk = CHUNK

    def steps(self) -> int:
        """Steps of a lane's loop, the last one for part of the lanes where 32 do not divide a row's chunks."""
        return math.ceil(self.k // self.chunk / 32)

    def full_steps(self) -> int:
        """Steps in which every lane has a chunk."""
        return self.k // self.chunk // 32

    def unrolled(self, p: Point) -> int:
        """Steps of a lane's loop whose loads are issued together."""
        return unroll_factor(self.full_steps(), self.loads_per_step(p)) if p["unroll"] else 1

    def canonical(self, p: Point) -> Point:
        # nothing to unroll where no more than one step divides the full steps
        return p | {"unroll": False} if unroll_factor(self.full_steps(), self.loads_per_step(p)) == 1 else p


class Gemv8Space(StreamingSteps, HopperTemplate):
    """``dequant_gemm`` with 8-bit weights (int8 or E4M3), one scale per output channel and at most eight rows on
    sm_90: the streaming kernel above."""

    name = "gemv8"
    version = 1
    families = ("matmul",)

    @classmethod
    def matches(cls, func) -> bool:
        return _shape(func) is not None

    @classmethod
    def suits(cls, func, target, hints) -> bool:
        hints = hints or {}
        if target.arch not in HOPPER_ARCHS or hints.get("op") != "dequant_gemm" or hints.get("bits") != 8:
            return False
        shape = _shape(func)
        # 16-byte chunks of whole rows, the codes of the workload's fmt, one scale per row
        return (shape is not None and shape[0] <= MAX_M and shape[2] % CHUNK == 0 and shape[3] in _DTYPES
                and shape[4] == _CODES.get(str(hints.get("fmt", "int"))))

    def __init__(self, func, target, hints=None):
        super().__init__(func, target, hints)
        self.m, self.n, self.k, self.dtype, codes = self.taken(
            _shape(func), "C[m, n] = A[m, k] · (scale[n] · Wq[n, k])ᵀ with 8-bit Wq")
        self.fmt = "e4m3" if codes == "uint8" else "int"
        self.bias = bool(self.hints.get("bias", False))
        self.act = str(self.hints.get("act", "none"))
        self.sms = device_facts(target).sms
        self.knobs = [
            Knob("warps", (1, 2, 4, 8)),
            Knob("rows_per_warp", (1, 2, 4)),
            Knob("unroll", (False, True), ordered=False),
        ]

    def loads_per_step(self, p: Point) -> int:
        return p["rows_per_warp"]

    def check(self, p: Point) -> str | None:
        if p["rows_per_warp"] * self.m > 32:
            return f"{p['rows_per_warp'] * self.m} accumulators per thread (at most 32)"
        if p["rows_per_warp"] * p["warps"] > 2 * self.n:
            return "more rows per block than the weights have"
        return None


    def default(self) -> Point:
        for point in ({"warps": 4, "rows_per_warp": 2, "unroll": True}, {"warps": 4, "rows_per_warp": 1, "unroll": True},
                      {"warps": 1, "rows_per_warp": 1, "unroll": True}):
            point = self.canonical(point)
            if self.check(point) is None:
                return point
        return super().default()

    def kernel(self, p: Point):
        return gemv8_kernel(self.m, self.n, self.k, self.dtype, self.fmt, self.bias, self.act, p)

    def point_features(self, p: Point) -> list[float]:
        """Knobs, the bytes each thread has in flight, and how the blocks fill the machine."""
        rows_pb = p["warps"] * p["rows_per_warp"]
        in_flight = 16 * p["rows_per_warp"] * self.unrolled(p)
        blocks = math.ceil(self.n / rows_pb)
        return [p["warps"], p["rows_per_warp"], float(p["unroll"]), rows_pb, math.log2(blocks), blocks / self.sms,
                in_flight, in_flight * 32 * p["warps"], self.steps(), self.m]


def _shape(func) -> tuple[int, int, int, str, str] | None:
    """(m, n, k, dtype, the codes' dtype) of A[m, k], Wq[n, k] (int8 or uint8), scale[n, 1], optional bias[n],
    C[m, n]."""
    found = operand_shapes(func, (4, 5))
    if found is None:
        return None
    (a, wq, _), ((m, k), (n, k2), (m2, n2)) = found
    codes = str(wq.dtype)
    if codes not in ("int8", "uint8") or k2 != k or m != m2 or n != n2:
        return None
    scales, *rest = list(func.params)[2:-1]
    try:
        if [int(x) for x in scales.shape] != [n, 1] or any([int(x) for x in p.shape] != [n] for p in rest):
            return None
    except (AttributeError, TypeError, ValueError):
        return None
    if str(scales.dtype) != str(a.dtype) or any(str(p.dtype) != str(a.dtype) for p in rest):
        return None
    return m, n, k, str(a.dtype), codes
