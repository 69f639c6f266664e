"""Attention masks of the block-KV kernels: which cached and which step tokens a query sees.

``gen_cache_mask`` hides everything at or beyond a row's cache length (null block, unwritten
slots, other requests' data), so cache contents there can never reach an output.
``gen_active_mask`` is the causal mask among the tokens of the step itself (one token for plain
decode, 1 + k draft tokens for speculative decode, a whole chunk for prefill);
``gen_segment_masks`` narrows both to segments, for steps that pack several requests in a row.
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


def gen_segment_masks(cached: Tensor, segment_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Bool (B, S, s_ctx) and (B, S, S) masks of a row whose tokens belong to segments.

    ``cached`` (B, s_ctx) marks the row's valid cache positions. Token s sees step token u iff
    u <= s in the same segment; only segment 0 sees the row's cached context.
    """
    seq = segment_ids.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=segment_ids.device).tril()
    active = causal & (segment_ids[:, :, None] == segment_ids[:, None, :])
    context = cached[:, None, :] & (segment_ids == 0)[:, :, None]
    return context, active
