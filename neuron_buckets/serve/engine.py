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

from collections import deque
from dataclasses import dataclass, field

import torch

from neuron_buckets.core.block_pool import BlockPool
from neuron_buckets.core.padding import DecodeRow, PrefillChunk
from neuron_buckets.serve.request_check import check_token_ids
from neuron_buckets.serve.runtime import BucketRuntime


@dataclass
class Sequence:
    """One request: its tokens so far (prompt then generated) and the blocks holding their K/V."""

    index: int
    tokens: list[int]
    prompt_len: int
    max_new_tokens: int
    blocks: list[int] = field(default_factory=list)

    @property
    def final_cached(self) -> int:
        """Tokens whose K/V is written by the end: the last generated token is never fed back."""
        return self.prompt_len + self.max_new_tokens - 1

    @property
    def done(self) -> bool:
        return len(self.tokens) - self.prompt_len >= self.max_new_tokens


class Scheduler:
    """Decides who runs each step and keeps the pool's books."""

    def __init__(self, pool: BlockPool, prompts: list[list[int]], max_new_tokens: int) -> None:
        self.pool = pool
        self.waiting = deque(Sequence(i, list(p), len(p), max_new_tokens) for i, p in enumerate(prompts))
        self.running: list[Sequence] = []
        self.finished: list[Sequence] = []

    def admit(self) -> list[Sequence]:
        """Waiting requests (in order) whose final length still fits beside the running ones'."""
        reserved = sum(self.pool.blocks_for(s.final_cached) - len(s.blocks) for s in self.running)
        budget = self.pool.num_free - reserved
        admitted = []
        while self.waiting and self.pool.blocks_for(self.waiting[0].final_cached) <= budget:
            seq = self.waiting.popleft()
            budget -= self.pool.blocks_for(seq.final_cached)
            self.pool.grow(seq.blocks, seq.prompt_len)
            admitted.append(seq)
        if not admitted and not self.running and self.waiting:  # a caller's pool already in use
            head = self.waiting[0]
            raise RuntimeError(
                f"prompt {head.index} needs {self.pool.blocks_for(head.final_cached)} blocks, only "
                f"{self.pool.num_free} of the pool are free"
            )
        self.running.extend(admitted)
        return admitted

    def grow_for_decode(self) -> None:
        """Cover each running request's newest token, which the coming decode step writes."""
        for seq in self.running:
            self.pool.grow(seq.blocks, len(seq.tokens))

    def retire(self) -> None:
        """Return the blocks of every request that has all its tokens."""
        for seq in [s for s in self.running if s.done]:
            self.pool.free(seq.blocks)
            self.running.remove(seq)
            self.finished.append(seq)


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
    vocab = runtime.limits.vocab_size
    usable = pool.num_blocks - 1  # block 0 is the null block
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        check_token_ids(prompt, vocab, f"prompt {i}")
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
