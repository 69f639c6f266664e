"""Torch golden references of the two block-KV kernels the model calls.

The model runs these on every backend but Neuron, where NKI kernels with the same contract replace
them; the NKI kernels are tested against these. Both are vectorised and torch.export-friendly:
fixed shapes, no data-dependent Python control flow.

Contract (shapes per layer; T = B * S tokens, NB blocks of BS slots, KVH kv heads, head dim D):

- ``write_kv_cache(k, v, k_cache, v_cache, slot_mapping, layer=None)``: token t's K/V go to slot
  ``slot_mapping[t]`` (block ``slot // BS``, offset ``slot % BS``), in place. Slot -1 (a pad token)
  writes nothing: every cache byte stays as it was, including the null block's. With ``layer``,
  the caches are the model's stacked (L, NB, BS, KVH, D) tensors and layer ``layer`` is written.
- ``block_kv_attention(q, k_active, v_active, k_cache, v_cache, block_table, cache_lens, scale)``:
  each row attends over its cached context (logical position p lives in block
  ``block_table[b, p // BS]``) below ``cache_lens[b]``, then causally over the step's own S
  tokens. Table entries of -1 read the null block 0 and are masked, as are all positions at or
  beyond the cache length, so whatever the cache holds there (garbage, NaN, another request's
  data) never reaches the output.
"""

from __future__ import annotations

import torch
from torch import Tensor

from neuron_buckets.core.masks import gen_active_mask, gen_cache_mask


def write_kv_cache(
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    layer: int | None = None,
) -> None:
    """Scatter (T, KVH, D) K/V into (NB, BS, KVH, D) caches at ``slot_mapping``; -1 skips.

    A fixed-shape graph cannot drop pad tokens, so a pad writes back the value slot 0 already
    holds (gathered first), which leaves the bytes unchanged. Real tokens never target the null
    block, so the write-back never races a real write. ``layer`` indexes the stacked caches in
    the same index_put_: writing through a ``cache[layer]`` view instead makes functionalized
    graphs (torch.export, inductor) copy the whole cache on every layer of every step.
    """
    block_size = k_cache.shape[-3]
    pad = slot_mapping < 0
    slots = slot_mapping.clamp(min=0)
    index = (slots // block_size, slots % block_size)
    if layer is not None:
        index = (torch.full_like(slots, layer), *index)
    keep = pad[:, None, None]
    for new, cache in ((k, k_cache), (v, v_cache)):
        values = torch.where(keep, cache[index], new.to(cache.dtype))
        cache.index_put_(index, values)


def block_kv_attention(
    q: Tensor,
    k_active: Tensor,
    v_active: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    cache_lens: Tensor,
    scale: float,
) -> Tensor:
    """Attention of (B, S, H, D) queries over the paged context plus the step's own tokens.

    K/V of the step come in as ``k_active``/``v_active`` (B, S, KVH, D), so the result does not
    depend on whether the cache write happened first. Query head h uses kv head
    ``h // (H // KVH)`` (grouped-query attention). Scores and softmax run in float32, the
    output comes back in ``q.dtype``.
    """
    batch, seq, num_heads, head_dim = q.shape
    num_kv_heads = k_active.shape[2]
    group = num_heads // num_kv_heads
    block_size = k_cache.shape[1]
    s_ctx = block_table.shape[1] * block_size

    blocks = block_table.clamp(min=0)  # -1 sentinels read the null block, masked below
    k_ctx = k_cache[blocks].reshape(batch, s_ctx, num_kv_heads, head_dim)
    v_ctx = v_cache[blocks].reshape(batch, s_ctx, num_kv_heads, head_dim)
    cache_mask = gen_cache_mask(cache_lens, num_heads, seq, s_ctx)
    # 0 * NaN is NaN, so masking scores alone is not enough: zero masked K/V before the matmuls.
    valid = cache_mask[:, 0, 0, :, None, None]
    k_ctx = torch.where(valid, k_ctx, 0).to(q.dtype)
    v_ctx = torch.where(valid, v_ctx, 0).to(q.dtype)

    keys = torch.cat([k_ctx, k_active], dim=1)  # (B, L, KVH, D), L = s_ctx + S
    values = torch.cat([v_ctx, v_active], dim=1)
    mask = torch.cat([cache_mask, gen_active_mask(batch, num_heads, seq, q.device)], dim=-1)

    # (B, KVH, group, S, D) x (B, KVH, 1, D, L): GQA by broadcasting, no repeated K/V.
    qg = q.permute(0, 2, 1, 3).reshape(batch, num_kv_heads, group, seq, head_dim)
    kg = keys.permute(0, 2, 3, 1).unsqueeze(2)
    scores = torch.matmul(qg.float(), kg.float()) * scale
    scores = scores.masked_fill(~mask.reshape(scores.shape), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    out = torch.matmul(probs, values.permute(0, 2, 1, 3).unsqueeze(2))  # (B, KVH, group, S, D)
    return out.reshape(batch, num_heads, seq, head_dim).permute(0, 2, 1, 3)
