"""Which (query tile, key tile) pairs of a block-KV step can meet, worked out tile by tile.

Flex attention skips every tile pair its ``BlockMask`` leaves out. Building that mask with
``create_block_mask`` evaluates the element mask over all S x (context + S) pairs first and only
then reduces it to tiles; on a packed row over R block-table rows the context axis is R times a
row's length, so that evaluation alone is a visible share of a layer's time (CHANGELOG). Here
the tiles come from the step's structure instead,
at tile granularity: segments are contiguous runs of a row in ascending order, so query tile i
holds the segments ``segment_ids[first] .. segment_ids[last]``; it reads the context tiles that
overlap those segments' cached positions, and the step's own tiles from the first token of its
first segment up to its last token. The element mask (``mask_mod``) still decides every pair
inside a kept tile, so a kept tile too many costs time, never correctness; a tile left out that
holds an allowed pair would be wrong, and tests check that none is.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, _mask_mod_signature

from .attention_step import AttentionStep


def tile_mask(step: AttentionStep, batch: int, seq: int, row_len: int, ctx_len: int, tile: int,
              mask_mod: _mask_mod_signature, windowed: bool = False) -> BlockMask:
    """The block mask of ``batch`` step rows of ``seq`` tokens whose keys are ``ctx_len`` context
    positions (the context rows each step row reads, ``row_len`` apiece, then padding up to a
    whole tile; 0: no context) followed by the step's own ``seq`` tokens.

    Step row b reads block-table row b (decode rows) or, as one packed row, row g for segment g;
    a row's real context is its first ``cache_lens`` positions. A kept tile is full (``mask_mod``
    not evaluated in it, which measured faster) when its queries are one segment and every key
    lies in that segment's context, or in its own tokens before the tile's first query; with a
    sliding window (``windowed``) no tile is full.
    """
    segments = step.segment_ids
    q_first, q_last, lowest, highest = _query_tiles(segments, tile)
    single = (lowest == highest)[..., None] & (not windowed)  # (B, NQ, 1): full tiles possible
    own_kept, own_full = _own_tiles(segments, q_first, q_last, lowest, tile)
    kept, full = [own_kept], [single & own_full]
    if ctx_len:
        ctx_kept, ctx_full = _context_tiles(step, batch, row_len, ctx_len, lowest, highest, tile)
        kept.insert(0, ctx_kept)
        full.insert(0, single & ctx_full)
    full_tiles = torch.cat(full, dim=-1)
    partial_tiles = torch.cat(kept, dim=-1) & ~full_tiles
    return BlockMask.from_kv_blocks(
        *_tile_list(partial_tiles), *_tile_list(full_tiles), BLOCK_SIZE=tile, mask_mod=mask_mod,
        seq_lengths=(seq, ctx_len + seq),
    )


def _own_tiles(segments: Tensor, q_first: Tensor, q_last: Tensor, lowest: Tensor, tile: int
               ) -> tuple[Tensor, Tensor]:
    """(B, NQ, own key tiles) kept and all-allowed flags: query tile i sees the step's tokens from
    the first one of its lowest segment (``searchsorted``: segments ascend) up to its last one."""
    first = torch.searchsorted(segments, lowest)[..., None]  # (B, NQ, 1)
    key_start = torch.arange(0, segments.shape[1], tile, device=segments.device)
    key_end = key_start + tile
    kept = (key_end > first) & (key_start <= q_last[:, None])
    return kept, (key_start >= first) & (key_end <= q_first[:, None] + 1)


def _context_tiles(step: AttentionStep, batch: int, row_len: int, ctx_len: int, lowest: Tensor,
                   highest: Tensor, tile: int) -> tuple[Tensor, Tensor]:
    """(B, NQ, context key tiles) kept and inside-one-context flags: query tile i reads the tiles
    that overlap the cached positions of the segments it holds."""
    lens = step.cache_lens.reshape(batch, -1)  # (B, K): the context rows step row b reads
    rows = torch.arange(lens.shape[1], device=lens.device)
    holds = ((rows >= lowest[..., None]) & (rows <= highest[..., None]))[..., None]  # (B, NQ, K, 1)
    start = rows * row_len
    end = start + lens
    key_start = torch.arange(0, ctx_len, tile, device=lens.device)
    key_end = key_start + tile
    overlaps = (key_start < end[..., None]) & (key_end > start[:, None]) & (lens[..., None] > 0)
    inside = (key_start >= start[:, None]) & (key_end <= end[..., None])  # (B, K, key tiles)
    return (holds & overlaps[:, None]).any(dim=2), (holds & inside[:, None]).any(dim=2)


def _query_tiles(segments: Tensor, tile: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Each query tile's first and last token (NQ,), and the lowest and highest segment it holds
    (B, NQ): segments ascend along a row, so those are the segments of its first and last token."""
    seq = segments.shape[1]
    q_first = torch.arange(0, seq, tile, device=segments.device)
    q_last = (q_first + tile).clamp(max=seq) - 1
    return q_first, q_last, segments[:, q_first], segments[:, q_last]


def _tile_list(tiles: Tensor) -> tuple[Tensor, Tensor]:
    """``BlockMask``'s form of (B, NQ, key tiles) flags: how many per query tile, and their
    indices first (stable, so ascending), as (B, 1, NQ) and (B, 1, NQ, key tiles) int32."""
    counts = tiles.sum(-1, dtype=torch.int32)
    order = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts[:, None], order[:, None]
