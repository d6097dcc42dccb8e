"""Mixture-of-experts GEMMs: each row multiplied by the weight of its own expert, the rows in any order
(``moe_gemm``: an expert index per row) or sorted by expert (``moe_grouped_gemm``: each expert's rows one
contiguous range, given by offsets, the grouped GEMM of a prefill)."""

from __future__ import annotations

import math

from ._base import DTYPE_BYTES, Operator, Preset, Workload, randn, register

# Deferred imports: tvm, torch (imported where used: `autosched --help` stays fast).

# (experts, hidden, expert intermediate size, experts per token) of the models whose shapes are presets.
MOE_MODELS = {"mixtral-8x7b": (8, 4096, 14336, 2), "qwen3-30b-a3b": (128, 2048, 768, 8)}


def _presets() -> tuple[Preset, ...]:
    out = []
    for model, (e, hidden, inter, top_k) in MOE_MODELS.items():
        for phase, tokens in (("decode", 1), ("prefill", 512)):
            m = tokens * top_k
            out.append(Preset(f"{model}-gate-up-{phase}", {"m": m, "e": e, "n": 2 * inter, "k": hidden},
                              note=f"{model} experts' gate and up projections, {tokens} tokens x {top_k} experts"))
            out.append(Preset(f"{model}-down-{phase}", {"m": m, "e": e, "n": hidden, "k": inter},
                              note=f"{model} experts' down projection, {tokens} tokens x {top_k} experts"))
    return tuple(out)


def _grouped_presets() -> tuple[Preset, ...]:
    return tuple(Preset(p.name, p.shape, note=p.note) for p in _presets() if p.name.endswith("-prefill"))


def moe_compute(X, expert, W, dtype: str):
    """The TE of ``Y[i] = X[i]·W[expert[i]]ᵀ`` (fp32 accumulation, cast to ``dtype``); shapes may be symbolic."""
    from tvm import te

    m, k = X.shape
    n = W.shape[1]
    r = te.reduce_axis((0, k), name="k")
    acc = te.compute((m, n), lambda i, j: te.sum(X[i, r].astype("float32") * W[expert[i], j, r].astype("float32"),
                                                 axis=r), name="moe_matmul")
    return acc if dtype == "float32" else te.compute((m, n), lambda i, j: acc[i, j].astype(dtype), name="epilogue")


@register
class MoeGemm(Operator):
    name = "moe_gemm"
    description = ("Y[i] = X[i]·W[expert[i]]ᵀ; X[m,k], expert[m] int32, W[e,n,k] (each routed token-slot by "
                   "its expert's nn.Linear weight); fp32 accumulation")
    shape_keys = ("m", "e", "n", "k")
    defaults = {"m": 64, "e": 8, "n": 512, "k": 512}
    family = "moe_matmul"
    presets = _presets()

    def build(self, wl: Workload):
        from tvm import te

        s = wl.shape_dict
        m, e, n, k = s["m"], s["e"], s["n"], s["k"]
        X = te.placeholder((m, k), wl.dtype, name="X")
        expert = te.placeholder((m,), "int32", name="expert")
        W = te.placeholder((e, n, k), wl.dtype, name="W")
        out = moe_compute(X, expert, W, wl.dtype)
        return te.create_prim_func([X, expert, W, out])

    def make_inputs(self, wl, gen, device):
        import torch

        s = wl.shape_dict
        expert = torch.randint(0, s["e"], (s["m"],), generator=gen, dtype=torch.int32)
        return [randn((s["m"], s["k"]), wl.dtype, gen, device), expert.to(device),
                randn((s["e"], s["n"], s["k"]), wl.dtype, gen, device, scale=1 / math.sqrt(s["k"]))]

    def output_specs(self, wl):
        s = wl.shape_dict
        return [((s["m"], s["n"]), wl.dtype)]

    def reference(self, wl, inputs):
        x, expert, w = inputs[0].double(), inputs[1].long(), inputs[2].double()
        return [(x.unsqueeze(1) @ w[expert].transpose(1, 2)).squeeze(1)]

    def flops(self, wl):
        s = wl.shape_dict
        return 2.0 * s["m"] * s["n"] * s["k"]

    def min_bytes(self, wl):
        s, b = wl.shape_dict, DTYPE_BYTES[wl.dtype]
        # The weights of at most min(m, e) distinct experts are read.
        return b * (s["m"] * s["k"] + min(s["m"], s["e"]) * s["n"] * s["k"] + s["m"] * s["n"]) + 4 * s["m"]


def row_experts(indptr, m: int, e: int):
    """The TE of each sorted row's expert from the experts' row offsets ``indptr`` [e + 1]: the number of experts
    after the first whose range starts at or before the row (an expert without rows starts where the next does)."""
    from tvm import te, tirx

    if e == 1:
        return te.compute((m,), lambda i: tirx.const(0, "int32"), name="row_expert")
    r = te.reduce_axis((0, e - 1), name="r")
    return te.compute((m,), lambda i: te.sum(tirx.Select(indptr[r + 1] <= i, tirx.const(1, "int32"),
                                                            tirx.const(0, "int32")), axis=r), name="row_expert")


def grouped_counts(m: int, e: int, gen):
    """Rows per expert for random inputs: each row's expert drawn uniformly, so some experts may get none."""
    import torch

    expert = torch.randint(0, e, (m,), generator=gen)
    return torch.bincount(expert, minlength=e)


@register
class MoeGroupedGemm(Operator):
    name = "moe_grouped_gemm"
    description = ("Y[i] = X[i]·W[expert(i)]ᵀ with X's rows sorted by expert: X[m,k], indptr[e+1] int32 (expert j's "
                   "rows are indptr[j]..indptr[j+1]-1, indptr[e] = m), W[e,n,k]; fp32 accumulation (a prefill's "
                   "experts as one grouped GEMM)")
    shape_keys = ("m", "e", "n", "k")
    defaults = {"m": 256, "e": 8, "n": 512, "k": 512}
    family = "moe_grouped"
    presets = _grouped_presets()

    def build(self, wl: Workload):
        from tvm import te

        s = wl.shape_dict
        m, e, n, k = s["m"], s["e"], s["n"], s["k"]
        X = te.placeholder((m, k), wl.dtype, name="X")
        indptr = te.placeholder((e + 1,), "int32", name="indptr")
        W = te.placeholder((e, n, k), wl.dtype, name="W")
        out = moe_compute(X, row_experts(indptr, m, e), W, wl.dtype)
        return te.create_prim_func([X, indptr, W, out])

    def make_inputs(self, wl, gen, device):
        import torch

        s = wl.shape_dict
        counts = grouped_counts(s["m"], s["e"], gen)
        indptr = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
        return [randn((s["m"], s["k"]), wl.dtype, gen, device), indptr.to(device),
                randn((s["e"], s["n"], s["k"]), wl.dtype, gen, device, scale=1 / math.sqrt(s["k"]))]

    def output_specs(self, wl):
        s = wl.shape_dict
        return [((s["m"], s["n"]), wl.dtype)]

    def reference(self, wl, inputs):
        import torch

        x, indptr, w = inputs[0].double(), inputs[1].long().cpu(), inputs[2].double()
        out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64, device=x.device)
        for j in range(w.shape[0]):
            lo, hi = int(indptr[j]), int(indptr[j + 1])
            out[lo:hi] = x[lo:hi] @ w[j].T
        return [out]

    def flops(self, wl):
        s = wl.shape_dict
        return 2.0 * s["m"] * s["n"] * s["k"]

    def min_bytes(self, wl):
        s, b = wl.shape_dict, DTYPE_BYTES[wl.dtype]
        return b * (s["m"] * s["k"] + min(s["m"], s["e"]) * s["n"] * s["k"] + s["m"] * s["n"]) + 4 * (s["e"] + 1)
