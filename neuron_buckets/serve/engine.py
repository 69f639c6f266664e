"""Greedy generation over a ``BucketRuntime``: a block pool and a continuous-batching loop.

nano-vllm in miniature, over the bookkeeping of ``core/scheduler.py``: each step prefills one
packed call (a continuing prompt first, then newly admitted ones, up to the token budget), then
decodes every request whose prompt is complete in one batch (the runtime splits it over the
decode buckets). Blocks are taken per step for the tokens actually written, never for padding,
and go back to the pool as soon as a request ends.

There is no draft model and no end-of-sequence token: every request generates exactly its
``max_new_tokens`` tokens. On an artifact compiled with ``speculation_length > 0`` decode rows
carry ``1 + speculation_length`` positions; this engine sends one real token per row and the
runtime pads the other positions (slot -1: no cache write, no block; causal attention keeps them
out of the real token's output; their sampled entries repeat the real token's logits), so such
artifacts generate the same greedy tokens, just without the speedup of verifying drafts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from neuron_buckets.core.block_pool import BlockPool
from neuron_buckets.core.padding import DecodeRow, PrefillChunk
from neuron_buckets.core.request import Request
from neuron_buckets.core.scheduler import Scheduler, run_to_completion
from neuron_buckets.serve.request_check import check_token_ids
from neuron_buckets.serve.runtime import BucketRuntime


def check_requests(
    runtime: BucketRuntime, pool: BlockPool, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int]
) -> None:
    """Refuse, before anything runs, every request that could never complete."""
    if pool.block_size != runtime.block_size or pool.num_blocks > runtime.num_blocks:
        raise ValueError(
            f"pool of {pool.num_blocks} blocks of {pool.block_size} does not fit the runtime's cache "
            f"({runtime.num_blocks} blocks of {runtime.block_size})"
        )
    vocab = runtime.limits.vocab_size
    usable = pool.num_blocks - 1  # block 0 is the null block
    for i, (prompt, new) in enumerate(zip(prompts, max_new_tokens, strict=True)):
        if new < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {new}")
        if not prompt:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        check_token_ids(prompt, vocab, f"prompt {i}")
        total = len(prompt) + new
        if total > runtime.max_model_len:
            raise ValueError(
                f"prompt {i}: {len(prompt)} prompt tokens + max_new_tokens {new} = {total} "
                f"exceeds max_model_len {runtime.max_model_len}"
            )
        if (need := pool.blocks_for(total - 1)) > usable:
            raise ValueError(
                f"prompt {i} needs {need} blocks of {pool.block_size} tokens, the pool has {usable}"
            )


def greedy(logits: torch.Tensor) -> list[int]:
    return logits.argmax(dim=-1).tolist()


def generate(
    runtime: BucketRuntime,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int],
    pool: BlockPool | None = None,
) -> list[list[int]]:
    """Greedy continuations, one list per prompt, in prompt order; ``max_new_tokens`` is one
    count for all or one per prompt.

    ``pool`` defaults to one covering the runtime's whole cache; pass a smaller one to bound the
    blocks in use (and to inspect it afterwards: every block is back when this returns).
    """
    pool = pool or BlockPool(runtime.num_blocks, runtime.block_size)
    news = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    check_requests(runtime, pool, prompts, news)
    budget = max(b.seq for b in runtime.prefill_buckets)
    sched = Scheduler(pool, prompts, news, budget, runtime.max_rows)

    def prefill(step: list[tuple[Request, int]]) -> list[int]:
        chunks = [PrefillChunk(r.tokens[r.cached : r.cached + n], r.cached, r.blocks) for r, n in step]
        return greedy(runtime.prefill(chunks))

    def decode(batch: list[Request]) -> list[int]:
        rows = [DecodeRow(r.tokens[-1:], len(r.tokens) - 1, r.blocks) for r in batch]
        return greedy(runtime.decode(rows)[:, 0])  # position 0 holds each row's one real token

    return [r.tokens[r.prompt_len :] for r in run_to_completion(sched, prefill, decode)]
