"""The decode path of block-KV attention: keys and values read where they lie in the cache.

A decode row has one query token (a few with speculative drafts) and a context of hundreds or
thousands of cached positions. The dense paths first gather each row's blocks into a contiguous
(B, context, KVH, D) copy, zero it past the row's length, and then attend over the copy: the
cache is read once, written once and read again, and at decode sizes that copying costs more
than the attention itself. Here scores and weighted sums are broadcast products reduced over
one axis, with the block table as an index into the cache, so that inductor fuses the gather into
the reductions: each cached K and V vector is read once, in place, and nothing of context size is
written. The context is taken block by block (split-K over the cache's own blocks, as in
flash-decoding): each reduction runs over one block's contiguous slots, and the softmax is
combined across blocks and the step's own tokens through one shared maximum, cheaper than one
softmax over the flat context (CHANGELOG has the figures). Scores and softmax run in float32.

Masked positions still load whatever the cache holds there (the null block, stale or NaN data):
their scores are replaced by the float32 minimum with ``where`` (a select, so NaN cannot leak),
and their value vectors are dropped with ``where`` before the sum, not multiplied by a zero
weight (0 * NaN is NaN). It agrees with the golden within float tolerance (tested).
"""

from __future__ import annotations

import torch
from torch import Tensor

from neuron_buckets.core.masks import gen_segment_masks

from .block_kv_torch import context_rows


def block_kv_attention(q, k_active, v_active, k_cache, v_cache, step, scale, window=None) -> Tensor:
    """An ``AttentionKernel``: the inputs, output and masking of ``block_kv_torch.block_kv_attention``."""
    batch, seq, num_heads, head_dim = q.shape
    kv_heads = k_active.shape[2]
    group = num_heads // kv_heads
    block_size = k_cache.shape[1]
    table, cached = context_rows(step, batch, block_size)  # (B, K * M): a packed row reads K rows
    max_blocks = table.shape[1]
    ctx_mask, own_mask = gen_segment_masks(cached, step.segment_ids, window)  # (B, S, ctx), (B, S, S)
    # Context axes (B, S, blocks, KVH, group, slots, D); the step's own (B, S, KVH, group, S, D).
    ctx_mask = ctx_mask.view(batch, seq, max_blocks, 1, 1, block_size)
    own_mask = own_mask[:, :, None, None, :]
    queries = q.view(batch, seq, 1, kv_heads, group, 1, head_dim).float()
    blocks = table.clamp(min=0)
    cache_axes = (batch, 1, max_blocks, kv_heads, 1, block_size, head_dim)
    k_ctx = k_cache[blocks].permute(0, 1, 3, 2, 4).reshape(cache_axes)
    v_ctx = v_cache[blocks].permute(0, 1, 3, 2, 4).reshape(cache_axes)
    k_own = k_active.permute(0, 2, 1, 3)[:, None, :, None]
    v_own = v_active.permute(0, 2, 1, 3)[:, None, :, None]
    neg = torch.finfo(torch.float32).min
    ctx_scores = torch.where(ctx_mask, (queries * k_ctx.float()).sum(-1) * scale, neg)
    own_scores = torch.where(own_mask, (queries[:, :, 0] * k_own.float()).sum(-1) * scale, neg)
    top = torch.maximum(ctx_scores.amax(-1).amax(2), own_scores.amax(-1))  # (B, S, KVH, group)
    ctx_weights = torch.exp(ctx_scores - top[:, :, None, :, :, None])
    own_weights = torch.exp(own_scores - top[..., None])
    total = ctx_weights.sum(-1).sum(2) + own_weights.sum(-1)
    from_ctx = torch.where(ctx_mask[..., None], ctx_weights[..., None] * v_ctx.float(), 0).sum(-2).sum(2)
    from_own = (own_weights[..., None] * v_own.float()).sum(-2)  # the step's own values are real data
    out = (from_ctx + from_own) / total[..., None]
    return out.reshape(batch, seq, num_heads, head_dim).to(q.dtype)
