"""Continuous batching as plain data: ``schedule`` plans a step, ``commit`` applies its result.

``schedule`` returns a ``StepPlan``: one decode row for every request whose prompt is complete, its
last token fed back, then a token budget filled the way vLLM does: the decode rows' tokens and rows
count first (so they fit the prefill call when ``BucketSet.mix_decode`` lets them ride in it, and
the step stays within ``max_num_seqs`` rows either way), then the request whose prompt was cut last
step continues, then waiting requests are admitted in order (but for one waiting for its prefix,
below) while the budget ``max_num_batched_tokens``, the row bound ``max_num_seqs`` and the block
pool allow; the last one admitted may be cut, to continue next step. Blocks for every token the
plan writes are allocated before it is returned. The caller runs the plan and hands ``commit`` the
tokens it sampled; ``commit`` appends them, retires the requests that ended and frees their blocks.
A request whose prompt completes in a step decodes from the next one, because a plan is decided
before anything of it runs. Every segment carries its own context, so the plan does not depend on
how the runtime fits it onto graphs.

Admission is conservative: a request enters only if the pool can cover its whole final length on
top of what the running requests may still need, so nothing is ever preempted and each
request's tokens are exactly what it would get running alone. A request that ends (its stop
rule, its length, an abort) gives its blocks and its reservation back at once, so waiting
requests enter the next step. Requests may be added between steps.

With prefix caching a waiting request starts with the longest cached run of its prompt's full
blocks shared (``BlockPool.cached_prefix``; the last prompt token is always computed) and
prefills only the rest. Shared blocks count once: a request's reservation is what it still
lacks, ``blocks_for(final_cached) - len(blocks)``, and admitting it costs its unshared blocks
plus the cached blocks nobody held, since sharing those takes them out of ``num_free``. Blocks
cached but unreferenced count as free, so eviction is only ever of blocks no running request or
reservation needs. ``commit`` names each request's newly full blocks once their K/V is written.
A waiting request whose leading blocks a running request is still prefilling waits for them
instead of computing them again (requests sharing a system prompt that arrive together): it is
passed over, the requests behind it may enter, and it enters the step after those blocks are
written, as a hit. The running request is always scheduled first, so no request waits longer than
it would take to compute those blocks itself.

The engine drives this with a runtime and a sampler; ``nb inspect`` drives the same code with
lengths alone, to predict the runtime's calls.

Speculation (``drafter`` and ``num_speculative_tokens``): a decode row of a request that
speculates carries its last token and up to ``num_speculative_tokens`` drafted tokens, all
sampled, so the target's logits at every draft position come back in one step. Drafts are
capped so the request never passes its ``max_tokens`` (and so its ``max_model_len`` and block
reservation). Its blocks grow to cover
the drafts' room before the drafter runs: a draft model writes its own cache at those positions.
The rejected drafts' K/V are written too, but ``commit`` advances ``cached`` only over the valid
ones (the context, the last token, the accepted drafts): the next step writes its own tokens over
those slots, so a rejected draft leaves nothing that any later token attends to.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from neuron_buckets.core.step_plan import Segment, StepPlan
from neuron_buckets.engine.block_pool import BlockPool
from neuron_buckets.engine.drafter import Drafter
from neuron_buckets.engine.request import Request


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        budget: int,
        max_rows: int,
        drafter: Drafter | None = None,
        num_speculative_tokens: int = 0,
    ) -> None:
        """``budget`` bounds a step's tokens and ``max_rows`` its segments (decode rows and prefill
        chunks: the packed call's block-table rows); a
        ``drafter`` proposes up to ``num_speculative_tokens`` tokens per decode row."""
        self.pool, self.budget, self.max_rows = pool, budget, max_rows
        self.drafter, self.num_speculative_tokens = drafter, num_speculative_tokens
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

    def schedule(self) -> StepPlan:
        """This step's plan: prefill chunks (the continuing prompt first), then decode rows."""
        decoding = [r for r in self.running if r.prefilled]
        rows = [(req, req.token_ids[-1:] + d) for req, d in zip(decoding, self.drafts(decoding), strict=True)]
        # decode rows' tokens and rows come first: room for them to ride in the prefill call
        chunks = self._prefill_chunks(
            self.budget - sum(len(tokens) for _, tokens in rows), self.max_rows - len(rows)
        )
        for req, n in chunks:
            self.pool.grow(req.blocks, req.cached + n)
        for req, tokens in rows:
            self.pool.grow(req.blocks, len(req.token_ids) - 1 + len(tokens))
        prefill = tuple(
            Segment(
                req.request_id,
                req.token_ids[req.cached : req.cached + n],
                req.cached,
                tuple(req.blocks),
                int(req.cached + n == req.prompt_len),  # only a chunk that ends its prompt samples
            )
            for req, n in chunks
        )
        decode = tuple(
            Segment(r.request_id, tokens, len(r.token_ids) - 1, tuple(r.blocks), len(tokens))
            for r, tokens in rows
        )
        return prefill + decode

    def drafts(self, decoding: Sequence[Request]) -> list[list[int]]:
        """The tokens drafted for each request's next row: none unless it speculates, and never so
        many that the row's tokens plus the one after them pass its ``max_tokens``."""
        rooms = [
            min(self.num_speculative_tokens, r.params.max_tokens - r.num_generated - 1) if r.speculates else 0
            for r in decoding
        ]
        asking = [i for i, room in enumerate(rooms) if room > 0]
        drafted: list[list[int]] = [[] for _ in decoding]
        if self.drafter is None or not asking:
            return drafted
        for i in asking:
            self.pool.grow(decoding[i].blocks, len(decoding[i].token_ids) - 1 + rooms[i])
        found = self.drafter.draft([decoding[i] for i in asking], [rooms[i] for i in asking])
        for i, tokens in zip(asking, found, strict=True):
            drafted[i] = tokens
        return drafted

    def commit(self, plan: StepPlan, sampled: Sequence[Sequence[int]]) -> list[Request]:
        """Apply a plan that ran: ``sampled[i]`` (empty where segment i returned no logits) is
        appended to its request, each token through the request's stop rule, so a request may end
        mid-draft. A segment's tokens count as cached up to the last one that ``sampled[i]``
        confirms: a decode row of ``1 + d`` tokens of which ``a`` drafts were accepted returns
        ``a + 1`` tokens and caches ``1 + a``; the slots of its rejected drafts are free for the
        next step to overwrite. The requests that ended give their blocks back. Returns the plan's
        requests that got tokens or ended, in plan order."""
        running = {r.request_id: r for r in self.running}
        touched = []
        for seg, tokens in zip(plan, sampled, strict=True):
            if (req := running.get(seg.request_id)) is None:  # aborted since it was planned
                continue
            req.cached = seg.end - max(0, seg.num_samples - len(tokens))
            for token in tokens:
                req.append(token)
                if req.done:
                    break
            # the accepted drafts are appended now; a request that ended mid-draft has fewer
            valid = min(req.cached, len(req.token_ids))
            self.pool.publish(req.blocks, req.token_ids, valid, req.block_hashes)
            if tokens:
                touched.append(req)
        for req in [r for r in self.running if r.done]:
            self.pool.free(req.blocks)
            self.running.remove(req)
        return touched

    def _in_flight(self, req: Request) -> int:
        """How many of ``req``'s leading prompt blocks (those a lookup may find) a running request
        that is still prefilling will write: a lookup after it has written them hits that many
        (none without prefix caching, which names no block)."""
        mine = self._prompt_blocks(req)[: (req.prompt_len - 1) // self.pool.block_size]
        longest = 0
        for other in self.running:
            if other.prefilled:
                continue
            shared = 0
            for a, b in zip(mine, self._prompt_blocks(other), strict=False):
                if a != b:
                    break
                shared += 1
            longest = max(longest, shared)
        return longest

    def _prompt_blocks(self, req: Request) -> list[bytes]:
        """The names of ``req``'s full prompt blocks, hashed once per request (empty without prefix
        caching, which names no block)."""
        if not self.pool.enable_prefix_caching:
            return []
        if req.prompt_hashes is None:
            prompt = req.token_ids[: req.prompt_len]
            req.prompt_hashes = self.pool.chain(prompt, req.prompt_len // self.pool.block_size)
        return req.prompt_hashes

    def _prefill_chunks(self, budget: int, max_rows: int) -> list[tuple[Request, int]]:
        """(request, tokens to prefill) pairs within ``budget`` tokens and ``max_rows`` chunks,
        admitting waiting requests."""
        step: list[tuple[Request, int]] = []
        for req in self.running:
            if not req.prefilled and budget > 0 and max_rows > 0:  # at most one is ever cut
                step.append((req, min(req.prompt_len - req.cached, budget)))
                budget -= step[-1][1]
        reserved = sum(self.pool.blocks_for(r.final_cached) - len(r.blocks) for r in self.running)
        free = self.pool.num_free - reserved
        passed = 0  # waiting requests passed over this step: their prefix is being computed
        while passed < len(self.waiting) and budget > 0 and len(step) < max_rows:
            req = self.waiting[passed]
            prompt = req.token_ids[: req.prompt_len]
            prefix = self.pool.cached_prefix(prompt, count=False, hashes=self._prompt_blocks(req))
            if self._in_flight(req) > len(prefix):
                passed += 1
                continue
            # its own blocks, plus the cached ones nobody holds: sharing those takes them off num_free
            need = self.pool.blocks_for(req.final_cached) - len(prefix)
            need += sum(self.pool.refcount(b) == 0 for b in prefix)
            if need > free:
                break
            del self.waiting[passed]
            self.pool.count(req.prompt_len, len(prefix))
            req.blocks = self.pool.share(prefix)
            req.cached = len(prefix) * self.pool.block_size
            free -= need
            self.running.append(req)
            step.append((req, min(req.prompt_len - req.cached, budget)))
            budget -= step[-1][1]
        if not step and not self.running and self.waiting:  # a caller's pool already in use
            head = self.waiting[0]
            raise RuntimeError(
                f"request {head.request_id} needs {self.pool.blocks_for(head.final_cached)} blocks, "
                f"only {self.pool.num_free} of the pool are free"
            )
        return step
