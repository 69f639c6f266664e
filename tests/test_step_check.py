"""``check_step``: the runtime checks a whole step before its first graph call, every block-table
entry (spare ones too), token ids, positions, types. Inductor graphs do not bounds-check, so a
step the check let through would write layer 0's K/V and then fail inside the graph; every
backend refuses the same steps. With prefix caching, segments may share the full blocks below
their contexts, never a block one of them writes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from neuron_buckets.compile.compiler import Compiler
from neuron_buckets.config import load_config
from neuron_buckets.core.step_plan import Segment
from neuron_buckets.runtime.bucket_runtime import BucketRuntime
from neuron_buckets.runtime.step_check import StepLimits, check_step
from tests.conftest import TINY_CONFIG, decode_plan, prefill_plan, write_config

LIMITS = StepLimits(block_size=4, num_blocks=16, max_model_len=64, vocab_size=32)


def seg(context: int, blocks: list[int], tokens: int = 1) -> Segment:
    return Segment(0, [1] * tokens, context, tuple(blocks), 1)


@pytest.mark.parametrize(
    "plan",
    [
        # two requests with the same 2-block prefix, each writing its own third block
        [seg(8, [1, 2, 3], 3), seg(8, [1, 2, 4], 2)],
        # a decode row and a prefill chunk that read the same full blocks
        [seg(9, [1, 2, 5]), seg(8, [1, 2, 6], 4), seg(4, [1, 7], 4)],
    ],
    ids=["two-prefills", "decode-and-prefill"],
)
def test_segments_may_read_one_full_block(plan):
    check_step(plan, LIMITS)


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        ([seg(0, [3], 2), seg(2, [3])], "block 3 is written twice"),  # two writes, even to two slots
        ([seg(5, [1, 3]), seg(5, [2, 3])], "block 3 is written twice"),  # one slot, twice
        # request 1 writes block 2, which request 0 reads as part of its prefix
        ([seg(8, [1, 2, 3]), seg(4, [1, 2])], "block 2 is written in a step in which request 0 reads it"),
        ([seg(8, [1, 1, 3])], "request 0 lists a block twice"),
    ],
    ids=["two-writers", "one-slot", "write-into-a-read-block", "twice-in-one-row"],
)
def test_writes_stay_private(plan, message):
    with pytest.raises(ValueError, match=message):
        check_step(plan, LIMITS)


@pytest.fixture(scope="module")
def eager_dir(hf_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("eager")
    config = load_config(write_config(tmp, hf_model_dir, TINY_CONFIG.replace('"inductor"', '"eager"')))
    Compiler(config, tmp / "art", tmp / "cache").run(jobs=2)
    return tmp / "art"


BAD_STEPS = {  # on 64 blocks of 8 tokens, vocabulary 256, decode rows of 1 token
    "spare-past-the-pool": (prefill_plan([([1, 2, 3], 0, [5, 200])]), r"\[5, 200\]"),
    "spare-negative": (prefill_plan([([1, 2, 3], 0, [5, -1])]), r"\[5, -1\]"),
    "spare-negative-decode": (decode_plan([([3], 2, [6, -7])]), r"\[6, -7\]"),
    "token-past-the-vocab": (prefill_plan([([1, 256], 0, [5])]), r"request 0 has token ids \[256\] outside"),
    "negative-token": (decode_plan([([-1], 2, [6])]), r"token ids \[-1\] outside"),
    "float-token": (prefill_plan([([1.7, 2], 0, [5])]), r"must be integers, got \[1.7\]"),
    "bool-token": (prefill_plan([([True, 2], 0, [5])]), r"must be integers, got \[True\]"),
    "float-tensor": (prefill_plan([(torch.tensor([1.0, 2.0]), 0, [5])]), "must be a 1-D integer tensor"),
    "negative-start": (prefill_plan([([1], -1, [5])]), "context_len must be a non-negative"),
    "float-block": (prefill_plan([([1], 0, [5.0])]), r"must be integers, got \[5.0\]"),
    # the first row is fine and would run first: nothing of it may be written either
    "second-row-bad": (prefill_plan([([1] * 20, 0, [7, 8, 9]), ([2], 0, [10, 64])]), r"\[10, 64\]"),
}


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["inductor", "eager"])
@pytest.mark.parametrize(("plan", "message"), BAD_STEPS.values(), ids=BAD_STEPS.keys())
def test_a_bad_step_is_refused_alike_on_every_backend_before_any_write(
    compiled_dir, eager_dir, backend, plan, message
):
    runtime = BucketRuntime.open(compiled_dir if backend == "inductor" else eager_dir)
    runtime.run_plan(prefill_plan([(list(range(10)), 0, [1, 2])]))  # some real K/V to protect
    k, v = runtime.k_cache.clone(), runtime.v_cache.clone()
    with pytest.raises(ValueError, match=message):
        runtime.run_plan(plan)
    assert torch.equal(runtime.k_cache, k) and torch.equal(runtime.v_cache, v)


@pytest.mark.slow
def test_unused_spare_entries_may_be_the_null_block(compiled_dir):
    runtime = BucketRuntime.open(compiled_dir)
    spare = runtime.run_plan(prefill_plan([([1, 2, 3], 0, [5, 0, 0])]))
    torch.testing.assert_close(spare, runtime.run_plan(prefill_plan([([1, 2, 3], 0, [6])])))
