"""The fast torch path of block-KV attention: the golden's contract through one fused
``scaled_dot_product_attention`` call.

The golden (``block_kv_torch``) spells the attention out as matmuls, masks and a softmax, which
is the readable reference; compiled for CPU, inductor turns it into generic loops that cost more
than the layer's GEMMs at prefill sizes. PyTorch's fused CPU attention kernel does the same math
in one pass (flash-style, float32 accumulation), with grouped-query attention built in. Masked
context K/V are zeroed first, as in the golden, so NaN or garbage in unused blocks never reaches
an output. It agrees with the golden within float tolerance (tested); the cache write is the
golden's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from neuron_buckets.core.masks import gen_segment_masks

from .block_kv_torch import gather_context


def block_kv_attention(q, k_active, v_active, k_cache, v_cache, step, scale, window=None) -> Tensor:
    """An ``AttentionKernel``: the inputs, output and masking of ``block_kv_torch.block_kv_attention``.

    A step with no cached context at all (a packed prefill of fresh prompts, the common case)
    skips the context gather and its scores: ``torch.cond`` picks the branch at run time inside
    the one compiled graph, so the same prefill piece serves fresh and continuing prompts.
    """

    def step_only(q: Tensor, k_active: Tensor, v_active: Tensor, *_: Tensor) -> Tensor:
        cached = torch.zeros(q.shape[0], 1, 0, dtype=torch.bool, device=q.device)
        _, active_mask = gen_segment_masks(cached, step.segment_ids, window)
        return _attend(q, k_active, v_active, active_mask, scale)

    def with_context(q: Tensor, k_active: Tensor, v_active: Tensor, k_cache: Tensor, v_cache: Tensor,
                     block_table: Tensor, cache_lens: Tensor) -> Tensor:
        # torch.cond hands a branch its operands: the step is rebuilt from them, not closed over.
        own = step._replace(block_table=block_table, cache_lens=cache_lens)
        k_ctx, v_ctx, cached = gather_context(k_cache, v_cache, own, q.shape[0])
        ctx_mask, active_mask = gen_segment_masks(cached, step.segment_ids, window)
        keys = torch.cat([k_ctx.to(q.dtype), k_active], dim=1)
        values = torch.cat([v_ctx.to(q.dtype), v_active], dim=1)
        return _attend(q, keys, values, torch.cat([ctx_mask, active_mask], dim=-1), scale)

    operands = (q, k_active, v_active, k_cache, v_cache, step.block_table, step.cache_lens)
    return torch.cond(step.cache_lens.max() > 0, with_context, step_only, operands)


def _attend(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float) -> Tensor:
    """(B, S, H, D) queries over (B, L, KVH, D) keys and values where ``mask`` (B, S, L) allows."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask[:, None],
        scale=scale, enable_gqa=True,
    )
    return out.transpose(1, 2)
