"""Sizes that cannot fit in memory fail at config time, before any worker starts, with the number.

Available memory is pinned to the 15 GB of the machine the problem was found on, so the outcome
does not depend on the machine running the tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from neuron_buckets.cli import app
from neuron_buckets.config import load_config
from neuron_buckets.model.checkpoint import DEFAULT_CONFIG, default_model
from neuron_buckets.runtime.memory import cache_bytes, weights_bytes
from tests.conftest import error_line

runner = CliRunner()


@pytest.fixture(autouse=True)
def fifteen_gb(monkeypatch):
    monkeypatch.setattr("neuron_buckets.runtime.memory.available_bytes", lambda: 15 * 10**9)


def compile_config(tmp_path: Path, toml: str):
    config = tmp_path / "nb.toml"
    config.write_text(toml)
    args = ["compile", config, "--backend", "eager", "--out", tmp_path / "out", "--cache-dir", tmp_path / "c"]
    return runner.invoke(app, [str(a) for a in args])


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        (
            "[cache]\nnum_blocks = 1000000000\n",
            "generating from this config needs at least 16.4 TB of memory (the KV cache 16.4 TB,",
        ),
        (
            "[cache]\nmax_model_len = 10000000\nnum_blocks = 625001\n",
            "the largest step (prefill_s128) 71.7 GB), but 15.0 GB is available",
        ),
        (
            "[compile]\njobs = 4000\n",
            "compiling needs at least 15.2 GB of memory (4000 jobs x (example KV cache and weights)",
        ),
    ],
    ids=["num-blocks-1e9", "max-model-len-1e7", "too-many-jobs"],
)
def test_sizes_beyond_memory_fail_before_compiling_with_the_number(tmp_path, toml, message):
    assert message in error_line(compile_config(tmp_path, toml))
    assert not (tmp_path / "out").exists()


def test_the_estimates_count_the_real_cache_and_weights():
    config = load_config()
    shape = default_model().cache_shape(config.cache.num_blocks, config.cache.block_size)
    assert cache_bytes(DEFAULT_CONFIG, config.cache.num_blocks, config.cache.block_size, "float32") == (
        2 * torch.zeros(shape).nbytes
    )
    params = sum(t.nbytes for t in default_model(torch.bfloat16).weights.tensors())
    assert weights_bytes(DEFAULT_CONFIG, "bfloat16") == params
