"""The block pool: hands out physical KV blocks for actual tokens, never for padding.

Block 0 is the null block, taken out of the pool at start so no request ever owns it; a 0 in a
block table therefore always means "unused".
"""

from __future__ import annotations

from collections import deque

from neuron_buckets.core.block_table import NULL_BLOCK_ID


class OutOfBlocks(RuntimeError):
    """The pool cannot cover a request; nothing was allocated."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2 or block_size <= 0:
            raise ValueError(
                f"need num_blocks >= 2 (block 0 is the null block) and block_size > 0, "
                f"got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = deque(b for b in range(num_blocks) if b != NULL_BLOCK_ID)
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` actual tokens: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    def grow(self, blocks: list[int], num_tokens: int) -> list[int]:
        """Extend a request's blocks in place to cover ``num_tokens`` tokens; all or nothing."""
        need = self.blocks_for(num_tokens) - len(blocks)
        if need > len(self._free):
            raise OutOfBlocks(
                f"need {need} more blocks for {num_tokens} tokens, only {len(self._free)} of "
                f"{self.num_blocks - 1} are free"
            )
        for _ in range(max(need, 0)):
            block = self._free.popleft()
            self._used.add(block)
            blocks.append(block)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Return a finished request's blocks; freeing a block twice is a bug, so it raises."""
        if stray := [b for b in blocks if b not in self._used]:
            raise ValueError(f"blocks {stray} are not allocated")
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"blocks {blocks} list a block twice; it would be handed out twice")
        for b in blocks:
            self._used.discard(b)
            self._free.append(b)
        blocks.clear()
