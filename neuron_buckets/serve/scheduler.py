"""Admission and block bookkeeping for continuous batching: who runs each step, and which blocks
they hold. Conservative admission: a request enters only if the pool can cover its final length."""

from __future__ import annotations

from collections import deque

from neuron_buckets.core.block_pool import BlockPool
from neuron_buckets.serve.request import Request


class Scheduler:
    """Decides who runs each step and keeps the pool's books."""

    def __init__(self, pool: BlockPool, prompts: list[list[int]], max_new_tokens: int) -> None:
        self.pool = pool
        self.waiting = deque(Request(i, list(p), len(p), max_new_tokens) for i, p in enumerate(prompts))
        self.running: list[Request] = []
        self.finished: list[Request] = []

    def admit(self) -> list[Request]:
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
