"""The KV cache manager: every block question the scheduler asks, answered over one ``BlockPool``.

vLLM's ``KVCacheManager`` and nano-vllm's ``BlockManager`` in one small interface: ``lookup`` a
request's cached prefix (and ``in_flight``, what a prefilling request is still writing of it),
``admit`` it, ``grow`` it for a step's tokens, ``commit`` the blocks it wrote, ``release`` it when
it ends, ``preempt`` it when the pool runs short. The scheduler decides who runs; only this
class counts blocks.

Blocks are taken on demand, as tokens are written: a request is admitted when the blocks its
prefill still lacks (its prompt, or after a preemption its prompt and output, minus the cached
prefix) fit beside a watermark of free blocks, and grows a block at a time. The watermark keeps
a newly admitted request from being preempted at its first decode steps, when the running ones
grow too; with nothing running it is waived, so every prompt that fits the pool is admitted.

The manager owns every request's KV state, in one record per request id (vLLM's
``req_to_blocks``): its blocks, the tokens the cache holds of it (and a draft model's cache),
its blocks' names, and the output a preemption makes it prefill again. ``Request`` holds none of
it; the scheduler, the engine and the drafter ask the manager (``blocks``, ``num_cached``,
``prefill_len``, ...), and only the manager writes it: a record starts at ``add`` and ends at
``release``.

A preempted request gives its blocks back. Full ones keep their names (``commit`` published them
as they were written), so its recompute finds them in the prefix cache unless they were evicted
meanwhile. With a draft model (``follows_draft``) a block is named only once the draft has
written its slots too: a later hit then skips both models' computation of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from neuron_buckets.engine.block_pool import BlockPool
from neuron_buckets.engine.request import Request

WATERMARK = 0.01  # vLLM's default share of the pool an admission leaves free


@dataclass
class RequestKV:
    """What the manager keeps of one request's KV cache."""

    blocks: list[int] = field(default_factory=list)
    cached: int = 0  # tokens whose K/V the cache holds
    draft_cached: int = 0  # tokens a draft model computed into its own cache (may pass the valid ones)
    block_hashes: list[bytes] = field(default_factory=list)  # names of its published full blocks
    prefill_hashes: list[bytes] = field(default_factory=list)  # names of the full blocks it prefills
    recomputed: int = 0  # generated tokens it prefills again, after a preemption took its blocks


class KVCacheManager:
    def __init__(self, pool: BlockPool, watermark: float = WATERMARK, follows_draft: bool = False) -> None:
        if not 0 <= watermark < 1:
            raise ValueError(f"the watermark is a share of the pool, 0 <= watermark < 1, got {watermark}")
        self.pool = pool
        self.watermark_blocks = int(watermark * (pool.num_blocks - 1))
        self.follows_draft = follows_draft
        self.num_preemptions = 0
        self.peak_usage = 0.0  # the most ``usage`` reached after a grow
        self.req_to_kv: dict[int, RequestKV] = {}  # by request id, from ``add`` to ``release``

    def add(self, req: Request) -> None:
        """Start ``req``'s record: no blocks, nothing cached."""
        self.req_to_kv[req.request_id] = RequestKV()

    def blocks(self, req: Request) -> tuple[int, ...]:
        """The blocks ``req`` holds, in order: its block table."""
        return tuple(self.req_to_kv[req.request_id].blocks)

    def num_cached(self, req: Request) -> int:
        """How many of ``req``'s leading tokens the cache holds."""
        return self.req_to_kv[req.request_id].cached

    def draft_context(self, req: Request) -> int:
        """How many of ``req``'s leading tokens a draft model's cache holds that the target
        confirmed: where its next catch-up starts."""
        kv = self.req_to_kv[req.request_id]
        return min(kv.draft_cached, kv.cached)

    def draft_computed(self, req: Request, num_tokens: int) -> None:
        """A draft model's cache now holds ``req``'s first ``num_tokens`` tokens."""
        self.req_to_kv[req.request_id].draft_cached = num_tokens

    def prefill_len(self, req: Request) -> int:
        """Tokens ``req`` prefills before its decode rows: its prompt, and after a preemption its
        output so far as well (the chunk that ends there samples its next token)."""
        return req.prompt_len + self.req_to_kv[req.request_id].recomputed

    def prefilled(self, req: Request) -> bool:
        return self.num_cached(req) >= self.prefill_len(req)

    @property
    def usage(self) -> float:
        """The share of the pool's blocks requests hold (cached blocks nobody holds count as free),
        vLLM's ``kv_cache_usage_perc``: 0 to 1."""
        return 1 - self.pool.num_free / (self.pool.num_blocks - 1)

    def fits_alone(self, num_tokens: int) -> bool:
        """Whether ``num_tokens`` tokens fit the whole pool."""
        return self.pool.blocks_for(num_tokens) <= self.pool.num_blocks - 1

    def lookup(self, req: Request) -> list[int]:
        """The cached blocks that hold the longest run of ``req``'s leading blocks to prefill (its
        last token is always computed); none for one that wants its prompt's logits, which
        computes every position. Counts nothing: ``admit`` counts the one that enters."""
        if req.wants_prompt_logits:
            return []
        tokens = req.token_ids[: self.prefill_len(req)]
        return self.pool.cached_prefix(tokens, count=False, hashes=self._names(req))

    def in_flight(self, req: Request, running: Sequence[Request]) -> int:
        """How many of ``req``'s leading blocks (those a lookup may find) a running request still
        prefilling will write: a lookup after it has written them hits that many (none without
        prefix caching, which names no block, nor for a request whose lookup finds none)."""
        if req.wants_prompt_logits:
            return 0
        mine = self._names(req)[: (self.prefill_len(req) - 1) // self.pool.block_size]
        longest = 0
        for other in (r for r in running if not self.prefilled(r)):
            shared = 0
            for a, b in zip(mine, self._names(other), strict=False):
                if a != b:
                    break
                shared += 1
            longest = max(longest, shared)
        return longest

    def admit(self, req: Request, prefix: list[int], alone: bool) -> bool:
        """Take ``req`` in with ``prefix`` (its ``lookup``) shared, if the blocks its prefill still
        lacks fit beside the watermark (waived when it is ``alone``); counts the lookup. Sharing a
        cached block nobody holds takes it off the free count, so those count as lacking too."""
        need = self.pool.blocks_for(self.prefill_len(req)) - len(prefix)
        need += sum(self.pool.refcount(b) == 0 for b in prefix)
        if need > self.pool.num_free - (0 if alone else self.watermark_blocks):
            return False
        self.pool.count(self.prefill_len(req), len(prefix))
        kv = self.req_to_kv[req.request_id]
        kv.blocks = self.pool.share(prefix)
        kv.cached = len(prefix) * self.pool.block_size
        if req.num_cached_tokens < 0:  # the first admission's hit: a recompute's is its own blocks
            req.num_cached_tokens = kv.cached
        del kv.block_hashes[len(prefix) :]  # a recompute names its blocks from its prefix on
        return True

    def grow(self, req: Request, num_tokens: int) -> bool:
        """Make ``req``'s blocks cover ``num_tokens`` tokens; all or nothing."""
        if self.pool.blocks_for(num_tokens) - len(self.req_to_kv[req.request_id].blocks) > self.pool.num_free:
            return False
        self._grow(req, num_tokens)
        return True

    def grow_up_to(self, req: Request, num_tokens: int) -> int:
        """Grow ``req``'s blocks towards ``num_tokens`` tokens as far as the pool allows; the
        tokens they cover then (at most ``num_tokens``)."""
        blocks = self.req_to_kv[req.request_id].blocks
        covered = (len(blocks) + self.pool.num_free) * self.pool.block_size
        self._grow(req, min(num_tokens, covered))
        return min(num_tokens, len(blocks) * self.pool.block_size)

    def commit(self, req: Request, num_cached: int) -> None:
        """A step left ``req``'s first ``num_cached`` tokens in the cache: name its full blocks
        whose K/V is written (with a draft model, by both models), so later requests, and its own
        recompute, may share them."""
        kv = self.req_to_kv[req.request_id]
        kv.cached = num_cached
        valid = min(num_cached, len(req.token_ids))
        if self.follows_draft:
            valid = min(valid, kv.draft_cached)
        self.pool.publish(kv.blocks, req.token_ids, valid, kv.block_hashes, req.lora_salt)

    def release(self, req: Request) -> None:
        """``req`` ended: its blocks go back (named ones stay cached until evicted) and its record
        ends."""
        self.pool.free(self.req_to_kv.pop(req.request_id).blocks)

    def preempt(self, req: Request) -> None:
        """Take ``req``'s blocks back to make room: it computes everything again when readmitted,
        its prompt and output so far as one prefill (cached blocks found by ``lookup``)."""
        kv = self.req_to_kv[req.request_id]
        self.pool.free(kv.blocks)
        kv.cached = kv.draft_cached = 0
        kv.recomputed = req.num_generated
        self.num_preemptions += 1

    def _grow(self, req: Request, num_tokens: int) -> None:
        self.pool.grow(self.req_to_kv[req.request_id].blocks, num_tokens)
        self.peak_usage = max(self.peak_usage, self.usage)

    def shortfall(self, req: Request) -> str:
        """Why ``req`` cannot be admitted into a pool that nobody it knows holds."""
        return (
            f"request {req.request_id} needs {self.pool.blocks_for(self.prefill_len(req))} blocks, "
            f"only {self.pool.num_free} of the pool are free"
        )

    def _names(self, req: Request) -> list[bytes]:
        """The names of ``req``'s full blocks to prefill, hashed once per request and extended in
        place when a preemption adds its output (empty without prefix caching)."""
        if not self.pool.enable_prefix_caching:
            return []
        hashes = self.req_to_kv[req.request_id].prefill_hashes
        return self.pool.chain(req.token_ids, self.prefill_len(req) // self.pool.block_size, hashes,
                               req.lora_salt)
