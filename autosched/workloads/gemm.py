"""GEMM in the ``torch.nn.Linear`` layout (C = A·Bᵀ, optional bias and activation) and batched GEMM."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ._base import DTYPE_BYTES, Attr, Operator, Preset, Workload, randn, register

if TYPE_CHECKING:
    import torch
    from tvm import te

# Deferred imports: tvm, torch (imported where used: `autosched --help` stays fast).


def epilogue(acc: te.Tensor, shape: tuple[int, ...], dtype: str, bias: te.Tensor | None, act: str,
             scale=None) -> te.Tensor:
    """The elementwise tail of a matmul: × scale (``scale(x, *idx)``, e.g. fp8's per-row and per-column
    scales), + bias, activation, cast to the output dtype.

    Returns ``acc`` itself when there is nothing to do, so a plain fp32 GEMM has a single block.
    """
    from tvm import te, tirx

    if bias is None and act == "none" and dtype == "float32" and scale is None:
        return acc

    def body(*idx):
        x = acc(*idx)
        if scale is not None:
            x = scale(x, *idx)
        if bias is not None:
            x = x + bias[idx[-1]].astype("float32")
        if act == "gelu":
            x = x * 0.5 * (1.0 + tirx.erf(x * (1.0 / math.sqrt(2.0))))
        elif act == "silu":
            x = x / (1.0 + tirx.exp(-x))
        return x.astype(dtype)

    return te.compute(shape, body, name="epilogue")


def torch_epilogue(x: torch.Tensor, bias: torch.Tensor | None, act: str) -> torch.Tensor:
    import torch.nn.functional as F

    if bias is not None:
        x = x + bias.double()
    if act == "gelu":
        x = F.gelu(x)
    elif act == "silu":
        x = F.silu(x)
    return x


EPILOGUE_ATTRS = (
    Attr("bias", (False, True), "add a bias vector of length n"),
    Attr("act", ("none", "gelu", "silu"), "activation applied after the bias"),
)


def _llama_linear(prefix: str, m: int, dims: dict[str, tuple[int, int]]) -> tuple[Preset, ...]:
    return tuple(Preset(f"{prefix}-{name}", {"m": m, "n": n, "k": k}, note=f"{prefix} {name} projection, {m} tokens")
                 for name, (n, k) in dims.items())


LLAMA2_7B = {"qkv": (12288, 4096), "o": (4096, 4096), "up": (11008, 4096), "gate-up": (22016, 4096),
             "down": (4096, 11008)}
LLAMA3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "up": (14336, 4096), "down": (4096, 14336)}


@register
class Gemm(Operator):
    name = "gemm"
    description = "C = A·Bᵀ (+bias, +GELU/SiLU); A[m,k], B[n,k] as in torch.nn.Linear; fp32 accumulation"
    shape_keys = ("m", "n", "k")
    defaults = {"m": 1024, "n": 1024, "k": 1024}
    attrs = EPILOGUE_ATTRS
    family = "matmul"
    presets = (
        _llama_linear("llama2-7b", 2048, LLAMA2_7B)
        + _llama_linear("llama2-7b-decode", 1, LLAMA2_7B)
        + _llama_linear("llama3-8b", 2048, LLAMA3_8B)
        + _llama_linear("llama3-8b-decode", 1, LLAMA3_8B)
        + (Preset("square-1024", {"m": 1024, "n": 1024, "k": 1024}), Preset("square-4096", {"m": 4096, "n": 4096, "k": 4096}))
    )

    def build(self, wl: Workload):
        from tvm import te

        s, a = wl.shape_dict, wl.attrs_dict
        m, n, k = s["m"], s["n"], s["k"]
        A = te.placeholder((m, k), wl.dtype, name="A")
        B = te.placeholder((n, k), wl.dtype, name="B")
        r = te.reduce_axis((0, k), name="k")
        acc = te.compute((m, n), lambda i, j: te.sum(A[i, r].astype("float32") * B[j, r].astype("float32"), axis=r),
                         name="matmul")
        bias = te.placeholder((n,), wl.dtype, name="bias") if a["bias"] else None
        out = epilogue(acc, (m, n), wl.dtype, bias, a["act"])
        return te.create_prim_func([A, B] + ([bias] if bias is not None else []) + [out])

    def make_inputs(self, wl, gen, device):
        s = wl.shape_dict
        ins = [randn((s["m"], s["k"]), wl.dtype, gen, device), randn((s["n"], s["k"]), wl.dtype, gen, device,
                                                                     scale=1 / math.sqrt(s["k"]))]
        if wl.attrs_dict["bias"]:
            ins.append(randn((s["n"],), wl.dtype, gen, device))
        return ins

    def output_specs(self, wl):
        s = wl.shape_dict
        return [((s["m"], s["n"]), wl.dtype)]

    def reference(self, wl, inputs):
        a, b = inputs[0].double(), inputs[1].double()
        bias = inputs[2] if wl.attrs_dict["bias"] else None
        return [torch_epilogue(a @ b.T, bias, wl.attrs_dict["act"])]

    def flops(self, wl):
        s = wl.shape_dict
        return 2.0 * s["m"] * s["n"] * s["k"]

    def min_bytes(self, wl):
        s, e = wl.shape_dict, DTYPE_BYTES[wl.dtype]
        return e * (s["m"] * s["k"] + s["n"] * s["k"] + s["m"] * s["n"] + (s["n"] if wl.attrs_dict["bias"] else 0))


@register
class SwigluGemm(Operator):
    """A SwiGLU MLP's gate and up projections in one GEMM, the gate's SiLU and the product in its epilogue:
    the [m, n] product it feeds to the down projection is written once, and no kernel reads the gate's
    and the up projection's [m, n] outputs back (a kernel of its own, every layer, otherwise). W is the
    gate's weight on top of the up projection's, [2n, k]."""

    name = "swiglu_gemm"
    description = "C = SiLU(A·W[:n]ᵀ) ⊙ (A·W[n:]ᵀ); A[m,k], W[2n,k] (gate rows, then up rows); CUDA sm_90"
    shape_keys = ("m", "n", "k")
    defaults = {"m": 2048, "n": 11008, "k": 4096}
    dtypes = ("float16", "bfloat16")  # what the sm_90 space takes
    family = "swiglu_gemm"
    presets = (Preset("llama2-7b", {"m": 2048, "n": 11008, "k": 4096}, note="gate and up projections, 2048 tokens"),
               Preset("llama3-8b", {"m": 2048, "n": 14336, "k": 4096}, note="gate and up projections, 2048 tokens"))

    def build(self, wl: Workload):
        from tvm import te, tirx

        s = wl.shape_dict
        m, n, k = s["m"], s["n"], s["k"]
        A = te.placeholder((m, k), wl.dtype, name="A")
        W = te.placeholder((2 * n, k), wl.dtype, name="W")
        r = te.reduce_axis((0, k), name="k")
        acc = te.compute((m, 2 * n), lambda i, j: te.sum(A[i, r].astype("float32") * W[j, r].astype("float32"),
                                                         axis=r), name="matmul")
        out = te.compute((m, n), lambda i, j: (acc[i, j] / (1.0 + tirx.exp(-acc[i, j])) * acc[i, n + j]).astype(wl.dtype),
                         name="epilogue")
        return te.create_prim_func([A, W, out])

    def make_inputs(self, wl, gen, device):
        s = wl.shape_dict
        return [randn((s["m"], s["k"]), wl.dtype, gen, device),
                randn((2 * s["n"], s["k"]), wl.dtype, gen, device, scale=1 / math.sqrt(s["k"]))]

    def output_specs(self, wl):
        s = wl.shape_dict
        return [((s["m"], s["n"]), wl.dtype)]

    def reference(self, wl, inputs):
        import torch.nn.functional as F

        a, w = inputs[0].double(), inputs[1].double()
        n = wl.shape_dict["n"]
        return [F.silu(a @ w[:n].T) * (a @ w[n:].T)]

    def flops(self, wl):
        s = wl.shape_dict
        return 4.0 * s["m"] * s["n"] * s["k"]

    def min_bytes(self, wl):
        s, e = wl.shape_dict, DTYPE_BYTES[wl.dtype]
        return e * (s["m"] * s["k"] + 2 * s["n"] * s["k"] + s["m"] * s["n"])


@register
class BatchMatmul(Operator):
    name = "batch_matmul"
    description = "C[b] = A[b]·B[b] as torch.bmm; A[b,m,k], B[b,k,n]; fp32 accumulation"
    shape_keys = ("b", "m", "n", "k")
    defaults = {"b": 16, "m": 256, "n": 256, "k": 256}
    family = "matmul"
    presets = (
        Preset("batch16-4096", {"b": 16, "m": 4096, "n": 4096, "k": 4096}, note="batch-16 GEMM"),
        Preset("attn-scores-2048", {"b": 32, "m": 2048, "n": 2048, "k": 128}, note="QKᵀ of 32 heads, 2048 tokens"),
    )

    def build(self, wl):
        from tvm import te

        s = wl.shape_dict
        b, m, n, k = s["b"], s["m"], s["n"], s["k"]
        A = te.placeholder((b, m, k), wl.dtype, name="A")
        B = te.placeholder((b, k, n), wl.dtype, name="B")
        r = te.reduce_axis((0, k), name="k")
        acc = te.compute((b, m, n), lambda x, i, j: te.sum(A[x, i, r].astype("float32") * B[x, r, j].astype("float32"),
                                                          axis=r), name="matmul")
        out = epilogue(acc, (b, m, n), wl.dtype, None, "none")
        return te.create_prim_func([A, B, out])

    def make_inputs(self, wl, gen, device):
        s = wl.shape_dict
        return [randn((s["b"], s["m"], s["k"]), wl.dtype, gen, device),
                randn((s["b"], s["k"], s["n"]), wl.dtype, gen, device, scale=1 / math.sqrt(s["k"]))]

    def output_specs(self, wl):
        s = wl.shape_dict
        return [((s["b"], s["m"], s["n"]), wl.dtype)]

    def reference(self, wl, inputs):
        return [inputs[0].double() @ inputs[1].double()]

    def flops(self, wl):
        s = wl.shape_dict
        return 2.0 * s["b"] * s["m"] * s["n"] * s["k"]

    def min_bytes(self, wl):
        s, e = wl.shape_dict, DTYPE_BYTES[wl.dtype]
        return e * s["b"] * (s["m"] * s["k"] + s["k"] * s["n"] + s["m"] * s["n"])
