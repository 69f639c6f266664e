"""Torch golden references of the two block-KV kernels the model calls.

The model runs these on every backend but Neuron, where NKI kernels with the same contract replace
them; the NKI kernels are tested against these. Both are vectorised and torch.export-friendly:
fixed shapes, no data-dependent Python control flow. Each works on ONE layer's caches: a
layer-granular graph is called once per layer with that layer's slice of the stacked cache.

Contract (shapes per layer; B rows of S tokens, NB blocks of BS slots, KVH kv heads, head dim D):

- ``write_kv_cache(k, v, k_cache, v_cache, slot_mapping)``: token t's K/V go to slot
  ``slot_mapping[t]`` (block ``slot // BS``, offset ``slot % BS``) of the (NB, BS, KVH, D) caches,
  in place. Slot -1 (a pad token) writes nothing: every cache byte stays as it was, including the
  null block's.
- ``block_kv_attention(q, k_active, v_active, k_cache, v_cache, step, scale, window=None)``, with
  ``step`` an ``AttentionStep`` of ``block_table`` (R, M), ``cache_lens`` (R,) and ``segment_ids``
  (B, S): a row's S tokens are one or more requests laid end to end, told apart by
  ``segment_ids``. Token s sees step token u iff u <= s and both are in the same segment (each
  request causal, requests blind to each other). Two layouts: decode rows (R = B), where row b is
  one request (segment 0) over block-table row b; and one packed row (B = 1) whose segment g
  continues the cached context of block-table row g, so every packed request (fresh prompt,
  continuing chunk, prefix-cache hit, decode row) has its own context. A segment id at or past R
  (pad tokens) has no context. A context is the positions below ``cache_lens[r]`` of the blocks in
  ``block_table[r]`` (logical position p lives in block ``block_table[r, p // BS]``). Table
  entries of -1 read the null block 0 and are masked, as are all positions at or beyond the cache
  length, so whatever the cache holds there (garbage, NaN, another request's data) never reaches
  the output. Every token sees at least itself, so no softmax row is empty. With a sliding
  ``window`` W (Mistral), a token sees only the W positions ending at its own, in the context and
  in the step alike (token s of segment g sits at position ``cache_lens[g]`` plus its index in the
  segment); the window is a constant of the compiled graph.
"""

from __future__ import annotations

import torch
from torch import Tensor

from neuron_buckets.core.masks import gen_segment_masks

from .attention_step import AttentionStep


def write_kv_cache(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Scatter (T, KVH, D) K/V into one layer's (NB, BS, KVH, D) caches at ``slot_mapping``; -1 skips.

    A fixed-shape graph cannot drop pad tokens, so a pad writes back the value slot 0 already
    holds (gathered first), which leaves the bytes unchanged. Real tokens never target the null
    block, so the write-back never races a real write.
    """
    block_size = k_cache.shape[1]
    pad = slot_mapping < 0
    slots = slot_mapping.clamp(min=0)
    index = (slots // block_size, slots % block_size)
    keep = pad[:, None, None]
    for new, cache in ((k, k_cache), (v, v_cache)):
        values = torch.where(keep, cache[index], new.to(cache.dtype))
        cache.index_put_(index, values)


def context_rows(step: AttentionStep, batch: int, block_size: int) -> tuple[Tensor, Tensor]:
    """The blocks each of the ``batch`` step rows reads, (B, K * M), and which of their positions
    hold context, (B, K, M * BS): K = 1 for decode rows (row b reads block-table row b), K = R for
    one packed row (it reads every block-table row, segment g the g-th)."""
    rows, cols = step.block_table.shape
    if rows == batch:
        table, lens = step.block_table, step.cache_lens[:, None]
    elif batch == 1:
        table, lens = step.block_table.reshape(1, -1), step.cache_lens[None, :]
    else:
        raise ValueError(f"{batch} step rows over {rows} block-table rows: need one each, or one packed row")
    positions = torch.arange(cols * block_size, device=lens.device)
    return table, positions < lens[..., None]


def gather_context(
    k_cache: Tensor, v_cache: Tensor, step: AttentionStep, batch: int
) -> tuple[Tensor, Tensor, Tensor]:
    """The cached K/V each step row reads, (B, K * M * BS, KVH, D), zero beyond the cache lengths,
    and which positions are valid, (B, K, M * BS) (``context_rows``).

    -1 table entries read the null block and are masked. 0 * NaN is NaN, so masking scores alone
    is not enough: whatever the cache holds past a row's length is zeroed before any matmul.
    """
    table, cached = context_rows(step, batch, k_cache.shape[1])
    blocks = table.clamp(min=0)
    valid = cached.reshape(batch, -1)[:, :, None, None]
    shape = (batch, valid.shape[1], *k_cache.shape[2:])
    k_ctx = torch.where(valid, k_cache[blocks].reshape(shape), 0)
    v_ctx = torch.where(valid, v_cache[blocks].reshape(shape), 0)
    return k_ctx, v_ctx, cached


def block_kv_attention(q, k_active, v_active, k_cache, v_cache, step, scale, window=None) -> Tensor:
    """Attention of (B, S, H, D) queries over the paged context plus the step's own tokens.

    K/V of the step come in as ``k_active``/``v_active`` (B, S, KVH, D), so the result does not
    depend on whether the cache write happened first. Query head h uses kv head
    ``h // (H // KVH)`` (grouped-query attention). Scores and softmax run in float32, the output
    comes back in ``q.dtype``; ``window`` is the sliding window of the contract above. Context and
    step scores are computed apart and joined only as scores: no copy of the keys or values is
    concatenated.
    """
    batch, seq, num_heads, head_dim = q.shape
    num_kv_heads = k_active.shape[2]
    group = num_heads // num_kv_heads
    k_ctx, v_ctx, cached = gather_context(k_cache, v_cache, step, batch)
    s_ctx = k_ctx.shape[1]
    ctx_mask, active_mask = gen_segment_masks(cached, step.segment_ids, window)  # (B, S, s_ctx), (B, S, S)

    # (B, KVH, group, S, D) x (B, KVH, 1, D, L): GQA by broadcasting, no repeated K/V.
    qg = q.reshape(batch, seq, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4).float()
    kc = k_ctx.permute(0, 2, 3, 1).unsqueeze(2).float()
    ka = k_active.permute(0, 2, 3, 1).unsqueeze(2).float()
    neg = torch.finfo(torch.float32).min
    scores = torch.cat(
        [
            (torch.matmul(qg, kc) * scale).masked_fill(~ctx_mask[:, None, None], neg),
            (torch.matmul(qg, ka) * scale).masked_fill(~active_mask[:, None, None], neg),
        ],
        dim=-1,
    )
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    vc = v_ctx.to(q.dtype).permute(0, 2, 1, 3).unsqueeze(2)
    va = v_active.permute(0, 2, 1, 3).unsqueeze(2)
    out = torch.matmul(probs[..., :s_ctx], vc) + torch.matmul(probs[..., s_ctx:], va)  # (B, KVH, g, S, D)
    return out.permute(0, 3, 1, 2, 4).reshape(batch, seq, num_heads, head_dim)
