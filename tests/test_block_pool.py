"""BlockPool: block 0 is never handed out, blocks cover actual tokens only, misuse is refused."""

import pytest

from neuron_buckets.core.block_table import NULL_BLOCK_ID
from neuron_buckets.engine.block_pool import BlockPool, OutOfBlocks


def test_null_block_is_never_handed_out():
    pool = BlockPool(num_blocks=8, block_size=4)
    blocks = pool.grow([], 7 * 4)  # every allocatable block
    assert sorted(blocks) == list(range(1, 8))
    assert NULL_BLOCK_ID not in blocks
    assert pool.num_free == 0


def test_allocates_for_actual_tokens_only():
    # Worked example: 100 actual tokens with block_size 64 need ceil(100 / 64) = 2 blocks, whatever the
    # bucket they are padded to.
    pool = BlockPool(num_blocks=1024, block_size=64)
    blocks = pool.grow([], 100)
    assert len(blocks) == 2
    assert pool.num_free == 1023 - 2


@pytest.mark.parametrize(("tokens", "blocks"), [(1, 1), (16, 1), (17, 2), (64, 4), (65, 5)])
def test_blocks_for_is_ceil(tokens, blocks):
    assert BlockPool(num_blocks=16, block_size=16).blocks_for(tokens) == blocks


def test_grow_extends_in_place_only_when_a_block_fills():
    pool = BlockPool(num_blocks=16, block_size=4)
    blocks = pool.grow([], 3)
    first = list(blocks)
    assert pool.grow(blocks, 4) is blocks and blocks == first  # still fits in one block
    pool.grow(blocks, 5)
    assert blocks[:1] == first and len(blocks) == 2
    assert pool.num_free == 15 - 2


def test_free_returns_blocks_and_clears_the_list():
    pool = BlockPool(num_blocks=8, block_size=4)
    blocks = pool.grow([], 10)
    pool.free(blocks)
    assert blocks == []
    assert pool.num_free == 7


def test_double_free_raises():
    pool = BlockPool(num_blocks=8, block_size=4)
    blocks = pool.grow([], 4)
    kept = list(blocks)
    pool.free(blocks)
    with pytest.raises(ValueError, match=rf"blocks \[{kept[0]}\] are not allocated"):
        pool.free(kept)


def test_free_listing_a_block_twice_raises_and_frees_nothing():
    pool = BlockPool(num_blocks=8, block_size=4)
    (block,) = pool.grow([], 4)
    with pytest.raises(ValueError, match="twice"):
        pool.free([block, block])
    assert pool.num_free == 6
    # Nothing was freed, so no later request can be handed the same block twice.
    assert len(set(pool.grow([], 6 * 4))) == 6


def test_free_refuses_the_null_block():
    with pytest.raises(ValueError, match="not allocated"):
        BlockPool(num_blocks=8, block_size=4).free([NULL_BLOCK_ID])


def test_exhaustion_refuses_clearly_and_allocates_nothing():
    pool = BlockPool(num_blocks=4, block_size=16)  # 3 allocatable blocks
    held = pool.grow([], 32)
    other: list[int] = []
    with pytest.raises(OutOfBlocks, match="need 2 more blocks for 17 tokens, only 1 of 3 are free"):
        pool.grow(other, 17)
    assert other == []
    assert pool.num_free == 1
    assert len(held) == 2


@pytest.mark.parametrize(("num_blocks", "block_size"), [(1, 16), (0, 16), (8, 0)])
def test_rejects_impossible_pools(num_blocks, block_size):
    with pytest.raises(ValueError, match="null block"):
        BlockPool(num_blocks, block_size)
