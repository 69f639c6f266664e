"""Fitting a step's requests onto buckets: waves for long prompts, packed prefill calls, decode
calls grouped by context; the scheduler fills the token budget as vLLM does."""

from __future__ import annotations

import pytest

from neuron_buckets.core.bucket import Bucket, NoBucketFits
from neuron_buckets.engine.block_pool import BlockPool
from neuron_buckets.engine.request import Request
from neuron_buckets.engine.scheduler import Scheduler
from neuron_buckets.runtime.packing import ChunkShape, group_decode, pack_prefill, split_long

DECODE = [Bucket("decode", b, 1, c) for c in (64, 256) for b in (1, 4)]


def test_long_prompts_split_into_waves_of_the_largest_bucket():
    waves = split_long([ChunkShape(300), ChunkShape(50)], 128)
    assert [[(i, c.tokens, c.start) for i, c in w] for w in waves] == [
        [(0, 128, 0), (1, 50, 0)],
        [(0, 128, 128)],
        [(0, 44, 256)],
    ]


def test_chunks_pack_end_to_end_into_the_smallest_bucket_that_holds_them():
    eight = [ChunkShape(50)] * 8
    assert pack_prefill(eight, [64, 256, 512], max_rows=8) == [(list(range(8)), 512)]
    assert pack_prefill(eight, [64, 256, 512], max_rows=4) == [([0, 1, 2, 3], 256), ([4, 5, 6, 7], 256)]
    assert pack_prefill([ChunkShape(30), ChunkShape(40)], [32, 64], max_rows=4) == [([0], 32), ([1], 64)]


def test_a_continuing_chunk_opens_a_call_that_fresh_chunks_may_join():
    chunks = [ChunkShape(10), ChunkShape(20, start=64), ChunkShape(5)]
    assert pack_prefill(chunks, [32, 64], max_rows=4) == [([0], 32), ([1, 2], 32)]


def test_a_chunk_beyond_the_largest_bucket_is_refused_by_name():
    with pytest.raises(NoBucketFits, match="129 tokens"):
        pack_prefill([ChunkShape(129)], [64, 128], max_rows=4)


def test_decode_rows_of_similar_context_share_the_smallest_context_bucket():
    calls = group_decode([300 - 250, 200, 10, 30, 20], DECODE)
    assert calls == [([2, 4, 3, 0], DECODE[1]), ([1], DECODE[2])]
    with pytest.raises(NoBucketFits, match="257 tokens"):
        group_decode([257], DECODE)


def test_the_scheduler_fills_the_budget_and_cuts_only_the_last_prompt():
    pool = BlockPool(64, 16)
    sched = Scheduler(pool, budget=64, max_rows=8)
    for i, n in enumerate((50, 30, 40)):
        sched.add(Request(i, [i + 1] * n, n, 4))
    first = sched.schedule_prefill()
    assert [(r.index, n) for r, n in first] == [(0, 50), (1, 14)]
    for r, n in first:
        r.cached += n
    second = sched.schedule_prefill()  # the cut prompt continues first, then the next one
    assert [(r.index, n) for r, n in second] == [(1, 16), (2, 40)]
    assert all(len(r.blocks) * 16 >= r.cached + n for r, n in second)
