"""The decoder's linear layers and RMSNorms as our workloads.

In a function of static shapes (a decode step at a fixed batch, a prefill chunk) each product ``x·Wᵀ`` is a
call of the ``gemm`` workload's kernel on W as stored, keyed, searched and stored exactly as ``autosched tune
gemm`` keys them, so a record of either serves both, and on sm_90 the Hopper spaces serve it (swapped operands
and split-K for a decode step's few rows, wgmma tiles for a prefill chunk). A SwiGLU MLP's gate and up
projections become one ``swiglu_gemm`` where an sm_90 space serves the shape (a prefill chunk's tiles, a decode
step's streaming GEMV of up to eight rows). An RMSNorm at static shapes is
a call of the ``rmsnorm`` workload's kernel on the rows, keyed as ``autosched tune rmsnorm`` keys it, or,
after a residual add, of ``add_rmsnorm`` (both in one kernel). At symbolic shapes (``batch_prefill``,
``batch_decode``) the product stays TVM's ``matmul`` and the norm TVM's ``rms_norm``, which their default
schedules serve. A mixture-of-experts layer's experts are ``moe_gemm`` calls (each routed token-slot by its
own expert's weight), static or symbolic alike; in a static prefill chunk of a CUDA sm_90 build with many routed
rows (:data:`GROUPED_MOE_MIN_ROWS`) the rows are sorted by expert and the experts' products are
``moe_grouped_gemm`` calls instead, a grouped GEMM on tensor cores (:func:`grouped_moe`). A quantised
projection (``build --generate --quantize``) is a call of the ``dequant_gemm`` workload's kernel at static
shapes and the same dequantising TE at symbolic ones (with ``zeros=1`` and its zero points for a scheme that has
them, ``q4f16_zp``; ``fmt=e4m3`` for ``fp8``'s float8 codes). In the static prefill chunks of an ``fp8`` build
for sm_90 (:func:`w8a8_prefill`), a projection that Hopper's FP8 space serves runs on FP8 tensor cores instead:
its activations quantised per token on the fly (``fp8_quant_rows``) and the GEMM on both operands' E4M3 codes
(``fp8_gemm``, :func:`fp8_linear`); decode steps and every other build stay weight-only.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import TYPE_CHECKING

from autosched.pipeline.substitute import workload_func
from autosched.tvm_adapter import nn_tensor, relax_expr
from autosched.workloads import get_operator, make_workload, supported_workload
from autosched.workloads.dequant import dequant_matmul
from autosched.workloads.gemm import epilogue
from autosched.workloads.moe import moe_compute

if TYPE_CHECKING:
    from tvm.relax.frontend.nn import Tensor

# Deferred imports: tvm, numpy (imported where used: `autosched --help` stays fast).


def static_rows(x: Tensor) -> int | None:
    """The rows of ``x`` flattened to [rows, features] if its shape is static, else None."""
    dims = x.shape[:-1]
    return math.prod(dims) if all(isinstance(d, int) for d in dims) else None


# True while a static prefill chunk of an fp8 build for sm_90 is traced (see :func:`w8a8_prefill`).
_W8A8 = contextvars.ContextVar("autosched_w8a8_prefill", default=False)


@contextlib.contextmanager
def w8a8_prefill():
    """While inside, an fp8 projection (``fmt`` "e4m3") of static shape that ``hopper_fp8_gemm`` serves quantises
    its activations per token and runs ``fp8_gemm`` (W8A8, :func:`fp8_linear`) instead of ``dequant_gemm``
    (weight-only). :func:`.decoder.build_module` traces its ``prefill_t<T>`` functions inside it on sm_90: the
    projections are reached through the model's modules, which take no build options."""
    token = _W8A8.set(True)
    try:
        yield
    finally:
        _W8A8.reset(token)


def _call(wl, name: str, args: list, rows: int, cols: int):
    from tvm.relax.frontend.nn import Tensor, op

    return op.tensor_ir_op(workload_func(wl), name, args, Tensor.placeholder((rows, cols), wl.dtype))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x·Wᵀ (+ bias)`` with W [n, k] as ``nn.Linear`` stores it: our ``gemm`` at static shapes."""
    from tvm.relax.frontend.nn import op

    n, k = weight.shape
    rows = static_rows(x)
    if rows is None or not isinstance(n, int) or x.dtype != weight.dtype:
        out = op.matmul(x, op.permute_dims(weight))
        return out + bias if bias is not None else out
    wl = make_workload("gemm", {"m": rows, "n": n, "k": k}, weight.dtype, {"bias": bias is not None, "act": "none"})
    args = [op.reshape(x, (rows, k)), weight] + ([bias] if bias is not None else [])
    return op.reshape(_call(wl, "autosched_gemm", args, rows, n), (*x.shape[:-1], n))


def quant_linear(x: Tensor, qweight: Tensor, scales: Tensor, bias: Tensor | None, bits: int, group: int,
                 k: int, zeros: Tensor | None = None, fmt: str = "int") -> Tensor:
    """``x·dequant(Wq)ᵀ (+ bias)`` of int4/int8 codes (``fmt`` "e4m3": float8 E4M3 bits) and per-group scales
    (:mod:`.quantize`), with int4's per-group zero points where ``zeros`` is given (else 8): our ``dequant_gemm``
    at static shapes; at symbolic ones the same TE, which TVM's default schedules serve."""
    from tvm.relax.frontend.nn import op

    n = qweight.shape[0]
    rows = static_rows(x)
    tail = ([zeros] if zeros is not None else []) + ([bias] if bias is not None else [])
    if rows is None:
        flat = op.reshape(x, (-1, k))

        def compute(a, wq, s, *rest):
            z = rest[0] if zeros is not None else None
            b = rest[-1] if bias is not None else None
            return epilogue(dequant_matmul(a, wq, s, bits, group, k, z, fmt), (a.shape[0], n), scales.dtype, b, "none")

        out = op.tensor_expr_op(compute, "dequant_matmul", [flat, qweight, scales] + tail)
        return op.reshape(out, (*x.shape[:-1], n))
    if fmt == "e4m3" and _W8A8.get() and group == k and zeros is None and w8a8_serves(rows, k, scales.dtype):
        return fp8_linear(x, qweight, scales, bias, k)
    attrs = {"bits": bits, "group": group, "bias": bias is not None, "act": "none", "zeros": int(zeros is not None),
             "fmt": fmt}
    wl = make_workload("dequant_gemm", {"m": rows, "n": n, "k": k}, scales.dtype, attrs)
    args = [op.reshape(x, (rows, k)), qweight, scales] + tail
    return op.reshape(_call(wl, "autosched_dequant_gemm", args, rows, n), (*x.shape[:-1], n))


def w8a8_serves(rows: int, k: int, dtype: str) -> bool:
    """Whether a W8A8 projection of ``rows`` tokens over ``k`` features with a ``dtype`` output has Hopper's FP8
    GEMM space (``hopper_fp8_gemm``) to run on: elsewhere it stays weight-only."""
    from autosched.search_spaces.templates.hopper_gemm import HopperFp8GemmSpace

    return dtype in get_operator("fp8_gemm").dtypes and HopperFp8GemmSpace.serves(rows, k, dtype)


def fp8_linear(x: Tensor, qweight: Tensor, scales: Tensor, bias: Tensor | None, k: int) -> Tensor:
    """``x·Wᵀ (+ bias)`` on FP8 tensor cores (W8A8) for E4M3 weight codes ``qweight`` [n, k] with one scale per
    output channel ``scales`` [n, 1] (fp8's layout, :mod:`.quantize`): x quantised per token by our
    ``fp8_quant_rows`` (codes and float32 scales), then our ``fp8_gemm`` on both operands' codes, scaled by the
    token's and the channel's scale (the weight scales cast to float32, exactly). Static shapes only."""
    from tvm.relax.frontend.nn import Tensor as NNTensor
    from tvm.relax.frontend.nn import op

    n, rows, dtype = qweight.shape[0], static_rows(x), scales.dtype
    quant = make_workload("fp8_quant_rows", {"m": rows, "k": k}, x.dtype)
    codes, scale_a = op.tensor_ir_op(workload_func(quant), "autosched_fp8_quant_rows", [op.reshape(x, (rows, k))],
                                     [NNTensor.placeholder((rows, k), "uint8"), NNTensor.placeholder((rows,), "float32")])
    scale_w = op.reshape(scales.astype("float32"), (n,))
    wl = make_workload("fp8_gemm", {"m": rows, "n": n, "k": k}, dtype, {"bias": bias is not None, "act": "none"})
    args = [codes, qweight, scale_a, scale_w] + ([bias] if bias is not None else [])
    return op.reshape(_call(wl, "autosched_fp8_gemm", args, rows, n), (*x.shape[:-1], n))


def swiglu(x: Tensor, weight: Tensor, hopper: bool) -> Tensor | None:
    """``SiLU(x·W[:n]ᵀ) ⊙ (x·W[n:]ᵀ)`` as one ``swiglu_gemm`` (W: the gate's rows over the up projection's),
    where an sm_90 space serves the shape (:func:`swiglu_serves`); None elsewhere (the caller computes it unfused)."""
    from tvm.relax.frontend.nn import op

    rows = static_rows(x)
    two_n, k = weight.shape
    if not hopper or rows is None or x.dtype != weight.dtype or weight.dtype not in get_operator("swiglu_gemm").dtypes \
            or not swiglu_serves(rows, k, x.dtype):
        return None
    n = two_n // 2
    wl = make_workload("swiglu_gemm", {"m": rows, "n": n, "k": k}, weight.dtype)
    out = _call(wl, "autosched_swiglu_gemm", [op.reshape(x, (rows, k)), weight], rows, n)
    return op.reshape(out, (*x.shape[:-1], n))


def swiglu_serves(rows: int, k: int, dtype: str) -> bool:
    """Whether a fused ``swiglu_gemm`` of ``rows`` tokens over ``k`` features in ``dtype`` has an sm_90 space to run
    on: a decode step's two to eight rows on the streaming GEMV (``swiglu_gemv``), a prefill chunk's more than 64 on
    hopper_gemm's tiles. Elsewhere the projections stay unfused: a single row, where the tuned ``gpu_gemv`` over the
    stacked weight plus the SiLU·up kernel outran ``swiglu_gemv`` on the H200 (BENCHMARKS.md, generation), and a
    decode step's 9 to 64 rows, which hopper_gemm's GEMMs serve with swapped operands (a gated tile cannot swap)."""
    from autosched.search_spaces.templates.hopper_gemm import HopperGemmSpace
    from autosched.search_spaces.templates.swiglu_gemv import SwigluGemvSpace

    return (rows > 1 and SwigluGemvSpace.serves(rows, k, dtype)) or (rows > HopperGemmSpace.SWAP_MAX_M
                                                                    and HopperGemmSpace.serves(rows, k, dtype))


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor | None:
    """``x / sqrt(mean(x², -1) + eps) · w`` over the last axis as our ``rmsnorm`` at static shapes; None where
    the shape is symbolic or the workload does not take the dtype or eps (the caller uses TVM's)."""
    from tvm.relax.frontend.nn import op

    rows, n = static_rows(x), x.shape[-1]
    wl = (supported_workload("rmsnorm", {"m": rows, "n": n}, x.dtype, {"eps": eps})
          if rows is not None and isinstance(n, int) and x.dtype == weight.dtype else None)
    if wl is None:
        return None
    out = _call(wl, "autosched_rmsnorm", [op.reshape(x, (rows, n)), weight], rows, n)
    return op.reshape(out, x.shape)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor] | None:
    """``(rmsnorm(x + residual) · w, x + residual)`` as one ``add_rmsnorm`` at static shapes (a decoder
    layer's residual add and the norm after it: one kernel instead of two); None where :func:`rms_norm`
    would give None (the caller adds, then normalises)."""
    from tvm.relax.frontend.nn import Tensor as NNTensor
    from tvm.relax.frontend.nn import op

    rows, n = static_rows(x), x.shape[-1]
    wl = (supported_workload("add_rmsnorm", {"m": rows, "n": n}, x.dtype, {"eps": eps})
          if rows is not None and isinstance(n, int) and x.dtype == weight.dtype == residual.dtype else None)
    if wl is None:
        return None
    flat = [op.reshape(x, (rows, n)), op.reshape(residual, (rows, n)), weight]
    total, normed = op.tensor_ir_op(workload_func(wl), "autosched_add_rmsnorm", flat,
                                    [NNTensor.placeholder((rows, n), wl.dtype), NNTensor.placeholder((rows, n), wl.dtype)])
    return op.reshape(normed, x.shape), op.reshape(total, x.shape)


def moe_linear(x: Tensor, expert: Tensor, weight: Tensor) -> Tensor:
    """``Y[i] = x[i]·W[expert[i]]ᵀ`` for x [m, k], expert [m] int32 and W [e, n, k] (each expert's
    ``nn.Linear`` weight): our ``moe_gemm`` at a static m, the same TE at a symbolic one (TVM's default
    schedules serve it there)."""
    from tvm.relax.frontend.nn import op

    m, k = x.shape
    e, n, _ = weight.shape
    if not isinstance(m, int) or x.dtype != weight.dtype:
        return op.tensor_expr_op(lambda a, b, c: moe_compute(a, b, c, weight.dtype), "moe_matmul", [x, expert, weight])
    wl = make_workload("moe_gemm", {"m": m, "e": e, "n": n, "k": k}, weight.dtype)
    return _call(wl, "autosched_moe_gemm", [x, expert, weight], m, n)


# Routed rows (tokens x experts per token) from which a prefill chunk's experts run as a grouped GEMM on sm_90:
# a row tile of the grouped GEMM is 32 to 128 rows of one expert, so below a few rows per expert its tiles are
# mostly masked off, where the GEMV per row (``gpu_moe_matmul``) wastes nothing. Decode steps (one token per
# sequence) keep ``moe_gemm`` at any batch.
GROUPED_MOE_MIN_ROWS = 64
# Tests: the sorted path on any target (the CPU's moe_matmul space serves moe_grouped_gemm), to check its
# gather, offsets and scatter against transformers without a GPU.
FORCE_GROUPED_MOE = False


def grouped_moe_serves(rows, seq, up: Tensor, down: Tensor, hopper: bool) -> bool:
    """Whether a layer's experts run as :func:`grouped_moe`: a static prefill chunk (``seq`` tokens per sequence,
    more than one) of at least :data:`GROUPED_MOE_MIN_ROWS` routed ``rows``, on sm_90 where the grouped GEMM
    serves both projections' shapes and dtype."""
    from autosched.search_spaces.templates.moe_grouped_gemm import unsupported

    if not isinstance(rows, int) or not isinstance(seq, int) or seq == 1 or rows < GROUPED_MOE_MIN_ROWS:
        return False
    if FORCE_GROUPED_MOE:
        return True
    return hopper and all(isinstance(w.shape[1], int) and unsupported(w.shape[1], w.shape[2], w.dtype) is None
                          for w in (up, down))


def grouped_linear(x: Tensor, indptr: Tensor, weight: Tensor) -> Tensor:
    """``Y[i] = x[i]·W[e(i)]ᵀ`` for x [m, k] sorted by expert, the experts' row offsets indptr [e + 1] and
    W [e, n, k]: our ``moe_grouped_gemm``."""
    m, k = x.shape
    e, n, _ = weight.shape
    wl = make_workload("moe_grouped_gemm", {"m": m, "e": e, "n": n, "k": k}, weight.dtype)
    return _call(wl, "autosched_moe_grouped_gemm", [x, indptr, weight], m, n)


def grouped_moe(x: Tensor, expert: Tensor, top_k: int, up: Tensor, down: Tensor, activation) -> Tensor:
    """A layer's experts over tokens x [tokens, hidden], each routed to ``top_k`` experts (expert [tokens x top_k]
    int32, token t's choices at rows t·top_k ...), as grouped GEMMs: the routed rows sorted by expert (``argsort``;
    any order among one expert's rows will do, each row's product being its own), the experts' row offsets counted
    (indptr[j]: the routed rows of experts before j), each sorted row's token gathered from x (no replicated copy of
    x), ``activation(gate) ⊙ up`` and the down projection on the sorted rows, and the output rows put back in the
    routed order. Returns [tokens x top_k, hidden]."""
    from tvm import relax as rx
    from tvm.relax.frontend.nn import op

    def take(t: Tensor, ids: Tensor, name: str) -> Tensor:  # rows of t (ids are in range by construction)
        return nn_tensor(rx.op.take(relax_expr(t), relax_expr(ids), axis=0, mode="clip"), name)

    rows = expert.shape[0]
    e = up.shape[0]
    order = op.argsort(expert, dtype="int32")  # sorted position -> routed row
    bounds = op.reshape(op.arange(0, e + 1, dtype="int32"), (e + 1, 1))
    indptr = op.sum(op.less(op.reshape(expert, (1, rows)), bounds).astype("int32"), axis=1)
    token = nn_tensor(rx.op.floor_divide(relax_expr(order), rx.const(top_k, "int32")), "moe_sorted_token")
    gate, projected = op.split(grouped_linear(take(x, token, "moe_sorted_x"), indptr, up), 2, axis=-1)
    out = grouped_linear(activation(gate) * projected, indptr, down)
    return take(out, op.argsort(order, dtype="int32"), "moe_unsorted")
