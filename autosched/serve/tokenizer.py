"""The served model's tokenizer: a Hugging Face tokenizer folder (the artifact's own ``tokenizer/``, which
``build --generate`` copies from the model's folder, or ``--tokenizer DIR``), the chat template, and text
made from tokens as they come (:class:`IncrementalDetokenizer`) and cut at stop strings (:class:`StopText`)."""

from __future__ import annotations

import os
from pathlib import Path

from autosched.artifact import ARTIFACT_TOKENIZER, TOKENIZER_MARKS, has_tokenizer
from autosched.errors import UsageError

# Deferred imports: transformers (imported where used: `autosched --help` stays fast).

def load_tokenizer(path: str | Path):
    """The Hugging Face tokenizer of a local folder (nothing is downloaded); one-line UsageErrors."""
    path = str(path)
    if not os.path.isdir(path):
        raise UsageError(f"--tokenizer {path} is not a folder: give a local folder with a Hugging Face tokenizer")
    if not has_tokenizer(path):
        raise UsageError(f"--tokenizer {path} holds no tokenizer (none of {', '.join(TOKENIZER_MARKS)}): give the "
                         "folder a tokenizer was saved to (save_pretrained)")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers' errors for a tokenizer it cannot read vary by kind
        said = " ".join(str(exc).split()) or type(exc).__name__
        raise UsageError(f"no tokenizer could be read from {path}: {said[:300]}") from None


def artifact_tokenizer(artifact_dir: str | Path, override: str | Path | None = None):
    """The tokenizer to serve an artifact with: ``override``, else the artifact's own, else None."""
    if override is not None:
        return load_tokenizer(override)
    own = Path(artifact_dir) / ARTIFACT_TOKENIZER
    return load_tokenizer(own) if own.is_dir() else None


def render_chat(tokenizer, messages: list[dict], tools: list | None = None, **template_args) -> list[int]:
    """The prompt's token ids: ``messages`` through the tokenizer's chat template, with the assistant's turn
    opened. A ValueError where the tokenizer has no template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model's tokenizer has no chat template: use /v1/completions with a prompt, or serve "
                         "with --tokenizer a folder whose tokenizer_config.json has one")
    options = {"add_generation_prompt": True} | template_args
    if tools:
        options["tools"] = tools
    text = tokenizer.apply_chat_template(messages, tokenize=False, **options)
    return tokenizer.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    """Text as tokens come, never a broken character: a multi-byte character split over tokens waits for its
    last token (the decoded text ends in U+FFFD until then). Each new piece is the decode of a short window of
    recent tokens less the decode of its start (as vLLM's detokenizer does), so tokenizers that drop a leading
    space at the start of a decode still give the spaces between tokens; :meth:`flush` then gives whatever
    makes the pieces, joined, the decode of all the tokens."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""  # what the pieces so far add up to
        self._prefix = 0  # the window's start: the decode of ids[_prefix:_read] was given already
        self._read = 0

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token: int) -> str:
        """The new text that ``token`` completes ("" while a character waits for its next bytes)."""
        self.ids.append(token)
        before = self._decode(self.ids[self._prefix:self._read])
        now = self._decode(self.ids[self._prefix:])
        if len(now) <= len(before) or now.endswith("\ufffd") or not now.startswith(before):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        piece = now[len(before):]
        self.text += piece
        return piece

    def flush(self) -> str:
        """The rest of the text once no more tokens come (a character left incomplete, as the decode gives it)."""
        full = self._decode(self.ids)
        if not full.startswith(self.text):  # not expected of a tokenizer; the pieces given stand
            return ""
        piece, self.text = full[len(self.text):], full
        return piece


class StopText:
    """The text of one sequence checked against stop strings across token boundaries: what may be sent (the
    end held back while it could be the start of a stop string) and whether a stop string ended it (the text
    is cut before it, the stop string left out)."""

    def __init__(self, stops):
        self.stops = [s for s in stops if s]
        self.text = ""
        self.sent = 0
        self.stopped = False

    def add(self, piece: str) -> str:
        """Take ``piece``; returns what can be sent now."""
        if self.stopped or not piece:
            return ""
        start = max(0, len(self.text) - max((len(s) for s in self.stops), default=0) + 1)
        self.text += piece
        cut = min((i for i in (self.text.find(s, start) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = self.text[:cut], True
            return self._send(len(self.text))
        return self._send(len(self.text) - self._held())

    def _held(self) -> int:
        """How many characters at the end could begin a stop string (not yet sent)."""
        for size in range(min(max((len(s) for s in self.stops), default=1) - 1, len(self.text) - self.sent), 0, -1):
            tail = self.text[-size:]
            if any(s.startswith(tail) for s in self.stops):
                return size
        return 0

    def _send(self, upto: int) -> str:
        piece = self.text[self.sent:upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return piece

    def finish(self) -> str:
        """Everything not yet sent (the sequence ended)."""
        return self._send(len(self.text))
