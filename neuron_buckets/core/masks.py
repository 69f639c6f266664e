"""Attention masks of the block-KV kernels: which cached and which step tokens a query sees.

``gen_cache_mask`` hides everything at or beyond a row's cache length (null block, unwritten
slots, other requests' data), so cache contents there can never reach an output.
``gen_active_mask`` is the causal mask among the tokens of the step itself (one token for plain
decode, 1 + k draft tokens for speculative decode, a whole chunk for prefill);
``gen_segment_masks`` narrows both to segments, for steps that pack several requests in a row, each
segment over its own context row, and to a sliding window where the model has one (Mistral).
"""

from __future__ import annotations

import torch
from torch import Tensor


def gen_cache_mask(cache_lens: Tensor, num_heads: int, s_tkg: int, s_ctx: int) -> Tensor:
    """Bool (B, num_heads, s_tkg, s_ctx): true where the position is below the row's length."""
    lens = cache_lens.reshape(-1, 1)
    valid = torch.arange(s_ctx, device=cache_lens.device).unsqueeze(0) < lens  # (B, s_ctx)
    return valid[:, None, None, :].expand(lens.shape[0], num_heads, s_tkg, s_ctx)


def gen_active_mask(
    batch: int, num_heads: int, s_tkg: int, device: torch.device | str = "cpu"
) -> Tensor:
    """Bool (B, num_heads, s_tkg, s_tkg): token i of the step sees step tokens 0..i."""
    causal = torch.ones(s_tkg, s_tkg, dtype=torch.bool, device=device).tril()
    return causal.expand(batch, num_heads, s_tkg, s_tkg)


def _segment_offsets(segment_ids: Tensor) -> Tensor:
    """(B, S): each token's index within its segment (segments are contiguous runs of a row)."""
    index = torch.arange(segment_ids.shape[1], device=segment_ids.device).expand_as(segment_ids)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    return index - torch.where(starts, index, 0).cummax(dim=1).values


def _segment_positions(cached: Tensor, segment_ids: Tensor) -> Tensor:
    """(B, S): each token's position, its segment's context length plus its index in the segment
    (``cached`` as in ``gen_segment_masks``; a pad's segment past the rows has no context)."""
    batch = cached.shape[0]
    lens = torch.cat([cached.sum(-1), cached.new_zeros(batch, 1, dtype=torch.int64)], dim=1)
    return lens.gather(1, segment_ids.clamp(max=cached.shape[1])) + _segment_offsets(segment_ids)


def gen_segment_masks(
    cached: Tensor, segment_ids: Tensor, window: int | None = None
) -> tuple[Tensor, Tensor]:
    """Bool (B, S, K * C) and (B, S, S) masks of a row whose tokens belong to segments.

    ``cached`` (B, K, C) marks the valid positions of the K context rows step row b may read,
    each a prefix (from ``gen_cache_mask``): K = 1 when each step row is one request over its own
    block-table row (decode), K = R when one packed row holds segments over R block-table rows.
    Token s of segment g sees context row g (rows at or past K: none) and step token u iff u <= s
    in the same segment. With a sliding ``window`` W, a token sees only the W positions ending at
    its own: a segment's tokens are consecutive positions after its context, so token s of segment
    g sits at position ``len(g) + offset(s)``, and distances follow from indices and lengths alone.
    """
    batch, rows, ctx = cached.shape
    seq = segment_ids.shape[1]
    index = torch.arange(seq, device=segment_ids.device)
    back = index[:, None] - index[None, :]  # (S, S): how many positions u lies behind s
    active = (back >= 0) & (segment_ids[:, :, None] == segment_ids[:, None, :])
    row_ids = torch.arange(rows, device=cached.device)
    context = cached[:, None] & (segment_ids[:, :, None, None] == row_ids[:, None])  # (B, S, K, C)
    if window is not None:
        position = _segment_positions(cached, segment_ids)[:, :, None, None]
        ctx_back = position - torch.arange(ctx, device=cached.device)
        context = context & (ctx_back < window)
        active = active & (back < window)
    return context.reshape(batch, seq, rows * ctx), active
