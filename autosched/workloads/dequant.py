"""Weight-dequantising GEMM: int4 / int8 weights, or float8 E4M3 ones, with per-group scales, dequantised inside
the kernel."""

from __future__ import annotations

import math

from ..errors import UsageError
from ._base import DTYPE_BYTES, Attr, Operator, Preset, ceil_div, randn, register, torch_dtype
from .gemm import EPILOGUE_ATTRS, epilogue, torch_epilogue

# Deferred imports: tvm, torch (imported where used: `autosched --help` stays fast).


def e4m3_value(code):
    """The float32 value of a uint8 expression holding the bits of a float8 E4M3FN number (OCP: sign, 4 exponent
    bits biased by 7, 3 mantissa bits; no infinities, 0x7F and 0xFF NaN), decoded with integer arithmetic: TVM's
    own cast from float8_e4m3fn decodes subnormals wrongly on the CPU."""
    from tvm import tirx

    c = code.astype("int32")
    exponent, mantissa = (c >> 3) & 15, c & 7
    # The magnitude in units of 2^-10: (8 + m)·2^e for a normal number, 2m for a subnormal one (m/8·2^-6).
    units = tirx.Select(exponent > 0, (mantissa + 8) << exponent, mantissa << 1)
    value = tirx.Select(c >= 128, -units, units).astype("float32") * tirx.const(2.0**-10, "float32")  # exact: < 2^24
    return tirx.Select((c & 127) == 127, tirx.const(float("nan"), "float32"), value)


def dequant_matmul(A, Wq, S, bits: int, group: int, k: int, Z=None, fmt: str = "int"):
    """The TE of ``A·dequant(Wq)ᵀ`` in fp32 (the weights dequantised to ``S``'s dtype first); A's rows may be
    symbolic (a generation module's dynamic functions compute it so, on TVM's default schedules). ``Z``: int4's
    zero points, uint8 [n, groups] (asymmetric checkpoints); None: every zero point 8. ``fmt`` "e4m3": Wq holds
    the uint8 bits of float8 E4M3FN weights (:func:`e4m3_value`)."""
    from tvm import te, tirx

    m, n, dtype = A.shape[0], Wq.shape[0], S.dtype
    if fmt == "e4m3":
        def value(j, r):
            return e4m3_value(Wq[j, r])
    elif bits == 4:
        def zero(j, r):
            return Z[j, r // group].astype("float32") if Z is not None else tirx.const(8.0, "float32")

        def value(j, r):
            byte = Wq[j, r // 2]
            shift = ((r % 2) * 4).astype("uint8")
            return (tirx.shift_right(byte, shift) & tirx.const(15, "uint8")).astype("float32") - zero(j, r)
    else:
        def value(j, r):
            return Wq[j, r].astype("float32")

    W = te.compute((n, k), lambda j, r: (value(j, r) * S[j, r // group].astype("float32")).astype(dtype),
                   name="dequantize")
    red = te.reduce_axis((0, k), name="k")
    return te.compute((m, n), lambda i, j: te.sum(A[i, red].astype("float32") * W[j, red].astype("float32"),
                                                  axis=red), name="matmul")


@register
class DequantGemm(Operator):
    name = "dequant_gemm"
    description = ("C = A·dequant(Wq)ᵀ; Wq int4 (two per uint8, low nibble first, zero point 8, or with zeros=1 "
                   "uint8 zero points[n, ceil(k/group)]), int8, or with fmt=e4m3 the uint8 bits of float8 E4M3FN, "
                   "scales[n, ceil(k/group)]; fp32 accumulation")
    shape_keys = ("m", "n", "k")
    defaults = {"m": 1, "n": 4096, "k": 4096}
    dtypes = ("float16", "float32", "bfloat16")
    attrs = (Attr("bits", (4, 8), "weight bits"),
             Attr("group", (128, 32, 64, 256), "weights per scale (k or more: one per output channel)", open=True),
             *EPILOGUE_ATTRS,
             # Last and unkeyed at 0, so that the workloads without zero points keep their keys and records.
             Attr("zeros", (0, 1), "int4 only: 1 takes a zero point per group and output channel, uint8 "
                  "[n, ceil(k/group)], w = s·(q − z) (asymmetric AWQ/GPTQ); 0: every zero point 8",
                  unkeyed_default=True),
             # Unkeyed at "int" for the same reason.
             Attr("fmt", ("int", "e4m3"), "bits=8 only: e4m3 reads Wq as the uint8 bits of float8 E4M3FN weights "
                  "(OCP E4M3FN: max 448, no infinities), w = s·e4m3(q); int: integers", unkeyed_default=True))
    family = "matmul"
    presets = (
        Preset("llama2-7b-decode-up", {"m": 1, "n": 11008, "k": 4096}, note="decode GEMV, MLP up"),
        Preset("llama2-7b-decode-o", {"m": 1, "n": 4096, "k": 4096}, note="decode GEMV, attention out"),
        Preset("llama2-7b-prefill-up", {"m": 2048, "n": 11008, "k": 4096}, note="prefill, MLP up"),
    )

    def check(self, shape, dtype, attrs):
        if attrs.get("zeros") and attrs["bits"] != 4:
            raise UsageError("dequant_gemm's zeros=1 (zero points) is for bits=4 only: int8 weights are symmetric")
        if attrs.get("fmt", "int") != "int" and attrs["bits"] != 8:
            raise UsageError(f"dequant_gemm's fmt={attrs['fmt']} (float8 weights) is for bits=8 only")

    def build(self, wl):
        from tvm import te

        s, a = wl.shape_dict, wl.attrs_dict
        m, n, k, group = s["m"], s["n"], s["k"], a["group"]
        A = te.placeholder((m, k), wl.dtype, name="A")
        S = te.placeholder((n, ceil_div(k, group)), wl.dtype, name="scale")
        fmt = a.get("fmt", "int")
        Wq = te.placeholder((n, ceil_div(k, 2)) if a["bits"] == 4 else (n, k),
                            "int8" if a["bits"] == 8 and fmt == "int" else "uint8", name="Wq")
        Z = te.placeholder((n, ceil_div(k, group)), "uint8", name="zero") if a.get("zeros") else None
        acc = dequant_matmul(A, Wq, S, a["bits"], group, k, Z, fmt)
        bias = te.placeholder((n,), wl.dtype, name="bias") if a["bias"] else None
        out = epilogue(acc, (m, n), wl.dtype, bias, a["act"])
        return te.create_prim_func([A, Wq, S] + ([Z] if Z is not None else []) + ([bias] if bias is not None else [])
                                   + [out])

    def make_inputs(self, wl, gen, device):
        import torch

        s, a = wl.shape_dict, wl.attrs_dict
        n, k = s["n"], s["k"]
        if a["bits"] == 4:
            wq = torch.randint(0, 256, (n, ceil_div(k, 2)), generator=gen, dtype=torch.uint8)
            scale = 1 / (4 * math.sqrt(k))
        elif a.get("fmt", "int") == "e4m3":
            wq = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.uint8)
            wq[(wq & 127) == 127] = 0  # no NaN codes
            scale = 1 / (128 * math.sqrt(k))  # codes' magnitudes reach 448
        else:
            wq = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
            scale = 1 / (64 * math.sqrt(k))
        # Positive scales around `scale`, so that outputs stay O(1) in half precision.
        scales = (torch.rand((n, ceil_div(k, a["group"])), generator=gen) + 0.5) * scale
        ins = [randn((s["m"], k), wl.dtype, gen, device), wq.to(device), scales.to(torch_dtype(wl.dtype)).to(device)]
        if a.get("zeros"):
            ins.append(torch.randint(0, 16, scales.shape, generator=gen, dtype=torch.uint8).to(device))
        if a["bias"]:
            ins.append(randn((n,), wl.dtype, gen, device))
        return ins

    def dequantize(self, wl, wq, scales, zeros=None):
        """The float64 weights [n, k] that the kernel must compute with; ``zeros``: int4's zero points
        [n, groups] (None: 8)."""
        import torch

        s, a = wl.shape_dict, wl.attrs_dict
        k = s["k"]
        if a["bits"] == 4:
            w = wq.to(torch.int16)
            w = torch.stack([w & 15, (w >> 4) & 15], dim=-1).reshape(w.shape[0], -1)[:, :k].double()
            w = w - (zeros.double().repeat_interleave(a["group"], dim=1)[:, :k] if zeros is not None else 8.0)
        elif a.get("fmt", "int") == "e4m3":
            w = wq.view(torch.float8_e4m3fn).double()
        else:
            w = wq.double()
        return w * scales.double().repeat_interleave(a["group"], dim=1)[:, :k]

    def output_specs(self, wl):
        s = wl.shape_dict
        return [((s["m"], s["n"]), wl.dtype)]

    def reference(self, wl, inputs):
        a = wl.attrs_dict
        zeros = inputs[3] if a.get("zeros") else None
        w = self.dequantize(wl, inputs[1], inputs[2], zeros)
        bias = inputs[4 if zeros is not None else 3] if a["bias"] else None
        return [torch_epilogue(inputs[0].double() @ w.T, bias, a["act"])]

    def flops(self, wl):
        s = wl.shape_dict
        return 2.0 * s["m"] * s["n"] * s["k"]

    def min_bytes(self, wl):
        s, a = wl.shape_dict, wl.attrs_dict
        e = DTYPE_BYTES[wl.dtype]
        weights = s["n"] * (ceil_div(s["k"], 2) if a["bits"] == 4 else s["k"])
        scales = s["n"] * ceil_div(s["k"], a["group"]) * (e + (1 if a.get("zeros") else 0))  # uint8 zero points
        return e * (s["m"] * s["k"] + s["m"] * s["n"]) + weights + scales
