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
request's tokens are exactly what it would get running alone. A request that ends early (a stop
token, a stop string, an abort) gives its blocks and its reservation back at once, so waiting
requests enter the next step. Requests may be added between steps. The engine drives this with
a runtime and a sampler; ``nb inspect`` drives the same code with lengths alone, to predict the
runtime's calls.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from neuron_buckets.engine.block_pool import BlockPool
from neuron_buckets.engine.request import Request

Chunks = list[tuple[Request, int]]


def never_stop(_: Request) -> str | None:
    return None


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        budget: int,
        max_rows: int,
        stop: Callable[[Request], str | None] = never_stop,
    ) -> None:
        """``stop`` sees a request right after each token it gets and returns a finish reason to
        end it early (None: go on); a request that reaches ``max_new_tokens`` ends as "length"."""
        self.pool, self.budget, self.max_rows, self.stop = pool, budget, max_rows, stop
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def abort(self, req: Request) -> None:
        """End ``req`` now, wherever it is, and return its blocks to the pool at once."""
        if req in self.waiting:
            self.waiting.remove(req)
        elif req in self.running:
            self.running.remove(req)
            self.pool.free(req.blocks)
        req.finish_reason = "abort"

    def schedule_prefill(self) -> Chunks:
        """This step's prefill: (request, tokens to write) pairs, continuing prompt first."""
        budget = self.budget
        step: Chunks = []
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
                f"request {head.index} needs {self.pool.blocks_for(head.final_cached)} blocks, only "
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

    def step(
        self,
        prefill: Callable[[Chunks], list[int]],
        decode: Callable[[list[Request]], list[int]],
    ) -> list[Request]:
        """One step: at most one packed prefill call, then one decode batch.

        ``prefill`` runs the step's chunks and returns a next token per chunk (used only where
        the chunk completes its prompt); ``decode`` runs one token per request and returns the
        next ones. Returns every request that got a token this step, once each, in order; those
        that ended have already given their blocks back.
        """
        touched: dict[int, Request] = {}
        if chunks := self.schedule_prefill():
            for (req, n), token in zip(chunks, prefill(chunks), strict=True):
                req.cached += n
                if req.prefilled:
                    self._append(req, token)
                    touched[req.index] = req
            self._retire()
        if batch := self.decode_batch():
            for req, token in zip(batch, decode(batch), strict=True):
                req.cached = len(req.tokens)
                self._append(req, token)
                touched[req.index] = req
            self._retire()
        return list(touched.values())

    def _append(self, req: Request, token: int) -> None:
        req.tokens.append(token)
        req.finish_reason = self.stop(req) or ("length" if req.num_generated >= req.max_new_tokens else None)

    def _retire(self) -> None:
        """Return the blocks of every request that has ended."""
        for req in [r for r in self.running if r.done]:
            self.pool.free(req.blocks)
            self.running.remove(req)
