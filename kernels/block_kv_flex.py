"""The fast torch path of block-KV attention: the golden's contract through ``flex_attention``.

Which (query, key) pairs may meet is sparse in every step nb runs: a packed row holds several
requests that must not see each other, each sees only its own cached context, and a context
bucket is usually longer than a row's real context. A dense fused kernel
(``scaled_dot_product_attention`` with a mask) still computes every pair and masks afterwards.
``flex_attention`` takes the mask as a ``BlockMask``: tiles where no pair may meet are never
computed, so attention costs what the requests' real lengths cost. Inductor compiles it to a CPU
template (and to a Triton kernel on GPU). The block mask is built inside the graph from
``segment_ids`` and ``cache_lens`` (and a sliding window, where the model has one), so one
compiled piece serves fresh and continuing prompts.

Masked context K/V are zeroed first, as in the golden (a masked score still multiplies its value
inside a computed tile, and 0 * NaN is NaN), so NaN or garbage in unused blocks never reaches an
output. It agrees with the golden within float tolerance (tested); the cache write is the golden's.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from neuron_buckets.kernels import block_kv_paged, block_kv_sdpa
from neuron_buckets.kernels.attention_step import AttentionStep
from neuron_buckets.kernels.block_kv_torch import gather_context

# Query and key tile of the block mask: a tile pair is skipped when no pair in it may meet. On the
# bench model (2-core AMD EPYC, 2026-11-30) a 512-token packed prefill layer took 15.6 ms with 32,
# 16.9 with 64, 18.2 with 128.
TILE = 32
DENSE_ROWS = 64  # rows of at most this many tokens take a dense path (measured faster there)
PAGED_ROWS = 8  # rows of at most this many tokens (decode, speculative drafts) read the cache in place


def block_kv_attention(
    q: Tensor,
    k_active: Tensor,
    v_active: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    step: AttentionStep,
    scale: float,
    window: int | None = None,
) -> Tensor:
    """Same inputs, output and masking as ``block_kv_torch.block_kv_attention``.

    Decode rows (at most ``PAGED_ROWS`` tokens) take ``block_kv_paged``, which reads the context
    in place instead of copying it. Other rows of at most ``DENSE_ROWS`` tokens (small prefill
    buckets) have few tiles to skip, so they take the dense fused path, which is faster there
    (measured); inductor's CPU flex template also fails to compile one-token query rows. The
    choice is made on static shapes at trace time.
    """
    batch, seq = q.shape[:2]
    kernel = block_kv_paged if seq <= PAGED_ROWS else block_kv_sdpa
    # A window in one packed row needs each token's position, a buffer computed in the graph,
    # which inductor's CPU flex template cannot take (it fails to lower): those rows go dense.
    packed_window = window is not None and step.block_table.shape[0] != batch
    if seq <= DENSE_ROWS or packed_window:
        return kernel.block_kv_attention(q, k_active, v_active, k_cache, v_cache, step, scale, window)
    k_ctx, v_ctx, cached = gather_context(k_cache, v_cache, step, batch)
    s_ctx, row_len = k_ctx.shape[1], cached.shape[2]

    def may_attend(b: Tensor, h: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
        # Keys are the context rows the row reads (ki < s_ctx), then the step's own tokens; row
        # b reads block-table row b (decode layout) or row g for segment g (one packed row).
        own_ki = (ki - s_ctx).clamp(min=0)
        row, pos = ki.clamp(max=s_ctx - 1) // row_len, ki.clamp(max=s_ctx - 1) % row_len
        segments, cache_len = step.segment_ids[b], step.cache_lens[b + row]
        own = (ki >= s_ctx) & (own_ki <= qi) & (segments[own_ki] == segments[qi])
        context = (ki < s_ctx) & (segments[qi] == row) & (pos < cache_len)
        if window is not None:  # decode layout only: segment 0's token qi sits at cache_len + qi
            own = own & (qi - own_ki < window)
            context = context & (cache_len + qi - pos < window)
        return own | context

    mask = create_block_mask(
        may_attend, batch, None, seq, s_ctx + seq, device=q.device, BLOCK_SIZE=TILE, _compile=False
    )
    # (B, heads, tokens, D) buffers of their own: inductor's CPU template reads its operands'
    # layouts directly and cannot take views of the projections' (tokens, heads * D) outputs.
    keys = torch.cat([k_ctx.to(q.dtype), k_active], dim=1).transpose(1, 2).contiguous()
    values = torch.cat([v_ctx.to(q.dtype), v_active], dim=1).transpose(1, 2).contiguous()
    queries = q.transpose(1, 2).contiguous()
    out = flex_attention(queries, keys, values, block_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)
