"""The buckets of a ``--tokens dynamic`` or ``--batch dynamic`` build, as its artifact names them and its loader
picks one: below the artifact and the pipeline, which both use them (``autosched.pipeline.lengths`` makes
the buckets)."""

from __future__ import annotations

from .errors import UsageError

Bucket = tuple  # (batch or None, tokens or None)


def bucket_key(bucket: Bucket) -> str:
    """The bucket's name in a manifest: ``"128"`` for a length alone (as builds of lengths alone have
    always named them), ``"b4"`` for a batch alone, ``"b4-t128"`` for both."""
    batch, tokens = bucket
    if batch is None:
        return str(tokens)
    return f"b{batch}" if tokens is None else f"b{batch}-t{tokens}"


def bucket_for(buckets: list[int], size: int, axis: str = "tokens") -> int:
    """The smallest bucket of at least ``size`` along ``axis``."""
    for bucket in sorted(buckets):
        if bucket >= size:
            return bucket
    option = "--max-tokens" if axis == "tokens" else "--max-batch"
    raise UsageError(f"{size} {'tokens' if axis == 'tokens' else 'sequences'} is more than this build's maximum "
                     f"of {max(buckets)}: rebuild with {option} {size} or more")
