"""Attention masks of the block-KV kernels: which cached and which step tokens a query sees.

``gen_cache_mask`` hides everything at or beyond a row's cache length (null block, unwritten
slots, other requests' data), so cache contents there can never reach an output.
``gen_active_mask`` is the causal mask among the tokens of the step itself (one token for plain
decode, 1 + k draft tokens for speculative decode, a whole chunk for prefill);
``gen_segment_masks`` narrows both to segments, for steps that pack several requests in a row, and
to a sliding window where the model has one (Mistral).
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


def gen_segment_masks(
    cached: Tensor, segment_ids: Tensor, window: int | None = None
) -> tuple[Tensor, Tensor]:
    """Bool (B, S, s_ctx) and (B, S, S) masks of a row whose tokens belong to segments.

    ``cached`` (B, s_ctx) marks the row's valid cache positions, a prefix of each row (from
    ``gen_cache_mask``). Token s sees step token u iff u <= s in the same segment; only segment 0
    sees the row's cached context. With a sliding ``window`` W, a token sees only the W positions
    ending at its own: a segment's tokens are consecutive positions, and segment 0's token s sits
    at position cache_len + s, so distances follow from the indices and the cache length alone.
    """
    seq = segment_ids.shape[1]
    index = torch.arange(seq, device=segment_ids.device)
    back = index[:, None] - index[None, :]  # (S, S): how many positions u lies behind s
    active = (back >= 0) & (segment_ids[:, :, None] == segment_ids[:, None, :])
    context = cached[:, None, :] & (segment_ids == 0)[:, :, None]
    if window is not None:
        lens = cached.sum(-1)[:, None, None]
        ctx_back = lens + index[None, :, None] - torch.arange(cached.shape[1], device=cached.device)
        context = context & (ctx_back < window)
        active = active & (back < window)
    return context, active
