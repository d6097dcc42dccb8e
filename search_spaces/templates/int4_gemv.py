"""int4 decode GEMV (``dequant_gemm`` with 4-bit weights and a few rows) as a TIRx kernel for sm_90.

The TensorIR GEMV space reads a packed weight byte per lane and unpacks one nibble at a time, which
left the int4 decode GEMV at a quarter of the copy bandwidth. This template streams the weights
instead:

* each warp owns ``rows_per_warp`` output columns (weight rows); its 32 lanes take consecutive 16-byte
  chunks of a row (32 weights each), so a warp reads 512 contiguous bytes per load, through the
  non-coherent path with no L1 allocation (the weights are read once);
* a chunk is unpacked eight nibbles per 32-bit word: two nibbles at a time become a half2 of
  1024 + q by one mask-and-or (1024's exponent leaves the mantissa's last four bits to the nibble),
  then q - 8 by one subtraction, exactly; the products and sums are fp32, and each chunk's sum is
  multiplied once by its group's scale (a chunk never straddles two groups: groups are multiples of 32);
* with zero points (``zeros=1``, w = s·(q − z): asymmetric AWQ/GPTQ) the chunk's zero point comes with its
  scale and the subtraction is of 1024 + z, q - z as exactly (``cuda/int4_gemv_zeros.cuh``);
* the activations (``m`` rows, at most 8 here) are read from L1/L2, where every warp of the block finds them;
* the lanes' partial sums meet by warp shuffles, and lane 0 applies bias and activation and stores.

Knobs: warps per block, weight rows per warp, whether the lane's loop over its chunks is unrolled
(all its loads issued before the arithmetic: more bytes in flight per thread) and, for fp16, whether the
products are taken in half2 (``half_products``: about half the instructions per weight, sums of eight
products in fp16, then fp32). With ``row_groups`` > 1 (a knob newer than this version's first records, whose
points have one group) a warp takes that many groups of ``rows_per_warp`` rows one after another and loads the
next group's chunks and scales into registers while it multiplies the current group's
(:func:`_pipelined_source`): with one group, every warp of a wave loads and then computes at about the same
time, and the one-row GEMV took as long on the H100 as on the H200 (it is not bound by the memory).
``loads_first`` (a knob newer still, off in points stored before it) runs one group in that kernel: every chunk and
scale of a lane's rows loaded into registers before the first product. In the kernel above ``unroll`` asks for
that, but ptxas interleaves the loads with the products, keeping about four chunks a lane in flight.

For fp16 with groups of 128 or more, ``mma`` selects a second kernel (:func:`_mma_source`): the products
on ``mma.sync`` with 16 weight rows as M and the activation rows as N, the weights bulk-copied into shared
memory. There ``warps`` split k and ``rows_per_warp`` counts tiles of 16 rows per block. It takes 8
activation rows in about the time of one, where the CUDA-core kernel's time grows with the rows; at one
row the CUDA-core kernel stays ahead (BENCHMARKS.md, GPU kernels). Zero points: :func:`_mma_source`. With
``stream`` the tensor-core kernel has no slab: each lane loads its weights straight into registers, ``unroll``
issuing four k-blocks' loads before their products (a knob newer than this version's first records, whose points
bulk-copy).

A decode step of 9 to 16 rows (a batch of 16 sequences) is the tensor-core kernel's alone: its activation rows
are two n8 tiles of mma's N, each A fragment (16 weight rows, unpacked once) taken by two ``mma.sync``, one per
tile. There the CUDA-core points are refused (at most 8 rows, ``MAX_M``) and the default is on tensor cores;
bf16 and groups under 128 keep the TensorIR GEMV space past 8 rows. Up to 8 rows the kernels are as before.
"""

from __future__ import annotations

import math

from autosched.target import device_facts

from .._analysis import operand_shapes
from .._knobs import Knob, Point
from ._hopper import (
    CUDA_SCALAR,
    HOPPER_ARCHS,
    SMEM_LIMIT,
    STREAM_REGISTERS,
    HopperTemplate,
    config_struct,
    cuda_file,
    epilogue_source,
)

# Deferred imports: tvm (imported where used: `autosched --help` stays fast).

CHUNK = 32  # weights per lane per load: 16 bytes of packed int4
MAX_M = 8  # activation rows of the CUDA-core kernel: a decode step of a few sequences
MMA_MAX_M = 16  # activation rows of the tensor-core kernel: two n8 tiles of mma.sync's N
MAX_UNROLLED_STEPS = 16

_WARP_SUM = "autosched_warp_sum"  # cuda/int4_gemv.cuh
_DTYPES = ("float16", "bfloat16")


def _dot_source(dtype: str, m: int, half_products: bool = False, zeros: bool = False) -> tuple[str, str]:
    """(name, source) of the helper that adds one chunk's scaled dot product to each of m rows' accumulators
    (``cuda/int4_gemv.cuh``: products in fp32, or for fp16 in half2 with ``half_products``). With ``zeros`` it
    takes the chunk's zero point after its scale (``cuda/int4_gemv_zeros.cuh``)."""
    if half_products:
        name, w = f"autosched_q4_chunk_float16_half_m{m}", "__half2 w[4][4]"
        unpack, row = "autosched_q4_unpack_half", "autosched_q4_row_half"
    else:
        name, w = f"autosched_q4_chunk_{dtype}_m{m}", "float w[32]"
        unpack, row = "autosched_q4_unpack", f"autosched_q4_row<{CUDA_SCALAR[dtype]}>"
    accs = ", ".join(f"float& acc{i}" for i in range(m))
    if zeros:
        name, unpack = f"{name}_zeros", f"{unpack}_zeros"
        row = "autosched_q4_row_half_zeros" if half_products else row
    rows = " ".join(f"{row}(acc{i}, w, xp, {i}, row_bytes, scale);" for i in range(m))
    zero_param, zero_arg = (", float zero", ", zero") if zeros else ("", "")
    return name, cuda_file("int4_gemv_zeros.cuh" if zeros else "int4_gemv.cuh") + (
        f"__device__ __forceinline__ void {name}({accs}, const void* wp, const void* xp, int row_bytes, float scale"
        f"{zero_param}) {{ {w}; {unpack}(wp, w{zero_arg}); {rows} }}\n")


MMA_K_BLOCK = 128  # weights of one row per k-block of the tensor-core kernel: 4 lanes x 32 nibbles
SM_SHARED = 228 * 1024  # shared memory per SM on sm_90
SM_REGISTERS = 65536  # 32-bit registers per SM


def _slab_row_bytes(k: int) -> int:
    """Bytes per weight row in the tensor-core kernel's shared slab: padded so that rows g and g + 1 fall on
    different banks (a quarter-warp's 16-byte reads then never conflict)."""
    return k // 2 + (64 if (k // 2) % 128 == 0 else 0)


def mma_n_tiles(m: int) -> int:
    """n8 tiles of activation rows of the tensor-core kernel (mma.sync's N is 8): one to 8 rows, two to 16."""
    return math.ceil(m / 8)


def mma_smem_bytes(k: int, tiles: int, warps: int, m: int, stream: bool = False) -> int:
    """Shared memory of a tensor-core point for m activation rows: its tiles' weight slab and an mbarrier per warp
    (none where the weights stream into registers), and the warps' partial sums (four per lane, 16-row tile and
    n8 tile of activation rows)."""
    partial = warps * tiles * mma_n_tiles(m) * 4 * 32 * 4 if warps > 1 else 0
    return (0 if stream else 16 * tiles * _slab_row_bytes(k) + 8 * warps) + partial


MMA_STREAM_UNROLL = 4  # k-blocks whose loads a streaming point with ``unroll`` issues together


def mma_stream_registers(m: int, tiles: int, unroll: bool) -> int:
    """32-bit registers of a streaming tensor-core thread's weights in flight, activation fragments, offsets and
    accumulators."""
    nt = mma_n_tiles(m)
    return (MMA_STREAM_UNROLL if unroll else 1) * tiles * 8 + 24 * nt + 4 * tiles * nt


def _mma_source(m: int, n: int, k: int, groups: int, group: int, warps: int, tiles: int, bias: bool,
                act: str, zeros: bool = False, stream: bool = False, unroll: int = 1) -> tuple[str, str]:
    """(name, source) of the tensor-core int4 GEMV (fp16): one device function that runs a whole block.

    Loads: the block's ``tiles`` x 16 weight rows are contiguous in memory. Each of its ``warps`` warps
    takes one contiguous share of the k-blocks (128 weights of a row) and, at the start, asks the copy
    engine for that share of every row (``cp.async.bulk``, one per row, completing on the warp's
    mbarrier). So the whole slab is in flight at once without a register or an instruction per byte, and
    each warp starts on its share as soon as that share has landed. With ``stream`` there is no slab: each lane
    loads its 16 bytes of rows g and g + 8 (below) straight from global memory, ``unroll`` k-blocks' loads
    issued before their products, so the weights of a block never wait for the whole of its share.

    The product is ``mma.sync`` m16n8k16 with 16 weight rows as M and the activation rows as N: up to 8
    rows one n8 tile, 9 to 16 two, each A fragment then taken by one product per tile. Inside a k-block the
    order of k is free as long as both operands agree, so a lane's A registers come straight from its own 16
    packed bytes of the slab: lane (g, t) reads bytes 16t..16t+15 of the k-block in rows g and g + 8, and one
    mask-and-or per register turns a word's nibble pairs into half2 1024 + q (low nibbles) or 1024 + 16 q
    (high nibbles), with no arithmetic per weight. The activations are regrouped into the same order once per
    k-block (high-nibble slots divided by 16), and one more product with constant A (-1032, -1152) gives the
    offsets, 1032 x + 72 x per slot, that turn the sums into sums of (q - 8) x. Each k-block lies in one group
    (groups are multiples of 128), so its fp32 sums are scaled once per row. The warps' partial sums meet in
    shared memory.

    With ``zeros`` (a zero point z per row and group): one more product with constant A (1, 16) gives the
    k-block's sum of x per activation row, and each row's sums start from the offsets plus (8 - z) times it,
    sums of (q - z) x."""
    name = (f"autosched_q4_mma_m{m}_n{n}_k{k}_g{group}_w{warps}_t{tiles}_{int(bias)}{act}" + ("_zeros" if zeros else "")
            + (f"_stream{unroll}" if stream else ""))
    _, store1, epi_source = epilogue_source("float16", act)
    config = {"M": m, "N": n, "K": k, "GROUPS": groups, "GROUP": group, "W": warps, "R": tiles,
              "ROW_BYTES": 0 if stream else _slab_row_bytes(k), "BIAS": bias, "ZEROS": zeros, "STREAM": stream,
              "U": unroll}
    entry = "AUTOSCHED_Q4_MMA_GEMV" + ("_ZEROS" if zeros else "") + ("_BIAS" if bias else "")
    return name, (epi_source + cuda_file("int4_mma_gemv.cuh") + config_struct(f"{name}_config", config)
                  + f"{entry}({name}, {name}_config, {store1})\n")


def _input_pointers(A, Wq, S, Z, Bias) -> list:
    """The workload's inputs in its order (zero points and bias where it has them), as an entry point takes them."""
    return [buf.access_ptr("r") for buf in (A, Wq, S, Z, Bias) if buf is not None]


def int4_mma_gemv_kernel(m: int, n: int, k: int, group: int, bias: bool, act: str, p: Point, zeros: bool = False):
    """The TIRx kernel of a tensor-core point (``p["mma"]``): a shell around :func:`_mma_source`."""
    from tvm.script import tirx as T

    warps, tiles, stream = p["warps"], p["rows_per_warp"], p.get("stream", False)
    grid = math.ceil(n / (16 * tiles))
    groups = math.ceil(k / group)
    smem_bytes = max(mma_smem_bytes(k, tiles, warps, m, stream), 16)
    unroll = MMA_STREAM_UNROLL if stream and p["unroll"] else 1
    fn, source = _mma_source(m, n, k, groups, group, warps, tiles, bias, act, zeros, stream, unroll)
    # Two n8 tiles hold twice the activations and sums in registers. Where shared memory alone bounds the blocks
    # per SM so that no register count could, ptxas is told one block per SM suffices (else its occupancy
    # heuristic may cap the registers and spill); up to 8 rows the kernels stay as they were. Streaming points
    # are told so too: else ptxas may interleave the loads with the products to save registers, leaving few
    # loads in flight.
    resident = SM_SHARED // (smem_bytes + 1024)  # 1 KB per block reserved
    free_registers = stream or (m > MAX_M and resident * 32 * warps * 255 <= SM_REGISTERS)

    # fmt: off
    @T.macro
    def body(A, Wq, S, Z, Bias, C):
        T.device_entry()
        if free_registers:
            T.attr({"tirx.launch_bounds_min_blocks_per_sm": 1})
        bx = T.cta_id([grid])
        tx = T.thread_id([32 * warps])
        smem = T.alloc_buffer((smem_bytes,), "uint8", scope="shared.dyn", align=128)
        T.cuda.func_call(fn, *_input_pointers(A, Wq, S, Z, Bias), C.access_ptr("w"), smem.access_ptr("rw"), bx, tx,
                         source_code=source)

    # fmt: on
    return dequant_main(body, m, n, k, groups, "float16", bias, {"global_symbol": "main", "tirx.noalias": True},
                        zeros)


def int4_gemv_kernel(m: int, n: int, k: int, group: int, dtype: str, bias: bool, act: str, p: Point,
                     zeros: bool = False):
    """The TIRx kernel of point ``p`` for C[m, n] = act(A[m, k] · dequant(Wq[n, k / 2], zeros)ᵀ + bias[n])."""
    from tvm.script import tirx as T

    warps, rows_pw, unroll = p["warps"], p["rows_per_warp"], p["unroll"]
    half_products = p.get("half_products", False)
    threads, rows_pb = 32 * warps, warps * rows_pw
    grid = math.ceil(n / rows_pb)
    chunks = k // CHUNK  # per weight row
    steps = math.ceil(chunks / 32)  # per lane
    groups = math.ceil(k / group)
    dot, dot_source = _dot_source(dtype, m, half_products, zeros)
    _, store1, epi_source = epilogue_source(dtype, act)
    loop = T.unroll if unroll else T.serial

    def stored(acc, Bias, i, row):
        return acc[i] + T.Cast("float32", Bias[row]) if bias else acc[i]

    def group_params(S, Z, row, chunk):  # the chunk's scale and, with zero points, its zero point
        index = chunk * CHUNK // group
        return [T.Cast("float32", S[row, index])] + ([T.Cast("float32", Z[row, index])] if zeros else [])

    # fmt: off
    @T.macro
    def body(A, Wq, S, Z, Bias, C):
        T.device_entry()
        bx = T.cta_id([grid])
        tx = T.thread_id([threads])
        acc = T.alloc_local((rows_pw * m,), "float32")
        lane = T.meta_var(tx % 32)
        for i in T.unroll(rows_pw * m):
            acc[i] = T.float32(0)
        for step in loop(steps):
            for r in T.unroll(rows_pw):
                row = T.meta_var(bx * rows_pb + (tx // 32) * rows_pw + r)
                chunk = T.meta_var(step * 32 + lane)
                if row < n and chunk < chunks:
                    T.cuda.func_call(dot, *[acc[r * m + i] for i in range(m)],
                                     Wq.access_ptr("r", offset=row * (k // 2) + chunk * (CHUNK // 2)),
                                     A.access_ptr("r", offset=chunk * CHUNK), k * 2,
                                     *group_params(S, Z, row, chunk), source_code=dot_source)
        for i in T.unroll(rows_pw * m):
            T.cuda.func_call(_WARP_SUM, acc[i], source_code=cuda_file("int4_gemv.cuh"))
        if lane == 0:
            for r in T.unroll(rows_pw):
                row = T.meta_var(bx * rows_pb + (tx // 32) * rows_pw + r)
                if row < n:
                    for i in T.unroll(m):
                        T.cuda.func_call(store1, C.access_ptr("w", offset=i * n + row),
                                         stored(acc, Bias, r * m + i, row), source_code=epi_source)

    # fmt: on
    return dequant_main(body, m, n, k, groups, dtype, bias, {"global_symbol": "main", "tirx.noalias": True}, zeros)


PIPELINE_REGISTERS = 128  # 32-bit registers of a pipelined thread's two groups of chunks, scales and zero points


def pipelined_registers(rows_per_warp: int, steps: int, zeros: bool) -> int:
    """Registers of a pipelined point's two groups in flight: per row and step a chunk (4), a scale and a zero point."""
    return 2 * rows_per_warp * steps * (5 + int(zeros))


def _pipelined_source(m: int, n: int, k: int, group: int, dtype: str, p: Point, bias: bool, act: str,
                      zeros: bool) -> tuple[str, str]:
    """(name, source) of the pipelined CUDA-core kernel's device function (``cuda/int4_gemv_pipelined.cuh``): a
    warp's ``row_groups`` groups of ``rows_per_warp`` rows, the next group's loads issued before the current
    group's products."""
    warps, rows_pw, row_groups = p["warps"], p["rows_per_warp"], p["row_groups"]
    half = p.get("half_products", False)
    name = (f"autosched_q4_pipelined_{dtype}_m{m}_n{n}_k{k}_g{group}_w{warps}_r{rows_pw}_x{row_groups}"
            f"_{int(half)}{int(bias)}{act}" + ("_zeros" if zeros else ""))
    _, store1, epi_source = epilogue_source(dtype, act)
    chunks = k // CHUNK
    config = {"M": m, "N": n, "K": k, "GROUPS": math.ceil(k / group), "GROUP": group, "W": warps, "R": rows_pw,
              "G": row_groups, "CHUNKS": chunks, "STEPS": math.ceil(chunks / 32), "HALF": half, "ZEROS": zeros,
              "BIAS": bias}
    entry = "AUTOSCHED_Q4_GEMV_PIPELINED" + ("_ZEROS" if zeros else "") + ("_BIAS" if bias else "")
    return name, (epi_source + cuda_file("int4_gemv_pipelined.cuh") + config_struct(f"{name}_config", config)
                  + f"{entry}({name}, {CUDA_SCALAR[dtype]}, {name}_config, {store1})\n")


def int4_gemv_pipelined_kernel(m: int, n: int, k: int, group: int, dtype: str, bias: bool, act: str, p: Point,
                               zeros: bool = False):
    """The TIRx kernel of a pipelined CUDA-core point (``row_groups`` > 1): a shell around
    :func:`_pipelined_source`."""
    from tvm.script import tirx as T

    warps = p["warps"]
    grid = math.ceil(n / (warps * p["rows_per_warp"] * p["row_groups"]))
    groups = math.ceil(k / group)
    fn, source = _pipelined_source(m, n, k, group, dtype, p, bias, act, zeros)

    # fmt: off
    @T.macro
    def body(A, Wq, S, Z, Bias, C):
        T.device_entry()
        bx = T.cta_id([grid])
        tx = T.thread_id([32 * warps])
        T.cuda.func_call(fn, *_input_pointers(A, Wq, S, Z, Bias), C.access_ptr("w"), bx, tx, source_code=source)

    # fmt: on
    return dequant_main(body, m, n, k, groups, dtype, bias, {"global_symbol": "main", "tirx.noalias": True}, zeros)


def dequant_main(body, m: int, n: int, k: int, groups: int, dtype: str, bias: bool, attrs: dict,
                 zeros: bool = False):
    """The ``dequant_gemm`` workload's signature (A, Wq, scales[, zero points][, bias], C) around a kernel's
    body macro."""
    from tvm.script import tirx as T

    # fmt: off
    @T.prim_func
    def main(A: T.Buffer((m, k), dtype, align=16), Wq: T.Buffer((n, k // 2), "uint8", align=16),
             S: T.Buffer((n, groups), dtype), Z: T.Buffer((n, groups), "uint8"), Bias: T.Buffer((n,), dtype),
             C: T.Buffer((m, n), dtype, align=16)):
        T.func_attr(attrs)
        body(A, Wq, S, Z if zeros else None, Bias if bias else None, C)
    # fmt: on
    if bias and zeros:
        return main
    # The body never names the inputs it was given as None: the same function less those parameters.
    from tvm import tirx

    params = [param for i, param in enumerate(main.params) if (i != 3 or zeros) and (i != 4 or bias)]
    return tirx.PrimFunc(params, main.body, main.ret_type, main.attrs, main.span)


class Int4Template(HopperTemplate):
    """A TIRx template for ``dequant_gemm`` with int4 weights on sm_90: the workload's sizes and hints."""

    families = ("matmul",)

    @classmethod
    def matches(cls, func) -> bool:
        return _shape(func) is not None

    @classmethod
    def suits_target(cls, target, hints) -> bool:
        hints = hints or {}
        return target.arch in HOPPER_ARCHS and hints.get("op") == "dequant_gemm" and hints.get("bits") == 4

    def __init__(self, func, target, hints=None):
        super().__init__(func, target, hints)
        self.m, self.n, self.k, self.dtype = self.taken(_shape(func), "C[m, n] = A[m, k] · dequant(Wq[n, k / 2])ᵀ")
        self.group = int(self.hints.get("group", 128))
        self.bias = bool(self.hints.get("bias", False))
        self.zeros = bool(self.hints.get("zeros", False))  # a zero point per row and group in place of 8
        self.act = str(self.hints.get("act", "none"))
        self.sms = device_facts(target).sms


def tensor_cores_apply(dtype: str, k: int, group: int) -> bool:
    """Whether the tensor-core kernel takes the shape: fp16, and every k-block of 128 in one group."""
    return dtype == "float16" and k % MMA_K_BLOCK == 0 and group % MMA_K_BLOCK == 0


class Int4GemvSpace(Int4Template):
    """``dequant_gemm`` with int4 weights and a decode step's rows on sm_90: the streaming kernels above, up to
    eight rows on CUDA or tensor cores, 9 to 16 rows on tensor cores only (fp16, groups of 128 or more)."""

    name = "int4_gemv"
    version = 3

    @classmethod
    def suits(cls, func, target, hints) -> bool:
        if not cls.suits_target(target, hints):
            return False
        shape = _shape(func)
        if shape is None:
            return False
        m, _, k, dtype = shape
        # 16-byte chunks of whole rows: k a multiple of 32 (the groups, 32 to 256, are too).
        if k % CHUNK or dtype not in _DTYPES:
            return False
        return m <= MAX_M or (m <= MMA_MAX_M and tensor_cores_apply(dtype, k, int((hints or {}).get("group", 128))))

    def __init__(self, func, target, hints=None):
        super().__init__(func, target, hints)
        self.knobs = [
            Knob("warps", (1, 2, 4, 8)),
            Knob("rows_per_warp", (1, 2, 4)),
            Knob("unroll", (False, True), ordered=False),
            # the CUDA-core kernel's groups of rows per warp, each group's loads issued before the products of
            # the one before (cuda/int4_gemv_pipelined.cuh); a knob newer than this version's first records
            Knob("row_groups", (1, 2, 4, 8)),
            # one group in the pipelined kernel's registers: all of a lane's loads issued before its products
            Knob("loads_first", (False, True), ordered=False),
        ]
        self.added = {"row_groups": 1, "loads_first": False}
        if self.dtype == "float16":  # bf16's 8-bit mantissa is too coarse for half2 sums
            self.knobs.append(Knob("half_products", (False, True), ordered=False))
        # the tensor-core kernel: fp16, and every k-block in one group
        self.tensor_cores = tensor_cores_apply(self.dtype, self.k, self.group)
        if self.tensor_cores:
            self.knobs.append(Knob("mma", (False, True), ordered=False))
            # its weights streamed into registers rather than bulk-copied into shared memory: a knob that came
            # after points of this version were stored (theirs bulk-copy)
            self.knobs.append(Knob("stream", (False, True), ordered=False))
            self.added["stream"] = False

    def steps(self) -> int:
        return math.ceil(self.k // CHUNK / 32)

    def check(self, p: Point) -> str | None:
        if p.get("mma"):
            if self.m > MMA_MAX_M:
                return f"{self.m} activation rows (the tensor-core kernel takes at most {MMA_MAX_M})"
            if 16 * p["rows_per_warp"] > 2 * self.n:
                return "more 16-row tiles per block than the weights have rows"
            if self.k // MMA_K_BLOCK < p["warps"]:
                return f"{p['warps']} warps split {self.k // MMA_K_BLOCK} k-blocks"
            if p.get("stream"):
                regs = mma_stream_registers(self.m, p["rows_per_warp"], p["unroll"])
                if regs > STREAM_REGISTERS:
                    return (f"{regs} registers of weights in flight, fragments and sums per thread "
                            f"(at most {STREAM_REGISTERS})")
                if p["unroll"] and self.k // MMA_K_BLOCK // p["warps"] < MMA_STREAM_UNROLL:
                    return f"unrolling {MMA_STREAM_UNROLL} k-blocks of a warp's {self.k // MMA_K_BLOCK // p['warps']}"
            smem = mma_smem_bytes(self.k, p["rows_per_warp"], p["warps"], self.m, p.get("stream", False))
            if smem > SMEM_LIMIT:
                return f"{smem} bytes of shared memory (limit {SMEM_LIMIT})"
            return None
        if self.m > MAX_M:
            return f"{self.m} activation rows on CUDA cores (at most {MAX_M}; more take the tensor-core kernel)"
        if p["rows_per_warp"] * self.m > 32:
            return f"{p['rows_per_warp'] * self.m} accumulators per thread (at most 32)"
        if p.get("loads_first"):  # one group in registers
            regs = pipelined_registers(p["rows_per_warp"], self.steps(), self.zeros) // 2
            if regs > PIPELINE_REGISTERS:
                return f"{regs} registers of a group of rows in flight per thread (at most {PIPELINE_REGISTERS})"
            if p["rows_per_warp"] * p["warps"] > 2 * self.n:
                return "more rows per block than the weights have"
            return None
        if p.get("row_groups", 1) > 1:
            regs = pipelined_registers(p["rows_per_warp"], self.steps(), self.zeros)
            if regs > PIPELINE_REGISTERS:
                return f"{regs} registers of two groups of rows in flight per thread (at most {PIPELINE_REGISTERS})"
            if p["rows_per_warp"] * p["row_groups"] * p["warps"] > 2 * self.n:
                return "more rows per block than the weights have"
            return None
        if p["unroll"] and self.steps() * p["rows_per_warp"] > MAX_UNROLLED_STEPS:
            return f"unrolling {self.steps() * p['rows_per_warp']} loads per thread (at most {MAX_UNROLLED_STEPS})"
        if p["rows_per_warp"] * p["warps"] > 2 * self.n:
            return "more rows per block than the weights have"
        return None

    def canonical(self, p: Point) -> Point:
        # The tensor-core kernel's products are fp32, and bulk copies leave nothing to unroll; the CUDA-core kernel
        # has no loads to choose.
        p = self.complete(p)
        if p.get("mma"):
            return (p | {"half_products": False, "row_groups": 1, "loads_first": False}
                    | ({} if p.get("stream") else {"unroll": False}))
        if p["row_groups"] > 1:  # a pipelined group's loads are all issued together
            p = p | {"unroll": True, "loads_first": False}
        elif p["loads_first"]:
            p = p | {"unroll": True}
        return p | {"stream": False} if self.tensor_cores else p

    def first_points(self) -> list[Point]:
        """The default, then (up to eight rows, where the default is on CUDA cores) the CUDA-core kernel with fp32
        products and, for 2 to 8 rows, with its rows pipelined, then the tensor-core kernel with its weights
        bulk-copied and streamed into registers, where it applies. One fp16 row whose default took fp32 products (its
        k too long to unroll the default's rows) has half2 products on fewer rows per warp second
        (:meth:`_half_unrolled`). For 2 to 8 rows, the CUDA-core points among those with their loads issued first
        (``loads_first``); one row takes neither these nor the pipelined rows, both slower than its default at
        Llama-2-7B's projections (BENCHMARKS.md). For 9 to 16 rows, the streamed kernel with 2 and 4 tiles of 16
        weight rows a block: each k-block's activation fragments and offset products (as many as its weight products
        with one tile) then serve more weight rows."""
        first = super().first_points()
        candidates = []
        if self.m <= MAX_M:  # fp32 products, where the default takes them in half2; from 2 rows, the rows pipelined
            candidates += [self.fp32_default()] + ([self._pipelined()] if self.m > 1 else [])
        if self.m == 1 and not first[0].get("half_products", True):  # one row whose default fell back to fp32
            candidates.insert(0, self._half_unrolled())
        if 1 < self.m <= MAX_M:  # the CUDA-core points so far, their loads issued first
            candidates += [self.canonical(point | {"loads_first": True}) for point in first + candidates
                           if point is not None and not point.get("mma") and point.get("row_groups", 1) == 1]
        if self.tensor_cores:
            candidates += [self.canonical(first[0] | {"warps": 4, "rows_per_warp": 1, "mma": True, "stream": False}),
                           self._streamed()]
        if self.m > MAX_M:  # 9 to 16 rows: more 16-row tiles a block share each k-block's activations and offsets
            candidates += [self._streamed(tiles, (True, False)) for tiles in (2, 4)]
        for point in candidates:
            if point is not None and point not in first and self.check(point) is None:
                first.append(point)
        return first

    def _half_unrolled(self) -> Point | None:
        """fp16's CUDA-core kernel with half2 products on 4 warps, each lane's loads all issued together, on the most
        rows per warp (4, 2 or 1) that leaves them few enough to unroll; None for bf16 or where none does."""
        if self.dtype != "float16":
            return None
        for rows in (4, 2, 1):
            point = self.canonical({"warps": 4, "rows_per_warp": rows, "unroll": True} | self._cuda_core(half=True))
            if self.check(point) is None:
                return point
        return None

    def _pipelined(self) -> Point | None:
        """The CUDA-core kernel with four groups of rows per warp, each group's loads in flight while the group
        before is multiplied (half2 products for fp16), on the most rows per group its registers allow."""
        for rows in (2, 1):
            point = self.canonical({"warps": 4, "rows_per_warp": rows, "unroll": True, "row_groups": 4}
                                   | self._cuda_core(half=True))
            if self.check(point) is None:
                return point
        return None

    def _streamed(self, tiles: int = 1, unrolls: tuple[bool, ...] = (True,)) -> Point | None:
        """The tensor-core kernel with its weights streamed into registers, four k-blocks in flight (or, where
        ``unrolls`` allows, one: where the registers of ``tiles`` 16-row tiles do not allow four), on as many of
        4, 2 or 1 warps as k allows (None without tensor cores or where no such point is valid)."""
        if not self.tensor_cores:
            return None
        for warps in (4, 2, 1):  # canonical takes the products in fp32
            for unroll in unrolls:
                point = self.canonical({"warps": warps, "rows_per_warp": tiles, "unroll": unroll, "mma": True,
                                        "stream": True})
                if self.check(point) is None:
                    return point
        return None

    def default(self) -> Point:
        return self.complete(self._default())

    def _default(self) -> Point:
        if self.m > MAX_M:  # 9 to 16 rows: tensor cores only (suits takes them only where these apply)
            streamed = self._streamed()  # ahead of the bulk copies at each Llama-2-7B shape timed on the H100
            if streamed is not None:
                return streamed
            for warps in (4, 2, 1):  # canonical takes the products in fp32
                point = self.canonical({"warps": warps, "rows_per_warp": 1, "unroll": False, "mma": True})
                if self.check(point) is None:
                    return point
            return super().default()
        if self.m == 1 and self.dtype == "float16":  # one row: half2 products, two an instruction (BENCHMARKS.md)
            point = {"warps": 1, "rows_per_warp": 4, "unroll": True} | self._cuda_core(half=True)
            if self.check(point) is None:
                return point
        return self.fp32_default()

    def _cuda_core(self, half: bool = False) -> Point:
        """The knobs a CUDA-core point fixes: its products (half2 or fp32, a knob of fp16 only), no tensor cores."""
        return (({"half_products": half} if self.dtype == "float16" else {})
                | ({"mma": False, "stream": False} if self.tensor_cores else {}))

    def fp32_default(self) -> Point:
        """The CUDA-core kernel's default with fp32 products (the default up to 8 rows but one of fp16)."""
        for point in ({"warps": 4, "rows_per_warp": 2, "unroll": True}, {"warps": 4, "rows_per_warp": 1, "unroll": True},
                      {"warps": 4, "rows_per_warp": 1, "unroll": False}):
            if self.check(point | self._cuda_core()) is None:
                return self.complete(point | self._cuda_core())
        return super().default()

    def kernel(self, p: Point):
        if p.get("mma"):
            return int4_mma_gemv_kernel(self.m, self.n, self.k, self.group, self.bias, self.act, p, self.zeros)
        if p.get("row_groups", 1) > 1 or p.get("loads_first"):
            return int4_gemv_pipelined_kernel(self.m, self.n, self.k, self.group, self.dtype, self.bias, self.act, p,
                                              self.zeros)
        return int4_gemv_kernel(self.m, self.n, self.k, self.group, self.dtype, self.bias, self.act, p, self.zeros)

    def point_features(self, p: Point) -> list[float]:
        """Knobs, the bytes each thread has in flight, and how the blocks fill the machine."""
        if p.get("stream"):  # warps split k over tiles of 16 rows; a lane has its unrolled k-blocks in flight
            rows_pb = 16 * p["rows_per_warp"]
            in_flight = 32 * p["rows_per_warp"] * (MMA_STREAM_UNROLL if p["unroll"] else 1)
        elif p.get("mma"):  # warps split k over tiles of 16 rows; the whole slab is in flight at once
            rows_pb = 16 * p["rows_per_warp"]
            in_flight = rows_pb * self.k // 2 / (32 * p["warps"])
        else:  # a group of rows per warp (with row_groups, the next group's loads in flight during the products)
            rows_pb = p["warps"] * p["rows_per_warp"] * p.get("row_groups", 1)
            in_flight = 16 * p["rows_per_warp"] * (self.steps() if p["unroll"] else 1)
        blocks = math.ceil(self.n / rows_pb)
        return [p["warps"], p["rows_per_warp"], float(p["unroll"]), float(p.get("half_products", False)),
                float(p.get("mma", False)), float(p.get("stream", False)), rows_pb,
                math.log2(blocks), blocks / self.sms,
                in_flight, in_flight * 32 * p["warps"], self.steps(), self.m, p.get("row_groups", 1),
                float(p.get("loads_first", False))]


def _shape(func) -> tuple[int, int, int, str] | None:
    """(m, n, k, dtype) of A[m, k], Wq[n, k / 2] (uint8), scale[n, groups], optional zero points[n, groups]
    (uint8), optional bias[n], C[m, n]."""
    found = operand_shapes(func, (4, 5, 6))
    if found is None:
        return None
    (a, wq, _), ((m, k), (n, half_k), (m2, n2)) = found
    if str(wq.dtype) != "uint8" or half_k * 2 != k or m != m2 or n != n2:
        return None
    scales, *rest = list(func.params)[2:-1]
    if rest and str(getattr(rest[0], "dtype", "")) == "uint8":  # zero points, shaped as the scales
        if [int(x) for x in rest[0].shape] != [int(x) for x in scales.shape]:
            return None
        rest = rest[1:]
    if len(rest) > 1 or any(str(getattr(p, "dtype", "")) == "uint8" for p in rest):
        return None
    return m, n, k, str(a.dtype)
