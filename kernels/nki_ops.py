"""The two block-KV ops in the goldens' signatures, computed by the NKI kernels of ``block_kv_nki``.

This is the torch side of the kernels: it permutes q/k/v into the kernels' layouts, builds the
masks with ``neuron_buckets.core.masks`` (the goldens' own), turns block tables into slot ids, and runs
the golden for steps beyond the attention kernel's tile limits. It is traced into the same graph
as the kernel calls. ``KERNELS`` is what the Neuron backend installs with ``dispatch.use``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from neuron_buckets.core.masks import gen_segment_masks

from . import block_kv_torch
from .attention_step import AttentionStep
from .block_kv_nki import MAX_CTX, PMAX, jitted
from .block_kv_torch import context_rows
from .dispatch import KernelSet


def attention_kernel_fits(q_shape: tuple[int, ...], kv_heads: int, ctx: int) -> bool:
    """Whether a step of this shape meets the attention kernel's tile constraints."""
    _, seq, num_heads, head_dim = q_shape
    rows = num_heads // kv_heads * seq
    return head_dim <= PMAX and rows <= PMAX and 0 < ctx <= MAX_CTX and ctx % min(ctx, PMAX) == 0


def context_slots(block_table: Tensor, cache_lens: Tensor, block_size: int) -> Tensor:
    """(B, M*BS, 1) int32 cache slot of each context position; -1 where nothing must be read."""
    batch, cols = block_table.shape
    offsets = torch.arange(block_size, device=block_table.device)
    slots = (block_table[:, :, None] * block_size + offsets).reshape(batch, cols * block_size)
    positions = torch.arange(cols * block_size, device=block_table.device)
    allocated = (block_table >= 0).repeat_interleave(block_size, dim=1)
    keep = allocated & (positions < cache_lens.reshape(-1, 1))
    return torch.where(keep, slots, -1).to(torch.int32).unsqueeze(-1)


def attention_kernel_inputs(
    q: Tensor, k_active: Tensor, v_active: Tensor, step: AttentionStep, bs: int, window: int | None = None
) -> tuple[Tensor, ...]:
    """The kernel's q, k_active, v_active, ctx_slots, mask_cache, mask_active from golden inputs.

    The kernel takes its masks as inputs, so packed steps need no kernel change: the segment
    masks of the golden (``gen_segment_masks``, sliding window included) are what it gets.
    """
    batch, seq, num_heads, head_dim = q.shape
    kv_heads = k_active.shape[2]
    rows = num_heads // kv_heads * seq
    q_k = q.permute(0, 2, 1, 3).reshape(batch, kv_heads, rows, head_dim).contiguous()
    _, cached = context_rows(step, batch, bs)  # a packed row reads every block-table row's context
    context, active = gen_segment_masks(cached, step.segment_ids, window)  # (B, S, ctx), (B, S, S)
    group = num_heads // kv_heads

    def per_row(mask: Tensor) -> Tensor:  # (B, S, L) -> (B, KVH, group * S, L), the kernel's rows
        return mask[:, None, None].expand(batch, kv_heads, group, seq, mask.shape[-1]).reshape(
            batch, kv_heads, rows, mask.shape[-1]
        )

    return (
        q_k,
        k_active.permute(0, 2, 1, 3).contiguous(),
        v_active.permute(0, 2, 1, 3).contiguous(),
        context_slots(step.block_table, step.cache_lens, bs).reshape(batch, -1, 1),
        per_row(context).to(torch.uint8),
        per_row(active).to(torch.uint8),
    )


def write_kv_cache(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Golden-compatible cache write through the NKI kernel (in place; slot -1 writes nothing).

    ``k_cache`` may be one layer's (NB, BS, KVH, D) cache or several layers' blocks flattened to
    (L * NB, BS, KVH, D) with slots already offset to a layer: the kernel sees rows either way.
    """
    write, _ = jitted()
    rows = slot_mapping.to(torch.int32).reshape(-1, 1)
    write(k.to(k_cache.dtype), v.to(v_cache.dtype), k_cache, v_cache, rows)


def block_kv_attention(q, k_active, v_active, k_cache, v_cache, step, scale, window=None) -> Tensor:
    """Golden-compatible block-KV attention: the NKI kernel where it fits, else the golden.

    Decode steps (a few tokens per row) fit the kernel; a packed prefill step (more than 128
    query rows per kv head) or a context beyond MAX_CTX runs the golden, which neuronx-cc
    compiles from its torch ops like the rest of the graph.
    """
    batch, seq, num_heads, head_dim = q.shape
    ctx = step.block_table.numel() // batch * k_cache.shape[1]  # a packed row reads every table row
    if not attention_kernel_fits(q.shape, k_active.shape[2], ctx):
        return block_kv_torch.block_kv_attention(q, k_active, v_active, k_cache, v_cache, step, scale, window)
    _, attend = jitted()
    q_k, k_act, v_act, slots, mask_cache, mask_active = attention_kernel_inputs(
        q, k_active, v_active, step, k_cache.shape[1], window
    )
    out = attend(q_k, k_act, v_act, k_cache, v_cache, slots, mask_cache, mask_active, float(scale))
    return out.reshape(batch, num_heads, seq, head_dim).permute(0, 2, 1, 3)


KERNELS = KernelSet("nki", write_kv_cache, block_kv_attention)
