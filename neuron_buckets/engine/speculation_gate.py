"""Speculation that turns itself off where it does not pay, and back on where it starts to.

Measured first: a decode row without drafts still runs the artifact's wide ``1 + k`` graphs
(every decode bucket has that width, and a row's unused positions are pads), so the graph costs
the same with drafts or without. What drafting adds to a step is the drafter's own time: a
prompt lookup's search, or a draft model's k calls. So drafting pays while the tokens a drafting
row emits, ``1 + accepted``, outweigh the step's time with the drafter over its time without:

    (rows + accepted) / rows  >  seconds / (seconds - draft_seconds)

summed over the last ``window`` steps that drafted. That ratio is at least 1, so drafts that are
always rejected turn speculation off whatever the clock says. Off, a step's rows carry no drafts
(counted in ``SpecDecodeStats.num_steps_off``); after ``probe_interval`` such steps drafting runs
again for a new window, so a workload that turns repetitive gets it back.

A gated step emits exactly one token per row, as without speculation, so greedy tokens never
change; a seeded sampled request's tokens depend on which steps drafted, and so on the clock.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from neuron_buckets.core.step_plan import Segment
from neuron_buckets.engine.drafter import Drafter
from neuron_buckets.engine.request import Request
from neuron_buckets.engine.spec_decode_stats import SpecDecodeStats


@dataclass(frozen=True)
class DraftingStep:
    """What one step that drafted cost and gave."""

    rows: int  # decode rows the drafter was asked for
    accepted: int  # draft tokens the target accepted
    seconds: float  # the whole step
    draft_seconds: float  # of which in the drafter


class SpeculationGate:
    """A drafter (``drafter.py``) that asks the real one only while drafting pays."""

    def __init__(
        self, drafter: Drafter, stats: SpecDecodeStats, window: int, probe_interval: int,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.drafter, self.stats, self.clock = drafter, stats, clock
        self.window, self.probe_interval = window, probe_interval
        self.on = True
        self.recent: deque[DraftingStep] = deque(maxlen=window)
        self._off_steps = 0  # since speculation went off
        self._asked = 0  # rows the drafter was asked for in this step
        self._draft_seconds = 0.0

    def draft(self, requests: Sequence[Request], rooms: Sequence[int]) -> list[list[int]]:
        if not self.on:
            self.stats.num_steps_off += 1
            self._off_steps += 1
            self.on = self._off_steps >= self.probe_interval  # the next step probes again
            return [[] for _ in requests]
        start = self.clock()
        drafts = self.drafter.draft(requests, rooms)
        self._draft_seconds += self.clock() - start
        self._asked += len(requests)
        return drafts

    def follow(self, chunks: Sequence[tuple[Request, Segment]]) -> None:
        self.drafter.follow(chunks)  # a draft model's cache keeps up even while it does not draft

    def observe(self, seconds: float, accepted: int) -> None:
        """The step that just ran: its wall seconds and the drafts its rows accepted. A step that
        asked the drafter nothing (off, or no row had room) leaves the rule as it was."""
        if self._asked:
            self.recent.append(DraftingStep(self._asked, accepted, seconds, self._draft_seconds))
            if len(self.recent) == self.window and not self.pays:
                self.on, self._off_steps = False, 0
                self.recent.clear()  # a probe decides on its own window
        self._asked, self._draft_seconds = 0, 0.0

    @property
    def pays(self) -> bool:
        """Whether the recent drafting steps emitted more tokens per second than the same steps
        would have without the drafter (the formula in the module docstring, multiplied out)."""
        rows = sum(s.rows for s in self.recent)
        emitted = rows + sum(s.accepted for s in self.recent)
        seconds = sum(s.seconds for s in self.recent)
        without = seconds - sum(s.draft_seconds for s in self.recent)
        return emitted * without > rows * seconds
