"""What the runtime will do with a trace: its scheduler and bucket set replayed on lengths alone.

The replay drives the engine's own scheduler (``engine/scheduler.py``: ``schedule``, then
``commit``) with dummy tokens, and lays each plan onto the buckets with the runtime's own
``BucketSet``, so its per-bucket calls, real and padded tokens are the runtime's counters for the
same requests run to their output lengths (as with ``ignore_eos``), reaching the engine as
``ReplayLoad`` says: all at once, a closed loop at a fixed concurrency, or at their arrivals on a
modelled clock. Unlike the per-request figures beside it, this is the padding of packed steps:
several prompts, continuing chunks and (mixed steps) decode rows share one token bucket.

The replay runs the block pool at the configured size with prefix caching as configured, so
preemptions (a pool too small for the batch) and the prefix hits of their recompute come out as
the runtime's. Given the prompts' tokens (a trace with prefix information,
``traffic/trace_prompts.py``) hits, evictions and the prefill they save across requests do too;
without tokens every prompt is its own and only a request's recompute finds its blocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from neuron_buckets.core.bucket import Bucket
from neuron_buckets.engine.block_pool import BlockPool
from neuron_buckets.engine.kv_cache_manager import KVCacheManager
from neuron_buckets.engine.request import Request
from neuron_buckets.engine.sampling_params import SamplingParams
from neuron_buckets.engine.scheduler import Scheduler
from neuron_buckets.runtime.bucket_set import BucketSet, Call
from neuron_buckets.runtime.bucket_stats import BucketStats, padding_share
from neuron_buckets.traffic.replay_load import ALL_AT_ONCE, ReplayLoad


@dataclass(frozen=True)
class Replay:
    """What the replay ran: the runtime's counters per ``Bucket.name``, every graph call in order,
    the prefill-chunk tokens of each packed call, the steps, the replayed clock at the end
    (``ReplayLoad``'s step-time model), and the KV cache manager (its pool's prefix-cache
    counters, the requests it preempted: the runtime's ``vllm:num_preemptions``)."""

    stats: dict[str, BucketStats]
    calls: tuple[Call, ...]
    chunk_tokens: tuple[int, ...]
    steps: int
    seconds: float
    kv: KVCacheManager

    @property
    def pool(self) -> BlockPool:
        return self.kv.pool

    def packed_tokens(self) -> np.ndarray:
        """Prefill-chunk tokens of every call of a token bucket, riding decode rows left out:
        what ``nb plan`` pads. Rows ride only where the call's bucket has room for them
        (``BucketSet``), so they never change which bucket a call takes."""
        return np.array(self.chunk_tokens, dtype=np.int64)


def replay_runtime(
    prompt_lens: Sequence[int],
    output_lens: Sequence[int],
    buckets: Sequence[Bucket],
    num_blocks: int,
    block_size: int,
    prompts: Sequence[Sequence[int]] | None = None,
    enable_prefix_caching: bool = False,
    load: ReplayLoad = ALL_AT_ONCE,
    fit_buckets: bool = True,
) -> Replay:
    """Generate every request through the scheduler and the bucket set, the requests reaching the
    waiting queue between steps as ``load`` says; ``fit_buckets`` gives the scheduler the token
    buckets as the engine does, so steps are cut at them and keep long prompts apart (off, steps
    are filled to the budget whatever the buckets: ``nb plan``'s replay, so that its schedule is the
    same for every bucket list it scores)."""
    bucket_set = BucketSet.of(buckets, prefill_only=all(b.kind == "prefill" for b in buckets))  # embed's
    stats = {b.name: BucketStats() for b in buckets}
    pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
    kv = KVCacheManager(pool)
    sizes = [b.seq for b in bucket_set.prefill] if fit_buckets else []
    sched = Scheduler(kv, bucket_set.token_budget, bucket_set.max_rows, token_buckets=sizes)
    requests = []
    for i, (p, o) in enumerate(zip(prompt_lens, output_lens, strict=True)):
        tokens = [-1 - i] * p if prompts is None else list(prompts[i][:p])  # no two alike
        requests.append(Request(i, tokens, p, SamplingParams(max_tokens=o, ignore_eos=True)))
    pending = deque(load.order(len(requests)))
    calls: list[Call] = []
    chunk_tokens: list[int] = []
    steps, clock = 0, 0.0
    while pending or sched.busy:
        while pending and load.admits(len(sched.waiting) + len(sched.running), pending[0], clock):
            sched.add(requests[pending.popleft()])
        if not sched.busy:  # only an arrival replay runs dry: on to the next arrival
            clock = max(clock, load.arrivals[pending[0]])
            continue
        plan = sched.schedule()
        for call in bucket_set.calls(plan):
            stats[call.bucket.name].add(call.real_tokens, call.bucket.tokens)
            calls.append(call)
            if call.bucket.kind == "prefill":
                chunks = (p for p in call.parts if not bucket_set.is_decode(plan[p.segment]))
                chunk_tokens.append(sum(p.tokens for p in chunks))
        clock += load.step_seconds(plan)
        steps += 1
        sched.commit(plan, [[0] * min(s.num_samples, 1) for s in plan])
    return Replay(stats, tuple(calls), tuple(chunk_tokens), steps, clock, kv)


def fit_requests(
    prompt_lens: Sequence[int], output_lens: Sequence[int], max_model_len: int, limit: int
) -> tuple[list[int], list[int]]:
    """The first ``limit`` requests, clipped the way a server must: a prompt to max_model_len - 1
    tokens, its output to at least 1 and what then fits."""
    prompts = [min(int(p), max_model_len - 1) for p in prompt_lens[:limit]]
    pairs = zip(prompts, output_lens[:limit], strict=False)
    outputs = [max(1, min(int(o), max_model_len - p)) for p, o in pairs]
    return prompts, outputs


def prefix_report(pool: BlockPool) -> dict:
    """The ``prefix_cache`` part of ``packed``: prompt tokens looked up and found cached (the
    prefill they save), and cached blocks evicted."""
    return {
        "queries": pool.queries,
        "hits": pool.hits,
        "hit_rate": pool.hits / max(pool.queries, 1),
        "evictions": pool.evictions,
        "prefill_tokens_saved": pool.hits,
    }


def packed_report(replay: Replay, requests: int, load: ReplayLoad) -> dict:
    """The ``packed`` section of ``nb inspect --json``: how the requests were replayed, and the
    runtime's counters per bucket."""
    counters = replay.stats
    per_bucket = [{"bucket": name, **c.to_json()} for name, c in counters.items() if c.calls]
    real = sum(c.real_tokens for c in counters.values())
    padded = sum(c.padded_tokens for c in counters.values())
    return {
        "requests": requests,
        "load": load.to_json(),
        "steps": replay.steps,
        "preemptions": replay.kv.num_preemptions,
        "replayed_seconds": replay.seconds,
        "per_bucket": per_bucket,
        "real_tokens": real,
        "computed_tokens": padded,
        "padding_share": padding_share(real, padded),
        "padded_tokens": padded,
        "padding_ratio": (padded - real) / max(real, 1),
    }
