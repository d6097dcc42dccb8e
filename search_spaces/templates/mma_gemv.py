"""hopper_gemm's streaming tensor-core kernel for a decode step: ``gemm`` (and ``swiglu_gemm``) of 2 to 16 rows of
fp16 or bf16, as a TIRx kernel for sm_90 (``cuda/mma_gemv.cuh``).

At a decode step the weights are read once and the rows are few, so the time is the weights' bytes. The wgmma
kernel with swapped operands pays for a 64-row tile, a TMA ring and its barriers, and (split-K) a cluster's
reduction per output tile; this kernel reads the weights straight into registers instead:

* a block owns ``tiles`` tiles of 16 weight rows (with ``swiglu_gemm``, those of the gate and the same of the up
  projection) and its ``warps`` warps split k between them, each a contiguous share of 64-element steps;
* in a step, lane (g, t) loads 32 bytes of weight rows g and g + 8 (so the four lanes of a row read its whole
  128-byte line) through the non-coherent path with no L1 allocation, and the same 32 bytes of its activation
  row; these registers are mma.sync m16n8k16's A and B fragments as they are, four products a step, with k taken in
  the order the loads give (any order serves while A and B agree);
* the loads of ``unroll`` steps are issued before their products: more bytes in flight per warp;
* the activation rows are mma's N: one n8 tile up to 8 rows, two up to 16 (rows past m read row m - 1, and their
  outputs are not stored);
* the warps' fp32 partial sums meet in shared memory, and each warp adds up and stores a share of the outputs
  (bias, activation, or SiLU(gate) · up).

It is a mode of ``hopper_gemm`` (its ``stream`` knobs) rather than a space of its own, so that one search weighs it
against the wgmma kernel on each shape.
"""

from __future__ import annotations

import math

from .._knobs import Knob, Point
from ._hopper import CUDA_SCALAR, PTX_TYPE, STREAM_REGISTERS, config_struct, cuda_file, epilogue_source

# Deferred imports: tvm (imported where used: `autosched --help` stays fast).

STEP = 64  # k per step: a 128-byte line of each weight row
MIN_M, MAX_M = 2, 16  # activation rows: one or two n8 tiles of mma's N (one row stays a GEMV)

KNOBS = (
    Knob("stream", (False, True), ordered=False),
    Knob("stream_warps", (1, 2, 4, 8)),
    Knob("stream_tiles", (1, 2, 4)),
    Knob("stream_unroll", (1, 2, 4)),
)
# A point of the wgmma kernel: the stream knobs at these values (and a point stored before they existed means it).
OFF = {knob.name: knob.choices[0] for knob in KNOBS}


def serves(m: int, k: int, dtype: str) -> bool:
    """Whether the kernel takes ``m`` rows over ``k`` in ``dtype``: a decode step's rows, whole steps of k."""
    return dtype in PTX_TYPE and MIN_M <= m <= MAX_M and k % STEP == 0


def n_tiles(m: int) -> int:
    """n8 tiles of activation rows (mma.sync's N is 8)."""
    return math.ceil(m / 8)


def a_tiles(tiles: int, gated: bool) -> int:
    """Tiles of 16 weight rows a block reads: the gate's and the up projection's with ``gated``."""
    return 2 * tiles if gated else tiles


def registers(m: int, tiles: int, unroll: int, gated: bool) -> int:
    """32-bit registers of a thread's loads in flight (8 per 32 bytes), fragments and accumulators."""
    a, nt = a_tiles(tiles, gated), n_tiles(m)
    return unroll * (16 * a + 8 * nt) + 4 * a * nt


def smem_bytes(m: int, tiles: int, warps: int, gated: bool) -> int:
    """The warps' partial sums, [warp][register][lane] fp32 (none for one warp)."""
    return warps * a_tiles(tiles, gated) * n_tiles(m) * 4 * 32 * 4 if warps > 1 else 0


def check(m: int, n: int, k: int, gated: bool, p: Point) -> str | None:
    """The reason a stream point is invalid for the shape, or None."""
    warps, tiles, unroll = p["stream_warps"], p["stream_tiles"], p["stream_unroll"]
    if k // STEP < warps:
        return f"{warps} warps split {k // STEP} steps of {STEP}"
    if 16 * tiles > 2 * n:
        return f"{tiles} tiles of 16 rows for {n} outputs"
    if unroll > 1 and unroll > k // STEP // warps:
        return f"unrolling {unroll} steps of a warp's {k // STEP // warps}"
    regs = registers(m, tiles, unroll, gated)
    if regs > STREAM_REGISTERS:
        return f"{regs} registers of loads and accumulators per thread (at most {STREAM_REGISTERS})"
    return None


def default(m: int, n: int, k: int, gated: bool) -> Point:
    """Four warps on one tile a block, one step in flight at a time: blocks enough to spread a decode step's weights
    over every SM, each warp streaming its own part of k, with few registers held for loads in flight (BENCHMARKS.md
    compares it with the wgmma kernel and the other streaming points); fewer warps where k is too short for four."""
    point = {"stream": True, "stream_warps": 4, "stream_tiles": 1, "stream_unroll": 1}
    while check(m, n, k, gated, point) and point["stream_warps"] > 1:
        point["stream_warps"] //= 2
    return point


def features(m: int, n: int, k: int, gated: bool, sms: int, p: Point) -> list[float]:
    """The cost model's view of a stream point (zeros for a wgmma point): its knobs, how its blocks fill the
    machine and the bytes each SM has in flight."""
    if not p.get("stream", False):
        return [0.0] * 7
    warps, tiles, unroll = p["stream_warps"], p["stream_tiles"], p["stream_unroll"]
    blocks = math.ceil(n / (16 * tiles))
    in_flight = unroll * 32 * warps * 32 * a_tiles(tiles, gated)  # bytes of weights a block's loads request at once
    return [1.0, warps, tiles, unroll, blocks / sms, in_flight / 1024, k / STEP / warps]


def source(m: int, n: int, k: int, dtype: str, p: Point, bias: bool, act: str, gated: bool) -> tuple[str, str]:
    """(name, source) of the device function that runs one block of stream point ``p``."""
    warps, tiles, unroll = p["stream_warps"], p["stream_tiles"], p["stream_unroll"]
    name = (f"autosched_mma_gemv_{PTX_TYPE[dtype]}_m{m}_n{n}_k{k}_w{warps}_t{tiles}_u{unroll}_{int(bias)}{act}"
            + ("_gated" if gated else ""))
    _, store1, epi_source = epilogue_source(dtype, act)
    config = {"M": m, "N": n, "K": k, "W": warps, "R": tiles, "U": unroll, "BIAS": bias, "GATED": gated}
    entry = "AUTOSCHED_MMA_GEMV" + ("_BIAS" if bias else "")
    return name, (epi_source + cuda_file("mma_gemv.cuh") + config_struct(f"{name}_config", config)
                  + f"{entry}({name}, {CUDA_SCALAR[dtype]}, {name}_config, {store1})\n")


def mma_gemv_kernel(m: int, n: int, k: int, dtype: str, bias: bool, act: str, p: Point, gated: bool = False):
    """The TIRx kernel of stream point ``p`` for C[m, n] = act(A[m, k] · B[n, k]ᵀ + bias[n]), or with ``gated``
    C = SiLU(A · B[:n]ᵀ) ⊙ (A · B[n:]ᵀ), B[2n, k]: a shell around :func:`source`."""
    from tvm.script import tirx as T

    warps, tiles = p["stream_warps"], p["stream_tiles"]
    grid = math.ceil(n / (16 * tiles))
    smem = max(smem_bytes(m, tiles, warps, gated), 16)
    fn, code = source(m, n, k, dtype, p, bias, act, gated)

    def inputs(A, B, Bias):  # in the workload's order, as the entry point takes them
        return [buf.access_ptr("r") for buf in (A, B, Bias) if buf is not None]

    # fmt: off
    @T.macro
    def body(A, B, Bias, C):
        T.device_entry()
        # One block per SM suffices to ptxas: else it may interleave the loads with the products to save registers
        # for an occupancy the kernel does not need, leaving a few loads in flight instead of all of a group's.
        T.attr({"tirx.launch_bounds_min_blocks_per_sm": 1})
        bx = T.cta_id([grid])
        tx = T.thread_id([32 * warps])
        partial = T.alloc_buffer((smem // 4,), "float32", scope="shared.dyn", align=16)
        T.cuda.func_call(fn, *inputs(A, B, Bias), C.access_ptr("w"), partial.access_ptr("rw"), bx, tx,
                         source_code=code)

    attrs = {"global_symbol": "main", "tirx.noalias": True}
    if bias:
        @T.prim_func
        def main(A: T.Buffer((m, k), dtype, align=16), B: T.Buffer((n, k), dtype, align=16),
                 Bias: T.Buffer((n,), dtype, align=16), C: T.Buffer((m, n), dtype, align=16)):
            T.func_attr(attrs)
            body(A, B, Bias, C)
    else:
        @T.prim_func
        def main(A: T.Buffer((m, k), dtype, align=16), B: T.Buffer((2 * n if gated else n, k), dtype, align=16),
                 C: T.Buffer((m, n), dtype, align=16)):
            T.func_attr(attrs)
            body(A, B, None, C)
    # fmt: on
    return main
