"""Constrained decoding: output held to a JSON schema, a regular expression, an EBNF grammar or a choice among
strings, enforced token by token with XGrammar (the engine MLC-LLM, vLLM and SGLang use).

A :class:`GrammarSpec` (kind and text, hashable) is what a request asks for (:class:`~.request.Sampling`'s
``grammar``); :class:`Grammars` compiles it for one tokenizer and vocabulary (compiled grammars are kept by their
text, least recently used out) and makes a :class:`GrammarState` per sequence: XGrammar's matcher, which gives
the set of tokens that keep the output valid (a bitmask in XGrammar's layout: bit ``t % 32`` of int32 word ``t //
32``), accepts each token made, rolls back tokens a speculative step rejected, and once the output is complete
allows only the stop tokens (the sequence then ends at one).

Guards of ours on top of XGrammar 0.2.9, so that every output is valid JSON and valid UTF-8 text:

- a tokenizer's special tokens (``<s>``, ``<|im_start|>``, ...), which XGrammar reads as their literal text in a
  byte-level vocabulary, are never allowed (its stop tokens are, where the grammar is complete);
- a token whose bytes would make the output invalid UTF-8 (an overlong form, a surrogate, a stray continuation
  byte: XGrammar's byte automaton lets them through) is masked too;
- in a JSON schema, a string bounded by ``minLength``/``maxLength`` and nothing else is given the equivalent
  ``pattern`` of characters that need no escape (XGrammar's bounded strings let raw control characters
  through, which JSON forbids).

XGrammar is imported when a grammar is first compiled.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

from autosched.errors import UsageError

from .runtime_kernels import compiled_at_first_use

# Deferred imports: xgrammar, numpy, tvm (imported where used: `autosched --help` stays fast).

KINDS = ("json_schema", "json_object", "regex", "ebnf", "choice")
CACHE_SIZE = 256  # compiled grammars kept per Grammars


class GrammarError(UsageError):
    """A grammar XGrammar cannot compile (its reason, one line), or one asked of a generator without a tokenizer."""


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must follow: ``kind`` is ``json_schema`` (``text``: the schema as JSON), ``json_object``
    (any JSON object), ``regex``, ``ebnf`` (XGrammar's EBNF, root rule ``root``) or ``choice`` (``text``: a JSON
    list of the strings, the output being one of them)."""

    kind: str
    text: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise GrammarError(f"a grammar's kind is one of {', '.join(KINDS)}, not {self.kind!r}")
        if not isinstance(self.text, str):
            raise GrammarError(f"a grammar's text is a string, not {type(self.text).__name__}")

    @classmethod
    def json_schema(cls, schema) -> GrammarSpec:
        """A JSON schema (a dict, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise GrammarError(f"the JSON schema is not JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"a JSON schema is an object, not {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema, ensure_ascii=False))

    @classmethod
    def json_object(cls) -> GrammarSpec:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        return cls("regex", pattern)

    @classmethod
    def ebnf(cls, grammar: str) -> GrammarSpec:
        return cls("ebnf", grammar)

    @classmethod
    def choice(cls, options) -> GrammarSpec:
        options = list(options) if not isinstance(options, str) else None
        if not options or not all(isinstance(o, str) and o for o in options):
            raise GrammarError("a choice is a list of one or more non-empty strings")
        return cls("choice", json.dumps(options, ensure_ascii=False))


def _one_line(exc: BaseException) -> str:
    """XGrammar's reason, without its C++ log prefix ("[12:00:00] /project/cpp/x.cc:10: ") and on one line."""
    text = " ".join(str(exc).split())
    text = re.sub(r"\[\d\d:\d\d:\d\d\] \S+?:\d+: ", "", text)
    text = re.sub(r"Check failed: \(.*?\) is false: ", "", text)
    return text or type(exc).__name__


def bounded_strings_as_patterns(schema):
    """``schema`` with each string bounded only by ``minLength``/``maxLength`` given the pattern of that many
    characters that need no escape in JSON (``[^"\\\\\\x00-\\x1f]{m,n}``) instead (see the module)."""
    if isinstance(schema, list):
        return [bounded_strings_as_patterns(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in ("enum", "const", "default", "examples") else bounded_strings_as_patterns(v))
           for k, v in schema.items()}
    if (out.get("type") == "string" and ("minLength" in out or "maxLength" in out)
            and not any(k in out for k in ("pattern", "format", "enum", "const"))):
        low, high = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f'^[^"\\\\\\x00-\\x1f]{{{low},{high}}}$'
    return out


class Grammars:
    """Compiles grammars for ``tokenizer`` (a Hugging Face tokenizer) and a model of ``vocab`` tokens (the
    logits' width, which may pass the tokenizer's), keeping the last ``cache_size`` compiled; makes each
    sequence's :class:`GrammarState`. ``stop_tokens``: the model's end-of-sequence tokens. Thread-safe: the
    server compiles in a worker thread while the engine's thread makes states."""

    def __init__(self, tokenizer, vocab: int, stop_tokens=(), cache_size: int = CACHE_SIZE):
        import numpy as np
        import xgrammar as xgr

        self.vocab = vocab
        self.words = (vocab + 31) // 32
        stops = sorted(stop_tokens) or ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else None)
        found = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=stops)
        # The tokenizer's special tokens as XGrammar's (an empty text): never part of the output's text.
        special = set(tokenizer.all_special_ids)
        special |= {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
        encoded = [""] * vocab
        for token, i in tokenizer.get_vocab().items():
            if i < vocab and i not in special:
                encoded[i] = token
        self.info = xgr.TokenizerInfo(encoded, found.vocab_type, vocab_size=vocab, stop_token_ids=found.stop_token_ids,
                                      add_prefix_space=found.add_prefix_space)
        self.stop_tokens = tuple(found.stop_token_ids)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self.utf8 = Utf8Table(self.info.decoded_vocab, np)
        self.cache_size = cache_size
        self._cache: OrderedDict[GrammarSpec, object] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec):
        """XGrammar's compiled grammar of ``spec`` (from the cache where compiled before); a GrammarError with
        XGrammar's reason where it cannot be compiled."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
            try:
                compiled = self._compile(spec)
            except GrammarError:
                raise
            except Exception as exc:  # noqa: BLE001 - XGrammar raises RuntimeError (and others) with its reason
                raise GrammarError(f"the {spec.kind.replace('_', ' ')} cannot be compiled: {_one_line(exc)}") from None
            self._cache[spec] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return compiled

    def _compile(self, spec: GrammarSpec):
        c = self.compiler
        compact = {"any_whitespace": False, "separators": (",", ":")}  # bounded output: no free whitespace
        if spec.kind == "json_schema":
            schema = json.loads(spec.text)
            return c.compile_json_schema(json.dumps(bounded_strings_as_patterns(schema)), **compact)
        if spec.kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', **compact)
        if spec.kind == "regex":
            return c.compile_regex(spec.text)
        if spec.kind == "ebnf":
            return c.compile_grammar(spec.text)
        options = json.loads(spec.text)  # choice: JSON's escapes are EBNF string literals' too
        return c.compile_grammar("root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options))

    def state(self, spec: GrammarSpec, stop_tokens=()) -> GrammarState:
        """A new sequence's state under ``spec``, ending at ``stop_tokens`` (default: the model's) once complete."""
        import xgrammar as xgr

        stops = sorted(stop_tokens) or list(self.stop_tokens)
        return GrammarState(xgr.GrammarMatcher(self.compile(spec), override_stop_tokens=stops), self)


class GrammarState:
    """One sequence's place in its grammar: the tokens allowed next (:meth:`allowed`, :meth:`fill`), each token
    made (:meth:`accept`), and rollback of the last tokens (:meth:`rollback`) for speculation."""

    def __init__(self, matcher, grammars: Grammars):
        import numpy as np

        self.matcher, self.grammars = matcher, grammars
        self.utf8 = [0]  # the UTF-8 state after each token accepted (the first: before any)
        self._bitmask = np.zeros((1, grammars.words), dtype=np.int32)

    @property
    def terminated(self) -> bool:
        """Whether a stop token ended the output (no token is allowed after it)."""
        return self.matcher.is_terminated()

    def fill(self, bitmask, row: int = 0) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (int32 words, XGrammar's layout)."""
        import numpy as np

        self.matcher.fill_next_token_bitmask(bitmask, row)
        words = bitmask[row].view(np.uint32)
        guard = self.grammars.utf8.allowed_words(self.utf8[-1])
        if guard is not None and (words & guard).any():  # (never none left: the guard yields where it would)
            words &= guard

    def allowed(self):
        """The tokens allowed next, as a bool array of the model's vocabulary."""
        import numpy as np

        self.fill(self._bitmask)
        return np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[:self.grammars.vocab].astype(bool)

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False (and no change) where the grammar does not allow it."""
        if not self.matcher.accept_token(int(token)):
            return False
        self.utf8.append(self.grammars.utf8.after(self.utf8[-1], int(token)))
        return True

    def rollback(self, tokens: int) -> None:
        """Undo the last ``tokens`` accepted."""
        if tokens > 0:
            self.matcher.rollback(tokens)
            del self.utf8[-tokens:]


# ---- UTF-8: which tokens keep the output's bytes valid ------------------------------------------------------

# A state is 0 (between characters) or (bytes still needed) * 256 + (the lowest allowed next byte's class):
# after E0 the next byte is A0-BF, after ED 80-9F, after F0 90-BF, after F4 80-8F, else 80-BF.
_FIRST_RANGE = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}


def _utf8_step(state: tuple[int, int, int], byte: int):
    """The state (need, low, high) after ``byte``, or None where it makes the bytes invalid UTF-8."""
    need, low, high = state
    if need:
        if not low <= byte <= high:
            return None
        return (need - 1, 0x80, 0xBF) if need > 1 else (0, 0, 0)
    if byte < 0x80:
        return state
    if 0xC2 <= byte <= 0xDF:
        return (1, 0x80, 0xBF)
    if 0xE0 <= byte <= 0xEF:
        return (2, *_FIRST_RANGE.get(byte, (0x80, 0xBF)))
    if 0xF0 <= byte <= 0xF4:
        return (3, *_FIRST_RANGE.get(byte, (0x80, 0xBF)))
    return None  # a continuation byte with no lead, C0, C1, F5-FF


class Utf8Table:
    """For each UTF-8 state, the tokens whose bytes keep the output valid UTF-8 (a bitmask of words, None where
    all are), and the state after each token. States are small ints; the tables are made as states are met."""

    def __init__(self, decoded_vocab: list[bytes], np):
        self.np = np
        self.vocab = [bytes(b) for b in decoded_vocab]
        self.states: list[tuple[int, int, int]] = [(0, 0, 0)]
        self.index = {(0, 0, 0): 0}
        self.masks: dict[int, object] = {}
        self.next: dict[tuple[int, int], int] = {}

    def _id(self, state) -> int:
        if state not in self.index:
            self.index[state] = len(self.states)
            self.states.append(state)
        return self.index[state]

    def _walk(self, state: tuple[int, int, int], data: bytes):
        for byte in data:
            state = _utf8_step(state, byte)
            if state is None:
                return None
        return state

    def allowed_words(self, state: int):
        """The bitmask (uint32 words) of the tokens valid after ``state``; None where every token is."""
        if state not in self.masks:
            np = self.np
            ok = np.asarray([self._walk(self.states[state], b) is not None for b in self.vocab], dtype=bool)
            words = (len(ok) + 31) // 32
            packed = np.packbits(np.pad(ok, (0, words * 32 - len(ok))), bitorder="little").view(np.uint32)
            self.masks[state] = None if ok.all() else packed
        return self.masks[state]

    def after(self, state: int, token: int) -> int:
        """The state after ``token`` (unchanged for a token of no bytes, or one the guard did not allow)."""
        key = (state, token)
        if key not in self.next:
            data = self.vocab[token] if token < len(self.vocab) else b""
            walked = self._walk(self.states[state], data)
            self.next[key] = state if walked is None else self._id(walked)
        return self.next[key]


# ---- the mask on the device ---------------------------------------------------------------------------------

MASK_THREADS = 1024  # per row on a GPU: a 32000-token vocabulary is 32 coalesced stores a thread at most


def mask_kernel(vocab: int, gpu: bool):
    """The PrimFunc ``main(logits [n, vocab] float32, bitmask [n, ceil(vocab / 32)] int32)`` that sets, in place,
    the logits of the tokens whose bit is 0 (XGrammar's layout) to -inf; on a GPU a CTA a row."""
    from tvm.script import tirx as T

    words = (vocab + 31) // 32
    width = MASK_THREADS if gpu else 1
    share = (vocab + width - 1) // width

    @T.macro
    def row(logits, bitmask, r, t):
        for i in range(share):
            j = i * width + t
            if j < vocab:
                if T.bitwise_and(T.shift_right(bitmask[r, j // 32], j % 32), 1) == 0:
                    logits[r, j] = T.float32("-inf")

    if gpu:
        @T.prim_func
        def main(var_logits: T.handle, var_bitmask: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            n = T.int64()
            logits = T.match_buffer(var_logits, (n, vocab), "float32")
            bitmask = T.match_buffer(var_bitmask, (n, words), "int32")
            for r in T.thread_binding(n, thread="blockIdx.x"):
                for t in T.thread_binding(MASK_THREADS, thread="threadIdx.x"):
                    row(logits, bitmask, r, t)
    else:
        @T.prim_func
        def main(var_logits: T.handle, var_bitmask: T.handle):
            T.func_attr({"tirx.noalias": True})
            n = T.int64()
            logits = T.match_buffer(var_logits, (n, vocab), "float32")
            bitmask = T.match_buffer(var_bitmask, (n, words), "int32")
            for r in T.parallel(n):
                row(logits, bitmask, r, 0)
    return main


def device_mask(model):
    """A function ``(logits, bitmask)`` that masks a step's logits on ``model``'s device (:func:`mask_kernel`,
    compiled here at the first use in this process), or None where it cannot be compiled (the rows under a
    grammar are then masked on the host)."""
    return compiled_at_first_use(model, "the grammar mask", mask_kernel)
