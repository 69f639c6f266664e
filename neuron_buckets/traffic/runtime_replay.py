"""What the runtime will do with a trace: its scheduler and packing replayed on lengths alone.

The replay drives the engine's own scheduler (``engine/scheduler.py``) and the runtime's own
packing (``runtime/packing.py``) with dummy tokens, so its per-bucket calls, real and padded tokens
are the runtime's counters for the same requests submitted together (``generate`` with every
prompt at once, each running to its output length, as with ``ignore_eos``; arrival times are not
replayed here). Unlike the per-request figures beside it, this is the padding of packed steps:
several prompts share one token bucket.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from neuron_buckets.core.bucket import Bucket
from neuron_buckets.engine.block_pool import BlockPool
from neuron_buckets.engine.request import Request
from neuron_buckets.engine.scheduler import Chunks, Scheduler
from neuron_buckets.runtime.packing import ChunkShape, group_decode, pack_prefill


@dataclass
class Counter:
    calls: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0

    def add(self, real: int, padded: int) -> None:
        self.calls += 1
        self.real_tokens += real
        self.padded_tokens += padded


def replay_runtime(
    prompt_lens: Sequence[int],
    output_lens: Sequence[int],
    buckets: Sequence[Bucket],
    num_blocks: int,
    block_size: int,
) -> dict[str, Counter]:
    """Per-bucket counters, keyed by ``Bucket.name``, of generating every request at once."""
    prefill_buckets = sorted(b for b in buckets if b.kind == "prefill")
    decode_buckets = sorted(b for b in buckets if b.kind == "decode")
    token_buckets = [b.seq for b in prefill_buckets]
    by_seq = {b.seq: b for b in prefill_buckets}
    max_rows = max(b.batch for b in prefill_buckets)
    counters = {b.name: Counter() for b in buckets}
    sched = Scheduler(BlockPool(num_blocks, block_size), token_buckets[-1], max_rows)
    for i, (p, o) in enumerate(zip(prompt_lens, output_lens, strict=True)):
        sched.add(Request(i, [0] * p, p, o))

    def prefill(step: Chunks) -> list[int]:
        shapes = [ChunkShape(n, r.cached) for r, n in step]
        for call, seq in pack_prefill(shapes, token_buckets, max_rows):
            counters[by_seq[seq].name].add(sum(shapes[i].tokens for i in call), seq)
        return [0] * len(step)

    def decode(batch: list[Request]) -> list[int]:
        for rows, bucket in group_decode([len(r.tokens) for r in batch], decode_buckets):
            counters[bucket.name].add(len(rows), bucket.tokens)
        return [0] * len(batch)

    while sched.busy:
        sched.step(prefill, decode)
    return counters


def fit_requests(
    prompt_lens: Sequence[int], output_lens: Sequence[int], max_model_len: int, limit: int
) -> tuple[list[int], list[int]]:
    """The first ``limit`` requests, clipped the way a server must: a prompt to max_model_len - 1
    tokens, its output to at least 1 and what then fits."""
    prompts = [min(int(p), max_model_len - 1) for p in prompt_lens[:limit]]
    pairs = zip(prompts, output_lens[:limit], strict=False)
    outputs = [max(1, min(int(o), max_model_len - p)) for p, o in pairs]
    return prompts, outputs


def packed_report(counters: dict[str, Counter], requests: int) -> dict:
    """The ``packed`` section of ``nb inspect --json``: the runtime's counters per bucket."""
    per_bucket = [{"bucket": name, **vars(c)} for name, c in counters.items() if c.calls]
    real = sum(c.real_tokens for c in counters.values())
    padded = sum(c.padded_tokens for c in counters.values())
    return {
        "requests": requests,
        "per_bucket": per_bucket,
        "real_tokens": real,
        "padded_tokens": padded,
        "padding_ratio": (padded - real) / max(real, 1),
    }
