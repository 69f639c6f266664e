"""Continuous batching as bookkeeping: who runs each step, and which blocks they hold.

Each step first fills a prefill budget the way vLLM does: the request whose prompt was cut last
step continues first, then waiting requests are admitted in order while the budget
(``max_num_batched_tokens``, the largest prefill bucket), the row bound (``max_num_seqs``) and
the block pool allow; the last one admitted may be cut, to continue next step. So a step's
prefill is exactly one packed call. Then every request whose prompt is complete decodes one
token. Prefill and decode run as separate calls: the decode graphs attend over context buckets
sized to the rows' real contexts, which a mixed step on the prefill graph would not.

Admission is conservative: a request enters only if the pool can cover its whole final length on
top of what the running requests may still need, so nothing is ever preempted and each
request's tokens are exactly what it would get running alone. The engine drives this with a
runtime; ``nb inspect`` drives the same code with lengths alone, to predict the runtime's calls.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from neuron_buckets.core.block_pool import BlockPool
from neuron_buckets.core.request import Request


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: Sequence[int],
        budget: int,
        max_rows: int,
    ) -> None:
        self.pool, self.budget, self.max_rows = pool, budget, max_rows
        pairs = enumerate(zip(prompts, max_new_tokens, strict=True))
        self.waiting = deque(Request(i, list(p), len(p), n) for i, (p, n) in pairs)
        self.running: list[Request] = []
        self.finished: list[Request] = []

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule_prefill(self) -> list[tuple[Request, int]]:
        """This step's prefill: (request, tokens to write) pairs, continuing prompt first."""
        budget = self.budget
        step: list[tuple[Request, int]] = []
        for req in self.running:
            if not req.prefilled:  # at most one: only the last request of a step is ever cut
                step.append((req, min(req.prompt_len - req.cached, budget)))
                budget -= step[-1][1]
        reserved = sum(self.pool.blocks_for(r.final_cached) - len(r.blocks) for r in self.running)
        free = self.pool.num_free - reserved
        while self.waiting and budget > 0 and len(step) < self.max_rows:
            need = self.pool.blocks_for(self.waiting[0].final_cached)
            if need > free:
                break
            req = self.waiting.popleft()
            free -= need
            self.running.append(req)
            step.append((req, min(req.prompt_len, budget)))
            budget -= step[-1][1]
        if not step and not self.running and self.waiting:  # a caller's pool already in use
            head = self.waiting[0]
            raise RuntimeError(
                f"prompt {head.index} needs {self.pool.blocks_for(head.final_cached)} blocks, only "
                f"{self.pool.num_free} of the pool are free"
            )
        for req, n in step:
            self.pool.grow(req.blocks, req.cached + n)
        return step

    def decode_batch(self) -> list[Request]:
        """Requests with a complete prompt and tokens still to generate, their newest token's
        block allocated (the coming decode step writes it)."""
        batch = [r for r in self.running if r.prefilled and not r.done]
        for req in batch:
            self.pool.grow(req.blocks, len(req.tokens))
        return batch

    def retire(self) -> None:
        """Return the blocks of every request that has all its tokens."""
        for req in [r for r in self.running if r.done]:
            self.pool.free(req.blocks)
            self.running.remove(req)
            self.finished.append(req)


def run_to_completion(
    sched: Scheduler,
    prefill: Callable[[list[tuple[Request, int]]], list[int]],
    decode: Callable[[list[Request]], list[int]],
) -> list[Request]:
    """Drive ``sched`` until every request has its tokens; finished requests in prompt order.

    ``prefill`` runs one step's chunks and returns a next token per chunk (used where the chunk
    completes its prompt); ``decode`` runs one token per request and returns the next ones.
    """
    while sched.busy:
        if step := sched.schedule_prefill():
            for (req, n), token in zip(step, prefill(step), strict=True):
                req.cached += n
                if req.prefilled:
                    req.tokens.append(token)
            sched.retire()
        if batch := sched.decode_batch():
            for req, token in zip(batch, decode(batch), strict=True):
                req.cached = len(req.tokens)
                req.tokens.append(token)
            sched.retire()
    return sorted(sched.finished, key=lambda r: r.index)
