"""Weight quantisation of a generation build: the decoder's linear layers as ``dequant_gemm`` weights.

Quantised at build time from the float weights, round-to-nearest, in the layout ``dequant_gemm`` reads:

- ``q4f16``: int4 weights, two per uint8 (low nibble first), zero point 8, a scale per group of 128 weights
  along K (the input features); where K is not a multiple of 128, the largest of 64 and 32 that divides it
  (tiny models), and a K that is not a multiple of 32 is refused. A group's scale is its largest magnitude / 7,
  so its weights take the levels -7..7 (the code 0, level -8, stays unused: symmetric).
- ``q4f16_zp``: q4f16's codes and groups with a zero point per group and output channel (uint8 [n, k / group],
  ``dequant_gemm``'s ``zeros=1``): w = s·(q − z). Quantised here as GPTQ's quantiser does (the group's range
  widened to hold 0, s = range / 15, z = round(−min / s)); it is what asymmetric AWQ and GPTQ checkpoints
  (:mod:`.awq`, :mod:`.gptq`) build as, their own zero points kept.
- ``q8f16``: int8 weights, one scale per output channel (a group of K weights), largest magnitude / 127.
- ``fp8``: float8 E4M3FN weights (OCP: max 448, subnormals down to 2^-9) stored as their uint8 bits, one scale
  per output channel, largest magnitude / 448; a weight's code is w / s rounded to the nearest E4M3 value (ties
  to even, saturating at ±448): ``dequant_gemm``'s ``fmt=e4m3``, w = s·e4m3(q). Per-channel and per-tensor FP8
  checkpoints (compressed-tensors, :mod:`.fp8`) build as ``fp8`` with their own codes and scales. This is the
  weight-only form: activations stay in the model's dtype, so a build computes the dequantised weights' product
  up to accumulation order, except in the static prefill chunks (``prefill_t<T>``) of a build for sm_90: there
  each projection that Hopper's FP8 GEMM space serves is W8A8, its activations quantised per token on the fly
  (``fp8_quant_rows``: scale amax / 448 in float32, codes rounded to E4M3) and the product on FP8 ``wgmma``
  (``fp8_gemm``, space ``hopper_fp8_gemm``), from the same weight codes and scales (cast to float32 exactly).

Scales are kept in the model's dtype (float16 for an fp16 build: the "f16"), rounded before the weights are
quantised against them, so that the codes fit the scales the kernel multiplies by. The projections of every
decoder layer (q/k/v, output, gate/up, down) are quantised; the embeddings, the LM head and the norms stay
in the model's dtype. Mixture-of-experts models are refused (their experts' ``moe_gemm`` has no int form).
"""

from __future__ import annotations

from dataclasses import dataclass

from autosched.errors import UsageError
from autosched.workloads.fp8 import E4M3_MAX, e4m3_bits, round_to_e4m3

# Deferred imports: torch (imported where used: `autosched --help` stays fast).


@dataclass(frozen=True)
class Scheme:
    name: str
    bits: int
    groups: tuple[int, ...]  # group sizes to try along K, largest first; () for one group of all K (per channel)
    doc: str
    zeros: bool = False  # int4 with a zero point per group and output channel (else zero point 8)
    fmt: str = "int"  # what the codes are: integers, or "e4m3" (the bits of float8 E4M3FN numbers)


SCHEMES = {
    "q4f16": Scheme(
        "q4f16", 4, (128, 64, 32), "int4 weights (zero point 8) in groups of 128 along K, scales in the model's dtype"
    ),
    "q4f16_zp": Scheme(
        "q4f16_zp", 4, (128, 64, 32),
        "int4 weights with a uint8 zero point per group and output channel (w = s·(q − z)), groups of 128 along K, "
        "scales in the model's dtype", zeros=True,
    ),
    "q8f16": Scheme("q8f16", 8, (), "int8 weights, one scale per output channel, scales in the model's dtype"),
    "fp8": Scheme(
        "fp8", 8, (), "float8 E4M3FN weights (uint8 bits), one scale per output channel, scales in the model's dtype",
        fmt="e4m3",
    ),
}
# The decoder's projections that are quantised (each layer's ``<name>.weight``).
QUANTIZED_PROJECTIONS = ("attn.qkv", "attn.o", "mlp.up", "mlp.down")


def scheme(name: str) -> Scheme:
    """The scheme called ``name``, or a one-line UsageError naming the known ones."""
    found = SCHEMES.get(name)
    if found is None:
        known = list(SCHEMES)
        raise UsageError(
            f"--quantize {name!r} is not a scheme: use {', '.join(known[:-1])} or {known[-1]}"
        )
    return found


def group_size(name: str, k: int) -> int:
    """The weights per scale of scheme ``name`` for a layer of ``k`` input features (a UsageError if none fits)."""
    s = scheme(name)
    if not s.groups:
        return k
    for group in s.groups:
        if k % group == 0:
            return group
    raise UsageError(
        f"--quantize {name} groups {s.groups[0]} (or {', '.join(map(str, s.groups[1:]))}) weights along "
        f"K, and a layer here has K={k}, not a multiple of {s.groups[-1]}: use --quantize q8f16 "
        "(one scale per output channel) or build without --quantize"
    )


def check_quantizable(cfg, name: str) -> None:
    """A one-line UsageError for a model ``name`` cannot quantise: a mixture of experts, or an input size it
    cannot group."""
    scheme(name)
    if cfg.experts:
        raise UsageError(
            f"--quantize {name} does not support mixture-of-experts models yet (their experts run as "
            "moe_gemm, which has no quantised form): build this model without --quantize"
        )
    for k in {cfg.hidden, cfg.heads * cfg.head_dim, cfg.mlp}:
        group_size(name, k)


def quantize_weight(weight, name: str, dtype: str) -> tuple:
    """The parameters of a float weight [n, k] (``nn.Linear``'s layout) as scheme ``name`` stores them, as torch
    tensors: (codes, scales), codes uint8 [n, k / 2] (int4), int8 [n, k] or uint8 [n, k] (fp8's E4M3 bits) and
    scales [n, k / group] in ``dtype``; a scheme with zero points adds them: (codes, scales, zeros uint8 [n, k /
    group])."""
    import torch

    s = scheme(name)
    n, k = weight.shape
    group = group_size(name, k)
    w = weight.detach().double().reshape(n, k // group, group)
    if s.zeros:
        # GPTQ's quantiser: the group's range widened to hold 0, 15 steps over it, 0 on a level (the zero point).
        low, high = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
        scales = ((high - low) / 15).to(getattr(torch, dtype))
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        zeros = torch.clamp(torch.round(-low / scales.double()), 0, 15)
        codes = torch.clamp(torch.round(w / scales.double()[..., None]) + zeros[..., None], 0, 15).reshape(n, k)
        nibbles = codes.to(torch.uint8)
        return nibbles[:, 0::2] | (nibbles[:, 1::2] << 4), scales, zeros.to(torch.uint8)
    top = E4M3_MAX if s.fmt == "e4m3" else 7 if s.bits == 4 else 127
    scales = (w.abs().amax(-1) / top).to(getattr(torch, dtype))
    # An all-zero group (or a scale below the dtype's range) quantises to zeros against a scale of one.
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    if s.fmt == "e4m3":
        return e4m3_bits(round_to_e4m3(w / scales.double()[..., None]).reshape(n, k)), scales
    codes = torch.clamp(torch.round(w / scales.double()[..., None]), -top, top).reshape(n, k)
    if s.bits == 8:
        return codes.to(torch.int8), scales
    nibbles = (codes + 8).to(torch.uint8)
    return nibbles[:, 0::2] | (nibbles[:, 1::2] << 4), scales


def check_prequantized(cfg, group: int | None, what: str) -> None:
    """A one-line UsageError where a ``what`` (GPTQ, AWQ) checkpoint's groups are not those ``q4f16`` gives this model's layers,
    or its family's projections are not Llama's (q/k/v/o, gate/up/down); ``group`` None: one scale per output
    channel (FP8), whose groups always fit."""
    if cfg.family in ("phi3", "gpt2") or cfg.experts:
        raise UsageError(
            f"{what} checkpoints of {cfg.family} models are not supported: only those with Llama-style "
            "projections (q/k/v/o, gate/up/down) are"
        )
    for k in sorted({cfg.hidden, cfg.heads * cfg.head_dim, cfg.mlp}):
        if group is not None and group_size("q4f16", k) != group:
            raise UsageError(
                f"the {what} checkpoint's group_size {group} is not q4f16's for K={k} "
                f"({group_size('q4f16', k)}): only checkpoints with q4f16's groups are supported"
            )


def parameter_names(name: str) -> tuple[str, ...]:
    """A quantised projection's parameters under scheme ``name``, in :func:`quantize_weight`'s order."""
    return ("qweight", "scales", "zeros") if scheme(name).zeros else ("qweight", "scales")


def quantize_weights(weights: dict, cfg, name: str, given: dict | None = None) -> dict:
    """``weights`` (the decoder's parameters by name, :func:`~.decoder.weights_from_hf`) with each quantised
    projection's ``<p>.weight`` replaced by ``<p>.qweight`` (codes) and ``<p>.scales`` (and ``<p>.zeros`` for a
    scheme with zero points): those of ``given`` (a checkpoint quantised already, :mod:`.gptq`, :mod:`.awq`)
    where it has them, else quantised here."""
    out = {}
    given = given or {}
    names = parameter_names(name)
    for key, value in weights.items():
        parts = key.split(".")
        if parts[0] == "layers" and len(parts) == 5 and ".".join(parts[2:4]) in QUANTIZED_PROJECTIONS and parts[4] == "weight":
            prefix = key[: -len(".weight")]
            if prefix + ".qweight" in given:
                out.update({f"{prefix}.{p}": given[f"{prefix}.{p}"] for p in names})
                continue
            out.update({f"{prefix}.{p}": t for p, t in zip(names, quantize_weight(value, name, cfg.dtype))})
        else:
            out[key] = value
    return out


def manifest_entry(cfg, source: str = "build", w8a8: bool = False) -> dict | None:
    """What the manifest says of a quantised build (None for a float one); ``source``: where the codes come from
    ("build": quantised from the float weights; "gptq", "awq", "compressed-tensors": a GPTQ, AWQ or FP8 checkpoint's);
    ``w8a8``: the build's prefill chunks run fp8_gemm (activations quantised per token)."""
    if not cfg.quantize:
        return None
    s = scheme(cfg.quantize)
    ks = {"q/k/v, gate/up": cfg.hidden, "output": cfg.heads * cfg.head_dim, "down": cfg.mlp}
    return {
        "scheme": s.name,
        "bits": s.bits,
        "about": s.doc,
        "layout": (
            "uint8 bits of float8 E4M3FN (OCP), w = s·e4m3(q)" if s.fmt == "e4m3"
            else "int8, symmetric" if s.bits == 8
            else "uint8, two int4 per byte, low nibble first; zero points uint8 [n, k / group], w = s·(q − z)"
            if s.zeros else "uint8, two int4 per byte, low nibble first, zero point 8"
        ),
        "zero_points": s.zeros,
        "scale_dtype": cfg.dtype,
        "group_size": {what: group_size(s.name, k) for what, k in ks.items()},
        "projections": list(QUANTIZED_PROJECTIONS),
        "source": source,
        "activations": (
            "float8 E4M3 per token (fp8_quant_rows: scale amax/448 in float32, fp8_gemm on FP8 wgmma) in the static "
            "prefill chunks' projections on sm_90; the model's dtype in decode steps and dynamic functions"
            if w8a8 else f"{cfg.dtype} (weight-only)"
        ),
    }
