"""Prompt-lookup drafts: the tokens that followed the latest earlier match of the request's own
last n tokens. No second model, so it costs only a search over the request's tokens; it pays
where text repeats (code edits, quoting, extraction) and proposes nothing elsewhere.

A match ``d`` tokens back says the text repeats with period ``d``; when fewer than k tokens
follow it (the match is recent: a loop, a run of one token), the draft goes on with that period
instead of stopping at the last token, so a row in a loop still carries k drafts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from neuron_buckets.core.step_plan import Segment
from neuron_buckets.engine.request import Request


@dataclass(frozen=True)
class NgramDrafter:
    """vLLM's ``ngram`` method: the longest suffix n-gram, ``max_n`` down to ``min_n``, that
    occurred earlier in the request decides the draft."""

    min_n: int = 1
    max_n: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"n-gram bounds need 1 <= min_n <= max_n, got {self.min_n} and {self.max_n}")

    def draft(self, requests: Sequence[Request], rooms: Sequence[int]) -> list[list[int]]:
        """The drafter interface (``drafter.py``): each request's own lookup."""
        return [self.propose(r.token_ids, k) for r, k in zip(requests, rooms, strict=True)]

    def follow(self, chunks: Sequence[tuple[Request, Segment]]) -> None:
        """Nothing to keep: a lookup reads the request's tokens, not the cache."""

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """``k`` tokens: those that followed the most recent earlier occurrence of the longest
        matching suffix, repeated with the match's period where they reach the end; [] when no
        suffix of at least ``min_n`` tokens occurred before."""
        seq = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, len(seq) - 1), self.min_n - 1, -1):
            # windows that end before the suffix itself starts, so a match has a continuation
            windows = sliding_window_view(seq[:-1], n)
            hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
            if hits.size:
                return np.resize(seq[int(hits[-1]) + n :], k).tolist()  # cyclic past the end
        return []
