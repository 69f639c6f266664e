"""Cache, active and segment masks: shapes, dtypes, and exactly which positions a query may see."""

import pytest
import torch

from neuron_buckets.core.masks import gen_active_mask, gen_cache_mask, gen_segment_masks


@pytest.mark.parametrize("shape", [(3,), (3, 1)])
def test_cache_mask_accepts_b_and_b1_lengths(shape):
    lens = torch.tensor([0, 2, 5]).reshape(shape)
    mask = gen_cache_mask(lens, num_heads=2, s_tkg=4, s_ctx=5)
    assert mask.shape == (3, 2, 4, 5) and mask.dtype == torch.bool
    expected_rows = torch.tensor([[0, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(mask, expected_rows[:, None, None, :].expand(3, 2, 4, 5))


def test_cache_mask_hides_everything_at_or_beyond_the_length():
    lens = torch.tensor([17, 64, 100])
    mask = gen_cache_mask(lens, num_heads=1, s_tkg=1, s_ctx=128)[:, 0, 0]
    assert mask.sum(dim=1).tolist() == [17, 64, 100]
    for row, n in enumerate(lens.tolist()):
        assert mask[row, :n].all() and not mask[row, n:].any()


def test_active_mask_is_causal_among_the_steps_tokens():
    mask = gen_active_mask(batch=2, num_heads=3, s_tkg=4)
    assert mask.shape == (2, 3, 4, 4) and mask.dtype == torch.bool
    causal = torch.tensor(
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool
    )  # draft i sees the base token and drafts before it, never later ones
    assert torch.equal(mask, causal.expand(2, 3, 4, 4))


def test_active_mask_for_plain_decode_is_the_token_itself():
    mask = gen_active_mask(batch=5, num_heads=2, s_tkg=1)
    assert mask.shape == (5, 2, 1, 1) and mask.all()


def test_a_sliding_window_counts_positions_within_each_segment():
    """A row of 3 cached positions, then request A (segment 0, positions 3, 4, 5) and request B
    (segment 1, positions 0, 1): with W = 2 each token sees itself and the position before it."""
    cached = gen_cache_mask(torch.tensor([3]), 1, 1, 4)[:, 0, 0][:, None]  # 4 context slots, 3 valid
    segments = torch.tensor([[0, 0, 0, 1, 1]])
    context, active = gen_segment_masks(cached, segments, window=2)
    assert context[0].int().tolist() == [
        [0, 0, 1, 0],  # position 3 sees cached position 2
        [0, 0, 0, 0],  # position 4 sees only step tokens (3 and itself)
        [0, 0, 0, 0],
        [0, 0, 0, 0],  # request B never sees the row's cache
        [0, 0, 0, 0],
    ]
    assert active[0].int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 1, 1, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 1, 1],
    ]
    wide = gen_segment_masks(cached, segments, window=100)  # wider than the row: no window at all
    assert all(torch.equal(a, b) for a, b in zip(wide, gen_segment_masks(cached, segments), strict=True))


def test_each_packed_segment_sees_its_own_context_row_within_the_window():
    """One packed row over two block-table rows: request A (segment 0) continues 3 cached
    positions, request B (segment 1) continues 2 of its own; pads (segment 2) see no context.
    With W = 2 each token sees the position before it, in its own row's context only."""
    cached = gen_cache_mask(torch.tensor([3, 2]), 1, 1, 4)[:, 0, 0][None]  # (1, 2 rows, 4)
    segments = torch.tensor([[0, 0, 1, 1, 2]])
    context, active = gen_segment_masks(cached, segments, window=2)
    assert context[0].int().tolist() == [
        [0, 0, 1, 0, 0, 0, 0, 0],  # A at position 3 sees its cached position 2
        [0, 0, 0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 1, 0, 0],  # B at position 2 sees its own cached position 1, not A's
        [0, 0, 0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 0],  # a pad: no context
    ]
    assert active[0].int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 0, 0, 1],
    ]
    full, _ = gen_segment_masks(cached, segments)
    assert full[0, 3].int().tolist() == [0, 0, 0, 0, 1, 1, 0, 0]  # no window: all of B's context
