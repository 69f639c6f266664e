"""Preemption by recompute end to end: a request whose blocks are taken back mid-prefill, mid-decode,
twice, while others share its prefix, or while it drafts, generates exactly the tokens it
generates undisturbed, and its stream carries each of them once, in order.

Every cache starts NaN, and after every step every slot the engine does not count as valid is
set to NaN again: a running request's slots from its ``cached`` on (a draft model's from
``min(draft_cached, cached)``), and every block no request holds and the prefix cache does not
name. A recompute that read a slot it had not written (or a freed block's stale K/V) would turn
logits to NaN and change the tokens.
"""

from __future__ import annotations

import asyncio

import openai
import pytest
import torch

from neuron_buckets.engine.block_pool import BlockPool
from neuron_buckets.engine.llm_engine import LLMEngine, generate, prefix_salt
from neuron_buckets.engine.sampling_params import SamplingParams
from neuron_buckets.runtime.bucket_runtime import BucketRuntime
from neuron_buckets.traffic.runtime_replay import replay_runtime
from tests.steps_compared import assert_same_tokens
from tests.test_draft_model_speculation import graph_cache, self_draft  # noqa: F401  (fixtures)
from tests.test_engine import make_prompts
from tests.test_llm_engine import artifact  # noqa: F401  (a fixture)
from tests.test_serve import MODEL, metric_samples, serving, total
from tests.test_speculative_decoding import SPEC, runtime  # noqa: F401  (a fixture)

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def caches(engine: LLMEngine) -> list[tuple[torch.Tensor, bool]]:
    """The engine's K and V caches, each with whether it is the draft model's."""
    pairs = [(engine.runtime.k_cache, False), (engine.runtime.v_cache, False)]
    if (draft := getattr(engine.drafter, "runtime", None)) is not None:
        pairs += [(draft.k_cache, True), (draft.v_cache, True)]
    return pairs


def poison(engine: LLMEngine) -> None:
    """NaN in every slot the engine does not count as valid (the module docstring)."""
    pool, bs, kv = engine.pool, engine.runtime.block_size, engine.kv_cache
    held = {b for r in engine.scheduler.running for b in kv.blocks(r)}
    stale = [b for b in range(1, pool.num_blocks) if b not in held and b not in pool._hash_of]
    for cache, draft in caches(engine):
        cache[:, stale] = float("nan")
        for req in engine.scheduler.running:
            valid = kv.draft_context(req) if draft else kv.num_cached(req)
            slots = torch.arange(valid, len(kv.blocks(req)) * bs)
            cache[:, torch.tensor(kv.blocks(req), dtype=torch.int64)[slots // bs], slots % bs] = float("nan")


def run(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, preempt: dict[int, list[int]]
) -> tuple[list[list[int]], list[list[int]]]:
    """Each request's final tokens and what its stream carried, over a poisoned cache; after step
    ``s`` the requests ``preempt[s]`` (indices into ``prompts``, each running then) are preempted."""
    for cache, _ in caches(engine):
        cache.fill_(float("nan"))
    ids = [engine.add_request(p, params) for p in prompts]
    streamed: dict[int, list[int]] = {i: [] for i in ids}
    final: dict[int, list[int]] = {}
    steps = 0
    while engine.has_unfinished:
        for out in engine.step():
            streamed[out.request_id] += out.new_token_ids
            if out.finished:
                final[out.request_id] = out.token_ids
        steps += 1
        for i in preempt.get(steps, []):
            (req,) = [r for r in engine.scheduler.running if r.request_id == ids[i]]
            engine.scheduler.preempt(req)
        poison(engine)
    assert engine.kv_cache.num_preemptions >= sum(map(len, preempt.values()))
    return [final[i] for i in ids], [streamed[i] for i in ids]


def poisoned_engine(target: BucketRuntime, num_blocks: int | None = None, **kw) -> LLMEngine:
    pool = BlockPool(num_blocks or target.num_blocks, target.block_size, True, prefix_salt(target.manifest))
    return LLMEngine(target, pool=pool, **kw)


LONG, SHORT = make_prompts((45, 20), seed=5)  # 45 tokens: two chunks of the 32-token budget
SHARED = make_prompts((16,), seed=6)[0]  # two full blocks of 8
# name -> (prompts, {step: requests preempted after it})
CASES = {
    "mid-prefill": ([LONG], {1: [0]}),  # 32 of its 45 prompt tokens computed
    "mid-decode": ([SHORT], {4: [0]}),
    "twice": ([SHORT, LONG], {3: [0], 7: [0]}),
    "newest-of-two": ([SHORT, LONG], {5: [1]}),
    # the first computed the prefix the second shares: it gives way while the second holds it
    "shared-prefix": ([SHARED + SHORT[:5], SHARED + SHORT[5:9]], {3: [0]}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_preempted_request_generates_what_it_does_undisturbed(artifact, case):  # noqa: F811
    prompts, preempt = CASES[case]
    target = BucketRuntime.open(artifact)
    plain = [o.token_ids for o in generate(LLMEngine(target), prompts, GREEDY)]
    tokens, streamed = run(poisoned_engine(target), prompts, GREEDY, preempt)
    assert_same_tokens(tokens, streamed, plain, total=len(prompts) * GREEDY.max_tokens)


def test_a_short_pool_preempts_by_itself_and_changes_no_token(artifact):  # noqa: F811
    """Three prompts of 20 tokens and 24 more each, in 9 blocks of 8: they cannot all grow."""
    target = BucketRuntime.open(artifact)
    prompts = make_prompts((20, 20, 20), seed=7)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = [o.token_ids for o in generate(LLMEngine(target), prompts, params)]
    engine = poisoned_engine(target, 10)
    tokens, streamed = run(engine, prompts, params, {})
    assert_same_tokens(tokens, streamed, plain, total=3 * 24)
    assert engine.kv_cache.num_preemptions > 0 and engine.pool.hits > 0  # recomputes found their blocks


def test_streaming_clients_of_preempted_requests_get_every_token_once_in_order(artifact):  # noqa: F811
    """The short pool above behind the server: three streams at once, each carrying its request's
    tokens once, in order, through the preemptions ``/metrics`` counts."""
    target = BucketRuntime.open(artifact)
    prompts = make_prompts((20, 20, 20), seed=7)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = [o.token_ids for o in generate(LLMEngine(target), prompts, params)]

    async def stream(c: openai.AsyncOpenAI, prompt: list[int]) -> list[int]:
        tokens = []
        chunks = await c.completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        async for chunk in chunks:
            tokens += chunk.choices[0].token_ids
        return tokens

    async def all_at_once(base: str) -> list[list[int]]:
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0) as c:
            return await asyncio.gather(*(stream(c, p) for p in prompts))

    engine = poisoned_engine(target, 10)
    with serving(engine) as base:
        streamed = asyncio.run(all_at_once(base))
        samples = metric_samples(base)
    assert_same_tokens(streamed, plain, total=3 * 24)
    assert total(samples, "vllm:num_preemptions_total") == engine.kv_cache.num_preemptions > 0


def test_a_seeded_sampled_request_continues_its_generator_across_a_preemption(artifact):  # noqa: F811
    target = BucketRuntime.open(artifact)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    plain = [o.token_ids for o in generate(LLMEngine(target), [SHORT], params)]
    tokens, streamed = run(poisoned_engine(target), [SHORT], params, {4: [0]})
    assert_same_tokens(tokens, streamed, plain, total=12)


def test_replay_counts_what_the_runtime_counts_on_a_trace_that_preempts(artifact):  # noqa: F811
    """``nb inspect``'s replay of the same lengths over the same 10-block pool: the same calls,
    tokens, padding and preemptions."""
    target = BucketRuntime.open(artifact)
    prompts = make_prompts((20, 13, 30, 9, 25), seed=8)
    outputs = [24, 30, 5, 28, 16]
    engine = poisoned_engine(target, 10)
    generate(engine, prompts, [SamplingParams(max_tokens=o, ignore_eos=True) for o in outputs])
    buckets = [*target.buckets.prefill, *target.buckets.decode]
    replay = replay_runtime([len(p) for p in prompts], outputs, buckets, 10, target.block_size,
                            enable_prefix_caching=True)
    measured = {name: s for name, s in engine.stats.items() if s.calls}
    assert replay.kv.num_preemptions == engine.kv_cache.num_preemptions > 0
    assert {name: s for name, s in replay.stats.items() if s.calls} == measured


def test_drafted_rows_of_a_preempted_request_change_no_token(runtime):  # noqa: F811
    prompts = [[5, 6, 7, 8, 9] * 4, SHORT]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    plain = [o.token_ids for o in generate(LLMEngine(runtime), prompts, params)]
    engine = poisoned_engine(runtime, speculative=SPEC)
    tokens, streamed = run(engine, prompts, params, {3: [0], 6: [1], 9: [0]})
    assert_same_tokens(tokens, streamed, plain, total=2 * 30)
    assert engine.spec_stats.num_accepted_tokens > 0


def test_a_draft_models_cache_follows_a_preempted_request(self_draft):  # noqa: F811
    """The draft's cache is poisoned as the target's. The target drafting for itself accepts every
    draft only if, after each preemption, the draft read nothing it had not computed. Each request
    is preempted when its first row of three accepted drafts filled its third block: the target
    wrote all of it, the draft all but its last slot (a last draft is never fed to the draft)."""
    draft_target, spec, _ = self_draft
    prompts = [SHARED + SHORT[:4], SHORT]  # 20 tokens each; 12 of the second's in step 1
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    plain = [o.token_ids for o in generate(LLMEngine(draft_target), prompts, params)]
    engine = poisoned_engine(draft_target, speculative=spec)
    tokens, streamed = run(engine, prompts, params, {2: [0], 3: [1]})
    assert_same_tokens(tokens, streamed, plain, total=2 * 30)
    stats = engine.spec_stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
