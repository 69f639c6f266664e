"""The decode path of block-KV attention: keys and values read where they lie in the cache.

A decode row has one query token (a few with speculative drafts) and a context of hundreds or
thousands of cached positions. The dense paths first gather each row's blocks into a contiguous
(B, context, KVH, D) copy, zero it past the row's length, and then attend over the copy: the
cache is read once, written once and read again, and at decode sizes that copying costs more
than the attention itself. Here the scores and the weighted sum are spelled as broadcast products
reduced over one axis, with the block table as an index into the cache, so that inductor fuses
the gather into the two reductions: each cached K and V vector is read once, in place, and
nothing of context size is written. Scores and softmax run in float32.

Masked positions still load whatever the cache holds there (the null block, stale or NaN data):
their scores are replaced by the float32 minimum with ``where`` (a select, so NaN cannot leak),
and their value vectors are dropped with ``where`` before the sum, not multiplied by a zero
probability (0 * NaN is NaN). It agrees with the golden within float tolerance (tested).
"""

from __future__ import annotations

import torch
from torch import Tensor

from neuron_buckets.core.masks import gen_cache_mask, gen_segment_masks


def block_kv_attention(
    q: Tensor,
    k_active: Tensor,
    v_active: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    cache_lens: Tensor,
    segment_ids: Tensor,
    scale: float,
    window: int | None = None,
) -> Tensor:
    """Same inputs, output and masking as ``block_kv_torch.block_kv_attention``."""
    batch, seq, num_heads, head_dim = q.shape
    kv_heads = k_active.shape[2]
    group = num_heads // kv_heads
    s_ctx = block_table.shape[1] * k_cache.shape[1]
    cached = gen_cache_mask(cache_lens, 1, 1, s_ctx)[:, 0, 0]
    ctx_mask, active_mask = gen_segment_masks(cached, segment_ids, window)  # (B, S, s_ctx), (B, S, S)
    # Axes (B, S, keys, KVH, group, D): D is the reduced axis of the scores, keys that of the sum.
    queries = q.view(batch, seq, 1, kv_heads, group, head_dim).float()
    blocks = block_table.clamp(min=0)
    k_ctx = k_cache[blocks].view(batch, 1, s_ctx, kv_heads, 1, head_dim)
    v_ctx = v_cache[blocks].view(batch, 1, s_ctx, kv_heads, 1, head_dim)
    k_own = k_active.view(batch, 1, seq, kv_heads, 1, head_dim)
    v_own = v_active.view(batch, 1, seq, kv_heads, 1, head_dim)
    neg = torch.finfo(torch.float32).min
    scores = torch.cat(
        [
            torch.where(ctx_mask[..., None, None], (queries * k_ctx.float()).sum(-1) * scale, neg),
            torch.where(active_mask[..., None, None], (queries * k_own.float()).sum(-1) * scale, neg),
        ],
        dim=2,
    )
    probs = torch.softmax(scores, dim=2)[..., None]  # (B, S, keys, KVH, group, 1)
    from_ctx = torch.where(ctx_mask[..., None, None, None], probs[:, :, :s_ctx] * v_ctx.float(), 0).sum(2)
    from_own = (probs[:, :, s_ctx:] * v_own.float()).sum(2)  # the step's own values are real data
    return (from_ctx + from_own).view(batch, seq, num_heads, head_dim).to(q.dtype)
