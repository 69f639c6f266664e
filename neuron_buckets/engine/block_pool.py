"""The block pool: hands out physical KV blocks for actual tokens, never for padding, and keeps
full blocks' contents for the next request with the same prefix (prefix caching).

Block 0 is the null block, taken out of the pool at start so no request ever owns it; a 0 in a
block table therefore always means "unused".

Prefix caching (vLLM's automatic prefix caching): a full block is named by a hash chained over its
parent block's hash and its token ids, salted with whatever else decides its K/V (the model and
the cache geometry). Once a request has written a full block, ``publish`` records that name. A
later request whose prompt starts with the same tokens takes the named blocks with ``share``
instead of computing them; blocks carry reference counts, and only full, published blocks are
ever shared, so a shared block is read-only and no block is written by two requests. A block whose
last reference ends keeps its content and name and waits, least recently used first, until
``grow`` needs it for new tokens: a cached block costs nothing until the pool is short.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence

import numpy as np

from neuron_buckets.core.block_table import NULL_BLOCK_ID


class OutOfBlocks(RuntimeError):
    """The pool cannot cover a request; nothing was allocated."""


def block_hash(parent: bytes, token_ids: Sequence[int], salt: bytes) -> bytes:
    """The name of a full block: its parent's name, its tokens and the salt, hashed together."""
    return hashlib.sha256(parent + salt + np.asarray(token_ids, dtype=np.int64).tobytes()).digest()


class BlockPool:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False, salt: bytes = b""
    ) -> None:
        if num_blocks < 2 or block_size <= 0:
            raise ValueError(
                f"need num_blocks >= 2 (block 0 is the null block) and block_size > 0, "
                f"got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.salt = salt
        self._free = deque(b for b in range(num_blocks) if b != NULL_BLOCK_ID)  # holding nothing
        self._refs: dict[int, int] = {}  # blocks some request holds, and how many hold each
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced, LRU first
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self.queries = 0  # prompt tokens looked up, as vLLM's prefix-cache counters count them
        self.hits = 0  # of which found cached
        self.evictions = 0  # cached blocks whose content ``grow`` gave up for new tokens

    @property
    def num_free(self) -> int:
        """Blocks ``grow`` can hand out: empty ones and cached ones nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._hash_of)

    def refcount(self, block: int) -> int:
        return self._refs.get(block, 0)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` actual tokens: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    def chain(
        self, token_ids: Sequence[int], num_blocks: int, hashes: list[bytes] | None = None, salt: bytes = b""
    ) -> list[bytes]:
        """The names of the first ``num_blocks`` full blocks of ``token_ids``, extending ``hashes``
        (the names already known, a request's own list) in place: each block is hashed once.
        ``salt``: the request's own (its LoRA adapter's), beside the pool's."""
        hashes = [] if hashes is None else hashes
        parent = hashes[-1] if hashes else b""
        for i in range(len(hashes), num_blocks):
            tokens = token_ids[i * self.block_size : (i + 1) * self.block_size]
            parent = block_hash(parent, tokens, self.salt + salt)
            hashes.append(parent)
        return hashes

    def cached_prefix(
        self, token_ids: Sequence[int], count: bool = True, hashes: Sequence[bytes] | None = None
    ) -> list[int]:
        """The cached blocks that hold the longest run of whole leading blocks of ``token_ids``,
        leaving at least the last token to compute (its logits are needed). Takes no reference;
        ``count`` adds the lookup to the hit counters. ``hashes``, the names of ``token_ids``'
        full blocks where the caller keeps them, spares hashing them again at every lookup."""
        if not self.enable_prefix_caching:
            return []
        found: list[int] = []
        lookup = (len(token_ids) - 1) // self.block_size
        for h in self.chain(token_ids, lookup) if hashes is None else hashes[:lookup]:
            if (block := self._by_hash.get(h)) is None:
                break
            found.append(block)
        if count:
            self.count(len(token_ids), len(found))
        return found

    def count(self, num_tokens: int, num_blocks: int) -> None:
        """Add one lookup of ``num_tokens`` prompt tokens, ``num_blocks`` of whose blocks were hit
        (nothing without prefix caching: nothing is looked up)."""
        if not self.enable_prefix_caching:
            return
        self.queries += num_tokens
        self.hits += num_blocks * self.block_size

    def share(self, blocks: Sequence[int]) -> list[int]:
        """Take a reference on cached blocks for a new request; they leave the eviction queue."""
        if stray := [b for b in blocks if b not in self._hash_of]:
            raise ValueError(f"blocks {stray} hold no cached content to share")
        for b in blocks:
            self._evictable.pop(b, None)
            self._refs[b] = self._refs.get(b, 0) + 1
        return list(blocks)

    def grow(self, blocks: list[int], num_tokens: int) -> list[int]:
        """Extend a request's blocks in place to cover ``num_tokens`` tokens; all or nothing. New
        blocks are empty ones first, then the least recently used cached ones, whose names go."""
        need = self.blocks_for(num_tokens) - len(blocks)
        if need > self.num_free:
            raise OutOfBlocks(
                f"need {need} more blocks for {num_tokens} tokens, only {self.num_free} of "
                f"{self.num_blocks - 1} are free"
            )
        for _ in range(max(need, 0)):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                del self._by_hash[self._hash_of.pop(block)]
                self.evictions += 1
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def publish(
        self, blocks: Sequence[int], token_ids: Sequence[int], num_tokens: int | None = None,
        hashes: list[bytes] | None = None, salt: bytes = b"",
    ) -> None:
        """Name the full blocks of a request whose K/V the first ``num_tokens`` of ``token_ids``
        (default: all) now hold in the cache, so that later requests may share them. ``hashes``,
        the request's own list, keeps the names from the last call, so each step hashes only its
        newly full blocks. A block whose name another block already has stays private (the
        content is the same; the first keeps the name)."""
        if not self.enable_prefix_caching:
            return
        hashes = [] if hashes is None else hashes
        start = len(hashes)
        full = min((len(token_ids) if num_tokens is None else num_tokens) // self.block_size, len(blocks))
        self.chain(token_ids, full, hashes, salt)
        for block, h in zip(blocks[start:full], hashes[start:full], strict=True):
            if block in self._hash_of or h in self._by_hash:
                continue
            self._by_hash[h] = block
            self._hash_of[block] = h

    def free(self, blocks: list[int]) -> None:
        """Drop a finished request's references; freeing a block twice is a bug, so it raises. A
        block nobody holds any more keeps its content if it has a name (tail blocks are evicted
        first), and is empty again otherwise."""
        if stray := [b for b in blocks if b not in self._refs]:
            raise ValueError(f"blocks {stray} are not allocated")
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"blocks {blocks} list a block twice; it would be handed out twice")
        for b in reversed(blocks) if self.enable_prefix_caching else blocks:
            self._refs[b] -= 1
            if self._refs[b]:
                continue
            del self._refs[b]
            if b in self._hash_of:
                self._evictable[b] = None
            else:
                self._free.append(b)
        blocks.clear()
