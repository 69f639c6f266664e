"""``[cache]``: the paged KV cache every bucket graph shares."""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int = 128
    max_model_len: int = 256
    dtype: str = "float32"

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)
