"""Streaming text: pieces that add up to the decoded tokens, and stop strings cut before they show.

Byte-level BPE makes any id sequence valid text, split characters included, so random sequences
test the offsets; stop strings are drawn from the text itself so they do occur.
"""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from neuron_buckets.engine.detokenizer import Detokenizer
from neuron_buckets.engine.tokenizer import Tokenizer
from tests.conftest import tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(tiny_tokenizer())


def ids_of(tokenizer: Tokenizer) -> st.SearchStrategy[list[int]]:
    words = st.sampled_from(["hello", " world", " 日本語", "héllo", " fox", "\n"])
    as_text = st.lists(words, min_size=1, max_size=6).map(lambda w: tokenizer.encode("".join(w))[1:])
    raw = st.lists(st.integers(0, len(tokenizer.hf) - 1), min_size=1, max_size=24)  # split characters too
    return st.one_of(as_text, raw)


def run(detok: Detokenizer, ids: list[int]) -> list[str]:
    """Push ``ids`` until a stop string; what a client saw after each push."""
    seen = []
    for token in ids:
        stopped = detok.push(token)
        seen.append(detok.visible(finished=stopped is not None))
        if stopped:
            return seen
    detok.flush()
    return [*seen, detok.visible(finished=True)]


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_streamed_text_adds_up_to_the_decoded_tokens(tokenizer, data):
    ids = data.draw(ids_of(tokenizer))
    seen = run(Detokenizer(tokenizer), ids)
    assert seen[-1] == tokenizer.decode(ids)
    assert all(seen[-1].startswith(s) for s in seen)  # each view extends the one before


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_stop_string_is_cut_and_never_streamed(tokenizer, data):
    ids = data.draw(ids_of(tokenizer))
    full = tokenizer.decode(ids)
    assume(full)
    start = data.draw(st.integers(0, len(full) - 1))
    stop = full[start : start + data.draw(st.integers(1, 4))]
    detok = Detokenizer(tokenizer, [stop, "never there \x00"])
    seen = run(detok, ids)
    assert detok.stopped_by == stop and stop not in seen[-1]
    assert full.startswith(seen[-1] + stop)  # cut right where the stop string first completed
    assert all(seen[-1].startswith(s) for s in seen)  # nothing that was cut had been shown


def test_stop_strings_are_looked_for_in_the_new_text_and_the_few_characters_before_it(tokenizer, monkeypatch):
    windows: list[int] = []
    search = Detokenizer._search
    monkeypatch.setattr(Detokenizer, "_search", lambda self, w: windows.append(len(w)) or search(self, w))
    detok = Detokenizer(tokenizer, stop=["fox!", "zzz"])
    ids = tokenizer.encode(" hello world" * 200 + " fox!")[1:]
    seen = run(detok, ids)
    text = tokenizer.decode(ids)
    assert detok.stopped_by == "fox!" and seen[-1] == text[: text.index("fox!")]
    longest_token = max(len(tokenizer.decode([t])) for t in ids)
    assert len(windows) >= 400 and max(windows) <= detok.hold + longest_token
