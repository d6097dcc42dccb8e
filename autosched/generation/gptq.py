"""GPTQ checkpoints (4-bit, ``desc_act`` false, symmetric) read without their library, repacked for ``q4f16``.

A GPTQ folder (``config.json`` with ``quantization_config.quant_method`` "gptq") stores each quantised linear
layer as ``qweight`` int32 [K / 8, N] (eight 4-bit codes along K per word, the lowest bits first), ``qzeros``
int32 [K / group, N / 8] (eight zero points along N per word, stored one less than they are in the original
"gptq" format), ``scales`` [K / group, N] and ``g_idx`` [K] (the group of each input feature). A weight is
``scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n])``. With symmetric quantisation every zero point is 8:
exactly ``dequant_gemm``'s int4 layout once transposed (codes [N, K / 2], low nibble first; scales
[N, K / group]), so a build runs the checkpoint's own weights, not a re-quantisation of them. Other zero
points, activation order (a ``g_idx`` other than k // group) and other bit widths are refused in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

from autosched.errors import UsageError

# transformers' projection names -> the decoder's fused projection and the order of its parts
PROJECTIONS = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}


def gptq_config(folder: str | Path) -> dict | None:
    """The ``quantization_config`` of a GPTQ folder, or None for a folder that is not one."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return None
    quant = json.loads(path.read_text()).get("quantization_config") or {}
    return quant if str(quant.get("quant_method", "")).lower() == "gptq" else None


def _unpack(words, axis: int):
    """The 4-bit fields of int32 ``words``, eight per word (lowest bits first), spread along ``axis``."""
    import torch

    fields = torch.stack([(words >> (4 * b)) & 15 for b in range(8)], dim=axis + 1)
    shape = list(words.shape)
    shape[axis] *= 8
    return fields.reshape(shape)


def repack(qweight, qzeros, scales, g_idx, group: int, zero_offset: int):
    """(codes uint8 [N, K / 2], scales [N, K / group]) in ``dequant_gemm``'s layout from one GPTQ layer's tensors;
    a one-line UsageError for what that layout cannot hold."""
    import torch

    codes = _unpack(qweight.to(torch.int64), 0)  # [K, N]
    k = codes.shape[0]
    if g_idx is not None and not torch.equal(g_idx.to(torch.int64), torch.arange(k) // group):
        raise UsageError(
            "this GPTQ checkpoint reorders its groups (desc_act / activation order): only desc_act=false "
            "checkpoints are supported"
        )
    zeros = _unpack(qzeros.to(torch.int64), 1) + zero_offset
    if not bool((zeros == 8).all()):
        raise UsageError(
            "this GPTQ checkpoint has asymmetric zero points (sym=false): only symmetric 4-bit "
            "checkpoints (every zero point 8) are supported"
        )
    nibbles = codes.t().to(torch.uint8)
    return nibbles[:, 0::2] | (nibbles[:, 1::2] << 4), scales.t().contiguous()


def load_gptq(folder: str | Path, dtype: str | None):
    """(transformers model holding the checkpoint's float tensors, the quantised projections as the decoder's
    parameters ``layers.<i>.<p>.qweight`` / ``.scales``, the group size) of a GPTQ folder."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    quant = gptq_config(folder)
    bits, group = int(quant.get("bits", 0)), int(quant.get("group_size", -1))
    if bits != 4 or group <= 0:
        raise UsageError(
            f"GPTQ with bits={bits} and group_size={group} is not supported: only 4-bit checkpoints "
            "with groups (group_size > 0) are"
        )
    if quant.get("desc_act"):
        raise UsageError("this GPTQ checkpoint has desc_act=true: only desc_act=false checkpoints are supported")
    fmt = str(quant.get("checkpoint_format", quant.get("format", "gptq"))).lower()
    zero_offset = 1 if fmt == "gptq" else 0  # "gptq" (v1) stores each zero point one less
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise UsageError(f"{folder} holds no *.safetensors files: GPTQ checkpoints are read from safetensors")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    torch_dtype = getattr(torch, dtype) if dtype else state[next(k for k in state if k.endswith("scales"))].dtype
    hf = AutoModelForCausalLM.from_config(config, dtype=torch_dtype).eval()
    floats = {key: value for key, value in state.items() if value.is_floating_point() and not key.endswith(".scales")}
    # Every float tensor the model has must come from the checkpoint (the quantised projections' come below).
    projections = tuple(f".{name}.weight" for names in PROJECTIONS.values() for name in names)
    missing = sorted(key for key in hf.state_dict() if key not in floats and not key.endswith(projections))
    if missing:
        raise UsageError(
            f"the GPTQ checkpoint has no {missing[0]} ({len(missing)} float tensors missing): is it a "
            "complete checkpoint of this model?"
        )
    hf.load_state_dict(floats, strict=False)
    quantized = {}
    layers = config.num_hidden_layers
    for i in range(layers):
        for ours, theirs in PROJECTIONS.items():
            parts = []
            for name in theirs:
                prefix = f"model.layers.{i}.{name}."
                if prefix + "qweight" not in state:
                    raise UsageError(
                        f"the GPTQ checkpoint has no {prefix}qweight: only Llama-style projections "
                        "(q/k/v/o, gate/up/down) are read"
                    )
                parts.append(
                    repack(
                        state[prefix + "qweight"],
                        state[prefix + "qzeros"],
                        state[prefix + "scales"],
                        state.get(prefix + "g_idx"),
                        group,
                        zero_offset,
                    )
                )
            quantized[f"layers.{i}.{ours}.qweight"] = torch.cat([codes for codes, _ in parts])
            quantized[f"layers.{i}.{ours}.scales"] = torch.cat([scales for _, scales in parts])
    return hf, quantized, group
