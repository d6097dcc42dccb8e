"""Rotary position embedding (the rotate-half form of Llama / Hugging Face) on X[b,s,h,d]."""

from __future__ import annotations

from ..errors import UsageError
from ._base import DTYPE_BYTES, Attr, Operator, Preset, randn, register

# Deferred imports: tvm, torch (imported where used: `autosched --help` stays fast).


def rope_tables(s: int, d: int, theta: float, device: str):
    """cos and sin [s, d] in float32, as Llama builds them."""
    import torch

    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    angles = torch.arange(s, dtype=torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float().to(device), angles.sin().float().to(device)


@register
class Rope(Operator):
    name = "rope"
    description = "Y = X·cos + rotate_half(X)·sin; X[b,s,h,d], cos/sin[s,d] fp32 tables"
    shape_keys = ("b", "s", "h", "d")
    defaults = {"b": 1, "s": 2048, "h": 32, "d": 128}
    attrs = (Attr("theta", (10000.0, 500000.0), "rotary base (Llama 2: 10000, Llama 3: 500000)"),)
    family = "injective"
    presets = (
        Preset("llama2-7b", {"b": 1, "s": 2048, "h": 32, "d": 128}, note="queries of one 2048-token prefill"),
        Preset("llama2-7b-batch16", {"b": 16, "s": 512, "h": 32, "d": 128}),
    )

    def check(self, shape, dtype, attrs):
        if shape["d"] % 2:
            raise UsageError(f"rope needs an even head dimension d (got d={shape['d']})")

    def build(self, wl):
        from tvm import te, tirx

        s = wl.shape_dict
        b, sq, h, d = s["b"], s["s"], s["h"], s["d"]
        half = d // 2
        X = te.placeholder((b, sq, h, d), wl.dtype, name="X")
        cos = te.placeholder((sq, d), "float32", name="cos")
        sin = te.placeholder((sq, d), "float32", name="sin")

        def body(n, t, hh, j):
            x = X[n, t, hh, j].astype("float32")
            rot = tirx.if_then_else(j < half, -X[n, t, hh, j + half].astype("float32"),
                                    X[n, t, hh, j - half].astype("float32"))
            return (x * cos[t, j] + rot * sin[t, j]).astype(wl.dtype)

        Y = te.compute((b, sq, h, d), body, name="rope")
        return te.create_prim_func([X, cos, sin, Y])

    def make_inputs(self, wl, gen, device):
        s = wl.shape_dict
        cos, sin = rope_tables(s["s"], s["d"], wl.attrs_dict["theta"], device)
        return [randn((s["b"], s["s"], s["h"], s["d"]), wl.dtype, gen, device), cos, sin]

    def output_specs(self, wl):
        s = wl.shape_dict
        return [((s["b"], s["s"], s["h"], s["d"]), wl.dtype)]

    def reference(self, wl, inputs):
        import torch

        x, cos, sin = inputs[0].double(), inputs[1].double(), inputs[2].double()
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return [x * cos[None, :, None, :] + rot * sin[None, :, None, :]]

    def flops(self, wl):
        s = wl.shape_dict
        return 3.0 * s["b"] * s["s"] * s["h"] * s["d"]

    def min_bytes(self, wl):
        s, e = wl.shape_dict, DTYPE_BYTES[wl.dtype]
        return e * 2 * s["b"] * s["s"] * s["h"] * s["d"] + 2 * 4 * s["s"] * s["d"]
