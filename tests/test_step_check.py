"""``check_step`` with prefix caching: segments may share the full blocks below their contexts,
never a block one of them writes."""

from __future__ import annotations

import pytest

from neuron_buckets.core.step_plan import Segment
from neuron_buckets.runtime.step_check import StepLimits, check_step

LIMITS = StepLimits(block_size=4, num_blocks=16, max_model_len=64, vocab_size=32)


def seg(context: int, blocks: list[int], tokens: int = 1) -> Segment:
    return Segment(0, [1] * tokens, context, tuple(blocks), 1)


@pytest.mark.parametrize(
    "plan",
    [
        # two requests with the same 2-block prefix, each writing its own third block
        [seg(8, [1, 2, 3], 3), seg(8, [1, 2, 4], 2)],
        # a decode row and a prefill chunk that read the same full blocks
        [seg(9, [1, 2, 5]), seg(8, [1, 2, 6], 4), seg(4, [1, 7], 4)],
    ],
    ids=["two-prefills", "decode-and-prefill"],
)
def test_segments_may_read_one_full_block(plan):
    check_step(plan, LIMITS)


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        ([seg(0, [3], 2), seg(2, [3])], "block 3 is written twice"),  # two writes, even to two slots
        ([seg(5, [1, 3]), seg(5, [2, 3])], "block 3 is written twice"),  # one slot, twice
        # request 1 writes block 2, which request 0 reads as part of its prefix
        ([seg(8, [1, 2, 3]), seg(4, [1, 2])], "block 2 is written in a step in which request 0 reads it"),
        ([seg(8, [1, 1, 3])], "request 0 lists a block twice"),
    ],
    ids=["two-writers", "one-slot", "write-into-a-read-block", "twice-in-one-row"],
)
def test_writes_stay_private(plan, message):
    with pytest.raises(ValueError, match=message):
        check_step(plan, LIMITS)
