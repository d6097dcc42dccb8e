"""Automatic prefix caching: the KV cache's pages of prompts served before, kept for the prompts that start
with the same tokens (a shared system prompt, the earlier turns of a chat), as vLLM's and SGLang's prefix
caches keep them.

An entry is a sequence of TVM's paged KV cache forked from a served sequence at a page boundary: it shares
that sequence's pages (TVM counts the references of each block of pages), so keeping it costs no copy, and a
new sequence forked from it reads them instead of prefilling them again. Entries are found by a chain of
hashes, one per page of tokens (a page's hash covers every token before it, so equal hashes mean equal
prefixes, which :meth:`PrefixCache.match` still checks token for token), and evicted least recently used
when pages run short. This module keeps the book; :class:`~.generator.Generator` forks and removes the
sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

# Sequence ids of the cache's entries: apart from those of requests (0, 1, ...) and of padding rows (1 << 40).
PREFIX_SEQUENCE_IDS = 1 << 41


@dataclass
class PrefixEntry:
    """A prefix in the KV cache: the sequence holding its pages, its tokens (a whole number of pages) and when
    it was last used (the cache's counter)."""

    seq_id: int
    tokens: tuple[int, ...]
    last_used: int


class PrefixCache:
    """The prefixes kept, found by page-chain hash at every page boundary of every entry (a prompt may share
    only an entry's first pages). ``hit_tokens`` of ``queried_tokens`` prompt tokens were found in the cache
    (what ``/metrics`` reports as the hit rate)."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self._entries: dict[int, PrefixEntry] = {}  # by sequence id
        self._holders: dict[int, list[PrefixEntry]] = {}  # page-chain hash -> the entries starting with it
        self._tick = 0
        self._next_id = PREFIX_SEQUENCE_IDS
        self.queried_tokens = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _chain(self, tokens, pages: int):
        """(length, hash) at each of the first ``pages`` page boundaries of ``tokens``."""
        digest, size = 0, self.page_size
        for page in range(pages):
            digest = hash((digest, tuple(tokens[page * size:(page + 1) * size])))
            yield (page + 1) * size, digest

    def _holder(self, digest: int, tokens, length: int) -> PrefixEntry | None:
        for entry in self._holders.get(digest, ()):
            if list(entry.tokens[:length]) == list(tokens[:length]):
                return entry
        return None

    def match(self, prompt) -> tuple[PrefixEntry, int] | None:
        """The entry holding the longest prefix of ``prompt``, and that prefix's length (whole pages), leaving
        at least one token of the prompt to prefill (its logits choose the first new token); None where no
        entry starts as the prompt does. Counts the query."""
        self._tick += 1
        self.queried_tokens += len(prompt)
        best = None
        for length, digest in self._chain(prompt, (len(prompt) - 1) // self.page_size):
            entry = self._holder(digest, prompt, length)
            if entry is None:
                break
            best = entry, length
        if best is not None:
            best[0].last_used = self._tick
            self.hit_tokens += best[1]
        return best

    def add(self, tokens) -> PrefixEntry | None:
        """A new entry for the whole pages of ``tokens`` (a sequence's tokens in the cache), with a new sequence
        id for the caller to fork; None where they hold no whole page or an entry holds them already (then
        marked used)."""
        pages = len(tokens) // self.page_size
        if not pages:
            return None
        chain = list(self._chain(tokens, pages))
        self._tick += 1
        held = self._holder(chain[-1][1], tokens, chain[-1][0])
        if held is not None:
            held.last_used = self._tick
            return None
        entry = PrefixEntry(self._next_id, tuple(tokens[:pages * self.page_size]), self._tick)
        self._next_id += 1
        self._entries[entry.seq_id] = entry
        for _, digest in chain:
            self._holders.setdefault(digest, []).append(entry)
        return entry

    def _drop(self, entry: PrefixEntry) -> PrefixEntry:
        del self._entries[entry.seq_id]
        for _, digest in self._chain(entry.tokens, len(entry.tokens) // self.page_size):
            holders = self._holders[digest]
            holders.remove(entry)
            if not holders:
                del self._holders[digest]
        return entry

    def least_recent(self) -> PrefixEntry | None:
        """The entry used longest ago, taken out of the cache (the caller removes its sequence), or None."""
        if not self._entries:
            return None
        return self._drop(min(self._entries.values(), key=lambda e: e.last_used))

    def clear(self) -> list[PrefixEntry]:
        """Every entry, taken out of the cache."""
        entries = list(self._entries.values())
        self._entries, self._holders = {}, {}
        return entries
