"""``[cache]``: the paged KV cache every bucket graph shares, and the geometry rule that the
config and the artifact check both apply. ``enable_prefix_caching`` shapes no graph: it decides
whether requests share the cached blocks of a common prefix (on by default, as in vLLM), so it
travels in the manifest beside the graphs, not in their keys."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

from neuron_buckets.config.config_error import ConfigError
from neuron_buckets.config.setting import check_choice, check_positive, check_types, setting

DTYPES = ("float32", "float16", "bfloat16")


class PagedCache(Protocol):
    """The sizes of a block pool (a ``CacheConfig``, or an artifact manifest's cache)."""

    block_size: int
    num_blocks: int
    max_model_len: int


def geometry_problem(cache: PagedCache) -> str | None:
    """Why a pool of positive sizes cannot serve one sequence of ``max_model_len``, or None."""
    fits = cache.max_model_len // cache.block_size
    if cache.num_blocks - 1 < fits:
        # As in vLLM: the pool must hold one sequence of max_model_len beside the null block 0.
        return (
            f"cache.num_blocks={cache.num_blocks} cannot hold one sequence of max_model_len="
            f"{cache.max_model_len}: need at least {fits + 1} (block 0 is the reserved null block)"
        )
    if cache.max_model_len % cache.block_size:
        # A bucket's block table has ctx // block_size columns; a partial last block would be cut off.
        return (
            f"cache.max_model_len={cache.max_model_len} must be a multiple of "
            f"cache.block_size={cache.block_size}"
        )
    return None


@dataclass(frozen=True)
class CacheConfig:
    SECTION: ClassVar[str] = "cache"

    # The cache tensors are graph inputs: their shape and dtype are in every graph.
    block_size: int = setting(16, graph=True)
    num_blocks: int = setting(128, graph=True)
    max_model_len: int = setting(256, graph=False)  # each bucket's own ctx bounds its graph
    dtype: str = setting("float32", graph=True)
    # block sharing, a runtime decision; an embedding artifact keeps no prompt's blocks to share
    enable_prefix_caching: bool = setting(True, graph=False, tasks=("generate",))

    def __post_init__(self) -> None:
        check_types(self)
        check_positive(self, "block_size", "num_blocks", "max_model_len")
        check_choice(self, "dtype", DTYPES)
        if problem := geometry_problem(self):
            raise ConfigError(problem)
