"""Checkpoints quantised already (GPTQ, :mod:`.gptq`; AWQ, :mod:`.awq`; FP8, :mod:`.fp8`), read without their
libraries: what they share.

Each format packs eight 4-bit fields per int32 (in its own order) and stores per-group scales and zero points;
:func:`unpack_int4` reads the fields, :func:`to_q4f16` repacks codes, scales and zero points as ``dequant_gemm``'s
int4 layout (codes [N, K / 2], low nibble first; scales and uint8 zero points [N, K / group]),
:func:`load_prequantized` reads a folder's safetensors: the float tensors into a transformers model, each
quantised projection into the decoder's ``layers.<i>.<p>.qweight`` / ``.scales`` / ``.zeros`` through the format's
reader, and :func:`choose_scheme` picks what the checkpoint builds as: ``q4f16`` where every zero point is 8
(symmetric: no zero points to read), else ``q4f16_zp`` (its zero points kept: ``dequant_gemm``'s ``zeros=1``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from autosched.errors import UsageError

# Deferred imports: torch, transformers, safetensors (imported where used: `autosched --help` stays fast).

# transformers' projection names -> the decoder's fused projection and the order of its parts
PROJECTIONS = {
    "attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attn.o": ("self_attn.o_proj",),
    "mlp.up": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down": ("mlp.down_proj",),
}
NATURAL_ORDER = tuple(range(8))


def quant_config(folder: str | Path, method: str) -> dict | None:
    """The ``quantization_config`` of a folder whose ``quant_method`` is ``method``, or None for one that is not."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return None
    quant = json.loads(path.read_text()).get("quantization_config") or {}
    return quant if str(quant.get("quant_method", "")).lower() == method else None


def unpack_int4(words, axis: int, order=NATURAL_ORDER):
    """The 4-bit fields of int32 ``words``, eight per word, spread along ``axis`` in their natural order:
    field ``order[j]`` of a word's eight sits at bits ``4 j`` (``NATURAL_ORDER``: the lowest bits first)."""
    import torch

    words = words.to(torch.int64)
    fields = torch.stack([(words >> (4 * order.index(i))) & 15 for i in range(8)], dim=axis + 1)
    shape = list(words.shape)
    shape[axis] *= 8
    return fields.reshape(shape)


def to_q4f16(codes, zeros, scales):
    """(codes uint8 [N, K / 2], scales [N, K / group], zero points uint8 [N, K / group]) in ``dequant_gemm``'s
    layout from a layer's codes [K, N], zero points [K / group, N] and scales [K / group, N]."""
    import torch

    nibbles = codes.t().to(torch.uint8)
    return nibbles[:, 0::2] | (nibbles[:, 1::2] << 4), scales.t().contiguous(), zeros.t().to(torch.uint8).contiguous()


def choose_scheme(quantized: dict, asked: str | None, what: str) -> tuple[str, dict]:
    """(the scheme a checkpoint's projections build as, those projections' parameters for it): ``q4f16`` where
    every zero point is 8 (its zero points dropped: the kernels' own), else ``q4f16_zp``; ``asked`` (--quantize)
    may choose ``q4f16_zp`` for a symmetric checkpoint too, and ``q4f16`` for an asymmetric one is refused."""
    symmetric = all(bool((t == 8).all()) for key, t in quantized.items() if key.endswith(".zeros"))
    name = asked or ("q4f16" if symmetric else "q4f16_zp")
    if name == "q4f16" and not symmetric:
        raise UsageError(
            f"this {what} checkpoint has zero points other than 8 (asymmetric), which q4f16 cannot hold: leave out "
            "--quantize q4f16 (it builds as q4f16_zp, its zero points kept)"
        )
    if name == "q4f16":
        quantized = {key: t for key, t in quantized.items() if not key.endswith(".zeros")}
    return name, quantized


def check_bits_and_group(quant: dict, what: str) -> int:
    """The group size of a 4-bit ``quantization_config``; a one-line UsageError for other bit widths or no groups."""
    bits, group = int(quant.get("bits", 0)), int(quant.get("group_size", -1))
    if bits != 4 or group <= 0:
        raise UsageError(
            f"{what} with bits={bits} and group_size={group} is not supported: only 4-bit checkpoints "
            "with groups (group_size > 0) are"
        )
    return group


def is_projection_tensor(key: str) -> bool:
    """Whether ``key`` is one of a decoder projection's quantised tensors (its codes, scales, ...; not its bias)."""
    module, _, name = key.rpartition(".")
    return (key.startswith("model.layers.") and name != "bias"
            and any(module.endswith("." + theirs) for names in PROJECTIONS.values() for theirs in names))


def load_prequantized(folder: str | Path, dtype: str | None, what: str, layer: Callable[[dict, str], tuple],
                      required: tuple[str, ...] = ("qweight", "qzeros"), scales: str = "scales",
                      parameters: tuple[str, ...] = ("qweight", "scales", "zeros"), kind: str = "quantised with zero points"):
    """(transformers model holding the checkpoint's float tensors, the quantised projections as the decoder's
    parameters ``layers.<i>.<p>.<parameters>``) of a ``what`` folder; ``layer(state, prefix)`` gives one
    projection's parameters (codes, scales, zero points) in ``dequant_gemm``'s layout from its tensors
    ``<prefix><required>``, ...; without ``dtype`` the model takes the dtype of the tensors named ``scales``.
    ``kind``: what the format's projections are, for the message naming one that is missing."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise UsageError(f"{folder} holds no *.safetensors files: {what} checkpoints are read from safetensors")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    torch_dtype = getattr(torch, dtype) if dtype else state[next(k for k in state if k.endswith("." + scales))].dtype
    hf = AutoModelForCausalLM.from_config(config, dtype=torch_dtype).eval()
    floats = {key: value for key, value in state.items() if value.is_floating_point() and not is_projection_tensor(key)}
    # Every float tensor the model has must come from the checkpoint (the quantised projections' come below).
    projections = tuple(f".{name}.weight" for names in PROJECTIONS.values() for name in names)
    missing = sorted(key for key in hf.state_dict() if key not in floats and not key.endswith(projections))
    if missing:
        raise UsageError(
            f"the {what} checkpoint has no {missing[0]} ({len(missing)} float tensors missing): is it a "
            "complete checkpoint of this model?"
        )
    hf.load_state_dict(floats, strict=False)
    quantized = {}
    for i in range(config.num_hidden_layers):
        for ours, theirs in PROJECTIONS.items():
            parts = []
            for name in theirs:
                prefix = f"model.layers.{i}.{name}."
                if any(prefix + name not in state for name in required):
                    raise UsageError(
                        f"the {what} checkpoint has no {prefix}{' and '.join(required)}: only Llama-style projections "
                        f"(q/k/v/o, gate/up/down) {kind} are read"
                    )
                parts.append(layer(state, prefix))
            for index, param in enumerate(parameters):
                quantized[f"layers.{i}.{ours}.{param}"] = torch.cat([part[index] for part in parts])
    return hf, quantized
