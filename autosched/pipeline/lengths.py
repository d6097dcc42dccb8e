"""Models at several sequence lengths: one artifact that runs any length up to a maximum.

``--tokens dynamic`` (or a list such as ``64,256,1024``) builds the model at a few *bucket* lengths,
each with static shapes, so that every kernel is one our spaces tune and the database holds. At run
time an input of ``n`` tokens is padded at the end to the smallest bucket of at least ``n`` and the
outputs are cut back to ``n``. That is exact for causal models: no position sees the ones after it, so
the padding changes nothing before it. The build checks this on the model itself, with torch, and
refuses a model whose first outputs change when tokens are appended.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autosched.errors import UsageError

if TYPE_CHECKING:
    from .load import Model

DEFAULT_MAX_TOKENS = 2048
SMALLEST_BUCKET = 16


def parse_lengths(text: str | None, max_tokens: int = DEFAULT_MAX_TOKENS, growth: float = 2.0) -> list[int] | None:
    """``--tokens``: None (the model's default length), one length, a comma list of lengths, or
    ``dynamic``: buckets from 16 up to ``max_tokens`` (the last one), each ``growth`` times the one
    before, rounded up to a multiple of 16 (2: powers of two; 1.5 pads less, with more buckets)."""
    if text is None:
        return None
    if text == "dynamic":
        if max_tokens < 1:
            raise UsageError(f"--max-tokens must be positive (got {max_tokens})")
        if growth <= 1:
            raise UsageError(f"--bucket-growth must be above 1 (got {growth})")
        buckets, length = [], SMALLEST_BUCKET
        while length < max_tokens:
            buckets.append(length)
            length = max(length + 16, -(-int(length * growth) // 16) * 16)
        return buckets + [max_tokens]
    try:
        lengths = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise UsageError(f"--tokens takes a length, lengths separated by commas, or 'dynamic' (got {text!r})") from None
    if not lengths or lengths[0] < 1:
        raise UsageError(f"--tokens takes positive lengths (got {text!r})")
    return lengths


@dataclass(frozen=True)
class TokenAxes:
    """Which axis of each input and output is the sequence (None: the tensor does not depend on it)."""

    inputs: list[int | None]
    outputs: list[int | None]


def _changed_axis(a: tuple[int, ...], b: tuple[int, ...]) -> int | None:
    changed = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    return changed[0] if len(changed) == 1 and len(a) == len(b) else None


def _outputs(module, inputs) -> list:
    import torch

    with torch.no_grad():
        out = module(*inputs)
    return list(out) if isinstance(out, (tuple, list)) else [out]


def check_padding_is_exact(spec: str, kwargs: dict[str, Any], tokens: int = SMALLEST_BUCKET) -> TokenAxes:
    """The model's sequence axes, after checking with torch (in float32) that its outputs for the first
    ``tokens // 2`` tokens do not change when ``tokens // 2`` more are appended. Raises UsageError
    for a model where they do (not causal): padding to a bucket would change its results."""
    import torch

    from .load import load_model

    base = {**kwargs, "dtype": torch.float32}
    short, full = load_model(spec, **{**base, "tokens": tokens // 2}), load_model(spec, **{**base, "tokens": tokens})
    axes_in = [_changed_axis(tuple(a.shape), tuple(b.shape)) for a, b in zip(short.inputs, full.inputs)]
    if not any(axis is not None for axis in axes_in):
        raise UsageError(f"{spec}: no input grows with --tokens, so its length cannot vary")
    cut = [t.narrow(axis, 0, tokens // 2) if axis is not None else t for t, axis in zip(full.inputs, axes_in)]
    expected, got = _outputs(short.module, cut), _outputs(full.module, full.inputs)
    axes_out = [_changed_axis(tuple(e.shape), tuple(g.shape)) for e, g in zip(expected, got)]
    for e, g, axis in zip(expected, got, axes_out):
        first = g.narrow(axis, 0, tokens // 2) if axis is not None else g
        if first.shape != e.shape or not torch.allclose(first.double(), e.double(), rtol=1e-4, atol=1e-5):
            raise UsageError(f"{spec}: its outputs for the first tokens change when tokens are appended (not a "
                             f"causal model), so padding to a bucket length would change them: build fixed "
                             f"lengths (--tokens N) instead")
    return TokenAxes(axes_in, axes_out)


def bucket_for(buckets: list[int], tokens: int) -> int:
    """The smallest bucket of at least ``tokens``."""
    for bucket in sorted(buckets):
        if bucket >= tokens:
            return bucket
    raise UsageError(f"{tokens} tokens is more than this build's maximum of {max(buckets)}: "
                     f"rebuild with --max-tokens {tokens} or more")


def models_at(spec: str, kwargs: dict[str, Any], lengths: list[int]) -> list[Model]:
    """The model loaded at each length (the factory's weights must not depend on the length)."""
    from .load import load_model

    models = [load_model(spec, **{**kwargs, "tokens": n}) for n in lengths]
    digests = {m.weights_digest() for m in models}
    if len(digests) != 1:
        raise UsageError(f"{spec}: the factory gives other weights at other lengths; seed its weights "
                         f"independently of tokens to build several lengths")
    return models
