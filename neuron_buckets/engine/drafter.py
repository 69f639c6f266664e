"""What the scheduler asks of a drafter: prompt lookup (``ngram_drafter.py``) or a draft model
(``draft_model_drafter.py``) behind one interface."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from neuron_buckets.core.step_plan import Segment
from neuron_buckets.engine.request import Request


class Drafter(Protocol):
    def draft(self, requests: Sequence[Request], rooms: Sequence[int]) -> list[list[int]]:
        """Up to ``rooms[i]`` tokens to follow ``requests[i]``'s last token, for every request at
        once (a model drafts them in batched calls). Each request's blocks already cover its
        last token and ``rooms[i] - 1`` positions after it."""
        ...

    def follow(self, chunks: Sequence[tuple[Request, Segment]]) -> None:
        """See the prefill chunks a target step ran (a draft model computes them too)."""
        ...
