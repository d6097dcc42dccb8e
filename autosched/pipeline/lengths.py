"""Models at several sequence lengths and batch sizes: one artifact that runs any of them up to a maximum.

``--tokens dynamic`` (or a list such as ``64,256,1024``) builds the model at a few *bucket* lengths,
each with static shapes, so that every kernel is one our spaces tune and the database holds. At run
time an input of ``n`` tokens is padded at the end to the smallest bucket of at least ``n`` and the
outputs are cut back to ``n``. That is exact for causal models: no position sees the ones after it, so
the padding changes nothing before it. ``--batch dynamic`` does the same along the batch: buckets 1,
2, 4, ... and padding rows, exact where the sequences of a batch do not see each other. Both together
build every pair. The build checks each on the model itself, with torch, and refuses a model where
padding would change the results.

A bucket is a pair (batch, tokens); an axis that does not vary holds None there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autosched.buckets import Bucket, bucket_for, bucket_key  # noqa: F401  (bucket_for and bucket_key: also from here)
from autosched.errors import UsageError

from .load import load_model

if TYPE_CHECKING:
    from .load import Model

# Deferred imports: torch (imported where used: `autosched --help` stays fast).

DEFAULT_MAX_TOKENS = 2048
DEFAULT_MAX_BATCH = 16
SMALLEST_BUCKET = 16


def parse_lengths(text: str | None, max_tokens: int = DEFAULT_MAX_TOKENS, growth: float = 2.0) -> list[int] | None:
    """``--tokens``: None (the model's default length), one length, a comma list of lengths, or
    ``dynamic``: buckets from 16 up to ``max_tokens`` (the last one), each ``growth`` times the one
    before, rounded up to a multiple of 16, and every power of two (2: powers of two; 1.5 pads less,
    with more buckets)."""
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
        # Finer buckets keep the powers of two, the default's: a build finer than the tuning then has
        # every tuned bucket among its own (the others take the nearest tuned bucket's schedules).
        powers = [1 << i for i in range(SMALLEST_BUCKET.bit_length() - 1, max_tokens.bit_length()) if (1 << i) < max_tokens]
        return sorted(set(buckets) | set(powers)) + [max_tokens]
    try:
        lengths = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise UsageError(f"--tokens takes a length, lengths separated by commas, or 'dynamic' (got {text!r})") from None
    if not lengths or lengths[0] < 1:
        raise UsageError(f"--tokens takes positive lengths (got {text!r})")
    return lengths


def parse_batches(text: str | None, max_batch: int = DEFAULT_MAX_BATCH) -> list[int] | None:
    """``--batch``: None (the model's default), one size, a comma list, or ``dynamic``: 1, 2, 4, ... up
    to ``max_batch`` (the last one)."""
    if text is None:
        return None
    if text == "dynamic":
        if max_batch < 1:
            raise UsageError(f"--max-batch must be positive (got {max_batch})")
        sizes = [1 << i for i in range(max_batch.bit_length()) if (1 << i) < max_batch]
        return sizes + [max_batch]
    try:
        sizes = sorted({int(part) for part in str(text).split(",") if part.strip()})
    except ValueError:
        raise UsageError(f"--batch takes a size, sizes separated by commas, or 'dynamic' (got {text!r})") from None
    if not sizes or sizes[0] < 1:
        raise UsageError(f"--batch takes positive sizes (got {text!r})")
    return sizes


def bucket_grid(batches: list[int] | None, lengths: list[int] | None) -> list[Bucket]:
    """Every (batch, tokens) pair to build; [] for a build of one shape."""
    if (batches is None or len(batches) == 1) and (lengths is None or len(lengths) == 1):
        return []
    vary_batch, vary_tokens = batches is not None and len(batches) > 1, lengths is not None and len(lengths) > 1
    return [(b if vary_batch else None, t if vary_tokens else None)
            for b in (batches if vary_batch else [None]) for t in (lengths if vary_tokens else [None])]


@dataclass(frozen=True)
class PaddedAxes:
    """Which axis of each input and output grows with the batch or the length (None: it does not)."""

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


_PADDING = {  # what padding along each axis assumes, and the error when the model breaks it
    "tokens": (SMALLEST_BUCKET, "its outputs for the first tokens change when tokens are appended (not a causal "
               "model), so padding to a bucket length would change them: build fixed lengths (--tokens N) instead"),
    "batch": (2, "its outputs for the first sequences of a batch change when sequences are added (the sequences "
              "are not independent), so padding to a bucket batch would change them: build fixed batches "
              "(--batch N) instead"),
}


def check_padding_is_exact(spec: str, kwargs: dict[str, Any], axis: str = "tokens") -> PaddedAxes:
    """The model's ``axis`` ("tokens" or "batch") in each input and output, after checking with torch
    (in float32) that its outputs for the first half do not change when the second half is appended
    along that axis (tokens: 8 then 16; batch: 1 then 2). Raises UsageError for a model where they do:
    padding to a bucket would change its results."""
    import torch

    size, refusal = _PADDING[axis]
    half = size // 2
    base = {**kwargs, "dtype": torch.float32}
    short, full = load_model(spec, **{**base, axis: half}), load_model(spec, **{**base, axis: size})
    axes_in = [_changed_axis(tuple(a.shape), tuple(b.shape)) for a, b in zip(short.inputs, full.inputs)]
    if all(a is None for a in axes_in):
        raise UsageError(f"{spec}: no input grows with --{axis}, so it cannot vary")
    cut = [t.narrow(a, 0, half) if a is not None else t for t, a in zip(full.inputs, axes_in)]
    expected, got = _outputs(short.module, cut), _outputs(full.module, full.inputs)
    axes_out = [_changed_axis(tuple(e.shape), tuple(g.shape)) for e, g in zip(expected, got)]
    for e, g, a in zip(expected, got, axes_out):
        first = g.narrow(a, 0, half) if a is not None else g
        if first.shape != e.shape or not torch.allclose(first.double(), e.double(), rtol=1e-4, atol=1e-5):
            raise UsageError(f"{spec}: {refusal}")
    return PaddedAxes(axes_in, axes_out)


def models_at(spec: str, kwargs: dict[str, Any], buckets: list) -> list[Model]:
    """The model loaded at each bucket: a (batch, tokens) pair (None keeps ``kwargs``'s value), or a
    length alone. The factory's weights must not depend on either."""
    pairs = [b if isinstance(b, tuple) else (None, b) for b in buckets]
    models = [load_model(spec, **{**kwargs, **({"batch": b} if b is not None else {}),
                                  **({"tokens": t} if t is not None else {})}) for b, t in pairs]
    digests = {m.weights_digest() for m in models}
    if len(digests) != 1:
        raise UsageError(f"{spec}: the factory gives other weights at other lengths or batches; seed its weights "
                         f"independently of them to build several")
    return models
