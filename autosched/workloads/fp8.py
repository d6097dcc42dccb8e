"""GEMM on float8 E4M3 operands: both the activations and the weights quantised, one scale per token and one per
output channel (the form FP8 tensor cores take, ``wgmma ... .e4m3.e4m3``)."""

from __future__ import annotations

import math

from ._base import DTYPE_BYTES, Operator, Preset, Workload, randn, register
from .dequant import e4m3_value
from .gemm import EPILOGUE_ATTRS, LLAMA2_7B, epilogue, torch_epilogue

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
