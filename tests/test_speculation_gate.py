"""The rule that turns speculation off where it does not pay, with injected costs: a clock that
only the test moves, and a drafter that moves it by its own cost. No timing is measured."""

from __future__ import annotations

from fractions import Fraction

from hypothesis import given
from hypothesis import strategies as st

from neuron_buckets.engine.spec_decode_stats import SpecDecodeStats
from neuron_buckets.engine.speculation_gate import SpeculationGate


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class CostlyDrafter:
    """Drafts every row's whole room, and costs ``cost`` seconds on the clock per call."""

    def __init__(self, clock: Clock, cost: float) -> None:
        self.clock, self.cost, self.followed = clock, cost, []

    def draft(self, requests, rooms):
        self.clock.now += self.cost
        return [[0] * k for k in rooms]

    def follow(self, chunks):
        self.followed.append(chunks)


def gate(cost: float, window: int = 4, probe_interval: int = 6) -> SpeculationGate:
    clock = Clock()
    return SpeculationGate(CostlyDrafter(clock, cost), SpecDecodeStats(), window, probe_interval, clock)


def steps(g: SpeculationGate, n: int, rows: int, accepted: int, seconds: float) -> list[bool]:
    """``n`` steps of ``rows`` rows, each taking ``seconds`` in all and accepting ``accepted``
    drafts when it drafted; whether each one drafted."""
    drafted = []
    for _ in range(n):
        drafted.append(any(g.draft([None] * rows, [3] * rows)))  # the gate never reads a request
        g.observe(seconds, accepted if drafted[-1] else 0)
    return drafted


def test_drafts_that_are_always_rejected_turn_speculation_off_and_probes_recur():
    g = gate(cost=0.0)  # even a free drafter: rejected drafts emit no more than rows without
    assert steps(g, 20, rows=2, accepted=0, seconds=1.0) == ([True] * 4 + [False] * 6) * 2
    assert g.stats.num_steps_off == 12


def test_cheap_drafts_that_are_accepted_keep_speculation_on():
    g = gate(cost=1.0)  # a tenth of the step: 1.11x the time for 1.5x the tokens
    assert all(steps(g, 50, rows=2, accepted=1, seconds=10.0))
    assert g.stats.num_steps_off == 0


def test_a_costly_drafter_goes_off_where_its_acceptance_does_not_cover_its_time():
    # half the step in the drafter (2x the time): 2 tokens per row only tie, 2.1 pays
    tie, pays = gate(cost=5.0), gate(cost=5.0)
    assert steps(tie, 5, rows=10, accepted=10, seconds=10.0) == [True] * 4 + [False]
    assert all(steps(pays, 50, rows=10, accepted=11, seconds=10.0))


def test_a_workload_that_turns_repetitive_gets_speculation_back_at_the_next_probe():
    g = gate(cost=0.5)
    assert steps(g, 10, rows=1, accepted=0, seconds=10.0) == [True] * 4 + [False] * 6
    assert all(steps(g, 40, rows=1, accepted=3, seconds=10.0))


def test_steps_that_ask_the_drafter_nothing_leave_the_rule_alone():
    g = gate(cost=0.0)
    for _ in range(3):
        steps(g, 1, rows=1, accepted=0, seconds=1.0)
        g.observe(1.0, 0)  # a prefill-only step, or rows without room: no draft call
    assert g.on
    assert steps(g, 2, rows=1, accepted=0, seconds=1.0) == [True, False]


def test_follow_reaches_the_drafter_while_speculation_is_off():
    g = gate(cost=0.0)
    steps(g, 5, rows=1, accepted=0, seconds=1.0)
    assert not g.on
    g.follow(["chunk"])
    assert g.drafter.followed == [["chunk"]]


@given(
    rows=st.integers(1, 8), accepted=st.integers(0, 24), ms=st.integers(1, 1000), share=st.floats(0, 1),
)
def test_speculation_stays_on_exactly_while_it_emits_more_tokens_per_second(rows, accepted, ms, share):
    """Tokens per second with the drafter, (rows + accepted) / s, against rows per second the same
    steps would have run without it, rows / (s - d): the rule is that comparison."""
    draft_ms = int(ms * share)
    g = gate(cost=float(draft_ms))
    steps(g, 4, rows, accepted, float(ms))
    without = ms - draft_ms
    faster = without > 0 and Fraction(rows + accepted, ms) > Fraction(rows, without)
    assert g.on == faster
