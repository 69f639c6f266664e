"""Greedy generation over a ``BucketRuntime``: a block pool and a continuous-batching loop.

nano-vllm in miniature. Each step admits waiting requests while the pool can still cover them,
prefills the new ones (the runtime chunks long prompts), then decodes every running request in
one batch (the runtime splits it over the decode buckets). Blocks are taken per step for the
tokens actually written, never for padding, and go back to the pool as soon as a request ends.

Admission is conservative: a request enters only if the pool can cover its whole final length
on top of what the running requests may still need. Nothing is ever preempted, so each request's
tokens are exactly what it would get running alone.

There is no draft model and no end-of-sequence token: every request generates exactly
``max_new_tokens`` tokens. On an artifact compiled with ``speculation_length > 0`` decode rows
carry ``1 + speculation_length`` positions; this engine sends one real token per row and the
runtime pads the other positions (slot -1: no cache write, no block; causal attention keeps them
out of the real token's output; their sampled entries repeat the real token's logits), so such
artifacts generate the same greedy tokens, just without the speedup of verifying drafts.
"""

from __future__ import annotations

import torch

from neuron_buckets.core.block_pool import BlockPool
from neuron_buckets.core.padding import DecodeRow, PrefillChunk
from neuron_buckets.serve.runtime import BucketRuntime
from neuron_buckets.serve.scheduler import Scheduler


def check_requests(
    runtime: BucketRuntime, pool: BlockPool, prompts: list[list[int]], max_new_tokens: int
) -> None:
    """Refuse, before anything runs, every request that could never complete."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if pool.block_size != runtime.block_size or pool.num_blocks > runtime.num_blocks:
        raise ValueError(
            f"pool of {pool.num_blocks} blocks of {pool.block_size} does not fit the runtime's cache "
            f"({runtime.num_blocks} blocks of {runtime.block_size})"
        )
    vocab = runtime.manifest["model"]["config"]["vocab_size"]
    usable = pool.num_blocks - 1  # block 0 is the null block
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if bad := [t for t in prompt if not 0 <= t < vocab]:
            raise ValueError(f"prompt {i} has token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        total = len(prompt) + max_new_tokens
        if total > runtime.max_model_len:
            raise ValueError(
                f"prompt {i}: {len(prompt)} prompt tokens + max_new_tokens {max_new_tokens} = {total} "
                f"exceeds max_model_len {runtime.max_model_len}"
            )
        if (need := pool.blocks_for(total - 1)) > usable:
            raise ValueError(
                f"prompt {i} needs {need} blocks of {pool.block_size} tokens, the pool has {usable}"
            )


def greedy(logits: torch.Tensor) -> list[int]:
    return logits.argmax(dim=-1).tolist()


def generate(
    runtime: BucketRuntime, prompts: list[list[int]], max_new_tokens: int, pool: BlockPool | None = None
) -> list[list[int]]:
    """Greedy continuations of ``max_new_tokens`` tokens, one list per prompt, in prompt order.

    ``pool`` defaults to one covering the runtime's whole cache; pass a smaller one to bound the
    blocks in use (and to inspect it afterwards: every block is back when this returns).
    """
    pool = pool or BlockPool(runtime.num_blocks, runtime.block_size)
    check_requests(runtime, pool, prompts, max_new_tokens)
    sched = Scheduler(pool, prompts, max_new_tokens)
    while sched.waiting or sched.running:
        if new := sched.admit():
            logits = runtime.prefill([PrefillChunk(s.tokens, 0, s.blocks) for s in new])
            for seq, token in zip(new, greedy(logits), strict=True):
                seq.tokens.append(token)
            sched.retire()
        if sched.running:
            sched.grow_for_decode()
            rows = [DecodeRow(s.tokens[-1:], len(s.tokens) - 1, s.blocks) for s in sched.running]
            logits = runtime.decode(rows)[:, 0]  # position 0 holds each row's one real token
            for seq, token in zip(sched.running, greedy(logits), strict=True):
                seq.tokens.append(token)
            sched.retire()
    by_index = sorted(sched.finished, key=lambda s: s.index)
    return [s.tokens[s.prompt_len :] for s in by_index]
