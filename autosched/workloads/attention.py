"""Attention: prefill (QKᵀ, softmax, PV with causal and grouped-query options) and decode attention over
a paged KV cache addressed through a block table."""

from __future__ import annotations

import math

from ..errors import UsageError
from ._base import DTYPE_BYTES, Attr, Operator, Preset, ceil_div, randn, register

# Deferred imports: tvm, torch (imported where used: `autosched --help` stays fast).


def _masked(cond, value, otherwise):
    from tvm import tirx

    return value if cond is None else tirx.if_then_else(cond, value, otherwise)


def _softmax_pv(qk, lead: tuple[int, ...], n_kv: int, d: int, mask, v_at, dtype: str, scale: float):
    """The shared tail of both attentions: row max, row sum, probabilities and P·V, then the cast.

    ``lead`` is the shape of the score rows (e.g. (b, h, s)); ``qk(*lead, j)`` reads a score,
    ``mask(*lead, j)`` is None or a condition, ``v_at(*lead, j, r)`` reads V.
    """
    from tvm import te, tirx

    ninf = tirx.min_value("float32")
    j1 = te.reduce_axis((0, n_kv), name="j")
    mx = te.compute(lead, lambda *i: te.max(_masked(mask(*i, j1), qk(*i, j1), ninf), axis=j1), name="row_max")

    def prob(*idx):
        *i, j = idx
        return _masked(mask(*i, j), tirx.exp((qk(*i, j) - mx(*i)) * scale), tirx.const(0.0, "float32"))

    j2 = te.reduce_axis((0, n_kv), name="j")
    den = te.compute(lead, lambda *i: te.sum(prob(*i, j2), axis=j2), name="row_sum")
    p = te.compute(lead + (n_kv,), lambda *idx: prob(*idx) / den(*idx[:-1]), name="probs")
    j3 = te.reduce_axis((0, n_kv), name="j")
    out = te.compute(lead + (d,), lambda *idx: te.sum(p(*idx[:-1], j3) * v_at(*idx[:-1], j3, idx[-1]).astype("float32"),
                                                      axis=j3), name="pv")
    if dtype != "float32":
        out = te.compute(lead + (d,), lambda *idx: out(*idx).astype(dtype), name="epilogue")
    return out


class _AttentionBase(Operator):

    def workload(self, shape=None, dtype="float32", attrs=None):
        shape = dict(shape or {})
        if "hkv" not in shape:
            shape["hkv"] = shape.get("h", self.defaults["h"])
        return super().workload(shape, dtype, attrs)

    def check(self, shape, dtype, attrs):
        if shape["h"] % shape["hkv"]:
            raise UsageError(f"{self.name}: query heads h={shape['h']} must be a multiple of KV heads hkv={shape['hkv']}")


@register
class Attention(_AttentionBase):
    name = "attention"
    family = "attention"
    description = "prefill attention O = softmax(QKᵀ/√d [causal]) V; Q[b,h,s,d], K/V[b,hkv,s,d] (hkv defaults to h)"
    shape_keys = ("b", "h", "s", "d", "hkv")
    defaults = {"b": 1, "h": 32, "s": 2048, "d": 128}
    attrs = (Attr("causal", (True, False), "mask out keys after the query"),)
    presets = (
        Preset("llama2-7b", {"b": 1, "h": 32, "s": 2048, "d": 128}, note="one 2048-token prefill"),
        Preset("llama3-8b", {"b": 1, "h": 32, "hkv": 8, "s": 2048, "d": 128}, note="grouped-query, 8 KV heads"),
        Preset("llama2-7b-512x16", {"b": 16, "h": 32, "s": 512, "d": 128}),
    )

    model_layout = False  # heads before tokens: Q[b,h,s,d]; the model's layout has them after

    def build(self, wl):
        from tvm import te

        s = wl.shape_dict
        b, h, sq, d, hkv = s["b"], s["h"], s["s"], s["d"], s["hkv"]
        group = h // hkv

        def at(n, head, token, *rest):  # an element's index in this layout
            return (n, token, head, *rest) if self.model_layout else (n, head, token, *rest)

        def head_token(x, y):  # (head, query) of the score rows' middle indices, which follow the layout
            return (y, x) if self.model_layout else (x, y)

        Q = te.placeholder(at(b, h, sq, d), wl.dtype, name="Q")
        K = te.placeholder(at(b, hkv, sq, d), wl.dtype, name="K")
        V = te.placeholder(at(b, hkv, sq, d), wl.dtype, name="V")
        r = te.reduce_axis((0, d), name="r")

        def score(n, x, y, j):
            hh, i = head_token(x, y)
            return te.sum(Q[at(n, hh, i, r)].astype("float32") * K[at(n, hh // group, j, r)].astype("float32"), axis=r)

        qk = te.compute(at(b, h, sq, sq), score, name="qk")
        causal = wl.attrs_dict["causal"]
        out = _softmax_pv(qk, at(b, h, sq), sq, d, (lambda n, x, y, j: j <= head_token(x, y)[1]) if causal else
                          (lambda *_: None), lambda n, x, y, j, c: V[at(n, head_token(x, y)[0] // group, j, c)],
                          wl.dtype, 1.0 / math.sqrt(d))
        return te.create_prim_func([Q, K, V, out])

    def make_inputs(self, wl, gen, device):
        s = wl.shape_dict
        q = randn((s["b"], s["h"], s["s"], s["d"]), wl.dtype, gen, device)
        kv = [randn((s["b"], s["hkv"], s["s"], s["d"]), wl.dtype, gen, device) for _ in range(2)]
        return [q] + kv

    def output_specs(self, wl):
        s = wl.shape_dict
        return [((s["b"], s["h"], s["s"], s["d"]), wl.dtype)]

    def reference(self, wl, inputs):
        import torch

        q, k, v = (t.double() for t in inputs)
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if wl.attrs_dict["causal"]:
            n = q.shape[2]
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        return [scores.softmax(-1) @ v]

    def flops(self, wl):
        s = wl.shape_dict
        full = 4.0 * s["b"] * s["h"] * s["s"] * s["s"] * s["d"]
        return full / 2 if wl.attrs_dict["causal"] else full

    def min_bytes(self, wl):
        s, e = wl.shape_dict, DTYPE_BYTES[wl.dtype]
        return e * s["b"] * s["s"] * s["d"] * (2 * s["h"] + 2 * s["hkv"])


@register
class ModelLayoutAttention(Attention):
    """Attention on the layout a Linear's output viewed as heads has: a model's Q, K and V reach it, and
    its output leaves it, without a transpose (otherwise V and the output are each transposed by a
    kernel of their own, every layer). Served by the sm_90 space; elsewhere the pipeline keeps
    ``attention``."""

    name = "attention_bshd"
    family = "attention_bshd"
    dtypes = ("float16", "bfloat16")  # what the sm_90 space takes
    description = ("prefill attention on the model's layout: Q[b,s,h,d], K/V[b,s,hkv,d], O[b,s,h,d] "
                   "(hkv defaults to h); CUDA sm_90")
    presets = (
        Preset("llama2-7b-512x16", {"b": 16, "h": 32, "s": 512, "d": 128}),
        Preset("llama3-8b", {"b": 1, "h": 32, "hkv": 8, "s": 2048, "d": 128}, note="grouped-query, 8 KV heads"),
    )
    model_layout = True

    def make_inputs(self, wl, gen, device):
        return [x.transpose(1, 2).contiguous() for x in super().make_inputs(wl, gen, device)]

    def output_specs(self, wl):
        s = wl.shape_dict
        return [((s["b"], s["s"], s["h"], s["d"]), wl.dtype)]

    def reference(self, wl, inputs):
        return [out.transpose(1, 2).contiguous() for out in super().reference(wl, [x.transpose(1, 2) for x in inputs])]


@register
class PagedDecodeAttention(_AttentionBase):
    name = "paged_decode_attention"
    family = "paged_attention"
    description = ("one query token per sequence against a paged KV cache: Q[b,h,d], K/V cache[pages,page,hkv,d], "
                   "block_table[b, ceil(ctx/page)], seq_lens[b]")
    shape_keys = ("b", "h", "d", "ctx", "page", "hkv")
    defaults = {"b": 16, "h": 32, "d": 128, "ctx": 4096, "page": 16}
    presets = (
        Preset("llama2-7b-b16-4k", {"b": 16, "h": 32, "d": 128, "ctx": 4096, "page": 16}),
        Preset("llama3-8b-b16-4k", {"b": 16, "h": 32, "hkv": 8, "d": 128, "ctx": 4096, "page": 16}),
        Preset("llama3-8b-b64-2k", {"b": 64, "h": 32, "hkv": 8, "d": 128, "ctx": 2048, "page": 16}),
    )

    @staticmethod
    def seq_lens(wl) -> list[int]:
        """The sequence lengths the inputs use: full context, except a shorter last sequence so that the
        masking is exercised. Fixed per workload, so byte counts and timings are comparable."""
        s = wl.shape_dict
        lens = [s["ctx"]] * s["b"]
        if s["b"] > 1:
            lens[-1] = s["ctx"] // 2 + 1
        return lens

    def build(self, wl):
        from tvm import te

        s = wl.shape_dict
        b, h, d, ctx, page, hkv = s["b"], s["h"], s["d"], s["ctx"], s["page"], s["hkv"]
        group, pages_per_seq = h // hkv, ceil_div(ctx, page)
        Q = te.placeholder((b, h, d), wl.dtype, name="Q")
        Kc = te.placeholder((b * pages_per_seq, page, hkv, d), wl.dtype, name="K_cache")
        Vc = te.placeholder((b * pages_per_seq, page, hkv, d), wl.dtype, name="V_cache")
        table = te.placeholder((b, pages_per_seq), "int32", name="block_table")
        lens = te.placeholder((b,), "int32", name="seq_lens")
        r = te.reduce_axis((0, d), name="r")
        qk = te.compute((b, h, ctx), lambda n, hh, j: te.sum(
            Q[n, hh, r].astype("float32") * Kc[table[n, j // page], j % page, hh // group, r].astype("float32"),
            axis=r), name="qk")
        out = _softmax_pv(qk, (b, h), ctx, d, lambda n, hh, j: j < lens[n],
                          lambda n, hh, j, c: Vc[table[n, j // page], j % page, hh // group, c],
                          wl.dtype, 1.0 / math.sqrt(d))
        return te.create_prim_func([Q, Kc, Vc, table, lens, out])

    def make_inputs(self, wl, gen, device):
        import torch

        s = wl.shape_dict
        pages = s["b"] * ceil_div(s["ctx"], s["page"])
        q = randn((s["b"], s["h"], s["d"]), wl.dtype, gen, device)
        kv = [randn((pages, s["page"], s["hkv"], s["d"]), wl.dtype, gen, device) for _ in range(2)]
        table = torch.randperm(pages, generator=gen, dtype=torch.int32).reshape(s["b"], -1)
        lens = torch.tensor(self.seq_lens(wl), dtype=torch.int32)
        return [q] + kv + [table.to(device), lens.to(device)]

    def output_specs(self, wl):
        s = wl.shape_dict
        return [((s["b"], s["h"], s["d"]), wl.dtype)]

    def reference(self, wl, inputs):
        q, kc, vc, table, lens = inputs
        s = wl.shape_dict
        group = s["h"] // s["hkv"]
        outs = []
        for n in range(s["b"]):
            length = int(lens[n])
            k = kc[table[n].long()].reshape(-1, s["hkv"], s["d"])[:length].double()  # [len, hkv, d]
            v = vc[table[n].long()].reshape(-1, s["hkv"], s["d"])[:length].double()
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            scores = (q[n].double()[:, None, :] * k.transpose(0, 1)).sum(-1) / math.sqrt(s["d"])  # [h, len]
            outs.append((scores.softmax(-1)[:, :, None] * v.transpose(0, 1)).sum(1))
        import torch

        return [torch.stack(outs)]

    def flops(self, wl):
        s = wl.shape_dict
        return 4.0 * s["h"] * s["d"] * sum(self.seq_lens(wl))

    def min_bytes(self, wl):
        s, e = wl.shape_dict, DTYPE_BYTES[wl.dtype]
        kv = 2 * e * s["hkv"] * s["d"] * sum(self.seq_lens(wl))
        return kv + 2 * e * s["b"] * s["h"] * s["d"] + 4 * s["b"] * (ceil_div(s["ctx"], s["page"]) + 1)
