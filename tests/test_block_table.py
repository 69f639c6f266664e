"""Slot mapping on the block-KV worked examples, bit for bit, and its refusals."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from neuron_buckets.core.block_table import (
    NULL_BLOCK_ID,
    PAD_SLOT_ID,
    check_block_ids,
    compute_slot_mapping,
    remap_null_block_to_sentinel,
)

# The worked example's block table after the remap: request 0 owns 10, 15, 22; request 1 owns 8, 12.
SEED_TABLE = torch.tensor([[10, 15, 22, -1, -1], [8, 12, -1, -1, -1]])


def slots(table, reqs, positions, block_size=64):
    return compute_slot_mapping(table, torch.tensor(reqs), torch.tensor(positions), block_size).tolist()


def test_constants():
    assert (NULL_BLOCK_ID, PAD_SLOT_ID) == (0, -1)


def test_seed_position_100_is_slot_996():
    # block_index 100 // 64 = 1 -> block 15; offset 100 % 64 = 36; 15 * 64 + 36 = 996.
    assert slots(SEED_TABLE, [0], [100]) == [996]


def test_seed_block_boundary_crossing():
    assert slots(SEED_TABLE, [0, 0, 0, 0], [62, 63, 64, 65]) == [702, 703, 960, 961]


def test_seed_speculative_decode_crossing_block_boundary():
    # Base token at position 62 plus three drafts: last slot of block 10, first slots of block 15.
    table = torch.tensor([[10, 15, -1, -1]])
    assert slots(table, [0] * 4, [62, 63, 64, 65]) == [702, 703, 960, 961]


def test_seed_multi_token_decode_batch_of_four():
    # The worked example's EAGLE example: 4 requests x 4 tokens at positions 50.., 75.., 100.., 125...
    table = torch.tensor([[10, 15, -1], [8, 12, -1], [22, 30, -1], [3, 5, 7]])
    reqs = [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    positions = [50, 51, 52, 53, 75, 76, 77, 78, 100, 101, 102, 103, 125, 126, 127, 128]
    assert slots(table, reqs, positions) == [
        690, 691, 692, 693,  # 10 * 64 + 50..53
        779, 780, 781, 782,  # 12 * 64 + 11..14
        1956, 1957, 1958, 1959,  # 30 * 64 + 36..39
        381, 382, 383, 448,  # 5 * 64 + 61..63, then 128 opens block 7 at offset 0
    ]  # fmt: skip


def test_seed_second_request_uses_its_own_row():
    assert slots(SEED_TABLE, [0, 0, 0, 1, 1, 1, 1], [0, 1, 2, 0, 1, 2, 3]) == [
        640, 641, 642, 512, 513, 514, 515,
    ]  # fmt: skip


def test_int32_inputs_give_int32_slots():
    out = compute_slot_mapping(
        SEED_TABLE.to(torch.int32), torch.tensor([0], dtype=torch.int32),
        torch.tensor([100], dtype=torch.int32), 64,
    )  # fmt: skip
    assert out.dtype == torch.int32 and out.tolist() == [996]


def test_empty_step_gives_no_slots():
    out = compute_slot_mapping(SEED_TABLE, torch.tensor([], dtype=torch.int64),
                               torch.tensor([], dtype=torch.int64), 64)  # fmt: skip
    assert out.shape == (0,)


def test_remap_null_block_to_sentinel():
    scheduler = torch.tensor([[10, 15, 22, 0, 0], [8, 12, 0, 0, 0]])
    remapped = remap_null_block_to_sentinel(scheduler)
    assert torch.equal(remapped, SEED_TABLE)
    assert remapped.dtype == scheduler.dtype
    assert scheduler[0, 3] == 0  # the input is left alone


@given(
    block_size=st.sampled_from([1, 2, 16, 64]),
    rows=st.lists(st.lists(st.integers(1, 500), min_size=1, max_size=6, unique=True), min_size=1, max_size=4),
    data=st.data(),
)
@settings(max_examples=150, deadline=None)
def test_matches_the_plain_python_formula(block_size, rows, data):
    width = max(len(r) for r in rows)
    table = torch.tensor([r + [-1] * (width - len(r)) for r in rows])
    reqs = data.draw(st.lists(st.integers(0, len(rows) - 1), min_size=1, max_size=40))
    positions = [data.draw(st.integers(0, len(rows[r]) * block_size - 1)) for r in reqs]
    expected = []
    for r, p in zip(reqs, positions, strict=True):  # the worked example's formula, one token at a time
        expected.append(rows[r][p // block_size] * block_size + p % block_size)
    assert slots(table, reqs, positions, block_size) == expected


def test_position_beyond_the_block_table_is_refused():
    message = r"position 320 needs logical block 5, but the block table has only 5 columns"
    with pytest.raises(ValueError, match=message):
        slots(SEED_TABLE, [0], [320])


@pytest.mark.parametrize("entry", [-1, 0])
def test_unallocated_entry_is_refused(entry):
    table = torch.tensor([[10, entry]])
    with pytest.raises(ValueError, match=rf"position 64\) maps to unallocated block entry {entry}"):
        slots(table, [0, 0], [63, 64])


@pytest.mark.parametrize(
    ("reqs", "positions", "block_size", "message"),
    [
        ([0], [-1], 64, "positions must be >= 0"),
        ([2], [0], 64, r"req_indices must lie in \[0, 2\)"),
        ([-1], [0], 64, r"req_indices must lie in \[0, 2\)"),
        ([0, 0], [0], 64, "equal length"),
        ([0], [0], 0, "block_size must be positive"),
    ],
)
def test_bad_arguments_are_refused(reqs, positions, block_size, message):
    with pytest.raises(ValueError, match=message):
        slots(SEED_TABLE, reqs, positions, block_size)


def test_block_table_must_be_2d():
    with pytest.raises(ValueError, match="must be 2-D"):
        compute_slot_mapping(torch.tensor([10, 15]), torch.tensor([0]), torch.tensor([0]), 64)


def test_check_block_ids_accepts_the_pool_and_refuses_beyond_it():
    check_block_ids(torch.tensor([[1023, -1]]), 1024)  # largest id and the sentinel are fine
    with pytest.raises(ValueError, match=r"block ids must lie in \[-1, 1024\), got range \[-1, 1024\]"):
        check_block_ids(torch.tensor([[1024, -1]]), 1024)
    with pytest.raises(ValueError, match=r"got range \[-2, 5\]"):
        check_block_ids(torch.tensor([[5, -2]]), 1024)
