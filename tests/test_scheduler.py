"""The scheduler: it plans a step within the token budget and commits it as vLLM does."""

from __future__ import annotations

from bench.bench_preemption import Workload, run_workload
from neuron_buckets.core.step_plan import StepPlan
from neuron_buckets.engine.block_pool import BlockPool
from neuron_buckets.engine.kv_cache_manager import WATERMARK, KVCacheManager
from neuron_buckets.engine.request import Request
from neuron_buckets.engine.sampling_params import SamplingParams
from neuron_buckets.engine.scheduler import Scheduler, fit_buckets


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


def decoding_and_arriving(token_buckets: tuple[int, ...], mixed: bool = True) -> Scheduler:
    """Three requests decoding, then a 300-token prompt arriving beside them, on a 512-token budget."""
    sched = Scheduler(KVCacheManager(BlockPool(128, 16)), budget=512, max_rows=8, token_buckets=token_buckets,
                      mixed=mixed)
    for i in range(3):
        sched.add(Request(i, [i + 1] * 20, 20, SamplingParams(max_tokens=50)))
    step(sched)
    sched.add(Request(3, [9] * 300, 300, SamplingParams(max_tokens=50)))
    return sched


def shape(plan: StepPlan) -> list[tuple[int, int, int, int]]:
    return [(s.request_id, len(s.token_ids), s.context_len, s.num_samples) for s in plan]


def test_a_prompt_beside_decode_rows_is_cut_at_the_token_bucket_below_when_that_pads_less():
    """300 prompt tokens + 3 decode rows: 256 now and 47 + the 3 rows next step (a 64-token call)
    compute 320 tokens where one call of 512 pads 209; the prompt samples only at its end."""
    sched = decoding_and_arriving((64, 128, 256, 512))
    first, second = step(sched), step(sched)
    assert shape(first) == [(3, 253, 0, 0), (0, 1, 20, 1), (1, 1, 20, 1), (2, 1, 20, 1)]
    assert shape(second) == [(3, 47, 253, 1), (0, 1, 21, 1), (1, 1, 21, 1), (2, 1, 21, 1)]
    assert sum(len(s.token_ids) for s in first) == 256 and sum(len(s.token_ids) for s in second) == 50
    assert sched.running[3].num_generated == 1


def test_without_token_buckets_or_where_a_cut_saves_nothing_the_step_is_filled():
    plain = decoding_and_arriving(())
    assert shape(plain.schedule())[0] == (3, 300, 0, 1)
    # 3 rows + 380 prompt tokens: 256 + a 128-token rest would cost 384 + ... the rest's 256: no cut
    big = decoding_and_arriving((64, 128, 256, 512))
    big.waiting[0] = Request(3, [9] * 380, 380, SamplingParams(max_tokens=50))
    assert shape(big.schedule())[0] == (3, 380, 0, 1)
    # unmixed: the rows take their own decode call, so only the prompt's tokens are fitted
    unmixed = decoding_and_arriving((64, 128, 256, 512), mixed=False)
    assert shape(unmixed.schedule())[0] == (3, 256, 0, 0)


def test_a_long_prompt_waits_for_the_next_step_when_another_completes_in_this_one():
    """Prompts of 200, 40 and 200 tokens arrive together: the first completes in the step and the
    40-token one (within the smallest bucket) rides beside it, but the second long one would delay
    both first tokens by its 200 tokens, so it runs alone next step; without token buckets the step
    packs all three up to the budget, as before."""
    def arriving(token_buckets: tuple[int, ...], lens: tuple[int, ...] = (200, 40, 200)) -> Scheduler:
        sched = Scheduler(KVCacheManager(BlockPool(128, 16)), budget=512, max_rows=8,
                          token_buckets=token_buckets)
        for i, n in enumerate(lens):
            sched.add(Request(i, [i + 1] * n, n, SamplingParams(max_tokens=50)))
        return sched

    apart = arriving((64, 128, 256, 512))
    first, second = step(apart), step(apart)
    assert shape(first) == [(0, 200, 0, 1), (1, 40, 0, 1)]
    assert shape(second) == [(2, 200, 0, 1), (0, 1, 200, 1), (1, 1, 40, 1)]
    assert shape(step(arriving(()))) == [(0, 200, 0, 1), (1, 40, 0, 1), (2, 200, 0, 1)]
    # a prompt cut last step continues first and completes: the long one behind it waits again
    cut = arriving((64, 128, 256, 512), (600, 200))
    assert [shape(step(cut)) for _ in range(3)] == [
        [(0, 512, 0, 0)], [(0, 88, 512, 1)], [(1, 200, 0, 1), (0, 1, 600, 1)]]


def test_fit_buckets_cuts_only_where_the_bucket_below_and_the_rests_cost_less():
    buckets = (64, 128, 256, 512)
    cases = {(303, 3): 47, (384, 3): 0, (381, 3): 125, (256, 3): 0, (258, 3): 0, (260, 3): 4, (60, 0): 0,
             (100, 0): 0, (150, 0): 22, (600, 0): 0}
    assert {case: fit_buckets(*case, buckets) for case in cases} == cases
    assert fit_buckets(303, 3, ()) == 0


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


def test_the_issue_workload_on_40_blocks_runs_the_full_batch_in_the_steps_of_80():
    """16 requests of 20-token prompts, max_tokens 200, stopped after 5 to 9 tokens, 4 rows: a pool
    of 40 blocks holds 4 of them as they are written, where reserving max_tokens held 2."""
    work = Workload()
    small, large = run_workload(work, 40, WATERMARK), run_workload(work, 80, WATERMARK)
    assert small.peak_running == large.peak_running == work.max_rows
    assert small.steps <= 1.1 * large.steps
    assert small.preemptions == 0


def test_a_short_pool_preempts_the_newest_and_still_finishes_everything():
    """Every fourth request runs to 150 tokens: 20 blocks cannot hold them together, so the newest
    is preempted, recomputed from the front of the queue, and every request still ends at its stop."""
    work = Workload(long_every=4)
    short, ample = run_workload(work, 20, WATERMARK), run_workload(work, 80, WATERMARK)
    assert short.preemptions > 0 and ample.preemptions == 0
    assert short.computed > ample.computed  # what the preempted ones computed again


def two_requests(pool: BlockPool, max_tokens: int) -> tuple[Scheduler, Request, Request]:
    sched = Scheduler(KVCacheManager(pool, watermark=0), budget=64, max_rows=4)
    old, new = (Request(i, [10 + i] * 12, 12, SamplingParams(max_tokens=max_tokens)) for i in range(2))
    sched.add(old)
    sched.add(new)
    return sched, old, new


def step(sched: Scheduler, token: int = 5) -> StepPlan:
    plan = sched.schedule()
    sched.commit(plan, [[token + s.end] if s.num_samples else [] for s in plan])
    return plan


def test_the_newest_request_is_preempted_to_the_front_and_recomputed_over_its_output():
    pool = BlockPool(9, 4, enable_prefix_caching=True)  # 8 blocks of 4: 32 tokens for two of 24
    sched, old, new = two_requests(pool, max_tokens=12)
    steps = 0
    while not sched.kv.num_preemptions:
        step(sched)
        steps += 1
    assert steps == 6  # both prompts in 3 blocks each, 4 tokens each fill the other 2, then a 5th
    assert sched.running == [old] and list(sched.waiting) == [new]  # the newest gave way
    assert sched.kv.num_preemptions == 1 and sched.kv.num_cached(new) == 0 and not sched.kv.blocks(new)
    generated = new.token_ids[new.prompt_len :]
    assert sched.kv.prefill_len(new) == len(new.token_ids) and len(generated) > 1  # its output is kept
    out = new.output()
    assert out.token_ids == generated and not out.finished
    while new not in sched.running:
        step(sched)
    assert new.token_ids[new.prompt_len : new.prompt_len + len(generated)] == generated
    assert pool.hits == 8  # its recompute found two of its full blocks; the old one took the third
    while sched.busy:
        step(sched)
    assert new.output().new_token_ids == new.token_ids[new.prompt_len + len(generated) :]  # no repeat
    assert old.finish_reason == new.finish_reason == "length"
    assert pool.num_free == 8


def test_a_preempted_prefill_samples_nothing_until_its_whole_prefill_is_computed_again():
    pool = BlockPool(32, 4)
    sched = Scheduler(KVCacheManager(pool), budget=10, max_rows=4)
    req = Request(0, list(range(25)), 25, SamplingParams(max_tokens=3))
    sched.add(req)
    first = step(sched)
    assert [(s.context_len, len(s.token_ids), s.num_samples) for s in first] == [(0, 10, 0)]
    sched.preempt(req)
    assert list(sched.waiting) == [req] and pool.num_free == 31
    plans = [step(sched) for _ in range(3)]
    assert [(s.context_len, len(s.token_ids), s.num_samples) for p in plans for s in p] == [
        (0, 10, 0), (10, 10, 0), (20, 5, 1)
    ]
    assert req.num_generated == 1


def test_a_request_the_whole_pool_cannot_hold_ends_with_length():
    """Only a pool smaller than max_model_len allows it: the prompt fits, its output outgrows it."""
    pool = BlockPool(4, 4)  # 12 tokens
    sched = Scheduler(KVCacheManager(pool), budget=16, max_rows=2)
    req = Request(0, [1] * 6, 6, SamplingParams(max_tokens=20))
    sched.add(req)
    ended = []
    while sched.busy:
        plan = sched.schedule()
        ended += [r for r in sched.commit(plan, [[1] if s.num_samples else [] for s in plan]) if r.done]
    assert ended == [req] and req.finish_reason == "length"
    assert len(req.token_ids) == 12 + 1  # its last token was never fed back: 12 written
    assert pool.num_free == 3
