"""The server's parts that need no artifact, in the fast tier: text as tokens come, stop strings, the prefix
cache's book, tool calls read from text, and the grammar's masks over a tokenizer trained here
(tests/test_serve.py serves a built model over HTTP, in the slow tier)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from .helpers import train_tokenizer

pytest.importorskip("xgrammar", reason="pip install -e . installs xgrammar")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def test_incremental_detokenization_never_splits_a_character_and_joins_to_the_decode(tokenizer):
    from autosched.serve.tokenizer import IncrementalDetokenizer

    text = "Naïve café owners wrote “smart quotes”, emoji 🙂 and 中文 text"
    rng = np.random.default_rng(1)
    for tokens in [tokenizer.encode(text), rng.integers(3, 512, size=60).tolist()]:
        detok = IncrementalDetokenizer(tokenizer)
        pieces = [detok.add(t) for t in tokens] + [detok.flush()]
        assert "".join(pieces) == tokenizer.decode(tokens, skip_special_tokens=True)
    detok = IncrementalDetokenizer(tokenizer)
    emitted = [detok.add(t) for t in tokenizer.encode("жщ")]  # letters the tokenizer never saw: a token a byte
    assert "".join(emitted) == "жщ" and all("\ufffd" not in p for p in emitted)
    assert "" in emitted  # a character's first byte waited for its second


def test_stop_text_holds_back_what_could_begin_a_stop_string():
    from autosched.serve.tokenizer import StopText

    stop = StopText(["END", "\n\n"])
    sent = [stop.add(p) for p in ["Hello E", "N", "x more\n", "\nignored"]]
    assert sent == ["Hello ", "", "ENx more", ""] and stop.stopped and stop.text == "Hello ENx more"
    assert stop.finish() == ""
    plain = StopText([])
    assert plain.add("abc") == "abc" and plain.finish() == ""


def test_prefix_cache_book_finds_the_longest_kept_prefix_and_evicts_least_recent():
    from autosched.generation.prefix_cache import PrefixCache

    cache = PrefixCache(page_size=4)
    a = cache.add(list(range(10)))  # two whole pages kept
    assert a.tokens == tuple(range(8)) and cache.add(list(range(8)) + [99]) is None  # held already
    assert cache.match(list(range(12)))[1] == 8
    assert cache.match(list(range(8))) [1] == 4  # a prompt keeps a token to prefill
    assert cache.match([0, 1, 2, 3, 5, 5, 6, 7, 8]) == (a, 4)  # the first page only
    assert cache.match([9, 9, 9, 9, 9]) is None
    b = cache.add([50, 51, 52, 53])
    cache.match([50, 51, 52, 53, 54])
    assert cache.least_recent() is a and cache.least_recent() is b and cache.least_recent() is None
    assert cache.hit_tokens == 4 + 8 + 4 + 4 and cache.queried_tokens == 12 + 8 + 9 + 5 + 5


def test_auto_tool_calls_are_json_objects_or_lists_of_them_possibly_in_tool_call_tags():
    from autosched.serve.structured import parse_calls

    functions = {"f": {}, "g": {}}
    one = parse_calls(' {"name": "f", "arguments": {"x": 1}} ', functions)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in one] == [("f", {"x": 1})]
    assert one[0]["id"].startswith("call_") and one[0]["type"] == "function"
    both = parse_calls('<tool_call>{"name": "f", "parameters": {}}</tool_call>\n<tool_call>[{"name": "g", '
                       '"arguments": "{\\"y\\": [2]}"}]</tool_call>', functions)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in both] == [("f", {}), ("g", {"y": [2]})]
    for text in ['{"name": "h", "arguments": {}}', '{"name": "f"}', '{"name": "f", "arguments": 3}', "Hello",
                 '<tool_call>{"name": "f", "arguments": {}}</tool_call> and text', "[]", '{"name": "f", "arguments": {}']:
        assert parse_calls(text, functions) is None, text


def test_the_grammar_never_allows_special_tokens_or_bytes_that_are_not_utf8(tokenizer):
    """XGrammar reads a byte-level tokenizer's added special tokens as their text, and lets overlong forms and
    surrogates through its byte automaton: both are masked."""
    from autosched.generation.grammar import Grammars, GrammarSpec

    grammars = Grammars(tokenizer, 512, [2])
    state = grammars.state(GrammarSpec.json_schema({"type": "string"}))
    vocab = {bytes(t): i for i, t in enumerate(grammars.info.decoded_vocab) if len(t) == 1}
    assert state.accept(tokenizer.convert_tokens_to_ids('"'))
    allowed = state.allowed()
    assert not allowed[[0, 1, 2, 3, 4]].any() and allowed[vocab[b"a"]] and allowed[vocab[b"\xe4"]]
    assert not allowed[vocab[b"\x80"]] and not allowed[vocab[b"\xc0"]] and not allowed[vocab[b"\xf5"]]
    assert state.accept(vocab[b"\xed"])  # the lead byte of U+D000..U+D7FF and of the surrogates
    allowed = state.allowed()
    assert allowed[vocab[b"\x80"]] and allowed[vocab[b"\x9f"]] and not allowed[vocab[b"\xa0"]]
    assert not allowed[vocab[b'"']]  # not in the middle of a character
    state.rollback(1)
    assert state.allowed()[vocab[b'"']] and not state.allowed()[2]
    assert state.accept(vocab[b'"']) and state.allowed()[2] and state.allowed().sum() == 1  # complete: EOS alone
    assert state.accept(2) and state.terminated
