"""Continuous batching as plain data: ``schedule`` plans a step, ``commit`` applies its result.

``schedule`` returns a ``StepPlan``: one decode row for every request whose prompt is complete, its
last token fed back, then a token budget filled the way vLLM does: the decode rows' tokens and rows
count first (so they fit the prefill call when ``BucketSet.mix_decode`` lets them ride in it, and
the step stays within ``max_num_seqs`` rows either way), then the request whose prompt was cut last
step continues, then waiting requests are admitted in order (but for one waiting for its prefix,
below) while the budget ``max_num_batched_tokens``, the row bound ``max_num_seqs`` and the KV cache
allow; the last one admitted may be cut, to continue next step. Given the runtime's token
bucket sizes, a step in which a prompt already completes admits no further prompt longer than the
smallest bucket (``pack_limit``): packed beside it, that prompt would delay the first one's first
token by all its own tokens to save itself one step's fixed cost, so prompts complete a step
apart, the first sooner, and a short one still rides along nearly free (``bench/profile_ttft.py``
measures the time to first token with and without it). The step's last chunk may also be cut
shorter, at a bucket boundary, where the padding
that saves outweighs the call its rest then takes next step (``fit_buckets``): a prompt of 300
tokens beside 3 decode rows runs as 256 + 64 tokens over two steps, not one call padded to 512.
The cut request keeps the blocks its admission took for the rest. The caller runs the plan and hands
``commit`` the tokens it sampled; ``commit`` appends them, retires the requests that ended and
frees their blocks. A request whose prompt completes in a step decodes from the next one, because
a plan is decided before anything of it runs. Every segment carries its own context, so the plan
does not depend on how the runtime fits it onto graphs. Requests may be added between steps.

Blocks come from the KV cache manager (``engine/kv_cache_manager.py``), which does all the block
counting; the scheduler only asks it. They are taken as tokens are written: a request is admitted
when its prefill fits beside the manager's watermark, and grows block by block. Each step first
grows every running request for its next token, oldest first; when the pool is short it preempts
the most recently admitted running request (itself, when it is the newest), as vLLM does: its
blocks go back, full ones staying in the prefix cache, and it returns to the front of the waiting
queue with everything it generated. Readmitted, it prefills its prompt and output again (what
the prefix cache still holds is a hit) and its last chunk samples its next token, so its
generator continues where it was and what it reported stays reported. A step that preempted
admits nobody. A request whose tokens the whole pool cannot hold ends with "length" (only a pool
smaller than ``max_model_len`` allows one; a prompt alone that large is refused when added).

With prefix caching a waiting request starts with the longest cached run of its full blocks to
prefill shared (the last token is always computed) and prefills only the rest; ``commit`` names
each request's newly full blocks once their K/V is written. A waiting request whose leading
blocks a running request is still prefilling waits for them instead of computing them again
(requests sharing a system prompt that arrive together): it is passed over, the requests behind it
may enter, and it enters the step after those blocks are written, as a hit. The running request is
always scheduled first, so no request waits longer than it would take to compute those blocks
itself.

The engine drives this with a runtime and a sampler; ``nb inspect`` drives the same code with
lengths alone, to predict the runtime's calls, preemptions included.

Speculation (``drafter`` and ``num_speculative_tokens``): a decode row of a request that
speculates carries its last token and up to ``num_speculative_tokens`` drafted tokens, all
sampled, so the target's logits at every draft position come back in one step. Drafts are
capped so the request never passes its ``max_tokens`` (and so its ``max_model_len``), and to the
blocks the pool has free: a draft never preempts. Its blocks grow to cover the drafts' room before
the drafter runs: a draft model writes its own cache at those positions. The rejected drafts' K/V
are written too, but ``commit`` counts only the valid ones cached (the context, the
last token, the accepted drafts): the next step writes its own tokens over those slots, so a
rejected draft leaves nothing that any later token attends to.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from neuron_buckets.core.step_plan import Segment, StepPlan
from neuron_buckets.engine.drafter import Drafter
from neuron_buckets.engine.kv_cache_manager import KVCacheManager
from neuron_buckets.engine.lora_pool import AdapterPool
from neuron_buckets.engine.request import Request


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        budget: int,
        max_rows: int,
        drafter: Drafter | None = None,
        num_speculative_tokens: int = 0,
        token_buckets: Sequence[int] = (),
        mixed: bool = True,
        adapters: AdapterPool | None = None,
    ) -> None:
        """``budget`` bounds a step's tokens and ``max_rows`` its segments (decode rows and prefill
        chunks: the packed call's block-table rows); a
        ``drafter`` proposes up to ``num_speculative_tokens`` tokens per decode row;
        ``token_buckets`` (the runtime's token bucket sizes) keeps a long prompt out of a step where
        another completes (``pack_limit``) and lets a step's last prompt chunk be cut
        at a bucket boundary (``fit_buckets``), its decode rows counted in the prefill call where
        they ride in it (``mixed``: ``BucketSet.mix_decode``); ``adapters`` gives a request of a
        LoRA adapter its slot as it is admitted (it waits while none is free) and takes it back
        as it leaves the running requests."""
        self.kv, self.budget, self.max_rows = kv, budget, max_rows
        self.token_buckets, self.mixed = tuple(sorted(token_buckets)), mixed
        self.drafter, self.num_speculative_tokens = drafter, num_speculative_tokens
        self.adapters = adapters
        # the longest prompt (tokens left to compute) admitted beside one that completes in the step
        self.pack_limit = self.token_buckets[0] if self.token_buckets else None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is preempted first
        self._ended: list[Request] = []  # ended while planning (the pool cannot hold them), for commit

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        self.kv.add(req)
        self.waiting.append(req)

    def abort(self, req: Request) -> None:
        """End ``req`` now, wherever it is, and return its blocks to the pool at once."""
        for queue in (self.waiting, self.running):
            if req in queue:
                queue.remove(req)
                self.kv.release(req)
                self._release_slot(req)
        req.finish_reason = "abort"

    def preempt(self, req: Request) -> None:
        """Take a running request's blocks back and queue it first, to prefill its prompt and
        output again when it is readmitted; one the whole pool could not hold again ends instead,
        with "length" (reported by the next ``commit``)."""
        self.running.remove(req)
        self._release_slot(req)
        if self.kv.fits_alone(len(req.token_ids)):
            self.kv.preempt(req)
            self.waiting.appendleft(req)
        else:
            self.kv.release(req)
            req.finish_reason = "length"
            self._ended.append(req)

    def schedule(self) -> StepPlan:
        """This step's plan: prefill chunks (the continuing prompt first), then decode rows."""
        preempted = self._make_room()
        decoding = [r for r in self.running if self.kv.prefilled(r)]
        rows = [(req, req.token_ids[-1:] + d) for req, d in zip(decoding, self.drafts(decoding), strict=True)]
        # decode rows' tokens and rows come first: room for them to ride in the prefill call
        decode_tokens = sum(len(tokens) for _, tokens in rows)
        chunks = self._prefill_chunks(self.budget - decode_tokens, self.max_rows - len(rows), not preempted)
        if chunks:
            riding = decode_tokens if self.mixed else 0
            cut = fit_buckets(riding + sum(n for _, n in chunks), riding, self.token_buckets)
            if 0 < cut < chunks[-1][1]:  # the rest of the last chunk continues next step, first
                chunks[-1] = (chunks[-1][0], chunks[-1][1] - cut)
        # Only a chunk that ends its prefill samples; one of a request that asked for its
        # prompt's logprobs returns the logits of every token it computes.
        prefill = tuple(self._chunk(req, n) for req, n in chunks)
        decode = tuple(
            Segment(r.request_id, tokens, len(r.token_ids) - 1, self.kv.blocks(r), len(tokens), r.lora_slot)
            for r, tokens in rows
        )
        return prefill + decode

    def _chunk(self, req: Request, n: int) -> Segment:
        """The prefill chunk of ``req``'s next ``n`` tokens."""
        start = self.kv.num_cached(req)
        samples = n if req.wants_prompt_logits else int(start + n == self.kv.prefill_len(req))
        return Segment(req.request_id, req.token_ids[start : start + n], start, self.kv.blocks(req), samples,
                       req.lora_slot)

    def drafts(self, decoding: Sequence[Request]) -> list[list[int]]:
        """The tokens drafted for each request's next row: none unless it speculates, and never so
        many that the row's tokens plus the one after them pass its ``max_tokens``, nor more than
        the pool's free blocks hold."""
        rooms = [
            min(self.num_speculative_tokens, r.params.max_tokens - r.num_generated - 1) if r.speculates else 0
            for r in decoding
        ]
        drafted: list[list[int]] = [[] for _ in decoding]
        if self.drafter is None:
            return drafted
        for i in (i for i, room in enumerate(rooms) if room > 0):
            # the row writes its last token and its drafts: blocks for all of them first
            n = len(decoding[i].token_ids)
            rooms[i] = self.kv.grow_up_to(decoding[i], n + rooms[i]) - n
        asking = [i for i, room in enumerate(rooms) if room > 0]
        if not asking:
            return drafted
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
        next step to overwrite. The requests that ended give their blocks back. Returns the
        requests that ended while the plan was made, then the plan's requests that got tokens or
        ended, in plan order."""
        running = {r.request_id: r for r in self.running}
        touched, self._ended = self._ended, []
        for seg, tokens in zip(plan, sampled, strict=True):
            if (req := running.get(seg.request_id)) is None:  # aborted since it was planned
                continue
            # a decode row's rejected drafts are not cached; a prefill chunk is, whatever it returned
            chunk = seg.context_len < self.kv.prefill_len(req)
            rejected = 0 if chunk else max(0, seg.num_samples - len(tokens))
            for token in tokens:
                req.append(token)
                if req.done:
                    break
            self.kv.commit(req, seg.end - rejected)
            if tokens:
                touched.append(req)
        for req in [r for r in self.running if r.done]:
            self.kv.release(req)
            self._release_slot(req)
            self.running.remove(req)
        return touched

    def _packs_too_long(self, step: list[tuple[Request, int]], tokens: int) -> bool:
        """Whether a prompt of ``tokens`` still to compute would wait for the next step: one of
        ``step``'s chunks completes its prompt and it is longer than ``pack_limit``."""
        return self.pack_limit is not None and tokens > self.pack_limit and any(
            self.kv.num_cached(r) + n >= self.kv.prefill_len(r) for r, n in step)

    def _release_slot(self, req: Request) -> None:
        if self.adapters is not None:
            self.adapters.release(req)

    def _make_room(self) -> bool:
        """Grow every running request, oldest first, for the next token it writes (a decode row's
        fed token, a continuing prompt's next one), preempting ``victim``s while the pool is
        short; whether any was preempted."""
        preempted = False
        for req in list(self.running):
            while req in self.running and not self.kv.grow(req, (need := self.kv.num_cached(req) + 1)):
                preempted = True
                # the victim gives way; one that could not grow even alone ends (``preempt``)
                self.preempt(req if not self.kv.fits_alone(need) else self.victim())
        return preempted

    def victim(self) -> Request:
        """The running request preempted first: the most recently admitted, as vLLM does
        (``bench/bench_preemption.py`` measures others)."""
        return self.running[-1]

    def _prefill_chunks(self, budget: int, max_rows: int, admit: bool) -> list[tuple[Request, int]]:
        """(request, tokens to prefill) pairs within ``budget`` tokens and ``max_rows`` chunks,
        admitting waiting requests if ``admit`` and the continuing prompt got all it asked."""
        step: list[tuple[Request, int]] = []
        for req in self.running:
            if not self.kv.prefilled(req) and budget > 0 and max_rows > 0:  # at most one is ever cut
                cached = self.kv.num_cached(req)
                want = cached + min(self.kv.prefill_len(req) - cached, budget)
                got = self.kv.grow_up_to(req, want)  # at least one token: ``_make_room`` grew it
                admit = admit and got == want
                step.append((req, got - cached))
                budget -= step[-1][1]
        passed = 0  # waiting requests passed over this step: their prefix is being computed
        while admit and passed < len(self.waiting) and budget > 0 and len(step) < max_rows:
            req = self.waiting[passed]
            prefix = self.kv.lookup(req)
            if self._packs_too_long(step, self.kv.prefill_len(req) - len(prefix) * self.kv.pool.block_size):
                break
            if self.kv.in_flight(req, self.running) > len(prefix) or not (
                self.adapters is None or self.adapters.acquire(req)  # every LoRA slot in use
            ):
                passed += 1
                continue
            if not self.kv.admit(req, prefix, alone=not self.running):
                self._release_slot(req)
                break
            del self.waiting[passed]
            self.running.append(req)
            cached = self.kv.num_cached(req)
            step.append((req, min(self.kv.prefill_len(req) - cached, budget)))
            self.kv.grow(req, cached + step[-1][1])  # ``admit`` found room for its whole prefill
            budget -= step[-1][1]
        if not step and not self.running and self.waiting and not self._ended:  # a caller's pool in use
            raise RuntimeError(self.kv.shortfall(self.waiting[0]))
        return step


def fit_buckets(tokens: int, decode_tokens: int, buckets: Sequence[int]) -> int:
    """How many of a prefill call's ``tokens`` (``decode_tokens`` of them decode rows riding in
    it) to leave to the next step so that this one fills a token bucket (0: none). A call costs
    about its bucket's tokens, real or padding: a step of 303 tokens on buckets (256, 512) pads 209,
    while 256 now and the other 47 beside the same decode rows in a 64-token call next step
    compute 320, and the prompt cut gets its first token after those 320 rather than 512. So the
    step is cut to the bucket below when that bucket plus the one the rest then takes (with the
    decode rows, which run again next step) is smaller than the bucket the whole step takes:
    never when it would cost as much (a step's fixed cost then tips it), never a step that
    already fills its bucket or fits the smallest, and never one whose prompt tokens alone fit
    the bucket below (the runtime then runs the rows in their own decode call instead)."""
    above = next((b for b in buckets if b >= tokens), None)
    below = max((b for b in buckets if b < tokens), default=0)
    if above is None or above == tokens or not below or tokens - decode_tokens <= below:
        return 0
    rest = tokens - below
    after = next((b for b in buckets if b >= rest + decode_tokens), None)
    return rest if after is not None and below + after < above else 0
