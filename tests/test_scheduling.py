"""Fitting rows onto buckets: long prompts become waves of chunks, calls are as wide as buckets allow."""

from __future__ import annotations

import pytest

from neuron_buckets.core.bucket import Bucket, NoBucketFits
from neuron_buckets.core.padding import PrefillChunk
from neuron_buckets.serve.row_packer import group_rows, split_long_chunks

# Wide buckets are short: 1 row x 128 or 2 rows x 64 tokens (128 tokens per graph at most).
MIXED = [Bucket("prefill", 1, 64, 256), Bucket("prefill", 1, 128, 256), Bucket("prefill", 2, 64, 256)]


def chunk(n: int, start: int = 0) -> PrefillChunk:
    return PrefillChunk(list(range(n)), start, list(range(1, 17)))


def test_long_prompts_split_into_waves_of_the_largest_seq():
    waves = split_long_chunks([chunk(300), chunk(50)], 128)
    assert [[(i, len(c.token_ids), c.start_pos) for i, c in w] for w in waves] == [
        [(0, 128, 0), (1, 50, 0)],
        [(0, 128, 128)],
        [(0, 44, 256)],
    ]


def test_rows_share_a_call_only_while_a_bucket_holds_them():
    calls = group_rows(list(enumerate([chunk(100), chunk(100), chunk(30), chunk(20)])), MIXED)
    shapes = [([i for i, _ in group], bucket) for group, bucket in calls]
    assert shapes == [([3, 2], MIXED[2]), ([0], MIXED[1]), ([1], MIXED[1])]


def test_a_row_no_bucket_holds_is_refused_by_name():
    with pytest.raises(NoBucketFits, match="1 rows x 129 tokens"):
        group_rows([(0, chunk(129))], MIXED)


def test_runtime_chunks_only_beyond_the_longest_bucket_with_wide_prefill_buckets(hf_model_dir, tmp_path):
    """With (2, 16) beside (1, 32), a 30-token prompt runs whole in (1, 32), not as 16 + 14."""
    from neuron_buckets.compile.compiler import Compiler
    from neuron_buckets.config import load_config
    from neuron_buckets.serve.runtime import BucketRuntime
    from tests.conftest import TINY_CONFIG, write_config

    text = TINY_CONFIG.replace('backend = "inductor"', 'backend = "eager"').replace(
        "num_batched_tokens_buckets = [16, 32]",
        "num_batched_tokens_buckets = [16, 32]\nprefill_batch_buckets = [1, 2]",
    )
    out = tmp_path / "art"
    assert (
        not Compiler(load_config(write_config(tmp_path, hf_model_dir, text)), out, tmp_path / "c")
        .run(1)
        .failed
    )
    runtime = BucketRuntime.open(out)
    runtime.prefill([PrefillChunk(list(range(30)), 0, [1, 2, 3, 4]), PrefillChunk([5, 6], 0, [5])])
    used = {label: s.calls for label, s in runtime.stats.items() if s.calls}
    assert used == {"prefill_s32": 1, "prefill_s16": 1}
