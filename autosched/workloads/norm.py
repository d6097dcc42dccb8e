"""Row-wise operators: RMSNorm and softmax over the last axis, fp32 internally."""

from __future__ import annotations

from ._base import DTYPE_BYTES, Attr, Operator, Preset, randn, register

# Deferred imports: tvm (imported where used: `autosched --help` stays fast).


@register
class RMSNorm(Operator):
    name = "rmsnorm"
    description = "Y = X / sqrt(mean(X², -1) + eps) · W; X[m,n], W[n]"
    shape_keys = ("m", "n")
    defaults = {"m": 2048, "n": 4096}
    attrs = (Attr("eps", (1e-5, 1e-6), "added to the mean square"),)
    family = "rows"
    presets = (
        Preset("llama2-7b", {"m": 2048, "n": 4096}, note="2048 tokens, hidden 4096"),
        Preset("llama2-7b-decode", {"m": 16, "n": 4096}, note="16 sequences, one token each"),
        Preset("llama2-70b", {"m": 2048, "n": 8192}),
        Preset("h200-4096", {"m": 4096, "n": 4096}),
    )

    def build(self, wl):
        from tvm import te, tirx

        s = wl.shape_dict
        m, n, eps = s["m"], s["n"], wl.attrs_dict["eps"]
        X = te.placeholder((m, n), wl.dtype, name="X")
        W = te.placeholder((n,), wl.dtype, name="W")
        r = te.reduce_axis((0, n), name="k")
        ss = te.compute((m,), lambda i: te.sum(X[i, r].astype("float32") * X[i, r].astype("float32"), axis=r),
                        name="sumsq")
        # One reciprocal square root per row, a stage of its own, so that no schedule is forced to
        # recompute it for every element.
        rstd = te.compute((m,), lambda i: tirx.rsqrt(ss[i] / float(n) + eps), name="rstd")
        Y = te.compute((m, n), lambda i, j: (X[i, j].astype("float32") * rstd[i] * W[j].astype("float32"))
                       .astype(wl.dtype), name="norm")
        return te.create_prim_func([X, W, Y])

    def make_inputs(self, wl, gen, device):
        s = wl.shape_dict
        return [randn((s["m"], s["n"]), wl.dtype, gen, device), randn((s["n"],), wl.dtype, gen, device)]

    def output_specs(self, wl):
        s = wl.shape_dict
        return [((s["m"], s["n"]), wl.dtype)]

    def reference(self, wl, inputs):
        x, w = inputs[0].double(), inputs[1].double()
        return [x * (x.pow(2).mean(-1, keepdim=True) + wl.attrs_dict["eps"]).rsqrt() * w]

    def flops(self, wl):
        s = wl.shape_dict
        return 4.0 * s["m"] * s["n"]

    def min_bytes(self, wl):
        s, e = wl.shape_dict, DTYPE_BYTES[wl.dtype]
        return e * (2 * s["m"] * s["n"] + s["n"])


@register
class AddRMSNorm(Operator):
    """A decoder's residual add and the RMSNorm after it in one kernel: ``S = X + R`` (the new residual
    stream, rounded to the dtype as the unfused add rounds it) and ``Y = rmsnorm(S) · W``. Unfused, every
    layer launches an add and a norm twice, each a whole pass over the rows.

    The norm recomputes ``X + R`` rather than reading S back: a kernel cannot read what its other threads
    wrote to global memory without a barrier, and the schedule spaces place no such barrier. The final
    stage writes S and Y together."""

    name = "add_rmsnorm"
    description = "S = X + R; Y = S / sqrt(mean(S², -1) + eps) · W; X, R [m,n], W[n]; outputs S and Y"
    shape_keys = ("m", "n")
    defaults = {"m": 16, "n": 4096}
    attrs = (Attr("eps", (1e-5, 1e-6), "added to the mean square"),)
    family = "rows"
    presets = (
        Preset("llama2-7b-decode", {"m": 16, "n": 4096}, note="16 sequences, one token each"),
        Preset("llama2-7b", {"m": 2048, "n": 4096}, note="2048 tokens, hidden 4096"),
    )

    def build(self, wl):
        from tvm.script import tirx as T

        s = wl.shape_dict
        m, n, eps, dtype = s["m"], s["n"], wl.attrs_dict["eps"], wl.dtype

        # One block writes both outputs (TE has no way to say so): a schedule places the residual with the
        # norm, where an output block of its own could not be moved into the row's loop.
        # fmt: off
        @T.prim_func(s_tir=True)
        def add_rmsnorm(X: T.Buffer((m, n), dtype), R: T.Buffer((m, n), dtype), W: T.Buffer((n,), dtype),
                        residual: T.Buffer((m, n), dtype), norm: T.Buffer((m, n), dtype)):
            T.func_attr({"tirx.noalias": True})
            sumsq = T.sblock_alloc_buffer((m,))
            rstd = T.sblock_alloc_buffer((m,))
            for i, k in T.grid(m, n):
                with T.sblock("sumsq"):
                    vi, vk = T.axis.remap("SR", [i, k])
                    with T.init():
                        sumsq[vi] = T.float32(0.0)
                    sumsq[vi] = sumsq[vi] + T.Cast("float32", X[vi, vk] + R[vi, vk]) * T.Cast("float32", X[vi, vk] + R[vi, vk])
            for i in range(m):
                with T.sblock("rstd"):
                    vi = T.axis.spatial(m, i)
                    rstd[vi] = T.rsqrt(sumsq[vi] / T.float32(n) + T.float32(eps))
            for i, j in T.grid(m, n):
                with T.sblock("norm"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    T.reads(X[vi, vj], R[vi, vj], rstd[vi], W[vj])
                    T.writes(residual[vi, vj], norm[vi, vj])
                    residual[vi, vj] = X[vi, vj] + R[vi, vj]
                    norm[vi, vj] = T.Cast(dtype, T.Cast("float32", X[vi, vj] + R[vi, vj]) * rstd[vi]
                                          * T.Cast("float32", W[vj]))
        # fmt: on
        return add_rmsnorm

    def make_inputs(self, wl, gen, device):
        s = wl.shape_dict
        return [randn((s["m"], s["n"]), wl.dtype, gen, device), randn((s["m"], s["n"]), wl.dtype, gen, device),
                randn((s["n"],), wl.dtype, gen, device)]

    def output_specs(self, wl):
        s = wl.shape_dict
        return [((s["m"], s["n"]), wl.dtype), ((s["m"], s["n"]), wl.dtype)]

    def reference(self, wl, inputs):
        x = inputs[0].double() + inputs[1].double()
        return [x, x * (x.pow(2).mean(-1, keepdim=True) + wl.attrs_dict["eps"]).rsqrt() * inputs[2].double()]

    def flops(self, wl):
        s = wl.shape_dict
        return 5.0 * s["m"] * s["n"]

    def min_bytes(self, wl):
        s, e = wl.shape_dict, DTYPE_BYTES[wl.dtype]
        return e * (4 * s["m"] * s["n"] + s["n"])


@register
class Softmax(Operator):
    name = "softmax"
    description = "Y = softmax(X, -1); X[m,n]"
    shape_keys = ("m", "n")
    defaults = {"m": 2048, "n": 4096}
    family = "rows"
    presets = (
        Preset("attn-2048", {"m": 32 * 2048, "n": 2048}, note="attention scores of 32 heads over 2048 tokens"),
        Preset("vocab-32000", {"m": 16, "n": 32000}, note="sampling over Llama-2's vocabulary"),
        Preset("h200-4096", {"m": 4096, "n": 4096}),
    )

    def build(self, wl):
        from tvm import te, tirx

        s = wl.shape_dict
        m, n = s["m"], s["n"]
        X = te.placeholder((m, n), wl.dtype, name="X")
        r1 = te.reduce_axis((0, n), name="k")
        mx = te.compute((m,), lambda i: te.max(X[i, r1].astype("float32"), axis=r1), name="row_max")
        r2 = te.reduce_axis((0, n), name="k")
        den = te.compute((m,), lambda i: te.sum(tirx.exp(X[i, r2].astype("float32") - mx[i]), axis=r2),
                         name="row_sum")
        Y = te.compute((m, n), lambda i, j: (tirx.exp(X[i, j].astype("float32") - mx[i]) / den[i]).astype(wl.dtype),
                       name="softmax")
        return te.create_prim_func([X, Y])

    def make_inputs(self, wl, gen, device):
        s = wl.shape_dict
        return [randn((s["m"], s["n"]), wl.dtype, gen, device, scale=2.0)]

    def output_specs(self, wl):
        s = wl.shape_dict
        return [((s["m"], s["n"]), wl.dtype)]

    def reference(self, wl, inputs):
        return [inputs[0].double().softmax(-1)]

    def flops(self, wl):
        s = wl.shape_dict
        return 5.0 * s["m"] * s["n"]

    def min_bytes(self, wl):
        s, e = wl.shape_dict, DTYPE_BYTES[wl.dtype]
        return e * 2 * s["m"] * s["n"]
