"""``[cache]``: the paged KV cache every bucket graph shares.

``enable_prefix_caching`` shapes no graph: it decides whether requests share the cached blocks of
a common prefix (on by default, as in vLLM), so it travels in the manifest beside the graphs'
geometry, not in their keys."""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int = 128
    max_model_len: int = 256
    dtype: str = "float32"
    enable_prefix_caching: bool = True

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)
