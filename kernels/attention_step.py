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
    """B step rows of S tokens over R block-table rows: a decode row per request (B = R), or one
    packed row (B = 1) whose segment g reads block-table row g."""

    block_table: Tensor  # (R, M) int64: row r's logical block j lives in physical block [r, j]; -1 unused
    cache_lens: Tensor  # (R,) int64: positions of each block-table row already cached before this step
    segment_ids: Tensor  # (B, S) int64: which segment each token belongs to (decode rows: 0)
