"""The tile lists of ``tile_mask`` against the element masks of the golden.

Eager flex attention (what the kernel tests run) evaluates ``mask_mod`` everywhere and ignores
which tiles the block mask keeps; only the compiled kernel skips tiles. So the tile lists are
checked here directly: every tile pair that holds an allowed (query, key) pair is kept, and a
tile marked full allows every pair in it.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from neuron_buckets.core.masks import gen_segment_masks
from neuron_buckets.kernels import block_kv_flex, block_kv_torch
from neuron_buckets.kernels.attention_step import AttentionStep
from neuron_buckets.kernels.block_kv_torch import context_rows
from neuron_buckets.kernels.tile_mask import tile_mask


def tiles_of(counts: torch.Tensor, indices: torch.Tensor, key_tiles: int) -> torch.Tensor:
    """(B, NQ, key tiles) flags from ``BlockMask``'s (B, 1, NQ) counts and (B, 1, NQ, n) indices."""
    batch, _, rows = counts.shape
    flags = torch.zeros(batch, rows, key_tiles, dtype=torch.bool)
    for b in range(batch):
        for i in range(rows):
            flags[b, i, indices[b, 0, i, : counts[b, 0, i]].long()] = True
    return flags


def allowed_pairs(step: AttentionStep, batch: int, seq: int, block_size: int, padded: int, window):
    """(B, S, padded + S): the golden's masks on flex's key axis (context, padding, own tokens)."""
    _, cached = context_rows(step, batch, block_size)
    ctx, own = gen_segment_masks(cached, step.segment_ids, window)
    pad = torch.zeros(batch, seq, padded - ctx.shape[2], dtype=torch.bool)
    return torch.cat([ctx, pad, own], dim=2)


def by_tile(pairs: torch.Tensor, tile: int, reduce) -> torch.Tensor:
    """(B, NQ, NK) ``reduce`` (any / all) of the pairs in each tile; partial edge tiles padded
    with what does not change the reduction."""
    batch, seq, keys = pairs.shape
    fill = reduce is torch.all
    grid = torch.full((batch, -(-seq // tile) * tile, -(-keys // tile) * tile), fill)
    grid[:, :seq, :keys] = pairs
    tiles = grid.view(batch, grid.shape[1] // tile, tile, grid.shape[2] // tile, tile)
    return reduce(reduce(tiles, dim=4), dim=2)


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.integers(0, 70), min_size=1, max_size=5),
    counts=st.lists(st.integers(1, 40), min_size=5, max_size=5),
    pads=st.integers(0, 40),
    packed=st.booleans(),
    window=st.sampled_from([None, 5, 33]),
    tile=st.sampled_from([8, 32]),
    seed=st.integers(0, 2**16),
)
def test_kept_tiles_cover_every_allowed_pair_and_full_tiles_allow_all(
    lens, counts, pads, packed, window, tile, seed
):
    block_size, max_blocks = 8, 9
    rows = len(lens)
    gen = torch.Generator().manual_seed(seed)
    table = torch.randint(1, 50, (rows, max_blocks), generator=gen)
    if packed:  # one row of segments end to end, then pads (segment R)
        counts = counts[:rows]
        segments = torch.repeat_interleave(torch.arange(rows + 1), torch.tensor([*counts, pads]))[None]
        batch, seq = 1, segments.shape[1]
    else:  # a row per request, all segment 0
        batch, seq = rows, counts[0]
        segments = torch.zeros(batch, seq, dtype=torch.int64)
    step = AttentionStep(table, torch.tensor(lens), segments)
    row_len = max_blocks * block_size
    s_ctx = row_len * (rows if packed else 1)
    padded = -(-s_ctx // tile) * tile
    everything = lambda b, h, q, k: q >= 0  # noqa: E731  (the element mask plays no part here)
    mask = tile_mask(step, batch, seq, row_len, padded, tile, everything, window is not None)
    key_tiles = (padded + seq + tile - 1) // tile
    kept = tiles_of(mask.kv_num_blocks, mask.kv_indices, key_tiles)
    full = tiles_of(mask.full_kv_num_blocks, mask.full_kv_indices, key_tiles)
    pairs = allowed_pairs(step, batch, seq, block_size, padded, window)
    assert not (kept & full).any()
    assert ((kept | full) >= by_tile(pairs, tile, torch.any)).all()
    assert (by_tile(pairs, tile, torch.all) >= full).all()


@pytest.mark.parametrize("context", [True, False], ids=["continuing", "fresh"])
def test_compiled_flex_skips_only_tiles_that_cannot_meet(context):
    """The compiled kernel (the one that skips tiles) on a packed row of a continuing chunk, two
    decode rows and pads, over a NaN cache, against the golden."""
    kv_heads, head_dim, block_size = 2, 16, 8
    gen = torch.Generator().manual_seed(0)
    lens = torch.tensor([37, 60, 5, 0]) * context
    counts = [70, 1, 1]
    seq = 96
    segments = torch.repeat_interleave(torch.arange(4), torch.tensor([*counts, seq - sum(counts)]))[None]
    table = torch.randperm(40, generator=gen)[:32].view(4, 8) + 1
    step = AttentionStep(table, lens, segments)
    k_cache = torch.randn(41, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(41, block_size, kv_heads, head_dim, generator=gen)
    for row, n in enumerate(lens.tolist()):  # everything past each context is NaN
        stale = torch.arange(n, 8 * block_size)
        k_cache[table[row, stale // block_size], stale % block_size] = float("nan")
        v_cache[table[row, stale // block_size], stale % block_size] = float("nan")
    q = torch.randn(1, seq, 2 * kv_heads, head_dim, generator=gen)
    k_act, v_act = (torch.randn(1, seq, kv_heads, head_dim, generator=gen) for _ in range(2))
    args = (q, k_act, v_act, k_cache, v_cache, step, 0.25)
    compiled = torch.compile(block_kv_flex.block_kv_attention, fullgraph=True, dynamic=False)
    got = compiled(*args)
    want = block_kv_torch.block_kv_attention(*args)
    real = segments[0] < len(counts)
    torch.testing.assert_close(got[0, real], want[0, real], rtol=1e-5, atol=1e-5)

