"""Bucket strategies, the vLLM-neuron validation rules, grid enumeration and bucket selection."""

import pytest

from neuron_buckets.config import (
    BucketConfig,
    CacheConfig,
    CompileConfig,
    Config,
    ModelSource,
    enumerate_grid,
)
from neuron_buckets.core.bucket import (
    Bucket,
    NoBucketFits,
    linear,
    powers_of_two,
    select_bucket,
    validate_buckets,
)


@pytest.mark.parametrize(
    ("lo", "hi", "expected"),
    [(1, 8, [1, 2, 4, 8]), (32, 128, [32, 64, 128]), (32, 100, [32, 64, 100]), (5, 5, [5])],
)
def test_powers_of_two_end_at_the_limit(lo, hi, expected):
    assert powers_of_two(lo, hi) == expected


@pytest.mark.parametrize(
    ("lo", "hi", "step", "expected"),
    [(16, 64, 16, [16, 32, 48, 64]), (10, 35, 10, [10, 20, 30, 35]), (4, 4, 8, [4])],
)
def test_linear_ends_at_the_limit(lo, hi, step, expected):
    assert linear(lo, hi, step) == expected


@pytest.mark.parametrize(("lo", "hi"), [(0, 8), (-2, 8), (16, 8)])
def test_powers_of_two_refuse_bad_ranges(lo, hi):
    with pytest.raises(ValueError, match=rf"0 < min <= max, got min={lo}, max={hi}"):
        powers_of_two(lo, hi)


@pytest.mark.parametrize(("lo", "hi", "step"), [(0, 8, 1), (16, 8, 1), (1, 8, 0)])
def test_linear_refuses_bad_ranges(lo, hi, step):
    with pytest.raises(ValueError, match="step > 0"):
        linear(lo, hi, step)


def test_validate_accepts_a_good_list():
    assert validate_buckets("num_seqs_buckets", [1, 2, 4, 8], last=8) == (1, 2, 4, 8)


@pytest.mark.parametrize(
    ("values", "last", "message"),
    [
        ([], None, "must not be empty"),
        ([0, 4], None, "must be positive integers"),
        ([-1, 4], None, "must be positive integers"),
        ([1.5, 4], None, "must be positive integers"),
        ([True, 4], None, "must be positive integers"),
        ([4, 2], None, r"must be strictly ascending, got \[4, 2\]"),
        ([2, 2, 4], None, "must be strictly ascending"),
        ([1, 2, 4], 8, r"b's last entry must equal 8, got \[1, 2, 4\]"),
    ],
)
def test_validate_refuses_with_the_rule_broken(values, last, message):
    with pytest.raises(ValueError, match=message):
        validate_buckets("b", values, last)


def test_seed_bucket_selection_table():
    # Active requests -> bucket used -> padding, for num_seqs_buckets = [1, 2, 4, 8].
    table = {1: (1, 0), 2: (2, 0), 3: (4, 1), 4: (4, 0), 5: (8, 3), 6: (8, 2), 7: (8, 1), 8: (8, 0)}
    for active, (bucket, padding) in table.items():
        assert select_bucket([1, 2, 4, 8], active) == bucket
        assert select_bucket([1, 2, 4, 8], active) - active == padding


def test_a_single_bucket_serves_every_size():
    assert {select_bucket([8], n) for n in range(1, 9)} == {8}


def test_no_bucket_fits_names_n_and_the_largest_bucket():
    with pytest.raises(NoBucketFits, match="no bucket fits 9: the largest bucket is 8") as e:
        select_bucket([1, 2, 4, 8], 9)
    assert isinstance(e.value, ValueError)


def test_select_refuses_a_non_positive_size():
    with pytest.raises(ValueError, match="positive size"):
        select_bucket([1, 2], 0)


def config(**buckets) -> Config:
    cache = CacheConfig(block_size=16, num_blocks=128, max_model_len=256)
    return Config(ModelSource(), cache, BucketConfig(**buckets), CompileConfig())


def test_enumerate_prefill_then_decode():
    grid = enumerate_grid(config(num_seqs_buckets=(1, 2, 4), num_batched_tokens_buckets=(32, 64, 128)))
    assert grid == [  # a prefill bucket packs up to max_num_seqs=4 requests into its seq tokens
        Bucket("prefill", 4, 32, 256),
        Bucket("prefill", 4, 64, 256),
        Bucket("prefill", 4, 128, 256),
        Bucket("decode", 1, 1, 256),
        Bucket("decode", 2, 1, 256),
        Bucket("decode", 4, 1, 256),
    ]
    assert [b.tokens for b in grid] == [32, 64, 128, 1, 2, 4]  # prefill: seq is the total
    assert [b.name for b in grid] == [
        "prefill_s32", "prefill_s64", "prefill_s128", "decode_b1_c256", "decode_b2_c256", "decode_b4_c256",
    ]


def test_enumerate_with_speculation_and_context_buckets():
    grid = enumerate_grid(
        config(num_seqs_buckets=(2, 4), speculation_length=3, decode_context_length_buckets=(128, 256))
    )
    decode = [(b.batch, b.seq, b.ctx) for b in grid if b.kind == "decode"]
    assert decode == [(2, 4, 128), (4, 4, 128), (2, 4, 256), (4, 4, 256)]
    assert [b.tokens for b in grid if b.kind == "decode"] == [8, 16, 8, 16]
    assert [b.name for b in grid if b.kind == "decode"] == [
        "decode_b2_s4_c128", "decode_b4_s4_c128", "decode_b2_s4_c256", "decode_b4_s4_c256",
    ]


def test_enumerate_packed_prefill_stays_within_max_num_batched_tokens():
    """One prefill bucket per token count, its tokens the packed total (never rows x seq); it packs
    up to max_num_seqs requests, but never more than it has tokens (a request needs one)."""
    buckets = config(max_num_seqs=8, max_num_batched_tokens=64, num_batched_tokens_buckets=(4, 16, 64))
    grid = enumerate_grid(buckets)
    prefill = [b for b in grid if b.kind == "prefill"]
    assert [(b.batch, b.seq, b.ctx) for b in prefill] == [(4, 4, 256), (8, 16, 256), (8, 64, 256)]
    assert [b.tokens for b in prefill] == [4, 16, 64]
    assert max(b.tokens for b in prefill) == 64  # max_num_batched_tokens
    assert [b.name for b in prefill] == ["prefill_s4", "prefill_s16", "prefill_s64"]
