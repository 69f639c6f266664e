"""Block tables and slot mapping: where each token's K/V lives in the paged cache.

A block table row lists the physical blocks of one request, logical block i at column i.
Block 0 is the null block (never allocated), so a 0 in a scheduler's table means "unused";
at the attention boundary it becomes the sentinel -1 so kernels can skip the read.
A slot is one token position in the flat cache: ``block * block_size + position % block_size``;
slot -1 marks a pad token whose K/V must not be written.
"""

from __future__ import annotations

import torch
from torch import Tensor

NULL_BLOCK_ID = 0
PAD_SLOT_ID = -1


def remap_null_block_to_sentinel(block_table: Tensor) -> Tensor:
    """Turn unused entries (the null block 0) into -1, as the Neuron attention kernels expect."""
    return torch.where(block_table == NULL_BLOCK_ID, PAD_SLOT_ID, block_table)


def compute_slot_mapping(
    block_table: Tensor, req_indices: Tensor, positions: Tensor, block_size: int
) -> Tensor:
    """Return one cache slot per token, ``block_table[req, pos // bs] * bs + pos % bs``.

    ``block_table`` is (num_requests, max_blocks); ``req_indices`` and ``positions`` are 1-D, one
    entry per token. A token whose position falls on an unused table entry (0 or -1) or outside
    the table is an error, never a silent write into another request's block.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be 2-D (requests, blocks), got {tuple(block_table.shape)}")
    if req_indices.shape != positions.shape or positions.dim() != 1:
        raise ValueError(
            "req_indices and positions must be 1-D and of equal length, got "
            f"{tuple(req_indices.shape)} and {tuple(positions.shape)}"
        )
    num_reqs, max_blocks = block_table.shape
    req_indices = req_indices.to(torch.int64)
    positions = positions.to(torch.int64)
    if positions.numel() == 0:
        return torch.empty(0, dtype=block_table.dtype)
    if int(positions.min()) < 0:
        raise ValueError(f"positions must be >= 0, got {int(positions.min())}")
    if int(req_indices.min()) < 0 or int(req_indices.max()) >= num_reqs:
        raise ValueError(f"req_indices must lie in [0, {num_reqs}), got {req_indices.tolist()[:8]}...")
    logical = positions // block_size
    if int(logical.max()) >= max_blocks:
        worst = int(positions.max())
        raise ValueError(
            f"position {worst} needs logical block {worst // block_size}, but the block table "
            f"has only {max_blocks} columns (block_size={block_size})"
        )
    blocks = block_table.reshape(-1)[req_indices * max_blocks + logical].to(torch.int64)
    bad = blocks <= NULL_BLOCK_ID
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(
            f"token {i} (request {int(req_indices[i])}, position {int(positions[i])}) maps to "
            f"unallocated block entry {int(blocks[i])}; allocate blocks before computing slots"
        )
    return (blocks * block_size + positions % block_size).to(block_table.dtype)


def check_block_ids(block_table: Tensor, num_blocks: int) -> None:
    """Refuse block ids outside the pool, which would read or write another cache's memory."""
    if block_table.numel() and (int(block_table.max()) >= num_blocks or int(block_table.min()) < -1):
        raise ValueError(
            f"block ids must lie in [-1, {num_blocks}), got range "
            f"[{int(block_table.min())}, {int(block_table.max())}]"
        )
