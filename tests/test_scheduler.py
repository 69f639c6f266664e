"""The scheduler: it plans a step within the token budget and commits it as vLLM does."""

from __future__ import annotations

from neuron_buckets.engine.block_pool import BlockPool
from neuron_buckets.engine.kv_cache_manager import KVCacheManager
from neuron_buckets.engine.request import Request
from neuron_buckets.engine.sampling_params import SamplingParams
from neuron_buckets.engine.scheduler import Scheduler


def admitted(pool: BlockPool, lens: tuple[int, ...], max_tokens: int = 4) -> Scheduler:
    sched = Scheduler(KVCacheManager(pool), budget=64, max_rows=8)
    for i, n in enumerate(lens):
        sched.add(Request(i, [i + 1] * n, n, SamplingParams(max_tokens=max_tokens)))
    return sched


def test_the_scheduler_fills_the_budget_and_cuts_only_the_last_prompt():
    sched = admitted(BlockPool(64, 16), (50, 30, 40))
    first = sched.schedule()
    assert [(s.request_id, len(s.token_ids), s.context_len, s.num_samples) for s in first] == [
        (0, 50, 0, 1),
        (1, 14, 0, 0),  # cut: it samples nothing
    ]
    assert sched.commit(first, [[7], []]) == [sched.running[0]]
    second = sched.schedule()  # the cut prompt continues first, then the next one, then decode rows
    assert [(s.request_id, len(s.token_ids), s.context_len, s.num_samples) for s in second] == [
        (1, 16, 14, 1),
        (2, 40, 0, 1),
        (0, 1, 50, 1),
    ]
    assert list(second[2].token_ids) == [7]  # the sampled token is fed back
    assert all(len(s.block_ids) * 16 >= s.end for s in second)


def test_commit_appends_retires_the_finished_and_frees_their_blocks():
    pool = BlockPool(64, 16)
    sched = admitted(pool, (5, 9), max_tokens=2)
    plan = sched.schedule()
    sched.commit(plan, [[3], [4]])
    plan = sched.schedule()
    assert [s.context_len for s in plan] == [5, 9]
    done = sched.commit(plan, [[5], [6]])
    assert [(r.token_ids[r.prompt_len :], r.finish_reason) for r in done] == [
        ([3, 5], "length"),
        ([4, 6], "length"),
    ]
    assert not sched.busy and pool.num_free == 63
    assert plan[0].block_ids  # the plan kept its own copy of the blocks that were freed


def test_a_stop_token_ends_a_request_at_commit():
    pool = BlockPool(64, 16)
    sched = Scheduler(KVCacheManager(pool), budget=64, max_rows=8)
    sched.add(Request(0, [1, 2], 2, SamplingParams(max_tokens=9, stop_token_ids=(42,))))
    sched.commit(sched.schedule(), [[42]])
    assert not sched.running and pool.num_free == 63
