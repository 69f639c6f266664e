"""What a step tells the block-KV attention about its rows: one record every kernel takes whole.

The attention of every kernel (golden, fast torch paths, NKI glue) reads the same three step
tensors; passing them as one ``AttentionStep`` keeps the kernels' signatures one and short, and a
new step field reaches every kernel without a new positional argument. The cache write reads only
the step's ``slot_mapping``, so it takes that tensor alone.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class AttentionStep(NamedTuple):
    """B block-table rows of S step tokens each: a decode row per request, or one packed prefill row."""

    block_table: Tensor  # (B, M) int64: row b's logical block j lives in physical block [b, j]; -1 unused
    cache_lens: Tensor  # (B,) int64: positions of each row already cached before this step
    segment_ids: Tensor  # (B, S) int64: which request of its row each token belongs to (0 continues)

    @classmethod
    def of_flat(cls, block_table: Tensor, cache_lens: Tensor, segment_ids: Tensor) -> AttentionStep:
        """The step of graph inputs whose segment ids are flat (T,), T = B * S row-major."""
        return cls(block_table, cache_lens, segment_ids.view(block_table.shape[0], -1))
