"""The prefix-caching block pool as a state machine (hypothesis): random requests over a small
alphabet, so that prefixes collide, are admitted with their cached prefix shared, write their own
blocks, publish them, and end in any order while the pool evicts what it needs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from neuron_buckets.core.block_table import NULL_BLOCK_ID
from neuron_buckets.engine.block_pool import BlockPool, OutOfBlocks
from neuron_buckets.engine.kv_cache_manager import KVCacheManager
from neuron_buckets.engine.request import Request
from neuron_buckets.engine.sampling_params import SamplingParams
from neuron_buckets.engine.scheduler import Scheduler
from neuron_buckets.runtime.step_check import StepLimits, check_step

BLOCK = 4


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(num_blocks=7, block_size=BLOCK, enable_prefix_caching=True, salt=b"m")
        # id -> (tokens, blocks, how many leading blocks are read-only: shared or published)
        self.live: dict[int, tuple[list[int], list[int], int]] = {}
        self.next_id = 0
        self.content: dict[int, tuple[int, ...] | None] = {}  # the prefix whose K/V a block ends

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=14), extra=st.integers(0, 4))
    def admit(self, tokens: list[int], extra: int) -> None:
        prefix = self.pool.cached_prefix(tokens)
        assert len(prefix) * BLOCK < len(tokens)  # the last token is always computed
        need = self.pool.blocks_for(len(tokens) + extra) - len(prefix)
        evictable_shared = sum(self.pool.refcount(b) == 0 for b in prefix)
        if need > self.pool.num_free - evictable_shared:
            return  # the scheduler's admission check: it would not admit this request now
        for i, b in enumerate(prefix):  # a shared block holds exactly this prompt's K/V
            assert self.content[b] == tuple(tokens[: (i + 1) * BLOCK])
        blocks = self.pool.share(prefix)
        self.pool.grow(blocks, len(tokens) + extra)
        written = blocks[len(prefix) :]
        self.content.update(dict.fromkeys(written))
        assert all(self.pool.refcount(b) == 1 for b in written)  # a block it writes is its own
        self.live[self.next_id] = (tokens, blocks, len(prefix))
        self.next_id += 1

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def compute(self, data: st.DataObject) -> None:
        """The request's step wrote its tokens' K/V: its full blocks may now be shared."""
        key = data.draw(st.sampled_from(sorted(self.live)))
        tokens, blocks, frozen = self.live[key]
        for i in range(frozen, len(tokens) // BLOCK):
            self.content[blocks[i]] = tuple(tokens[: (i + 1) * BLOCK])
        self.pool.publish(blocks, tokens)
        self.live[key] = (tokens, blocks, max(frozen, len(tokens) // BLOCK))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def end(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.live)))
        _, blocks, _ = self.live.pop(key)
        self.pool.free(blocks)
        assert blocks == []

    @invariant()
    def no_block_is_written_by_two_requests(self) -> None:
        writes = [b for _, blocks, frozen in self.live.values() for b in blocks[frozen:]]
        assert len(writes) == len(set(writes))
        reads = {b for _, blocks, frozen in self.live.values() for b in blocks[:frozen]}
        assert not reads & set(writes)  # nobody writes a block another live request reads

    @invariant()
    def counts_add_up(self) -> None:
        held = [b for _, blocks, _ in self.live.values() for b in blocks]
        assert NULL_BLOCK_ID not in held
        for b in set(held):
            assert self.pool.refcount(b) == held.count(b) > 0
        assert self.pool.num_free + len(set(held)) == self.pool.num_blocks - 1

    def teardown(self) -> None:
        for _, blocks, _ in self.live.values():
            self.pool.free(blocks)
        # every block is empty or cached and evictable: nothing leaked
        assert self.pool.num_free == self.pool.num_blocks - 1
        assert all(self.pool.refcount(b) == 0 for b in range(self.pool.num_blocks))


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_a_shared_prefix_is_found_once_published_and_counted_once():
    pool = BlockPool(16, BLOCK, enable_prefix_caching=True)
    first = pool.grow([], 10)
    prompt = list(range(10))
    assert pool.cached_prefix(prompt) == []  # nothing is shared before it is written
    pool.publish(first, prompt)
    assert pool.cached_prefix(prompt) == first[:2]  # two full blocks; the partial one is private
    assert pool.cached_prefix(list(range(8))) == first[:1]  # the last token is always computed
    assert pool.cached_prefix([0, 1, 2, 9, 4, 5, 6, 7, 8]) == []  # a block differs: no match
    assert (pool.queries, pool.hits) == (10 + 10 + 8 + 9, 8 + 4)


def test_a_freed_cached_block_waits_and_is_evicted_only_when_needed():
    pool = BlockPool(4, BLOCK, enable_prefix_caching=True)  # 3 usable blocks
    blocks = pool.grow([], 12)
    pool.publish(blocks, list(range(12)))
    pool.free(list(blocks))
    assert pool.num_free == 3 and pool.num_cached == 3
    again = pool.share(pool.cached_prefix(list(range(13))))
    assert len(again) == 3
    pool.free(again)
    other = pool.grow([], 4)  # the tail block goes first; the prefix's head stays cached
    assert other == [blocks[2]] and pool.num_cached == 2
    assert pool.cached_prefix(list(range(9))) == blocks[:2]


def test_off_hands_out_and_returns_blocks_exactly_as_a_plain_pool():
    pool = BlockPool(8, BLOCK)
    blocks = pool.grow([], 9)
    pool.publish(blocks, list(range(9)))
    assert pool.cached_prefix(list(range(9))) == [] and pool.num_cached == 0
    pool.free(blocks)
    assert list(pool._free) == [4, 5, 6, 7, 1, 2, 3]  # freed blocks go to the back, in order
    with pytest.raises(OutOfBlocks):
        pool.grow([], 8 * BLOCK)


@settings(max_examples=150, deadline=None)
@given(
    requests=st.lists(
        st.tuples(st.lists(st.integers(0, 1), min_size=1, max_size=18), st.integers(1, 5)),
        min_size=1, max_size=8,
    ),
    num_blocks=st.integers(7, 14),
    publish_early=st.booleans(),
)
def test_the_scheduler_with_prefix_caching_plans_valid_steps_and_never_runs_short(
    requests: list[tuple[list[int], int]], num_blocks: int, publish_early: bool
) -> None:
    """Random prompts over two tokens, so prefixes collide, through the scheduler: admission
    counts shared and evictable blocks right (``grow`` never runs short, a short pool preempts),
    every plan passes the runtime's step check (reads shared, writes private), a segment computes
    only what is not cached, and every block is free or cached once all requests end."""
    pool = BlockPool(num_blocks, BLOCK, enable_prefix_caching=True, salt=b"s")
    sched = Scheduler(KVCacheManager(pool), budget=8, max_rows=2)
    limits = StepLimits(BLOCK, num_blocks, 64, 2)
    reqs = [
        Request(i, list(p), len(p), SamplingParams(max_tokens=o, ignore_eos=True))
        for i, (p, o) in enumerate(requests)
    ]
    for r in reqs if publish_early else reqs[:1]:
        sched.add(r)
    pending = [] if publish_early else reqs[1:]
    computed, discarded = 0, []  # tokens computed; cached tokens each preemption gave up
    preempt = sched.preempt
    sched.preempt = lambda r: discarded.append(sched.kv.num_cached(r)) or preempt(r)  # type: ignore[method-assign]
    for _ in range(500):
        if not sched.busy:
            if not pending:
                break
            sched.add(pending.pop(0))  # one after another: each finds the last one's blocks
        plan = sched.schedule()
        check_step(plan, limits)
        computed += sum(len(s.token_ids) for s in plan)
        sched.commit(plan, [[1] if s.num_samples else [] for s in plan])
    assert not sched.busy and all(r.finish_reason == "length" for r in reqs)
    # every position is computed once per admission, but for the hits
    assert computed == sum(r.prompt_len + r.params.max_tokens - 1 for r in reqs) + sum(discarded) - pool.hits
    assert pool.num_free == num_blocks - 1
    assert all(pool.refcount(b) == 0 for b in range(num_blocks))


@pytest.mark.parametrize("enable", [True, False], ids=["on", "off"])
def test_a_request_whose_prefix_is_being_computed_waits_for_it(enable: bool) -> None:
    """A and B share three blocks and arrive together, C (another prompt) behind them; a 9-token
    budget cuts A's prompt over two steps. With caching on, B waits while A computes the shared
    blocks, C passes it, and B enters once they are written, computing only its own last token;
    off, B computes its whole prompt beside A."""
    pool = BlockPool(32, BLOCK, enable_prefix_caching=enable)
    sched = Scheduler(KVCacheManager(pool), budget=9, max_rows=4)
    shared = list(range(3 * BLOCK))
    prompts = [shared + [50, 51], shared + [60], [70, 71]]
    for i, p in enumerate(prompts):
        sched.add(Request(i, list(p), len(p), SamplingParams(max_tokens=3, ignore_eos=True)))
    plans = []
    while sched.busy:
        plan = sched.schedule()
        plans.append([(s.request_id, s.context_len, len(s.token_ids)) for s in plan])
        sched.commit(plan, [[1] if s.num_samples else [] for s in plan])
    if enable:  # then: A's last 5 tokens and C; B's token over the 12 A wrote, beside A's and C's rows
        assert plans[:3] == [[(0, 0, 9)], [(0, 9, 5), (2, 0, 2)], [(1, 12, 1), (0, 14, 1), (2, 2, 1)]]
        assert pool.hits == len(shared)
    else:  # B's first chunk rides beside A's second, over nothing cached
        assert plans[:2] == [[(0, 0, 9)], [(0, 9, 5), (1, 0, 4)]]
        b_chunks = [n for plan in plans for rid, ctx, n in plan if rid == 1 and ctx < len(prompts[1])]
        assert sum(b_chunks) == len(prompts[1])
        assert pool.hits == 0


class SchedulerMachine(RuleBasedStateMachine):
    """The scheduler over a small prefix-caching pool, with preemption: requests over two tokens
    (so prefixes collide) are added, stepped with random sampled tokens, preempted by force or by
    a short pool, and aborted, in any order. A model of the cache follows every slot: what each
    segment reads must hold the K/V of exactly its own tokens, however it was preempted."""

    TOKEN_BUCKETS: tuple[int, ...] = ()  # steps filled to the budget

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(num_blocks=6, block_size=BLOCK, enable_prefix_caching=True, salt=b"q")
        self.sched = Scheduler(KVCacheManager(self.pool, watermark=0.2), budget=8, max_rows=3,
                               token_buckets=self.TOKEN_BUCKETS)
        self.limits = StepLimits(BLOCK, 6, 64, 2)
        self.requests: dict[int, Request] = {}
        self.streamed: dict[int, list[int]] = {}  # what a streaming client of each got, in order
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}  # (block, offset) -> tokens its K/V is of

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=12), max_tokens=st.integers(1, 12))
    def add(self, tokens: list[int], max_tokens: int) -> None:
        rid = len(self.requests)
        self.requests[rid] = Request(rid, tokens, len(tokens), SamplingParams(max_tokens=max_tokens))
        self.streamed[rid] = []
        self.sched.add(self.requests[rid])

    @precondition(lambda self: self.sched.busy)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        ended = len(self.sched._ended)
        plan = self.sched.schedule()
        if not plan:  # only when the requests it had ended while it was planned
            assert self.sched._ended[ended:] and not self.sched.running
        else:
            check_step(plan, self.limits)
        running = {r.request_id: r for r in self.sched.running}
        for seg in plan:
            req = running[seg.request_id]
            for p in range(seg.end):  # what it reads, then what it writes
                slot = (seg.block_ids[p // BLOCK], p % BLOCK)
                if p < seg.context_len:
                    assert self.slots[slot] == tuple(req.token_ids[: p + 1])
                else:
                    assert self.pool.refcount(slot[0]) == 1  # never a shared block
                    assert slot[0] not in self.pool._hash_of  # nor one named for others to share
                    self.slots[slot] = tuple(req.token_ids[: p + 1])
        sampled = [data.draw(st.lists(st.integers(0, 1), min_size=1, max_size=1)) if s.num_samples else []
                   for s in plan]
        for req in self.sched.commit(plan, sampled):
            self.streamed[req.request_id] += req.output().new_token_ids

    @precondition(lambda self: self.sched.running)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        self.sched.preempt(data.draw(st.sampled_from(self.sched.running)))

    @precondition(lambda self: self.sched.busy)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from([*self.sched.waiting, *self.sched.running]))
        self.sched.abort(req)
        self.streamed[req.request_id] += req.output().new_token_ids

    @invariant()
    def every_request_is_in_one_place_once(self) -> None:
        waiting, running = list(self.sched.waiting), self.sched.running
        finished = [r for r in self.requests.values() if r.done]
        places = [r.request_id for r in [*waiting, *running, *finished]]
        assert sorted(places) == sorted(self.requests)  # none lost, none twice
        kv = self.sched.kv
        assert all(not kv.blocks(r) and kv.num_cached(r) == 0 for r in waiting)
        assert sorted(kv.req_to_kv) == sorted(r.request_id for r in [*waiting, *running])  # no record left

    @invariant()
    def no_block_leaks_and_the_null_block_is_never_handed_out(self) -> None:
        held = [b for r in self.sched.running for b in self.sched.kv.blocks(r)]
        assert NULL_BLOCK_ID not in held
        for b in set(held):
            assert self.pool.refcount(b) == held.count(b)
        assert self.pool.num_free + len(set(held)) == self.pool.num_blocks - 1

    @invariant()
    def streaming_clients_got_every_token_once_in_order(self) -> None:
        for rid, req in self.requests.items():
            sent = self.streamed[rid]
            assert sent == req.token_ids[req.prompt_len : req.prompt_len + len(sent)]

    def teardown(self) -> None:
        for _ in range(500):
            if not self.sched.busy:
                break
            self.step_all_ones()
        assert not self.sched.busy
        for rid, req in self.requests.items():
            assert self.streamed[rid] == req.token_ids[req.prompt_len :]
        assert self.pool.num_free == self.pool.num_blocks - 1
        assert all(self.pool.refcount(b) == 0 for b in range(self.pool.num_blocks))

    def step_all_ones(self) -> None:
        plan = self.sched.schedule()
        for req in self.sched.commit(plan, [[1] if s.num_samples else [] for s in plan]):
            self.streamed[req.request_id] += req.output().new_token_ids


class FittedSchedulerMachine(SchedulerMachine):
    """The same, with steps cut at token buckets: a cut prompt holds blocks for tokens it writes
    next step, and may be preempted or aborted holding them."""

    TOKEN_BUCKETS = (2, 4, 8)


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestFittedSchedulerMachine = FittedSchedulerMachine.TestCase
TestFittedSchedulerMachine.settings = TestSchedulerMachine.settings
