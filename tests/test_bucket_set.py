"""Laying a step plan onto buckets: waves for long prompts, packed prefill calls, decode calls
grouped by context."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from neuron_buckets.core.bucket import Bucket, NoBucketFits
from neuron_buckets.core.step_plan import Segment
from neuron_buckets.runtime.bucket_set import BucketSet, Part

DECODE = [Bucket("decode", b, 1, c) for c in (64, 256) for b in (1, 4)]


def buckets(*seqs: int, max_rows: int = 8, mix_decode: bool = True) -> BucketSet:
    return BucketSet.of([*(Bucket("prefill", min(max_rows, s), s, 256) for s in seqs), *DECODE], mix_decode)


def chunk(tokens: int, context: int = 0, samples: int = 1) -> Segment:
    return Segment(0, [1] * tokens, context, (), samples)


def row(context: int) -> Segment:
    return Segment(0, [1], context, (), 1)


def layout(calls) -> list[tuple[str, list[tuple[int, int, int]]]]:
    return [(c.bucket.name, [(p.segment, p.offset, p.tokens) for p in c.parts]) for c in calls]


def test_long_prompts_split_into_waves_of_the_largest_bucket():
    calls = buckets(128).calls([chunk(300), chunk(50)])
    assert layout(calls) == [
        ("prefill_s128", [(0, 0, 128)]),
        ("prefill_s128", [(1, 0, 50)]),  # a fresh chunk does not join a call that is full
        ("prefill_s128", [(0, 128, 128)]),
        ("prefill_s128", [(0, 256, 44)]),
    ]


def test_chunks_pack_end_to_end_into_the_smallest_bucket_that_holds_them():
    eight = [chunk(50)] * 8
    assert layout(buckets(64, 256, 512).calls(eight)) == [("prefill_s512", [(i, 0, 50) for i in range(8)])]
    four = buckets(64, 256, 512, max_rows=4).calls(eight)
    assert layout(four) == [("prefill_s256", [(i, 0, 50) for i in r]) for r in ((0, 1, 2, 3), (4, 5, 6, 7))]
    assert layout(buckets(32, 64).calls([chunk(30), chunk(40)])) == [
        ("prefill_s32", [(0, 0, 30)]),
        ("prefill_s64", [(1, 0, 40)]),
    ]


def test_continuing_chunks_and_fresh_ones_share_one_call_each_over_its_own_context():
    plan = [chunk(10), chunk(20, context=64), chunk(5), chunk(3, context=8), chunk(4, context=40, samples=0)]
    assert layout(buckets(32, 64).calls(plan)) == [
        ("prefill_s64", [(0, 0, 10), (1, 0, 20), (2, 0, 5), (3, 0, 3), (4, 0, 4)]),
    ]


def test_decode_rows_of_similar_context_share_the_smallest_context_bucket():
    plan = [row(c - 1) for c in (50, 200, 10, 30, 20)]
    calls = buckets(64).calls(plan)
    assert [(c.bucket, [p.segment for p in c.parts]) for c in calls] == [
        (DECODE[1], [2, 4, 3, 0]),
        (DECODE[2], [1]),
    ]
    with pytest.raises(NoBucketFits, match="257 tokens"):
        buckets(64).calls([row(256)])


def test_a_mixed_plan_runs_in_one_call_with_its_decode_rows_riding_behind_the_chunks():
    plan = [row(40), chunk(20, context=16), chunk(1, context=7), chunk(8)]
    calls = buckets(32).calls(plan)
    assert [c.parts for c in calls] == [
        # the one-token chunk that ends its prompt is a decode row
        (Part(1, 0, 20), Part(3, 0, 8), Part(0, 0, 1), Part(2, 0, 1)),
    ]
    assert [c.bucket.kind for c in calls] == ["prefill"]
    bs = buckets(32)
    assert [bs.part_samples(plan, p) for p in calls[0].parts] == [1, 1, 1, 1]


def test_decode_rows_that_do_not_fit_the_packed_call_or_would_grow_its_bucket_take_the_decode_graphs():
    full = [chunk(31), row(40), row(50)]  # 33 tokens: the rows do not fit the 32-token budget
    assert [(c.bucket.kind, [p.segment for p in c.parts]) for c in buckets(32).calls(full)] == [
        ("prefill", [0]),
        ("decode", [1, 2]),
    ]
    unmixed = buckets(32, mix_decode=False).calls([chunk(20), row(40)])  # mixing off: two calls
    assert [c.bucket.kind for c in unmixed] == ["prefill", "decode"]
    rows_only = [row(40), row(50)]  # a decode-only step keeps the decode graphs
    assert [c.bucket.kind for c in buckets(32).calls(rows_only)] == ["decode"]
    crowded = [chunk(2), *(row(9) for _ in range(4))]  # 5 segments, the packed call holds 4
    assert [c.bucket.kind for c in buckets(32, max_rows=4).calls(crowded)] == ["prefill", "decode"]
    growing = [chunk(14), row(40), row(50), row(60)]  # 17 tokens would take s64 instead of s16
    assert layout(buckets(16, 64).calls(growing)) == [
        ("prefill_s16", [(0, 0, 14)]),
        ("decode_b4_c64", [(1, 0, 1), (2, 0, 1), (3, 0, 1)]),
    ]
    two = layout(buckets(16, 64).calls(growing[:3]))  # two rows fill s16 exactly: they ride
    assert two == [("prefill_s16", [(0, 0, 14), (1, 0, 1), (2, 0, 1)])]


def test_a_chunk_returning_all_its_logits_gets_them_from_every_wave():
    # 40 tokens over a 32-token budget: the first wave returns 32 logits, the second 8
    bs = buckets(32)
    plan = [chunk(40, samples=40), chunk(5, samples=3)]
    calls = bs.calls(plan)
    returned = {}
    for call in calls:
        for p in call.parts:
            returned[p.segment] = returned.get(p.segment, 0) + bs.part_samples(plan, p)
    assert returned == {0: 40, 1: 3}


# samples: 0 (a cut prompt), 1 (its last token), 2 (every token: prompt logprobs)
SHAPES = st.tuples(st.integers(1, 300), st.integers(0, 200), st.integers(0, 2))


@given(st.lists(SHAPES, min_size=1, max_size=12))
def test_every_token_of_a_plan_is_computed_once_in_order_and_fits_its_call(shapes):
    bs = buckets(16, 64, 128, max_rows=4)
    plan = [chunk(n, context=c, samples=n if s == 2 else s) for n, c, s in shapes]
    calls = bs.calls(plan)
    done, returned = [0] * len(plan), [0] * len(plan)
    for call in calls:
        assert call.real_tokens <= call.bucket.tokens and len(call.parts) <= call.bucket.batch
        for p in call.parts:
            assert p.offset == done[p.segment]  # a piece runs after the one before it
            done[p.segment] += p.tokens
            returned[p.segment] += bs.part_samples(plan, p)
    assert done == [len(s.token_ids) for s in plan]
    assert returned == [s.num_samples for s in plan]  # every logit asked for, once
