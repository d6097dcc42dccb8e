"""GEMM on float8 E4M3 operands: both the activations and the weights quantised, one scale per token and one per
output channel (the form FP8 tensor cores take, ``wgmma ... .e4m3.e4m3``), and the per-token quantisation of
the activations that feeds it (``fp8_quant_rows``)."""

from __future__ import annotations

import math

from ..correctness import relative_error
from ._base import DTYPE_BYTES, Operator, Preset, Workload, randn, register, torch_dtype
from .dequant import e4m3_value
from .gemm import EPILOGUE_ATTRS, LLAMA2_7B, epilogue, torch_epilogue

# Deferred imports: tvm, torch (imported where used: `autosched --help` stays fast).

E4M3_MAX = 448.0  # the largest finite float8 E4M3FN value (code 0x7E)
# Every code that is a number (0x7F and 0xFF are NaN): make_inputs writes them into the first row of A and of W,
# so that a kernel's decoding of subnormals, -0 and ±448 is checked on every run, not only where the
# quantisation of random data happens to reach them.
FINITE_CODES = [c for c in range(256) if c & 127 != 127]


def quantize_e4m3(x, dim: int = -1):
    """(uint8 codes of float8 E4M3FN, float32 scales): ``x`` scaled so that each slice's largest magnitude along
    ``dim`` becomes 448 (per token for activations, per output channel for weights), rounded to E4M3."""
    import torch

    amax = x.abs().amax(dim=dim, keepdim=True).clamp(min=1e-12)
    scale = (amax / E4M3_MAX).float()
    codes = (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes, scale.squeeze(dim)


def round_to_e4m3(x):
    """float64 ``x`` rounded to the nearest float8 E4M3FN value, ties to even, saturating at ±448 (as float64)."""
    import torch

    x = x.clamp(-E4M3_MAX, E4M3_MAX)
    _, exponent = torch.frexp(x)  # |x| in [2^(exponent - 1), 2^exponent)
    # Three mantissa bits: a step of 2^(exponent - 4); below the smallest normal (2^-6) the subnormals' 2^-9.
    step = torch.ldexp(torch.ones_like(x), (exponent - 4).clamp(min=-9))
    return torch.round(x / step) * step


def e4m3_bits(values):
    """The uint8 bits of float64 ``values`` that are float8 E4M3FN numbers already (exactly converted)."""
    import torch

    return values.float().to(torch.float8_e4m3fn).view(torch.uint8)


E4M3_MAX_BITS = 0x43E00000  # 448.0's float32 bits


def e4m3_code(v):
    """The uint8 bits of float8 E4M3FN nearest to the float32 expression ``v`` (ties to even, saturating at ±448;
    -0 and a negative value that rounds to zero keep the sign), encoded with integer arithmetic on v's bits: the
    inverse of :func:`~.dequant.e4m3_value`, and like it independent of TVM's float8 casts (whose LLVM lowering
    gets subnormals wrong). Infinities and NaN saturate to ±448."""
    from tvm import tirx

    def const(x):
        return tirx.const(x, "int32")

    bits = tirx.reinterpret("int32", v)
    sign = (bits >> 24) & const(128)
    mag = tirx.min(bits & const(0x7FFFFFFF), const(E4M3_MAX_BITS))
    exponent = mag >> 23  # float32's, biased by 127; E4M3's normal numbers start at 2^-6 (121)

    def rounded(value, shift):
        """value >> shift, rounded to nearest, ties to even."""
        kept, rest, half = value >> shift, value & ((const(1) << shift) - 1), const(1) << (shift - 1)
        up = tirx.any(rest > half, tirx.all(rest == half, (kept & 1) == 1))
        return kept + tirx.Select(up, const(1), const(0))

    # A normal number: rebias the exponent (127 -> 7) and keep 3 of the 23 mantissa bits; a carry out of the
    # mantissa steps the exponent up, as the encoding wants.
    normal = rounded(mag - (const(120) << 23), const(20))
    # A subnormal one: |v| / 2^-9 rounded, from the full significand (2^23 + mantissa) · 2^(exponent - 150);
    # a code of 8 is the smallest normal number, 2^-6. Past a shift of 25 everything rounds to 0.
    significand = (mag & const(0x7FFFFF)) | const(0x800000)
    subnormal = rounded(significand, tirx.min(const(141) - exponent, const(25)))
    return (tirx.Select(exponent >= 121, normal, subnormal) | sign).astype("uint8")


def e4m3_step_distance(a, b):
    """How many E4M3 values apart the codes ``a`` and ``b`` (uint8 torch tensors) are, elementwise: their
    signed magnitudes' difference (+0 and -0 are both 0); NaN codes are infinitely far from everything."""
    import torch

    def position(c):
        c = c.to(torch.int16)
        return torch.where(c >= 128, -(c & 127), c & 127)

    nan = ((a & 127) == 127) | ((b & 127) == 127)
    return torch.where(nan, torch.tensor(float("inf"), dtype=torch.float64),
                       (position(a) - position(b)).abs().double())


@register
class Fp8QuantRows(Operator):
    """Per-token FP8 quantisation of activations (what feeds ``fp8_gemm``'s A): scale[i] = amax(|X[i, :]|) / 448
    in float32 (0 for a row of zeros) and codes[i, j] the float8 E4M3FN bits nearest X[i, j] / scale[i] (ties to
    even; a zero row divides by 1: codes 0, no NaN), encoded with integer arithmetic (:func:`e4m3_code`).

    One block writes both outputs (the row's scale at its first column), as ``add_rmsnorm`` does: a schedule
    places the scale with the codes in the row's loop, where an output block of its own could not go."""

    name = "fp8_quant_rows"
    description = ("scale[m] = amax(|X[m,:]|)/448 (float32), codes[m,k] = e4m3(X/scale) as uint8 bits of float8 "
                   "E4M3FN (nearest, ties to even, saturating): per-token activation quantisation for fp8_gemm")
    shape_keys = ("m", "k")
    defaults = {"m": 512, "k": 4096}
    dtypes = ("float16", "bfloat16", "float32")  # X's
    family = "rows"
    presets = (Preset("llama2-7b-prefill512", {"m": 512, "k": 4096}, note="a 512-token chunk's hidden states"),
               Preset("llama2-7b-b16x512-down", {"m": 8192, "k": 11008}, note="MLP down's input, 16 x 512 tokens"))
    # Tolerated relative error of the scales (float32 amax / 448 against float64: one rounding, 2^-24); the codes
    # are checked by :meth:`errors`, which gives 0 for correct ones.
    SCALE_TOLERANCE = 1e-6
    # A code may be one E4M3 step from the float64 reference's only where X / scale lies this close (relative) to
    # the midpoint between the two: the kernel's quotient is rounded to float32 (or divided approximately on a
    # GPU, a few ulp) before it is encoded, so a value that near a tie may round either way; nowhere else.
    TIE_WINDOW = 2.0**-20

    def build(self, wl):
        from tvm.script import tirx as T

        s = wl.shape_dict
        m, k, dtype = s["m"], s["k"], wl.dtype

        # fmt: off
        @T.prim_func(s_tir=True)
        def fp8_quant_rows(X: T.Buffer((m, k), dtype), codes: T.Buffer((m, k), "uint8"),
                           scale: T.Buffer((m,), "float32")):
            T.func_attr({"tirx.noalias": True})
            amax = T.sblock_alloc_buffer((m,))
            for i, j in T.grid(m, k):
                with T.sblock("amax"):
                    vi, vj = T.axis.remap("SR", [i, j])
                    with T.init():  # max's identity, which rfactor's reducer registry knows (|x| is at least 0)
                        amax[vi] = T.min_value("float32")
                    amax[vi] = T.max(amax[vi], T.abs(T.Cast("float32", X[vi, vj])))
            for i, j in T.grid(m, k):
                with T.sblock("encode"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    T.reads(X[vi, vj], amax[vi])
                    T.writes(codes[vi, vj], scale[vi])
                    codes[vi, vj] = e4m3_code(T.Cast("float32", X[vi, vj]) / T.Select(
                        amax[vi] > T.float32(0.0), amax[vi] / T.float32(E4M3_MAX), T.float32(1.0)))
                    if vj == 0:
                        scale[vi] = amax[vi] / T.float32(E4M3_MAX)
        # fmt: on
        return fp8_quant_rows

    def make_inputs(self, wl, gen, device):
        """Normal rows, and in the first rows the cases a kernel must get right: a row of zeros (and -0), a row
        reaching past 448 whose small values land in E4M3's subnormals, a row of exact ties between E4M3 values."""
        import torch

        s = wl.shape_dict
        m, k = s["m"], s["k"]
        x = torch.randn((m, k), generator=gen, dtype=torch.float32)
        if m >= 1:
            x[0] = 0.0
            x[0, 1::2] = -0.0
        if m >= 2 and k >= 2:  # amax 1000: scale 1000/448; values down to 2^-12 of it in the subnormals
            x[1] = torch.randn((k,), generator=gen) * torch.exp2(-torch.randint(0, 14, (k,), generator=gen).float())
            x[1, 0] = 1000.0
            x[1, 1] = -999.0
        if m >= 3 and k >= 2:  # amax 448 (scale 1): ties 17 (16 | 18), -19 (-18 | -20), 2.5·2^-9 (subnormals 2 | 3)
            x[2] = torch.tensor([17.0, -19.0, 2.5 * 2.0**-9, 448.0] * k)[:k]
            x[2, -1] = 448.0
        return [x.to(torch_dtype(wl.dtype)).to(device)]

    def output_specs(self, wl):
        s = wl.shape_dict
        return [((s["m"], s["k"]), "uint8"), ((s["m"],), "float32")]

    def _quotient(self, inputs):
        """(X / scale in float64 with the scale rounded to float32 as the kernel stores it, that scale)."""
        import torch

        x = inputs[0].double()
        scale = (x.abs().amax(-1) / E4M3_MAX).float().double()
        return x / torch.where(scale > 0, scale, torch.ones_like(scale))[:, None], scale

    def reference(self, wl, inputs):
        q, scale = self._quotient(inputs)
        return [e4m3_bits(round_to_e4m3(q)).to(inputs[0].device), (inputs[0].double().abs().amax(-1) / E4M3_MAX)]

    def errors(self, wl, inputs, outs, refs):
        """[0 if every code is the reference's or one step from it at a near-tie (:attr:`TIE_WINDOW`), else the
        number of codes that are not (at least 1, past any tolerance; infinity for a NaN code, which an unwritten
        output also shows), the scales' relative error scaled so that :attr:`SCALE_TOLERANCE` meets the workload's
        tolerance]."""
        import torch

        q, _ = self._quotient([t.cpu() for t in inputs])
        out, ref = outs[0].cpu(), refs[0].cpu()
        distance = e4m3_step_distance(out, ref)
        if bool(torch.isinf(distance).any()):
            return [math.inf, relative_error(outs[1], refs[1])]
        # The midpoint between the reference's value and the kernel's where they are one step apart.
        values = (out.view(torch.float8_e4m3fn).double() + ref.view(torch.float8_e4m3fn).double()) / 2
        near_tie = (q.abs().clamp(max=E4M3_MAX) - values.abs()).abs() <= self.TIE_WINDOW * values.abs()
        wrong = int(((distance > 1) | ((distance == 1) & ~near_tie)).sum())
        scale_error = relative_error(outs[1], refs[1]) * self.tolerance(wl) / self.SCALE_TOLERANCE
        return [float(wrong), scale_error]

    def flops(self, wl):
        s = wl.shape_dict
        return 2.0 * s["m"] * s["k"]

    def min_bytes(self, wl):
        s = wl.shape_dict
        return s["m"] * s["k"] * (DTYPE_BYTES[wl.dtype] + 1) + 4 * s["m"]


@register
class Fp8Gemm(Operator):
    """C = (e4m3(A) · e4m3(W)ᵀ) ⊙ (scale_a ⊗ scale_w) (+ bias, + GELU/SiLU): A[m, k] and W[n, k] are the uint8 bits
    of float8 E4M3FN numbers (OCP E4M3FN: max 448, no infinities), both K-major (torch.nn.Linear's layout, which
    FP8 wgmma requires of both operands), scale_a[m] per token and scale_w[n] per output channel in float32; the
    products are exact and summed in fp32, the output is the workload's dtype."""

    name = "fp8_gemm"
    description = ("C = (e4m3(A)·e4m3(W)ᵀ)·scale_a[m]·scale_w[n] (+bias, +GELU/SiLU); A[m,k], W[n,k] uint8 bits of "
                   "float8 E4M3FN, float32 scales per token and per output channel; fp32 accumulation")
    shape_keys = ("m", "n", "k")
    defaults = {"m": 512, "n": 4096, "k": 4096}
    dtypes = ("float16", "bfloat16")  # the output's (and the bias's)
    attrs = EPILOGUE_ATTRS
    family = "matmul"
    presets = tuple(Preset(f"llama2-7b-prefill512-{name}", {"m": 512, "n": n, "k": k},
                           note=f"Llama-2-7B {name} projection, a 512-token prefill chunk")
                    for name, (n, k) in LLAMA2_7B.items()) + (
        Preset("llama2-7b-b16x512-up", {"m": 8192, "n": 11008, "k": 4096}, note="MLP up, 16 sequences of 512 tokens"),)

    def build(self, wl: Workload):
        from tvm import te

        s, a = wl.shape_dict, wl.attrs_dict
        m, n, k = s["m"], s["n"], s["k"]
        A = te.placeholder((m, k), "uint8", name="A")
        W = te.placeholder((n, k), "uint8", name="W")
        Sa = te.placeholder((m,), "float32", name="scale_a")
        Sw = te.placeholder((n,), "float32", name="scale_w")
        # Decoded with integer arithmetic (TVM's LLVM cast from float8 gets subnormals wrong); every product of
        # two E4M3 values is exact in fp32.
        Ad = te.compute((m, k), lambda i, r: e4m3_value(A[i, r]), name="decode_a")
        Wd = te.compute((n, k), lambda j, r: e4m3_value(W[j, r]), name="decode_w")
        red = te.reduce_axis((0, k), name="k")
        acc = te.compute((m, n), lambda i, j: te.sum(Ad[i, red] * Wd[j, red], axis=red), name="matmul")
        bias = te.placeholder((n,), wl.dtype, name="bias") if a["bias"] else None
        out = epilogue(acc, (m, n), wl.dtype, bias, a["act"], scale=lambda x, i, j: x * Sa[i] * Sw[j])
        return te.create_prim_func([A, W, Sa, Sw] + ([bias] if bias is not None else []) + [out])

    def make_inputs(self, wl, gen, device):
        import torch

        s = wl.shape_dict
        m, n, k = s["m"], s["n"], s["k"]
        a, scale_a = quantize_e4m3(torch.randn((m, k), generator=gen, dtype=torch.float32))
        w, scale_w = quantize_e4m3(torch.randn((n, k), generator=gen, dtype=torch.float32) / math.sqrt(k))
        codes = torch.tensor(FINITE_CODES, dtype=torch.uint8)
        a[0, : min(k, len(codes))] = codes[:k]
        w[0, : min(k, len(codes))] = codes.flip(0)[:k]
        ins = [a.to(device), w.to(device), scale_a.to(device), scale_w.to(device)]
        if wl.attrs_dict["bias"]:
            ins.append(randn((n,), wl.dtype, gen, device))
        return ins

    def output_specs(self, wl):
        s = wl.shape_dict
        return [((s["m"], s["n"]), wl.dtype)]

    def reference(self, wl, inputs):
        import torch

        a = inputs[0].view(torch.float8_e4m3fn).double()
        w = inputs[1].view(torch.float8_e4m3fn).double()
        out = (a @ w.T) * inputs[2].double()[:, None] * inputs[3].double()[None, :]
        bias = inputs[4] if wl.attrs_dict["bias"] else None
        return [torch_epilogue(out, bias, wl.attrs_dict["act"])]

    def flops(self, wl):
        s = wl.shape_dict
        return 2.0 * s["m"] * s["n"] * s["k"]

    def min_bytes(self, wl):
        s, e = wl.shape_dict, DTYPE_BYTES[wl.dtype]
        m, n, k = s["m"], s["n"], s["k"]
        return m * k + n * k + 4 * (m + n) + e * (m * n + (n if wl.attrs_dict["bias"] else 0))
