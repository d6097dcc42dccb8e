"""Where a token is: the embeddings' row gather, and the rotary embedding of a frequency table (yarn, longrope,
Gemma 3's table per layer type), which the model applies itself before the cache. The cache's own fused RoPE
(default, linear, llama3 frequencies) is the cache's: :mod:`.decoder`."""

from __future__ import annotations

import numpy as np
from tvm import relax as rx
from tvm import te, tirx
from tvm.relax.frontend.nn import Tensor, op
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache

from autosched.tvm_adapter import nn_tensor, relax_expr


def gather(x: Tensor, ids: Tensor, axis: int, name: str) -> Tensor:
    """Slices of ``x`` at ``ids`` along ``axis``. Indices are clipped rather than trusted: the Generator refuses a
    token outside the vocabulary before it gets here, and TVM's unchecked gather warns at every build that an
    out-of-bounds index would crash it."""
    return nn_tensor(rx.op.take(relax_expr(x), relax_expr(ids), axis=axis, mode="clip"), name)


def table_rope(cfg) -> bool:
    """Whether ``cfg``'s rotary embedding is the model's own, from a frequency table (:class:`TableRotary`),
    not the cache's."""
    return bool(cfg.rotary_dim) and "inv_freq" in cfg.rope_scaling


class TableRotary:
    """The rotary embedding of a frequency table (``inv_freq``, and ``long_inv_freq`` for longrope), applied to q
    and k before the cache (which then runs without RoPE): cos and sin of each token's position times the table,
    scaled by the attention factor, as transformers computes them."""

    def __init__(self, cfg):
        self.cfg, self.scaling = cfg, cfg.rope_scaling

    def cos_sin(self, cache: PagedKVCache, b, s, last: Tensor | None):
        """(cos, sin) of shape (b, s, 1, rotary_dim) for the tokens of this forward, or a list of them, one per
        table, where layers have tables of their own (Gemma 3). ``last``: each prompt's last token in the packed
        prefill (longrope picks its table by the sequence's length after this forward), None in a decode step."""
        positions = cache.get_query_positions(b * s)
        if "tables" in self.scaling:
            return [self._cos_sin(table, positions, b, s, last) for table in self.scaling["tables"]]
        return self._cos_sin(self.scaling, positions, b, s, last)

    def _cos_sin(self, scaling: dict, positions: Tensor, b, s, last: Tensor | None):
        n = b * s
        table = lambda key: nn_tensor(rx.const(np.asarray(scaling[key], "float32")[None, :]), key)  # noqa: E731
        freq = table("inv_freq")
        if "long_inv_freq" in scaling:
            end = op.tensor_expr_op(_sequence_end, "sequence_end", [positions, last]) if last is not None else positions
            longer = op.greater_equal(op.reshape(end, (n, 1)),
                                      nn_tensor(rx.const(scaling["original_max_position_embeddings"], "int32"), "orig"))
            freq = op.where(longer, table("long_inv_freq"), freq)
        angle = op.reshape(positions.astype("float32"), (n, 1)) * freq
        angle = op.concat([angle, angle], dim=1)
        factor = scaling["attention_factor"]
        cos, sin = (nn_tensor(f(relax_expr(angle)), name) * factor for f, name in ((rx.op.cos, "cos"), (rx.op.sin, "sin")))
        shape = (b, s, 1, self.cfg.rotary_dim)
        return op.reshape(cos.astype(self.cfg.dtype), shape), op.reshape(sin.astype(self.cfg.dtype), shape)


def rotate(cfg, qkv: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """q and k of the fused (b, s, heads, head_dim) ``qkv`` rotated by (cos, sin) of :meth:`TableRotary.cos_sin`
    (the first rotary_dim of each head)."""
    qk, v = op.split(qkv, [cfg.heads + cfg.kv_heads], axis=2)
    keep = None
    if cfg.rotary_dim < cfg.head_dim:
        qk, keep = op.split(qk, [cfg.rotary_dim], axis=3)
    x1, x2 = op.split(qk, 2, axis=3)
    qk = qk * cos + op.concat([op.negative(x2), x1], dim=3) * sin
    if keep is not None:
        qk = op.concat([qk, keep], dim=3)
    return op.concat([qk, v], dim=2)


def _sequence_end(pos, ends):
    """The position of the last token of each token's prompt (``ends``: each prompt's last index)."""
    k = te.reduce_axis((0, ends.shape[0]), "k")
    prompt = te.compute((pos.shape[0],), lambda i: te.sum(tirx.Select(ends[k] < i, 1, 0), axis=k), name="prompt")
    return te.compute((pos.shape[0],), lambda i: pos[ends[tirx.min(prompt[i], ends.shape[0] - 1)]], name="sequence_end")
