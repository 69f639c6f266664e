"""The fast torch path of block-KV attention: the golden's contract through ``flex_attention``.

Which (query, key) pairs may meet is sparse in every step nb runs: a packed row holds several
requests that must not see each other, each sees only its own cached context, and a context
bucket is usually longer than a row's real context. A dense fused kernel
(``scaled_dot_product_attention`` with a mask) still computes every pair and masks afterwards.
``flex_attention`` takes the mask as a ``BlockMask``: tiles where no pair may meet are never
computed, so attention costs what the requests' real lengths cost. Inductor compiles it to a CPU
template (and to a Triton kernel on GPU). The block mask is built inside the graph, tile by tile
(``tile_mask``), from ``segment_ids`` and ``cache_lens``, and the element mask from the same two
(and a sliding window, where the model has one), so one compiled piece serves fresh and
continuing prompts.

Masked context K/V are zeroed first, as in the golden (a masked score still multiplies its value
inside a computed tile, and 0 * NaN is NaN), so NaN or garbage in unused blocks never reaches an
output. It agrees with the golden within float tolerance (tested); the cache write is the golden's.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import flex_attention

from . import block_kv_paged, block_kv_sdpa
from .attention_step import AttentionStep
from .block_kv_torch import gather_context
from .tile_mask import tile_mask

# Query and key tile of the block mask: a tile pair is skipped when no pair in it may meet, so the
# smaller tile skips more of a packed call's cross-segment pairs (the fastest tried, CHANGELOG).
TILE = 32
DENSE_ROWS = 64  # decode rows of at most this many tokens take the dense path (measured faster there)
PAGED_ROWS = 8  # rows of at most this many tokens (decode, speculative drafts) read the cache in place


def block_kv_attention(q, k_active, v_active, k_cache, v_cache, step, scale, window=None) -> Tensor:
    """An ``AttentionKernel``: the inputs, output and masking of ``block_kv_torch.block_kv_attention``.

    Rows of at most ``PAGED_ROWS`` tokens (decode, speculative drafts) read the context in place
    instead of copying it, through ``block_kv_paged`` (inductor's CPU flex template also fails to
    compile one-token query rows). Decode rows of at most ``DENSE_ROWS`` tokens have few tiles to
    skip, so they take the dense fused path, which is faster there (measured). A packed row of any
    other length takes flex: the dense path would attend every token to every segment's context, R
    times the keys it needs. The choices on shapes are made at trace time.

    A step with nothing cached (fresh prompts, the common case) neither gathers nor copies a
    context: ``torch.cond`` picks at run time between gathering it and leaving the context part
    of the key buffers unwritten, where no kept tile reads. Only the key buffers are built in the
    branches: torch.export (non-strict, torch 2.13) rejects a flex call inside one, and a branch
    that writes into a buffer in place. Inductor still fills the unwritten part (with NaN, at a
    cost that grows with the block table's rows and width), so a runtime with a piece over no
    context (a block table of no columns) runs that one for such steps, with no context part.
    """
    batch, seq = q.shape[:2]
    packed = step.block_table.shape[0] != batch
    row_len = k_cache.shape[1] * step.block_table.shape[1]
    if seq <= PAGED_ROWS and row_len:
        return block_kv_paged.block_kv_attention(q, k_active, v_active, k_cache, v_cache, step, scale, window)
    # A window in one packed row needs each token's position, a buffer computed in the graph,
    # which inductor's CPU flex template cannot take (it fails to lower): those rows go dense, as
    # do short rows over no context (nothing to read in place).
    if (seq <= DENSE_ROWS and not packed) or (packed and window is not None) or seq <= PAGED_ROWS:
        return block_kv_sdpa.block_kv_attention(q, k_active, v_active, k_cache, v_cache, step, scale, window)
    s_ctx = row_len * (step.block_table.shape[0] // batch)  # K context rows per step row (1 or R)
    padded = -(-s_ctx // TILE) * TILE  # the context axis in whole key tiles

    def may_attend(b: Tensor, h: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
        # Keys are the context rows the row reads (ki < s_ctx), padding up to a whole tile, then
        # the step's own tokens; row b reads block-table row b (decode) or row g for segment g.
        own_ki = (ki - padded).clamp(min=0)
        segments = step.segment_ids[b]
        own = (ki >= padded) & (own_ki <= qi) & (segments[own_ki] == segments[qi])
        if window is not None:  # decode layout only: segment 0's token qi sits at cache_len + qi
            own = own & (qi - own_ki < window)
        if not s_ctx:  # a piece over no context (a fresh layer): the step's own tokens only
            return own
        ctx_ki = ki.clamp(max=s_ctx - 1)
        row, pos = ctx_ki // row_len, ctx_ki % row_len
        cache_len = step.cache_lens[b + row]
        context = (ki < s_ctx) & (segments[qi] == row) & (pos < cache_len)
        if window is not None:
            context = context & (cache_len + qi - pos < window)
        return own | context

    mask = tile_mask(step, batch, seq, row_len, padded, TILE, may_attend, window is not None)

    def context_keys(k_cache: Tensor, v_cache: Tensor, k_active: Tensor, v_active: Tensor,
                     *step_parts: Tensor) -> tuple[Tensor, Tensor]:
        k_ctx, v_ctx, _ = gather_context(k_cache, v_cache, AttentionStep(*step_parts), batch)
        return _keys(k_ctx.to(q.dtype), k_active, padded), _keys(v_ctx.to(q.dtype), v_active, padded)

    def own_keys(k_cache: Tensor, v_cache: Tensor, k_active: Tensor, v_active: Tensor,
                 *step_parts: Tensor) -> tuple[Tensor, Tensor]:
        return _keys(None, k_active, padded), _keys(None, v_active, padded)

    operands, cached = (k_cache, v_cache, k_active, v_active, *step), step.cache_lens.max() > 0
    if not s_ctx:
        keys, values = own_keys(*operands)
    elif torch.compiler.is_compiling():
        keys, values = torch.cond(cached, context_keys, own_keys, operands)
    else:  # eager (the eager backend, tests): a plain branch, which torch.cond would trace per shape
        keys, values = (context_keys if bool(cached) else own_keys)(*operands)
    queries = q.transpose(1, 2).contiguous()
    out = flex_attention(queries, keys, values, block_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


def _keys(context: Tensor | None, own: Tensor, padded: int) -> Tensor:
    """(B, KVH, padded + S, D): the context (zero up to ``padded``), then the step's own K or V,
    in a buffer of its own (inductor's CPU template reads its operands' layouts directly and
    cannot take views of the projections' outputs). Without a context, a compiled graph leaves
    the front unwritten (zeroing it would cost a pass over the whole buffer): no tile there is kept,
    and the compiled kernel reads only kept tiles. Eager flex (a reference) reads every key, so
    there the front is zeros."""
    batch, seq, kv_heads, head_dim = own.shape
    shape = (batch, kv_heads, padded + seq, head_dim)
    out = own.new_empty(shape) if torch.compiler.is_compiling() else own.new_zeros(shape)
    out = torch.slice_scatter(out, own.transpose(1, 2), dim=2, start=padded)
    if context is None:
        return out
    zeros = context.new_zeros(batch, padded - context.shape[1], kv_heads, head_dim)
    front = torch.cat([context, zeros], dim=1)
    return torch.slice_scatter(out, front.transpose(1, 2), dim=2, end=padded)
