"""The runtime checks a whole step before its first graph call: every block-table entry (spare
ones too), token ids, positions, types. Inductor graphs do not bounds-check, so a step the check
let through used to write layer 0's K/V and then fail inside the graph; eager refused it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from neuron_buckets.compile.compiler import Compiler
from neuron_buckets.config import load_config
from neuron_buckets.core.step_plan import PrefillChunk
from neuron_buckets.engine.llm_engine import generate
from neuron_buckets.runtime.bucket_runtime import BucketRuntime
from tests.conftest import TINY_CONFIG, write_config

pytestmark = pytest.mark.slow  # the inductor runtime needs the compiled session artifact


@pytest.fixture(scope="module")
def eager_dir(hf_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("eager")
    config = load_config(write_config(tmp, hf_model_dir, TINY_CONFIG.replace('"inductor"', '"eager"')))
    Compiler(config, tmp / "art", tmp / "cache").run(jobs=2)
    return tmp / "art"


def prefill(*rows):
    return lambda rt: rt.prefill([PrefillChunk(*row) for row in rows])


def decode(*rows):
    return lambda rt: rt.decode([PrefillChunk(*row) for row in rows])


BAD_STEPS = {  # on 64 blocks of 8 tokens, vocabulary 256, decode rows of 1 token
    "spare-past-the-pool": (prefill(([1, 2, 3], 0, [5, 200])), r"\[5, 200\]"),
    "spare-negative": (prefill(([1, 2, 3], 0, [5, -1])), r"\[5, -1\]"),
    "spare-negative-decode": (decode(([3], 2, [6, -7])), r"\[6, -7\]"),
    "token-past-the-vocabulary": (prefill(([1, 256], 0, [5])), r"request 0 has token ids \[256\] outside"),
    "negative-token": (decode(([-1], 2, [6])), r"token ids \[-1\] outside"),
    "float-token": (prefill(([1.7, 2], 0, [5])), r"must be integers, got \[1.7\]"),
    "bool-token": (prefill(([True, 2], 0, [5])), r"must be integers, got \[True\]"),
    "float-tensor": (prefill((torch.tensor([1.0, 2.0]), 0, [5])), "must be a 1-D integer tensor"),
    "negative-start": (prefill(([1], -1, [5])), "context_len must be a non-negative"),
    "float-block": (prefill(([1], 0, [5.0])), r"must be integers, got \[5.0\]"),
    # the first row is fine and would run first: nothing of it may be written either
    "second-row-bad": (prefill(([1] * 20, 0, [7, 8, 9]), ([2], 0, [10, 64])), r"\[10, 64\]"),
}


@pytest.mark.parametrize("backend", ["inductor", "eager"])
@pytest.mark.parametrize(("step", "message"), BAD_STEPS.values(), ids=BAD_STEPS.keys())
def test_a_bad_step_is_refused_alike_on_every_backend_before_any_write(
    compiled_dir, eager_dir, backend, step, message
):
    runtime = BucketRuntime.open(compiled_dir if backend == "inductor" else eager_dir)
    runtime.prefill([PrefillChunk(list(range(10)), 0, [1, 2])])  # some real K/V to protect
    k, v = runtime.k_cache.clone(), runtime.v_cache.clone()
    with pytest.raises(ValueError, match=message):
        step(runtime)
    assert torch.equal(runtime.k_cache, k) and torch.equal(runtime.v_cache, v)


def test_unused_spare_entries_may_be_the_null_block(compiled_dir):
    runtime = BucketRuntime.open(compiled_dir)
    spare = runtime.prefill([PrefillChunk([1, 2, 3], 0, [5, 0, 0])])
    torch.testing.assert_close(spare, runtime.prefill([PrefillChunk([1, 2, 3], 0, [6])]))


def test_generate_refuses_float_token_ids_instead_of_truncating_them(compiled_dir):
    with pytest.raises(ValueError, match=r"prompt 0 token ids must be integers, got \[1.7\]"):
        generate(BucketRuntime.open(compiled_dir), [[1.7, 2]])
